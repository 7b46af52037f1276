"""GPT-2-style vs Llama-style on Tiny Shakespeare (char level) for the same wall time.

Runs configs/shakespeare-char.yaml (GPT-2 style) to completion, then configs/shakespeare-llama.yaml
(RoPE, RMSNorm, SwiGLU, GQA) with its iteration count set so it takes the same wall time
(estimated from a short timing run; `max_time` guards the end). Prints both val losses.

    python benchmarks/bench_llama_vs_gpt2.py [--iters 2000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lmforge.data.corpus import shared_data_dir  # noqa: E402
from lmforge.train.config import TrainConfig, build_config  # noqa: E402
from lmforge.train.pretrain import Pretrainer  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def run(config: str, out_dir: Path, iters: int, max_time: float | None = None):
    overrides = {"out_dir": str(out_dir), "max_iters": iters, "lr_decay_iters": iters,
                 "progress": False, "max_time": max_time}  # fmt: skip
    trainer = Pretrainer(build_config(TrainConfig, CONFIGS / config, overrides), log=lambda *_: 0)
    start = time.perf_counter()
    result = trainer.run()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    if not (shared_data_dir() / "tinyshakespeare.txt").is_file():
        sys.exit("skipped: tinyshakespeare.txt not found")
    with tempfile.TemporaryDirectory() as tmp:
        wall, gpt2 = run("shakespeare-char.yaml", Path(tmp) / "gpt2", args.iters)
        print(f"gpt2-style:  {gpt2['step']} iters in {wall:.1f} s, val loss {gpt2['val_loss']:.4f}")
        probe, _ = run("shakespeare-llama.yaml", Path(tmp) / "probe", 100)
        per_iter = probe / 100
        iters = max(100, int(wall / per_iter))
        wall2, llama = run("shakespeare-llama.yaml", Path(tmp) / "llama", iters, max_time=wall)
        print(
            f"llama-style: {llama['step']} iters in {wall2:.1f} s, val loss {llama['val_loss']:.4f}"
        )
        verdict = "lower" if llama["val_loss"] < gpt2["val_loss"] else "NOT lower"
        print(f"llama-style val loss is {verdict} at equal wall time "
              f"({llama['val_loss']:.4f} vs {gpt2['val_loss']:.4f})")  # fmt: skip


if __name__ == "__main__":
    main()
