"""Pre- vs post-norm and RMSNorm vs LayerNorm: convergence of short runs on Tiny Shakespeare.

The seeds claim pre-norm trains more stably than post-norm (no warmup needed, higher learning
rates) and that RMSNorm is cheaper than LayerNorm at equal quality. Four short char-level runs
with identical data, seed and schedule; the table gives validation loss along the way and
throughput. Needs ../shared/data/tinyshakespeare.txt.

    python benchmarks/bench_norms.py [--max_iters 300] [--lr 2e-3] [--warmup 0]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench_cli import options

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare.txt"
RUNS = {
    "pre + layernorm": dict(norm_position="pre", norm="layernorm"),
    "post + layernorm": dict(norm_position="post", norm="layernorm"),
    "pre + rmsnorm": dict(norm_position="pre", norm="rmsnorm"),
    "post + rmsnorm": dict(norm_position="post", norm="rmsnorm"),
}


def main() -> None:
    parser = options(__doc__.splitlines()[0], {"--max_iters": 300, "--lr": 2e-3, "--threads": 1})
    parser.add_argument("--warmup", type=int, default=0, help="warmup steps (post-norm needs them)")
    args = parser.parse_args()
    if not DATA.is_file():
        raise SystemExit(f"skipped: {DATA} not found")
    import torch

    from lmforge.train.config import TrainConfig
    from lmforge.train.metrics import read_series
    from lmforge.train.pretrain import Pretrainer

    torch.set_num_threads(args.threads)
    evals = list(range(args.max_iters // 4, args.max_iters + 1, args.max_iters // 4))
    print(f"char-level Tiny Shakespeare, d=128, 4 layers, {args.max_iters} steps, lr {args.lr}, "
          f"warmup {args.warmup}; val loss at steps {evals}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in RUNS.items():
            cfg = TrainConfig(
                out_dir=str(Path(tmp) / name.replace(" ", "")), data=str(DATA), tokenizer="char",
                max_iters=args.max_iters, batch_size=16, block_size=64, lr=args.lr,
                min_lr=args.lr / 10, warmup_iters=args.warmup, eval_interval=args.max_iters // 4,
                eval_iters=10, progress=False, device="cpu", samples=0, seed=1337,
                model=dict(n_layer=4, d_model=128, n_head=4, pos="learned", **model),
            )  # fmt: skip
            trainer = Pretrainer(cfg, log=lambda *a: None)
            result = trainer.run()
            _, val = read_series(trainer.metrics.path, "val", "loss")
            curve = "  ".join(f"{v:.3f}" for v in val)
            print(f"  {name:<18} val loss {curve}   {result['tokens_per_s']:>8,.0f} tok/s")


if __name__ == "__main__":
    main()
