"""`lmforge vlm`: train the vision-language model on the built-in shapes captions, caption images.

lmforge vlm train --config configs/vlm-shapes.yaml --max_iters 3000 # prints held-out exact match
lmforge vlm train --vision_tower DIR --freeze_vision true             # CLIP/SigLIP tower from HF
lmforge vlm samples --out_dir out/shapes-png --n 8                   # synthetic PNGs + captions
lmforge vlm caption --checkpoint out/vlm-shapes --image out/shapes-png/novel_0.png
"""

from __future__ import annotations

from lmforge.cli.main import add_run_parser, config_from_args

IMAGE_RULE = (  # = lmforge.vlm.data.IMAGE_RULE (a test checks); no torch import to build the parser
    "converted to RGB (transparency composited onto black), padded with black to a centred "
    "square, resized (bicubic) to the model's image size"
)


def register(sub) -> None:
    p = sub.add_parser("vlm", help="vision-language model: train on synthetic shapes, caption")
    s = p.add_subparsers(dest="vlm_command", metavar="ACTION", required=True)
    add_run_parser(
        s, "train", "VLMTrainConfig", run_vlm_train, model="language-model",
        help="train on synthetic shape captions; keep the validation-best step, report held-out "
        "exact match", example="--max_iters 3000 --projector mlp2 --model.n_layer 3",
    )  # fmt: skip

    c = s.add_parser(
        "caption",
        help="caption images with a trained checkpoint",
        description="Each image is " + IMAGE_RULE + " (16-bit/float images are refused).",
    )
    c.add_argument("--checkpoint", required=True, help="directory written by `vlm train`")
    c.add_argument("--image", action="append", required=True, help="PNG/JPEG file (repeatable)")
    c.add_argument(
        "--prompt", default="", help="text after the image; put <|image|> where images go when "
        "several images share one prompt (--joint)",
    )  # fmt: skip
    c.add_argument("--joint", action="store_true", help="all images in one prompt")
    c.add_argument("--max_new_tokens", type=int, default=32)
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    c.add_argument("--seed", type=int)
    c.set_defaults(func=run_caption)

    m = s.add_parser("samples", help="write synthetic shape images (PNG) and their captions")
    m.add_argument("--out_dir", required=True)
    m.add_argument("--n", type=int, default=8, help="images per split")
    m.add_argument("--split", action="append", choices=["train", "validation", "test", "novel"])
    m.add_argument("--image_size", type=int, default=32)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--colours", type=int, default=8, help="first N colours (as in training)")
    m.add_argument("--shapes", type=int, default=5, help="first N shapes (as in training)")
    m.set_defaults(func=run_samples)


def run_vlm_train(args) -> int:
    from lmforge.vlm.train import VLMTrainConfig, train

    cfg = config_from_args(args, VLMTrainConfig)
    result = train(cfg, resume=args.resume)
    print(
        f"\nvalidation exact match {result['validation_exact']:.1%} at the kept step "
        f"{result['best_step']} of {result['steps']}; training {result['train_cpu_s']:.0f} s "
        f"CPU, {result['train_s']:.0f} s wall"
    )
    if cfg.report:
        print(
            f"exact match: held-out images {result['test_exact']:.1%}, held-out colour x shape "
            f"pairs {result['novel_exact']:.1%}"
        )
    print(f"checkpoint: {cfg.out_dir}   plot: {result['plot']}")
    return 0


def run_caption(args) -> int:
    import torch

    from lmforge.vlm.data import load_image, to_pixels
    from lmforge.vlm.model import VisionLanguageModel

    vlm = VisionLanguageModel.load(args.checkpoint)
    size = vlm.vision_tower.config.image_size
    pixels = torch.cat([to_pixels(load_image(path, size)) for path in args.image])
    sampling = dict(temperature=args.temperature, seed=args.seed)
    if args.joint:
        ids = vlm.encode_prompt(args.prompt, len(args.image))
        row = vlm.generate(pixels, [ids], args.max_new_tokens, **sampling)[0]
        print(vlm.tokenizer.decode(row, skip_special_tokens=True).strip())
        return 0
    vlm.encode_prompt(args.prompt, 1)  # checks the prompt's image slots before any work
    captions = vlm.caption(pixels, args.prompt, args.max_new_tokens, **sampling)
    for path, text in zip(args.image, captions):
        print(f"{path}: {text}" if len(args.image) > 1 else text)
    return 0


def run_samples(args) -> int:
    from pathlib import Path

    from lmforge.fileio import write_text
    from lmforge.vlm.data import ShapesDataset, save_image

    data = ShapesDataset(args.image_size, args.seed, colours=args.colours, shapes=args.shapes)
    out = Path(args.out_dir)
    lines = []
    for split in args.split or ["test", "novel"]:
        for i in range(args.n):
            image, caption = data.sample(split, i)
            save_image(out / f"{split}_{i}.png", image)
            lines.append(f"{split}_{i}.png\t{caption}")
    write_text(out / "captions.tsv", "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} images and captions.tsv to {out}")
    return 0
