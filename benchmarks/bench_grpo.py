"""GRPO training-step throughput: lmforge's GRPOTrainer vs TRL's GRPOTrainer, same model and data.

Both train the same randomly initialised Llama-shaped model (RMSNorm, RoPE, SwiGLU, no biases;
4 layers, d_model 128), read from one Hugging Face-layout folder so the weights are identical,
on prompts of the built-in 2-digit addition task with the same character tokenizer and the same
binary exact-answer reward: 16 prompts x 8 completions per step,
up to 6 new tokens at temperature 1.0, β = 0 (no reference model), one update per batch. A step
is everything: sampling (lmforge: its KV-cache engine; TRL: transformers' generate), rewards,
advantages, loss, backward, optimizer. Steps/s are measured after warm-up steps, runs alternate,
and the median of `--repeats` is reported (the machine is shared, so only ratios taken in one
process mean anything). TRL is a benchmark-only dependency: `pip install trl`.

  python benchmarks/bench_grpo.py [--steps 10] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

from pathlib import Path

from trl_common import compare, hf_twin, steps_per_second, trl_steps_per_second

from lmforge.align.grpo import GRPOConfig, GRPOTrainer
from lmforge.model.config import ModelConfig
from lmforge.tasks.answers import verify
from lmforge.tasks.synthetic import problems

PROMPTS, G, NEW_TOKENS, WARMUP = 16, 8, 6, 3


def ours(directory: Path, steps: int, out: Path) -> float:
    cfg = GRPOConfig(init=str(directory), out_dir=str(out), data="task:add:2", n_train=2000,
                     n_eval=8, batch_size=PROMPTS, group_size=G, max_new_tokens=NEW_TOKENS,
                     temperature=1.0, beta=0.0, num_iterations=1, max_iters=steps + WARMUP,
                     lr=1e-5, min_lr=1e-5, progress=False)  # fmt: skip
    return steps_per_second(GRPOTrainer(cfg, log=lambda *a: None), steps, WARMUP)


def trl_run(directory: Path, cfg: ModelConfig, steps: int, out: Path) -> float:
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    hf_tok, model = hf_twin(directory, cfg)
    rows = problems("add", 2000, seed=1337, digits=2)
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def exact_match(completions, answer, **kw) -> list[float]:
        return [verify({"answer": a}, c) for c, a in zip(completions, answer)]

    args = TRLConfig(output_dir=str(out), per_device_train_batch_size=PROMPTS * G,
                     num_generations=G, max_completion_length=NEW_TOKENS, temperature=1.0,
                     beta=0.0, num_iterations=1, max_steps=steps + WARMUP, learning_rate=1e-5,
                     report_to="none", use_cpu=True, save_strategy="no", logging_steps=10_000,
                     dataloader_num_workers=0, disable_tqdm=True)  # fmt: skip
    return trl_steps_per_second(
        lambda callbacks: TRLTrainer(model=model, reward_funcs=exact_match, args=args,
                                     train_dataset=data, processing_class=hf_tok,
                                     callbacks=callbacks),
        steps, WARMUP)  # fmt: skip


def main() -> None:
    med = compare("lmforge GRPO vs TRL GRPO step throughput", 10, trl_run, {"ours": ours},
                  ("ours", "trl"), digits=3)  # fmt: skip
    print(f"\nmedian steps/s  lmforge {med['ours']:.3f}  TRL {med['trl']:.3f}")
    print(f"speed-up vs TRL: {med['ours'] / med['trl']:.2f}x")


if __name__ == "__main__":
    main()
