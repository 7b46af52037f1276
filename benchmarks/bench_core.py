"""`lmforge eval core` speed: the batched, KV-cached scorer against plain per-option forwards.

Both score the same prepared examples (rendered, tokenized, cropped by lmforge.eval.core), so
the figure is the scoring alone; tokenizing is reported separately. The reference is the
protocol as nanochat's core_eval.py runs it: one example at a time, one full forward per
option (no cache, no batching). The fast path runs the examples' shared context once into a KV
cache, then all options of a batch of examples in one forward (lmforge/eval/core_scoring.py).
Decisions are compared per example; they must all agree.

    python benchmarks/bench_core.py [--checkpoint DIR | --gguf FILE] [--tasks copa,arc_easy]
        [--max-per-task 32] [--device cpu|cuda] [--dtype float32]

Without a checkpoint the model is a random-init Llama shape (d_model 512, 8 layers, vocab 8192,
context 1024) with a byte-level BPE tokenizer trained on the Python docs: speed does not depend
on the weights. The examples/s ratio grows with the options per example and with few-shot
context length (a 4-choice 10-shot ARC item pays its context once instead of four times).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from lmforge.data.corpus import builtin_corpus, shared_data_dir
from lmforge.eval import core
from lmforge.eval.core_scoring import OptionSet, score_option_sets
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tokenizer import Tokenizer


@torch.inference_mode()
def reference_scores(model, sets: list[OptionSet]) -> list[list[tuple[float, bool]]]:
    """Per example, per option: one full forward; mean CE and greedy hit over [start, end)."""
    device = next(model.parameters()).device
    out = []
    for s in sets:
        per = []
        for seq, start, end in zip(s.seqs, s.starts, s.ends):
            ids = torch.tensor([seq], device=device)
            logits = model(ids)[0].float()
            ce = F.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")
            hit = (logits[start - 1 : end - 1].argmax(-1) == ids[0, start:end]).all()
            per.append((ce[start - 1 : end - 1].mean().item(), bool(hit)))
        out.append(per)
    return out


def decisions(task, rows, scores) -> list[bool]:
    if task.kind == core.LM:
        return [per[0][1] for per in scores]
    return [
        [x for x, _ in per].index(min(x for x, _ in per)) == row["gold"]
        for row, per in zip(rows, scores)
    ]


def timed(device, fn, *args):
    """(fn(*args), seconds), the GPU's queue drained on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    result = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - t


def load(args) -> LM:
    if args.checkpoint or args.gguf:
        return LM.load(args.checkpoint or args.gguf, device=args.device, dtype=args.dtype)
    tok = Tokenizer.train_bpe(builtin_corpus("pydoc"), vocab_size=8192)
    config = ModelConfig(vocab_size=8192, d_model=512, n_layer=8, n_head=8, n_kv_head=4,
                         max_seq_len=1024, norm="rmsnorm", mlp="swiglu", pos="rope",
                         bias=False)  # fmt: skip
    lm = LM.from_config(config, tok, seed=0, device=args.device)
    if args.dtype:
        lm.model.to(getattr(torch, args.dtype))
    return lm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--gguf", default=None)
    p.add_argument("--data", default=str(shared_data_dir() / "core"))
    p.add_argument("--tasks", default="copa,arc_easy,winograd,lambada_openai")
    p.add_argument("--max-per-task", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    args = p.parse_args()
    lm = load(args)
    lm.model.eval()
    device = next(lm.model.parameters()).device
    bos = core.bos_id(lm.tokenizer)
    print(f"model: {lm.model.num_parameters() / 1e6:.1f}M parameters, context "
          f"{lm.config.max_seq_len}, {device}, {next(lm.model.parameters()).dtype}")  # fmt: skip
    print(f"{'task':22} {'n':>4} {'opts':>4} {'tok/opt':>7} {'ref ex/s':>9} {'core ex/s':>9} "
          f"{'ratio':>6} agree")  # fmt: skip
    totals = [0, 0.0, 0.0]
    for task in core.select_tasks(args.tasks):
        rows = core.shuffled_subset(core.load_task_rows(args.data, task), args.max_per_task)
        build = core.build_option_sets
        sets, t_tok = timed(device, build, lm.tokenizer, task, rows, lm.config.max_seq_len, bos)
        score_option_sets(lm.model, sets[:2])  # warm-up (allocator, kernels)
        fast, t_fast = timed(device, score_option_sets, lm.model, sets)
        ref, t_ref = timed(device, reference_scores, lm.model, sets)
        agree = decisions(task, rows, fast) == decisions(task, rows, ref)
        opts = sum(len(s.seqs) for s in sets) / len(sets)
        toks = sum(len(x) for s in sets for x in s.seqs) / sum(len(s.seqs) for s in sets)
        n = len(rows)
        print(f"{task.label:22} {n:4} {opts:4.1f} {toks:7.0f} {n / t_ref:9.2f} {n / t_fast:9.2f} "
              f"{t_ref / t_fast:5.1f}x {agree}   (tokenizing {t_tok:.2f}s)")  # fmt: skip
        totals[0] += n
        totals[1] += t_ref
        totals[2] += t_fast
    n, t_ref, t_fast = totals
    print(f"{'all':22} {n:4} {'':4} {'':7} {n / t_ref:9.2f} {n / t_fast:9.2f} "
          f"{t_ref / t_fast:5.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
