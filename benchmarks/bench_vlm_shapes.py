"""Choose the VLM's vision stem, depth and learning rate on validation; report held-out scores once.

    python benchmarks/bench_vlm_shapes.py --steps 500 --threads 1

Data: lmforge.vlm.data.ShapesDataset (shapes of random size at random pixel positions, so they
straddle the patch grid; the mixing statistics are printed first). Every candidate trains on
"train" and is scored only on "validation" (exact match of greedy captions, ties broken by
validation loss); each run also keeps its best validation step (lmforge.vlm.train.train), so
the number of steps is chosen on validation as well. The search is coordinate-wise, to stay
cheap on a CPU: stage 1 tries every stem x depth at the first learning rate, stage 2 tries the
other learning rates on the stage-1 winner. Only the final winner is then read on "test"
(held-out images of seen colour x shape pairs) and "novel" (held-out pairs), once, to report.
Only the general stems (linear ViT patches, convolutional stem) are candidates: the factorised
stems of vision.py are specific to flat-coloured shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from lmforge.vlm.model import VisionLanguageModel
from lmforge.vlm.train import VLMTrainConfig, build_data, caption_scores, train

# The mixing statistics live with the test that checks the data with them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vlm"))
from test_shapes_data import patch_mixing  # noqa: E402


def cpu_model() -> str:
    """lscpu's "Model name" (the machine the timings come from), or platform's guess."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/vlm-shapes.yaml", help="base VLMTrainConfig")
    ap.add_argument("--out_dir", default="out/bench-vlm-shapes")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--eval_interval", type=int, default=250)
    ap.add_argument("--eval_size", type=int, default=200, help="validation images per eval")
    ap.add_argument("--report_size", type=int, default=500, help="test / novel images")
    ap.add_argument("--stems", default="linear,conv")
    ap.add_argument("--layers", default="1,2")
    ap.add_argument("--lrs", default="2e-3,1e-3,4e-3", help="first: stage 1; rest: stage 2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    from lmforge.train.config import build_config

    torch.set_num_threads(args.threads)
    base = build_config(VLMTrainConfig, args.config, {})
    base = dataclasses.replace(
        base, max_iters=args.steps, eval_interval=args.eval_interval, eval_size=args.eval_size,
        max_time=None, report=False, progress=False, seed=args.seed, threads=args.threads,
    )  # fmt: skip
    data = build_data(base)
    mix = patch_mixing(data, base.patch_size, "train", 300)
    print(
        f"data: {mix['straddling']:.0%} of shapes straddle a {base.patch_size}-px patch border; "
        f"of occupied patches {mix['two_shapes']:.0%} hold two shapes, "
        f"{mix['two_colours']:.0%} two colours"
    )
    stems, layers = args.stems.split(","), [int(x) for x in args.layers.split(",")]
    lrs = [float(x) for x in args.lrs.split(",")]
    start, results = time.perf_counter(), {}

    def run(stem: str, depth: int, lr: float) -> None:
        name = f"{stem}-L{depth}-lr{lr:g}"
        cfg = dataclasses.replace(base, patch_embed=stem, vision_layers=depth, lr=lr,
                                  out_dir=str(Path(args.out_dir) / name))  # fmt: skip
        t0 = time.perf_counter()
        r = train(cfg, log=lambda _: None)
        results[name] = (r["validation_exact"], -r["validation_loss"], cfg, r)
        print(
            f"  {name:22s} validation exact {r['validation_exact']:6.1%}  loss "
            f"{r['validation_loss']:.4f}  best step {r['best_step']:4d}/{r['steps']}  "
            f"({r['train_cpu_s']:.0f} s CPU, {time.perf_counter() - t0:.0f} s wall)",
            flush=True,
        )

    def leader() -> str:
        return max(results, key=lambda n: results[n][:2])

    print(f"stage 1: stems {stems} x vision_layers {layers} at lr {lrs[0]:g}")
    for stem in stems:
        for depth in layers:
            run(stem, depth, lrs[0])
    winner = results[leader()][2]
    if lrs[1:]:
        print(f"stage 2: lr {lrs[1:]} on {winner.patch_embed}, {winner.vision_layers} layers")
        for lr in lrs[1:]:
            run(winner.patch_embed, winner.vision_layers, lr)
    name = leader()
    cfg, r = results[name][2], results[name][3]
    vlm = VisionLanguageModel.load(cfg.out_dir)  # the checkpoint of its best validation step
    test = caption_scores(vlm, data, "test", args.report_size)["test_exact"]
    novel = caption_scores(vlm, data, "novel", args.report_size)["novel_exact"]
    print(
        f"\nchosen on validation: {name} (step {r['best_step']}; validation exact "
        f"{r['validation_exact']:.1%})\nreported once: held-out images {test:.1%}, held-out "
        f"colour x shape pairs {novel:.1%} ({args.report_size} images each)\n"
        f"wall time {time.perf_counter() - start:.0f} s, {args.threads} thread(s), CPU: "
        f"{cpu_model()} (shared machine under load: wall times are not comparable)"
    )


if __name__ == "__main__":
    main()
