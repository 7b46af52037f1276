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
from pathlib import Path

import torch

from lmforge.errors import CheckpointError, ConfigError
from lmforge.infer.generate import generate, generate_stream
from lmforge.infer.sampling import SamplingParams
from lmforge.interop.checkpoint import load_model
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer


class LM:
    """A Transformer plus (optionally) the Tokenizer that feeds it."""

    def __init__(self, model: Transformer, tokenizer=None, generation_config: dict | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.generation_config = generation_config  # HF generation_config.json, when loaded
        self.speculative_stats = None  # counters of the latest generation with a draft model

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
        a llama.cpp `.gguf` file (weights dequantised, tokenizer rebuilt from its metadata).
        quantize="int8": weight-only int8 Linear layers for inference (lmforge.infer.quantize)."""
        from lmforge.infer.quantize import resolve_dtype, to_inference_precision

        path = Path(path)
        dtype = resolve_dtype(dtype)
        if path.is_file():  # a single-file checkpoint: llama.cpp's GGUF
            from lmforge.interop.gguf import load_gguf

            model, tokenizer, generation = load_gguf(path, device=device, dtype=dtype)
            if quantize is not None:
                model = to_inference_precision(model, dtype, quantize, copy_model=False)
            return cls(model, tokenizer, generation)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory not found: {path}")
        model = load_model(path, device=device, dtype=dtype)
        if quantize is not None:
            model = to_inference_precision(model, dtype, quantize, copy_model=False)
        tokenizer = None
        if (path / "tokenizer.json").is_file():
            from lmforge.tokenizer import Tokenizer

            tokenizer = Tokenizer.load(path)
        from lmforge.interop.hf import read_generation_config

        return cls(model, tokenizer, read_generation_config(path))

    def save(self, path: str | Path, format: str = "auto") -> Path:
        """Write config.json, model.safetensors and the tokenizer. format="auto": a model that came
        from a transformers family (HF folder, GGUF) is written in that family's layout, which
        `AutoModelForCausalLM.from_pretrained` loads as written; an lmforge-born one in lmforge's
        format. "hf" / "lmforge" force one (lmforge.interop.hf.save_lm). LM.load reads both."""
        from lmforge.interop.hf import save_lm

        return save_lm(self, path, format)

    def export_hf(self, path: str | Path, max_shard_bytes: int | None = None) -> Path:
        """Write a directory transformers' AutoModelForCausalLM/AutoTokenizer load unchanged."""
        from lmforge.interop.hf import export_hf

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
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        n: int = 1,
        seed: int | None = None,
        eos_ids: Sequence[int] | None = None,
        use_cache: bool = True,
        draft: LM | None = None,
        draft_tokens: int = 4,
    ) -> list[list[int]]:
        """New token ids for each prompt (n consecutive rows per prompt when n > 1).

        draft: a smaller LM with the same vocabulary for speculative decoding (draft_tokens
        proposals per target forward; same output distribution, greedy output unchanged)."""
        params = SamplingParams(max_new_tokens, temperature, top_k, top_p, seed)
        rows = [list(p) for p in prompts for _ in range(n)]
        was_training = self.model.training
        self.model.eval()
        try:
            if draft is not None:
                return self._speculative(draft, draft_tokens, rows, params, self._eos_ids(eos_ids))
            return generate(self.model, rows, params, self._eos_ids(eos_ids), None, use_cache)
        finally:
            self.model.train(was_training)

    def complete(
        self,
        texts: str | Sequence[str],
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        n: int = 1,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        add_bos: bool = False,
        draft: LM | None = None,
        draft_tokens: int = 4,
    ) -> list[str]:
        """Text continuations, cut at the first stop string (which is not included)."""
        tok = self._require_tokenizer()
        texts = [texts] if isinstance(texts, str) else list(texts)
        params = SamplingParams(max_new_tokens, temperature, top_k, top_p, seed)
        rows = [tok.encode(t, add_bos=add_bos) for t in texts for _ in range(n)]
        stop = [s for s in (stop or []) if s]
        stop_fn = None
        if stop:
            stop_fn = lambda row, toks: any(s in tok.decode(toks[-64:]) for s in stop)  # noqa: E731
        self.model.eval()
        if draft is not None:
            ids = self._speculative(draft, draft_tokens, rows, params, self._eos_ids(None), stop_fn)
        else:
            ids = generate(self.model, rows, params, self._eos_ids(None), stop_fn)
        return [truncate_at_stop(tok.decode(row, skip_special_tokens=True), stop) for row in ids]

    def stream(
        self,
        text: str,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        draft: LM | None = None,
        draft_tokens: int = 4,
    ) -> Iterator[str]:
        """Yield pieces of text as they are generated (UTF-8-safe incremental decoding)."""
        tok = self._require_tokenizer()
        params = SamplingParams(max_new_tokens, temperature, top_k, top_p, seed)
        stop = [s for s in (stop or []) if s]
        tokens: list[int] = []
        sent = ""
        self.model.eval()
        if draft is None:
            steps = generate_stream(self.model, [tok.encode(text)], params, self._eos_ids(None))
            new_tokens = (int(token[0]) for token, _active in steps)
        else:
            spec = self._speculative_decoder(draft, draft_tokens)
            chunks = spec.stream(tok.encode(text), params, self._eos_ids(None))
            new_tokens = (t for chunk in chunks for t in chunk)
        for token in new_tokens:
            tokens.append(token)
            full = tok.decode(tokens, skip_special_tokens=True)
            cut = truncate_at_stop(full, stop)
            if cut.endswith("\ufffd") and cut == full:
                continue  # an incomplete multi-byte character: wait for the rest
            if len(cut) > len(sent):
                yield cut[len(sent) :]
                sent = cut
            if cut != full:
                return

    def _speculative_decoder(self, draft: LM, draft_tokens: int):
        from lmforge.infer.speculative import SpeculativeDecoder  # lazy: pulls in the decoder

        draft.model.eval()
        return SpeculativeDecoder(self.model, draft.model, draft_tokens)

    def _speculative(self, draft, draft_tokens, rows, params, eos_ids, stop_fn=None):
        """Rows one at a time through speculative decoding (batch size 1, one random stream);
        the summed counters are left in `self.speculative_stats`."""
        from lmforge.infer.speculative import SpeculativeStats

        spec = self._speculative_decoder(draft, draft_tokens)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        out, total = [], SpeculativeStats()
        for i, row in enumerate(rows):
            row_stop = None if stop_fn is None else (lambda _r, toks, i=i: stop_fn(i, toks))
            out.append(spec.generate(row, params, eos_ids, row_stop, generator).tokens)
            total.add(spec.stats)
        self.speculative_stats = total
        return out

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ConfigError("this LM has no tokenizer: pass token ids to generate() instead")
        return self.tokenizer


def truncate_at_stop(text: str, stop: Sequence[str] | None) -> str:
    """Cut text at the earliest occurrence of any stop string."""
    cut = len(text)
    for s in stop or []:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]
