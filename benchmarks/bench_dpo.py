"""DPO training-step throughput: lmforge's DPOTrainer vs TRL's DPOTrainer, same model and data.

Both train the same randomly initialised Llama-shaped model (RMSNorm, RoPE, SwiGLU, no biases;
4 layers, d_model 128), read from one Hugging Face-layout folder so the weights are identical,
on the same verifier-labelled pairs of the built-in addition task, tokenised with the same
character tokenizer, batch 32, β = 0.1, reference log-probs recomputed every step in both
(TRL's default). Steps/s are measured after warm-up steps, runs
alternate, and the median of `--repeats` is reported (the machine is shared, so only ratios taken
in one process mean anything). TRL is a benchmark-only dependency: `pip install trl`.

  python benchmarks/bench_dpo.py [--steps 30] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import copy
from pathlib import Path

from trl_common import compare, hf_twin, steps_per_second, trl_steps_per_second

from lmforge.align.dpo import DPOConfig, DPOTrainer
from lmforge.model.config import ModelConfig
from lmforge.tasks.synthetic import preference_pairs

BATCH, WARMUP = 32, 5


def ours(directory: Path, steps: int, precompute: bool, out: Path) -> float:
    cfg = DPOConfig(init=str(directory), out_dir=str(out), data="task:add:2", n_train=2000,
                    max_len=24, batch_size=BATCH, max_iters=steps + WARMUP, progress=False,
                    precompute_ref=precompute, beta=0.1, lr=1e-4)  # fmt: skip
    return steps_per_second(DPOTrainer(cfg, log=lambda *a: None), steps, WARMUP)


def trl_run(directory: Path, cfg: ModelConfig, steps: int, out: Path) -> float:
    from datasets import Dataset
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer as TRLTrainer

    hf_tok, model = hf_twin(directory, cfg)
    pairs = preference_pairs("add", 2000, seed=1337, digits=2)
    data = Dataset.from_list([{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in pairs])
    args = TRLConfig(output_dir=str(out), per_device_train_batch_size=BATCH,
                     max_steps=steps + WARMUP, learning_rate=1e-4, beta=0.1, report_to="none",
                     use_cpu=True, save_strategy="no", logging_steps=10_000, max_length=24,
                     dataloader_num_workers=0, disable_tqdm=True)  # fmt: skip
    return trl_steps_per_second(
        lambda callbacks: TRLTrainer(model=model, ref_model=copy.deepcopy(model), args=args,
                                     train_dataset=data, processing_class=hf_tok,
                                     callbacks=callbacks),
        steps, WARMUP)  # fmt: skip


def main() -> None:
    ours_runs = {
        "ours": lambda directory, steps, out: ours(directory, steps, False, out),
        "ours_precompute": lambda directory, steps, out: ours(directory, steps, True, out),
    }
    med = compare("lmforge DPO vs TRL DPO step throughput", 30, trl_run, ours_runs,
                  ("ours", "ours_precompute", "trl"), digits=2)  # fmt: skip
    print(f"\nmedian steps/s  lmforge {med['ours']:.2f}  TRL {med['trl']:.2f}  "
          f"(lmforge with precompute_ref {med['ours_precompute']:.2f})")  # fmt: skip
    print(f"speed-up vs TRL (same per-step reference forward): {med['ours'] / med['trl']:.2f}x")
    print(f"speed-up vs TRL with precompute_ref (lmforge default): "
          f"{med['ours_precompute'] / med['trl']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
