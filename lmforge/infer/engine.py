"""The inference engine: every generation in lmforge runs here (LM.generate/complete/stream,
`lmforge generate`, chat, serve, RL rollouts, evaluation, VLM captioning, speculative decoding).

    engine = Engine.from_lm(lm, max_batch=16)
    rid = engine.add_request("Once upon", GenerationParams(max_new_tokens=50, temperature=0.8))
    while engine.has_work():
        for out in engine.step():   # StepOutput: new token(s), text delta, finish reason
            ...
    engine.generate(["a", "b"], params, n=4)  # or run a batch to completion

Each `step()` admits waiting requests into free slots (one prefill for all of them; identical
prompts, e.g. the n samples of one request or a GRPO group, are prefilled once and their keys
copied), then runs one decode step for every running sequence. Finished sequences leave at once
and their slot is reused by the next request. Per token the host work is one `.tolist()` and a
few list operations: masks and positions are updated in place (model/cache.py SlotCache),
logits are computed for the last position only, and sampling is vectorized over rows
(sampling.py). The forward is the model's own (`Transformer.forward` with the cache), on a copy
whose layers run the kernels `quantize.inference_model` picks.

Three paths, one API:
- full softmax attention (`model.cache.full_attention`): the slot cache above, continuous
  batching;
- other attention kinds (sliding window, sparse patterns, MLA, linear attention): the model's own
  forward over the cache its kind needs (`new_cache`); waiting requests are admitted together
  when the batch is empty, rows leave as they finish (a slower path, same results);
- `draft=`: speculative decoding (speculative.py), each sequence proposing with the draft and
  verifying with the target in rounds of 1..draft_tokens+1 tokens.

A request may bring `prompt_embeds` [len(prompt), d_model]: its input embeddings, used instead of
the token embeddings at prefill (a VLM's image features spliced into its text).

Precision: `dtype="bfloat16"` and/or `quantize="int8"` (weight-only, per-channel scales) run a
converted copy of the model (quantize.py); the caller's model is untouched.

The decode step is one object, picked when the engine is built (`EngineConfig.compile`,
`cuda_graphs`): `EagerStep` below, its `CompiledStep` (torch.compile), or steps.py's
`ExportedStep` (CPU + compile: AOTInductor) or `GraphStep` (a CUDA graph per batch bucket; on by
default on a GPU). Speed figures: docs/inference.md and docs/benchmarks.md.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from lmforge.errors import ConfigError
from lmforge.infer.cpu_kernels import native_kernels
from lmforge.infer.detokenize import IncrementalDecoder, StopMatcher
from lmforge.infer.params import Completion, GenerationParams, StepOutput
from lmforge.infer.prefix_cache import PrefixCache, PrefixCacheStats
from lmforge.infer.quantize import inference_model
from lmforge.infer.sampling import RowSampler, request_uniforms
from lmforge.infer.sequence import RunningSequence
from lmforge.infer.speculative import SpeculativeDecoder, SpeculativeStats
from lmforge.infer.steps import (
    ExportedStep,
    GraphStep,
    compile_forward,
    exportable,
    fixed_step_unsupported,
    warm_up_by_decoding,
)
from lmforge.model.cache import SlotCache, full_attention, new_cache

# prompt tokens one prefill forward takes at most on a CPU (Engine._prefill_groups)
PREFILL_GROUP_TOKENS = 128

__all__ = ["Engine", "EngineConfig", "GenerationParams", "StepOutput", "Completion"]


@dataclass
class EngineConfig:
    """How an engine is built (what each request asks for is GenerationParams).

    max_batch: running sequences at most (cache rows); max_len: context per sequence (default
    and cap: the model's max_seq_len); eos_ids: stop tokens (default: the tokenizer's EOS);
    max_prefill_tokens: the prompt tokens one prefill may take; dtype / quantize: precision
    (quantize.py); kv_dtype: the KV cache's dtype (default: the activations'); compile: compile
    the decode step; cuda_graphs: replay it as CUDA graphs (None: on a GPU when it can);
    draft_tokens: tokens a draft model proposes per round (speculative decoding);
    prefix_cache_bytes: keys and values of prompt blocks kept for later prompts that start the
    same way (prefix_cache.py; 0: off), in blocks of prefix_block tokens."""

    max_batch: int = 16
    max_len: int | None = None
    eos_ids: Sequence[int] | None = None
    max_prefill_tokens: int = 8192
    dtype: torch.dtype | str | None = None
    quantize: str | None = None
    kv_dtype: torch.dtype | None = None
    compile: bool = False
    cuda_graphs: bool | None = None
    draft_tokens: int = 4
    prefix_cache_bytes: int = 0
    prefix_block: int = 16

    def __post_init__(self):
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ConfigError(f"max_batch must be an integer >= 1, got {self.max_batch!r}")


class EagerStep:
    """The decode step as the model runs it: ids [n, 1] (the running rows' next tokens) ->
    (logits [n, V], their argmax or None), the cache one column on and the rows' positions one
    further. The other steps (steps.py) have the same interface."""

    def __init__(self, model: nn.Module, cache: SlotCache):
        self.model, self.cache = model, cache
        # greedy tokens by lmforge's argmax on a CPU (torch.max over a batch's logits costs
        # several times one pass over them); the sampler takes torch's where this is None
        native = native_kernels() if cache.mask.device.type == "cpu" else None
        self.argmax = native.argmax_rows if native is not None else None

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache, n = self.cache, ids.shape[0]
        positions = cache.positions[:n, None]
        logits = self.model(ids, positions=positions, cache=cache, last_only=True)[:, -1]
        cache.positions[:n] += 1
        fp32 = self.argmax is not None and logits.dtype == torch.float32
        return logits, self.argmax(logits) if fp32 else None

    def warm_up(self, engine, progress=print, cache_dir=None) -> None:
        """Nothing to prepare."""


class CompiledStep(EagerStep):
    """The model's forward through torch.compile (steps.compile_forward), one token per row."""

    warm_up = staticmethod(warm_up_by_decoding)

    def __init__(self, model: nn.Module, cache: SlotCache):
        super().__init__(compile_forward(model, cache), cache)


class Engine:
    """Continuous-batching generation for a Transformer (thread-safe add/abort; one stepper)."""

    def __init__(
        self, model, tokenizer=None, config: EngineConfig | None = None, draft=None, **options
    ):
        """`options`: EngineConfig fields, overriding `config`'s (Engine(model, max_batch=4)).
        `draft`: a smaller model sharing the vocabulary, for speculative decoding."""
        cfg = replace(config or EngineConfig(), **options)
        self.tokenizer, self.config, self.quantize = tokenizer, model.config, cfg.quantize
        self.model = inference_model(model, cfg.dtype, cfg.quantize)
        self.max_len = min(cfg.max_len or model.config.max_seq_len, model.config.max_seq_len)
        self.max_batch, self.max_prefill_tokens = cfg.max_batch, cfg.max_prefill_tokens
        eos_ids = cfg.eos_ids
        if eos_ids is None:
            eos_ids = [tokenizer.eos_id] if tokenizer and tokenizer.eos_id is not None else []
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        weight = getattr(getattr(self.model, "embed", None), "weight", None)
        weight = weight if weight is not None else next(self.model.parameters())
        self.device, self.dtype = weight.device, weight.dtype  # activations and KV cache
        self.speculative: SpeculativeDecoder | None = None
        self.speculative_stats = SpeculativeStats()  # summed over this engine's sequences
        if draft is not None:
            draft_model = inference_model(draft, cfg.dtype, cfg.quantize)
            self.speculative = SpeculativeDecoder(self.model, draft_model, cfg.draft_tokens)
        # The slot cache needs keys that may sit in any column; other kinds take the per-kind
        # path, speculative decoding keeps one rewindable cache per sequence.
        self.slots = full_attention(self.config) and draft is None
        export = cfg.compile and self.slots and not cfg.cuda_graphs
        export = export and exportable(self.model, self.device)
        # Keys and values in fp16 where a quantised model decodes in fp32 through the CPU's
        # exported step, as llama.cpp keeps its cache in F16 whatever the weights: every step
        # reads each row's whole cache, and the compiled attention reads fp16 into fp32
        # arithmetic in the same loop (eagerly the upcast would be a copy: fp32 stays there).
        fp16_kv = export and cfg.quantize is not None and self.dtype == torch.float32
        self.kv_dtype = cfg.kv_dtype or (torch.float16 if fp16_kv else self.dtype)
        self.cache = SlotCache(self.config, cfg.max_batch, self.max_len, self.kv_dtype,
                               self.device) if self.slots else None  # fmt: skip
        self.sampler = RowSampler(cfg.max_batch, self.config.vocab_size, self.max_len, self.device)
        self.next_tokens = torch.zeros(cfg.max_batch, dtype=torch.long, device=self.device)
        self.rows: list[RunningSequence] = []  # running sequences, in cache-row order
        self.waiting: deque[RunningSequence] = deque()
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.decode_step = self._pick_step(cfg, export)
        self.prefix_cache = None  # the slot cache path only: keys sit in any column there
        if cfg.prefix_cache_bytes and self.slots:
            self.prefix_cache = PrefixCache(cfg.prefix_block, cfg.prefix_cache_bytes)

    def _pick_step(self, cfg: EngineConfig, export: bool):
        """The one decode step object of the slot cache path (None on the others): exported on
        CPU with compile, a CUDA graph on a GPU (by default; cuda_graphs=True on a CPU runs the
        same static step without graphs, which the tests compare), compiled, or eager."""
        why_not = fixed_step_unsupported(self.model)
        if not self.slots:
            if cfg.compile:
                raise ConfigError("compile needs full softmax attention and no draft model")
            why_not = "this attention kind has no slot cache"
            if self.speculative is not None:
                why_not = "speculative decoding verifies several tokens per step"
        on_gpu = self.device.type == "cuda" and why_not is None  # the default
        graphs = on_gpu if cfg.cuda_graphs is None else cfg.cuda_graphs
        if graphs and why_not:
            raise ConfigError(f"cuda_graphs needs a static decode step, but {why_not}")
        if not self.slots:
            return None
        if export:
            return ExportedStep(self.model, self.cache)
        if graphs:
            forward = compile_forward(self.model, self.cache) if cfg.compile else self.model
            return GraphStep(forward, self.cache, self.next_tokens,
                             use_graphs=self.device.type == "cuda")  # fmt: skip
        return CompiledStep(self.model, self.cache) if cfg.compile else \
            EagerStep(self.model, self.cache)  # fmt: skip

    @property
    def precision(self) -> str:
        """What the engine computes in, e.g. 'float32' or 'int8 weights, bfloat16 activations'."""
        act = str(self.dtype).removeprefix("torch.")
        kv = "" if self.kv_dtype == self.dtype else f", {str(self.kv_dtype)[6:]} KV cache"
        return f"{self.quantize} weights, {act} activations{kv}" if self.quantize else act

    @classmethod
    def from_lm(cls, lm, **kwargs) -> Engine:
        """An engine for an `LM` (its tokenizer and EOS ids, incl. generation_config's)."""
        kwargs.setdefault("eos_ids", lm._eos_ids(None))
        return cls(lm.model, lm.tokenizer, **kwargs)

    def warm_up(self, progress=print, cache_dir=None) -> None:
        """With compile=True (or CUDA graphs): prepare the decode step for every batch size up
        to max_batch now, not inside the first requests (a server calls this before it reports
        ready), reporting each through `progress`. On CPU, cache_dir keeps the compiled steps
        for the next engine over a model of the same shapes (steps.ExportedStep). Eager:
        nothing to do."""
        if self.decode_step is not None:
            self.decode_step.warm_up(self, progress, cache_dir)

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("this engine has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: GenerationParams | None = None,
        n: int = 1,
        request_id: str | None = None,
        prompt_embeds: torch.Tensor | None = None,
    ) -> str:
        """Queue a prompt (text or ids) for n samples; returns the request id.

        prompt_embeds [len(prompt), d_model]: input embeddings to use instead of the prompt's
        token embeddings (the ids still count for penalties and the context length)."""
        params = params or GenerationParams()
        ids = self.encode(prompt)
        if not ids:
            raise ConfigError("the prompt is empty")
        if len(ids) >= self.max_len:
            raise ConfigError(
                f"the prompt has {len(ids)} tokens; the context holds {self.max_len} "
                f"(prompt plus at least one new token; max_seq_len={self.config.max_seq_len})"
            )
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:
            raise ConfigError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"n must be an integer >= 1, got {n!r}")
        if prompt_embeds is not None:
            want = (len(ids), self.config.d_model)
            if tuple(prompt_embeds.shape) != want:
                raise ConfigError(
                    f"prompt_embeds must have shape {want} (prompt tokens, d_model), got "
                    f"{tuple(prompt_embeds.shape)}"
                )
            prompt_embeds = prompt_embeds.detach().to(self.device, self.dtype)
        if self.speculative is not None:
            unsupported = [name for name, on in [
                ("penalties", params.has_penalties), ("logprobs", params.logprobs is not None),
                ("suppress_token_ids", bool(params.suppress_token_ids)),
                ("constraint", params.constraint is not None),
                ("prompt_embeds", prompt_embeds is not None)] if on]  # fmt: skip
            if unsupported:
                raise ConfigError(f"speculative decoding does not support {unsupported[0]}")
        rid = request_id or f"req-{next(self._ids)}"
        stop_ids = self.eos_ids if params.stop_token_ids is None else params.stop_token_ids
        uniforms = None
        if params.temperature > 0 and self.speculative is None:
            steps = min(params.max_new_tokens, self.max_len)
            uniforms = request_uniforms(n, steps, params.seed, self.device)
        seqs = []
        for i in range(n):
            decoder = None
            if self.tokenizer is not None:
                decoder = IncrementalDecoder(self.tokenizer, params.skip_special_tokens)
            seq = RunningSequence(rid, i, ids, params, frozenset(stop_ids),
                            None if uniforms is None else uniforms[i], decoder,
                            StopMatcher(params.stop), prompt_embeds)  # fmt: skip
            if self.speculative is not None and params.temperature > 0:
                # without a seed: follow torch.manual_seed, like the rest of lmforge
                seed = params.seed + i if params.seed is not None else int(torch.randint(2**62, ()))
                seq.generator = torch.Generator(device=self.device).manual_seed(seed)
            seqs.append(seq)
        with self._lock:
            self.waiting.extend(seqs)
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request (e.g. its client went away); its slots free up at the next step."""
        with self._lock:
            self._aborted.add(request_id)

    def has_work(self) -> bool:
        return bool(self.rows or self.waiting)

    def reset(self) -> None:
        """Drop every running and waiting sequence (after a failed step)."""
        with self._lock:
            self.waiting.clear()
            self._aborted.clear()
        self.rows.clear()
        if self.slots:
            self.cache.n = 0
        else:
            self.cache = None
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Prompt tokens looked up in the prefix cache and found there (None: no cache)."""
        return None if self.prefix_cache is None else self.prefix_cache.stats

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Admit waiting requests, then advance every running sequence by one token (by one
        speculative round with a draft model)."""
        if not torch.is_inference_mode_enabled():  # loops over steps enter it once
            with torch.inference_mode():
                return self.step()
        outputs = self._drop_aborted()
        admitted = self._take_waiting()
        if admitted and self.speculative is not None:
            self._start_speculative(admitted)
        elif admitted:
            outputs += self._prefill(admitted)
        if self.rows:
            outputs += self._decode()
        return outputs

    def _drop_aborted(self) -> list[StepOutput]:
        with self._lock:
            aborted, self._aborted = self._aborted, set()
            if aborted:
                self.waiting = deque(s for s in self.waiting if s.request_id not in aborted)
        if not aborted:
            return []
        gone = [r for r, s in enumerate(self.rows) if s.request_id in aborted]
        outs = [StepOutput(self.rows[r].request_id, self.rows[r].index, [], "", None, "abort")
                for r in gone]  # fmt: skip
        self._remove(gone)
        return outs

    def _take_waiting(self) -> list[RunningSequence]:
        """FIFO, as many as free slots and the prefill token budget allow (at least one; a
        prompt shared by several samples counts once). The per-kind path admits only into an
        empty batch: its rows share one cache offset."""
        taken: list[RunningSequence] = []
        if self.rows and not self.slots and self.speculative is None:
            return taken
        # A sparse pattern (block-local, strided) is laid out over cache columns: left padding
        # would shift it, so such a model admits equal-length prompts together.
        same_length = not self.slots and getattr(self.config, "attention_pattern", None)
        with self._lock:
            width, prefixes = 0, set()
            while self.waiting and len(self.rows) + len(taken) < self.max_batch:
                seq = self.waiting[0]
                if same_length and taken and len(seq.prompt) != len(taken[0].prompt):
                    break
                key = seq.prefix_key
                if key not in prefixes:
                    width = max(width, len(seq.prompt))
                    if taken and width * (len(prefixes) + 1) > self.max_prefill_tokens:
                        break
                    prefixes.add(key)
                taken.append(self.waiting.popleft())
        return taken

    def _start_speculative(self, seqs: list[RunningSequence]) -> None:
        """Each sequence decodes in rounds of its own (speculative.py keeps its caches)."""
        for seq in seqs:
            budget = min(seq.params.max_new_tokens, self.max_len - len(seq.prompt))
            seq.rounds = self.speculative.stream(seq.prompt, seq.params, seq.stop_ids, budget,
                                                 seq.generator, self.speculative_stats)  # fmt: skip
        self.rows.extend(seqs)

    def _prefill(self, seqs: list[RunningSequence]) -> list[StepOutput]:
        """Prefill the prompts: those starting with blocks in the prefix cache from them, the
        others together (`_prefill_together`)."""
        if self.prefix_cache is None:
            return self._prefill_together(seqs)
        seqs, hits = self.prefix_cache.split(seqs)
        outputs = self._prefill_together(seqs) if seqs else []
        for seq, blocks in hits:
            lo, total = len(self.rows), len(seq.prompt)
            logits = self.prefix_cache.prefill(self.model, self.cache, lo, seq.prompt, blocks)
            self.cache.start_rows(lo, [total], [total])
            self.sampler.start_row(lo, seq.params, seq.prompt, seq.uniforms)
            self.rows.append(seq)
            self.cache.n = len(self.rows)
            self.prefix_cache.store(self.cache, lo, seq.prompt)  # the blocks after the hit
            outputs += self._emit(logits, lo=lo)
        return outputs

    def _prefill_together(self, seqs: list[RunningSequence]) -> list[StepOutput]:
        """One forward pass over the distinct prompts, then every sample's row from its
        prompt's (keys copied, not recomputed)."""
        firsts: dict[tuple, RunningSequence] = {}
        for s in seqs:
            firsts.setdefault(s.prefix_key, s)
        unique = {key: i for i, key in enumerate(firsts)}
        # Rows: the first sample of each distinct prompt, then the copies.
        ordered = list(firsts.values()) + [s for s in seqs if firsts[s.prefix_key] is not s]
        prompts = [s.prompt for s in firsts.values()]
        width = max(len(p) for p in prompts)
        rows = [torch.as_tensor(p) for p in prompts]
        ids = pad_sequence(rows, batch_first=True, padding_side="left").to(self.device)
        pad = torch.arange(width) >= width - torch.as_tensor([len(p) for p in prompts])[:, None]
        source = [unique[s.prefix_key] for s in ordered]  # the prefilled row of each sequence
        embeds = [s.embeds for s in firsts.values()]
        lo, pad_mask = len(self.rows), None if bool(pad.all()) else pad.to(self.device)
        if self.slots:
            cache = self.cache
            cache.room_for(width)
            parts = []
            for a, b in self._prefill_groups(len(prompts), width):
                mask = None if pad_mask is None else pad_mask[a:b]
                view = cache.prefill_view(lo + a, lo + b, width, mask)
                with self._prompt_embeds(embeds[a:b], width):
                    parts.append(self.model(ids[a:b], cache=view, last_only=True)[:, -1])
            logits = torch.cat(parts)
            lengths = [len(s.prompt) for s in ordered]
            cache.start_rows(lo, lengths, lengths)
            if len(ordered) > len(prompts):  # the samples that share a prefilled prompt
                copies = range(lo + len(prompts), lo + len(ordered))
                cache.copy_kv([lo + i for i in source[len(prompts) :]], list(copies),
                              cache.length - width)  # fmt: skip
        else:  # the per-kind path: a fresh cache of the kind this attention needs
            room = min(self.max_len, width + max(s.params.max_new_tokens for s in seqs))
            cache = new_cache(self.config, len(prompts), room, self.dtype, self.device)
            if pad_mask is not None:
                cache.set_padding(pad_mask)
            with self._prompt_embeds(embeds, width):
                logits = self.model(ids, cache=cache, last_only=True)[:, -1]
            if source != list(range(len(prompts))):
                cache.reorder(torch.as_tensor(source, device=self.device))
            self.cache = cache
        for row, s in enumerate(ordered, start=lo):
            self.sampler.start_row(row, s.params, s.prompt, s.uniforms)
        self.rows.extend(ordered)
        if self.slots:
            self.cache.n = len(self.rows)
        if self.prefix_cache is not None:  # before _emit retires any row
            for row in range(lo, lo + len(prompts)):
                self.prefix_cache.store(self.cache, row, self.rows[row].prompt)
        return self._emit(logits[torch.as_tensor(source, device=self.device)], lo=lo)

    def _prefill_groups(self, n: int, width: int) -> list[tuple[int, int]]:
        """The prompts one prefill forward takes ([a, b) of n prompts `width` wide): on a CPU
        at most PREFILL_GROUP_TOKENS tokens (at least one prompt), elsewhere all. Past that a
        layer's activations ([tokens, d_ff] fp32) no longer fit a core's L2 cache and each of the
        many elementwise passes between the matmuls streams them from memory: 8 or 16 prompts
        prefilled together ran well below one prompt's tokens/s (the batch-8 / 16 prefill of
        docs/benchmarks.md's matched table), and larger groups lost at 2 threads too."""
        per = n
        if self.device.type == "cpu":
            per = max(1, PREFILL_GROUP_TOKENS // width)
        return [(a, min(a + per, n)) for a in range(0, n, per)]

    def _prompt_embeds(self, embeds: list[torch.Tensor | None], width: int):
        """A context for prefilling left-padded prompts `width` wide: the token embeddings of
        rows that brought prompt embeddings are replaced by those (a forward hook on the
        embedding table, removed on leaving)."""
        if all(e is None for e in embeds):
            return nullcontext()

        def hook(module, inputs, out):
            out = out.clone()
            for i, e in enumerate(embeds):
                if e is not None:
                    out[i, width - e.shape[0] :] = e.to(out.dtype)
            return out

        return self.model.embed.register_forward_hook(hook)

    def _decode(self) -> list[StepOutput]:
        if self.speculative is not None:
            return self._speculative_round()
        n = len(self.rows)
        if not self.slots:
            logits = self.model(self.next_tokens[:n, None], cache=self.cache, last_only=True)
            return self._emit(logits[:, -1], lo=0)
        self.cache.begin_decode()
        logits, greedy = self.decode_step(self.next_tokens[:n, None])
        return self._emit(logits, greedy, lo=0)

    def _speculative_round(self) -> list[StepOutput]:
        outputs = [seq.push(next(seq.rounds, []), None, self.max_len) for seq in self.rows]
        for out in outputs:
            if not out.finished and not out.token_ids:  # the round found nothing more to do
                out.finish_reason = "length"
        self._remove([i for i, out in enumerate(outputs) if out.finished])
        return outputs

    def _emit(self, logits: torch.Tensor, greedy: torch.Tensor | None = None, lo: int = 0):
        """Sample rows lo.. (greedy: their argmax, if already known), record tokens, build
        outputs, retire the rows they finish."""
        tokens_t, tokens, logprobs = self.sampler.sample(logits, lo, greedy)
        self.next_tokens[lo : lo + len(tokens)] = tokens_t
        # the per-kind cache has a fixed width: no column left means no next token
        full = not self.slots and self.cache.length >= self.cache.max_len
        outputs = [
            self.rows[lo + i].push([token], None if lp is None else [lp], self.max_len, full)
            for i, (token, lp) in enumerate(zip(tokens, logprobs))
        ]
        self._remove([lo + i for i, out in enumerate(outputs) if out.finished])
        return outputs

    def _remove(self, rows: list[int]) -> None:
        """Retire rows; the last running row moves into each freed slot (dense batch)."""
        if not rows:
            return
        order = list(range(len(self.rows)))  # the per-kind cache's rows, gathered once
        for row in sorted(rows, reverse=True):
            last = len(self.rows) - 1
            if row != last:
                if self.slots:
                    self.cache.copy_row(last, row)
                self.sampler.move_row(last, row)
                self.next_tokens[row] = self.next_tokens[last]
                self.rows[row] = self.rows[last]
                order[row] = order[last]
            self.rows.pop()
            order.pop()
        if self.slots:
            self.cache.n = len(self.rows)
        elif self.speculative is None:
            if self.rows:
                self.cache.reorder(torch.as_tensor(order, device=self.device))
            else:
                self.cache = None

    # ---- convenience drivers (single caller; the server uses AsyncEngine instead) --------------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: GenerationParams | None = None,
        n: int = 1,
        prompt_embeds: Sequence[torch.Tensor | None] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion; n consecutive Completions per prompt. With a seed, prompt
        j is a request seeded seed + j (its samples differ from every other prompt's)."""
        params = params or GenerationParams()
        embeds = list(prompt_embeds) if prompt_embeds is not None else [None] * len(prompts)
        if len(embeds) != len(prompts):
            raise ConfigError(f"{len(embeds)} prompt_embeds for {len(prompts)} prompts")
        rids = []
        for j, (prompt, e) in enumerate(zip(prompts, embeds)):
            p = params if params.seed is None or j == 0 else replace(params, seed=params.seed + j)
            rids.append(self.add_request(prompt, p, n, prompt_embeds=e))
        outs: dict[tuple[str, int], list[StepOutput]] = {(r, i): [] for r in rids for i in range(n)}
        with torch.inference_mode():
            while self.has_work():
                for out in self.step():
                    outs.get((out.request_id, out.index), []).append(out)
        want_lp = params.logprobs is not None
        return [
            Completion(self.encode(prompts[j]), [t for o in got for t in o.token_ids],
                       "".join(o.text for o in got), got[-1].finish_reason,
                       [lp for o in got for lp in o.logprobs or []] if want_lp else None)
            for j, r in enumerate(rids) for got in [outs[r, i] for i in range(n)]
        ]  # fmt: skip

    def stream(
        self, prompt: str | Sequence[int], params: GenerationParams | None = None
    ) -> Iterator[StepOutput]:
        """Yield one request's outputs as they are produced (drives the engine itself)."""
        rid = self.add_request(prompt, params)
        try:
            while self.has_work():
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(rid)
