"""RoPE context extension without fine-tuning: perplexity at 1x, 2x, 4x the training length.

A small char-level RoPE model is trained on Tiny Shakespeare at context L; the same weights are
then loaded with a larger max_seq_len and each `rope_scaling` (none, linear = position
interpolation, static NTK-aware, dynamic NTK, YaRN) at factor 2 and 4, and scored on the same
validation characters cut into non-overlapping windows of L, 2L and 4L. "pos>=L" columns score only
the positions the model never saw in training. Needs ../shared/data/tinyshakespeare.txt.

    python benchmarks/bench_rope_scaling.py [--block 128] [--max_iters 1500] [--threads 1]
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from bench_cli import options

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare.txt"
# name -> rope_scaling dict builder (factor s, original context L); None = plain RoPE.
SCALINGS = {
    "none": lambda s, L: None,
    "linear (PI)": lambda s, L: {"rope_type": "linear", "factor": s},
    "ntk": lambda s, L: {"rope_type": "ntk", "factor": s},
    "dynamic ntk": lambda s, L: {"rope_type": "dynamic", "factor": s,
                                 "original_max_position_embeddings": L},
    "yarn": lambda s, L: {"rope_type": "yarn", "factor": s,
                          "original_max_position_embeddings": L},
}  # fmt: skip
MULTIPLES = (1, 2, 4)


def window_nll(model, tokens, window: int, batch: int = 8):
    """Mean NLL per position [window] over non-overlapping windows; every window length scores
    the same len(tokens) - 1 targets (tokens - 1 must be a multiple of `window`)."""
    import torch
    import torch.nn.functional as F

    inputs, targets = tokens[:-1].view(-1, window), tokens[1:].view(-1, window)
    total = torch.zeros(window, dtype=torch.float64)
    with torch.inference_mode():
        for i in range(0, len(inputs), batch):
            logits = model(inputs[i : i + batch]).float()
            nll = F.cross_entropy(logits.transpose(1, 2), targets[i : i + batch], reduction="none")
            total += nll.sum(0).double()
    return total / len(inputs)


def main() -> None:
    parser = options(__doc__.splitlines()[0], {"--max_iters": 1500, "--threads": 1})
    parser.add_argument("--block", type=int, default=128, help="training context L")
    parser.add_argument("--max_time", type=float, default=None, help="stop training after s")
    parser.add_argument("--eval_tokens", type=int, default=32768, help="validation chars scored")
    args = parser.parse_args()
    if not DATA.is_file():
        raise SystemExit(f"skipped: {DATA} not found")
    import numpy as np
    import torch

    from lmforge.data import TokenShard
    from lmforge.model.config import ModelConfig
    from lmforge.model.transformer import Transformer
    from lmforge.train.config import TrainConfig
    from lmforge.train.pretrain import Pretrainer

    torch.set_num_threads(args.threads)
    L = args.block
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(
            out_dir=tmp, data=str(DATA), tokenizer="char", block_size=L, batch_size=16,
            max_iters=args.max_iters, max_time=args.max_time, lr=2e-3, min_lr=2e-4,
            warmup_iters=100, eval_interval=max(1, args.max_iters // 5), eval_iters=10,
            progress=False, device="cpu", samples=0, seed=1337,
            model=dict(n_layer=4, d_model=128, n_head=4, pos="rope", norm="rmsnorm",
                       mlp="swiglu", bias=False, max_seq_len=L),
        )  # fmt: skip
        t0 = time.perf_counter()
        trainer = Pretrainer(cfg, log=lambda *a: None)
        result = trainer.run()
        state = trainer.model.state_dict()
        base = trainer.model_config.to_dict()
        val = TokenShard.open(Path(tmp) / "data" / "val.bin").tokens
        val = torch.from_numpy(np.asarray(val, dtype=np.int64))
    n = args.eval_tokens // (4 * L) * (4 * L)
    if n == 0 or len(val) < n + 1:
        raise SystemExit(f"need {n + 1} validation tokens; have {len(val)}")
    tokens = val[: n + 1]
    print(f"char-level Tiny Shakespeare, RoPE d=128 4 layers (head_dim 32), trained at L={L} for "
          f"{result['step']} steps ({time.perf_counter() - t0:.0f} s), val loss "
          f"{result['val_loss']:.3f}; {n:,} val chars scored in windows of L, 2L, 4L")  # fmt: skip
    head = "".join(f"{f'{m}x ({m * L})':>13}" for m in MULTIPLES)
    print(f"\n{'rope_scaling':<18}{'factor':>7}{head}{'2x pos>=L':>12}{'4x pos>=L':>12}")
    for name, build in SCALINGS.items():
        for s in (1,) if name == "none" else (2, 4):
            model_cfg = ModelConfig.from_dict(
                dict(base, max_seq_len=4 * L, rope_scaling=build(float(s), L)), source="bench"
            )
            model = Transformer(model_cfg)
            model.load_state_dict(state)  # the rope cos/sin tables are buffers built from cfg
            model.eval()
            nll = {m: window_nll(model, tokens, m * L) for m in MULTIPLES}
            ppl = [math.exp(nll[m].mean()) for m in MULTIPLES]
            far = [math.exp(nll[m][L:].mean()) for m in MULTIPLES[1:]]
            cells = "".join(f"{p:>13.3f}" for p in ppl) + "".join(f"{p:>12.3f}" for p in far)
            print(f"{name:<18}{s:>7}{cells}")


if __name__ == "__main__":
    main()
