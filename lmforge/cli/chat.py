"""`lmforge chat`: a terminal conversation with a checkpoint, streamed token by token.

The prompt is the whole history rendered with the model's chat template (the tokenizer's Jinja
`chat_template` when it has one, else the built-in `<|user|>...<|end|><|assistant|>` format the
SFT stage trains on), so the model sees exactly what it was fine-tuned on. /reset clears the
history, /exit (or Ctrl-D) quits.
"""

from __future__ import annotations

import sys

HELP = "commands: /reset (forget the conversation), /exit (quit)"


def register(sub) -> None:
    from lmforge.cli.generate import add_compile_args, add_engine_args, add_sampling_args

    p = sub.add_parser("chat", help="chat with a checkpoint in the terminal")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (with tokenizer)")
    p.add_argument("--system", help="system message")
    add_engine_args(p)
    add_compile_args(p, "One compile, a minute or more on a 2-core CPU, for the one running row.")
    add_sampling_args(p)
    p.set_defaults(func=run, max_new_tokens=256)


def run(args, stdin=None, stdout=None) -> int:
    from lmforge.cli.generate import compile_cache_dir, load_engine, sampling, warm_up
    from lmforge.cli.main import Terminated
    from lmforge.errors import ConfigError, require_text
    from lmforge.infer.engine import GenerationParams
    from lmforge.interop.chat_template import render_chat

    if stdin is None and hasattr(sys.stdin, "reconfigure"):
        # undecodable input becomes lone surrogates that require_text reports for that line,
        # instead of a UnicodeDecodeError that would end the session
        sys.stdin.reconfigure(errors="surrogateescape")
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    if args.system is not None:
        require_text(args.system, "--system")
    lm, engine, compiled = load_engine(args, max_batch=1)
    tok = lm.require_tokenizer(f"chat with {args.checkpoint}")
    if compiled:
        warm_up(engine, compile_cache_dir(args))
    stop_ids = tok.chat_stop_ids(engine.eos_ids)
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    print(HELP, file=stdout)
    while True:
        print("> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.strip()
        if text == "/reset":
            history = list(start)
            print("(conversation cleared)", file=stdout)
            continue
        if not text:
            continue
        try:
            require_text(text, "input")
        except ConfigError as err:
            print(f"error: {err}", file=stdout)
            continue
        history.append({"role": "user", "content": text})
        ids = tok.encode(render_chat(tok, history, add_generation_prompt=True))
        while len(ids) >= engine.max_len - 1 and len(history) > len(start) + 1:
            history = start + history[len(start) + 2 :]  # drop the oldest exchange
            ids = tok.encode(render_chat(tok, history, add_generation_prompt=True))
        params = GenerationParams(**sampling(args), stop_token_ids=stop_ids)
        try:
            reply = []
            for out in engine.stream(ids, params):
                reply.append(out.text)
                print(out.text, end="", file=stdout, flush=True)
        except Terminated:  # SIGTERM ends the session (main maps it to KeyboardInterrupt)
            raise
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the session
            pass
        except ConfigError as err:
            print(f"error: {err}", file=stdout)
            history.pop()
            continue
        stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
