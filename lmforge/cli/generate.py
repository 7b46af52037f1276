"""`lmforge generate`: sample text from a checkpoint on the engine (lmforge.infer.engine)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

COMPILE_CACHE = Path("~/.cache/lmforge/compile")


def add_sampling_args(p) -> None:
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)


def sampling(args) -> dict:
    """The GenerationParams fields add_sampling_args' options give."""
    return {
        k: getattr(args, k) for k in ("max_new_tokens", "temperature", "top_k", "top_p", "seed")
    }


def add_engine_args(p) -> None:
    """Device and decoding precision for the engine-backed commands (generate, chat, serve):
    --dtype (default auto: chosen per machine) and --quantize, with the choices
    lmforge.infer.quantize defines (one list for every command)."""
    from lmforge.infer.quantize import DTYPE_CHOICES, DTYPE_HELP, QUANTIZE_CHOICES, QUANTIZE_HELP

    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, help=QUANTIZE_HELP)


def add_compile_args(p, ranges: str) -> None:
    """--compile / --no-compile (default: on where a compiler exists) and --compile-cache, for
    the long-lived engines (chat, serve) whose start-up can afford a compile that every later
    token repays."""
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction,
        help="compile the decode step at start-up (default: on where a compiler exists: a CUDA "
        f"GPU, or a C++ compiler for the CPU's AOTInductor). {ranges} The compiled steps are "
        "kept in --compile-cache, so a restart with a model of the same shapes loads them in "
        "seconds; "
        "docs/inference.md has the speed-ups and compile times",
    )  # fmt: skip
    p.add_argument(
        "--compile-cache", default=str(COMPILE_CACHE), metavar="DIR",
        help="where compiled decode steps are kept, per model, precision, torch version and "
        "CPU (default: %(default)s; 'none': compile again at every start)",
    )  # fmt: skip


def compile_wanted(args, model) -> bool:
    """--compile as given, else whether this machine can compile this model's decode step: a
    static step needs full softmax attention (engine.py), and the CPU's AOTInductor a C++
    compiler (the CXX variable or one on PATH)."""
    from lmforge.model.cache import full_attention

    if args.compile is not None:
        return args.compile
    if not full_attention(model.config):
        return False
    if str(args.device).startswith("cuda"):
        return True
    compilers = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    return any(name and shutil.which(name) for name in compilers)


def compile_cache_dir(args) -> Path | None:
    """The folder compiled steps are kept in (None: compile at every start). Points inductor's
    own cache (torch.compile's graphs, AOTInductor's precompiled headers) next to it instead of
    /tmp, which a reboot empties; its keys include torch's version."""
    if args.compile_cache.lower() == "none":
        return None
    folder = Path(args.compile_cache).expanduser()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder / "inductor"))
    return folder


def load_engine(args, max_batch: int, **engine_args):
    """(lm, engine, compiled) for the long-lived engines (chat, serve): the checkpoint on the
    device (a GGUF file made at the asked precision as it loads, its own by default), on an
    engine of --dtype/--quantize whose decode step is compiled where compile_wanted says."""
    from lmforge.infer.engine import Engine
    from lmforge.lm import LM

    gguf = Path(args.checkpoint).is_file()
    precision = dict(dtype=args.dtype, quantize=args.quantize) if gguf else {}
    lm = LM.load(args.checkpoint, device=args.device, **precision)
    compiled = compile_wanted(args, lm.model)
    engine = Engine.from_lm(lm, max_batch=max_batch, compile=compiled, dtype=args.dtype,
                            quantize=args.quantize, **engine_args)  # fmt: skip
    return lm, engine, compiled


def warm_up(engine, cache_dir: Path | None, out=None) -> None:
    """Compile (or load) the engine's decode step now and say once how long it took."""
    lines: list[str] = []
    began = time.perf_counter()
    engine.warm_up(progress=lines.append, cache_dir=cache_dir)
    if lines:
        loaded = not any("compil" in line for line in lines)
        print(f"decode step {'loaded from the cache' if loaded else 'compiled'} in "
              f"{time.perf_counter() - began:.1f} s (--no-compile to skip)", file=out or sys.stderr,
              flush=True)  # fmt: skip


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--raw", action="store_true", help="continue the prompt text as it is; by "
                   "default a checkpoint with a chat template (an instruct model) gets each "
                   "prompt as a user message in that template")  # fmt: skip
    add_engine_args(p)
    p.add_argument("--draft", metavar="CHECKPOINT_DIR", help="a smaller checkpoint "
                   "with the same vocabulary: speculative decoding (same output distribution; "
                   "greedy output unchanged)")  # fmt: skip
    p.add_argument("--draft-tokens", type=int, default=4, metavar="K",
                   help="tokens the draft proposes per target forward")  # fmt: skip
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from lmforge.errors import require_text
    from lmforge.lm import LM

    for text in args.prompt:
        require_text(text, "--prompt")
    for text in args.stop or ():
        require_text(text, "--stop")
    precision = dict(device=args.device, dtype=args.dtype, quantize=args.quantize)
    lm = LM.load(args.checkpoint, **precision)
    kwargs = dict(sampling(args), stop=args.stop)
    if args.draft is not None:
        kwargs.update(draft=LM.load(args.draft, **precision), draft_tokens=args.draft_tokens)
    # An instruct model answers a user turn: given the bare text, its first token is usually its
    # end of turn, and the command printed nothing. So its own template wraps each prompt.
    chat = not args.raw and getattr(lm.tokenizer, "chat_template", None) is not None
    prompts, echo = args.prompt, args.prompt
    if chat:
        from lmforge.interop.chat_template import render_chat

        note = "using the checkpoint's chat template (--raw for plain continuation)"
        print(note, file=sys.stderr)
        prompts = [
            render_chat(lm.tokenizer, [{"role": "user", "content": text}], True)
            for text in args.prompt
        ]
        echo = [""] * len(prompts)  # the reply alone, not the rendered template
    if args.stream:
        for prompt, shown in zip(prompts, echo):
            sys.stdout.write(shown)
            for piece in lm.stream(prompt, **kwargs):
                print(piece, end="", flush=True)
            sys.stdout.write("\n")
        return 0
    outputs = lm.complete(prompts, n=args.n, **kwargs)
    for i, text in enumerate(outputs):
        print(f"--- {i + 1} ---\n{echo[i // args.n]}{text}")
    if lm.speculative_stats is not None:
        s = lm.speculative_stats
        print(f"speculative: {s.accepted}/{s.proposed} draft tokens accepted "
              f"({s.acceptance_rate:.0%}), {s.target_calls} target forwards for "
              f"{s.new_tokens} tokens", file=sys.stderr)  # fmt: skip
    return 0
