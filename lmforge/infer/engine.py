"""The inference engine: continuous batching over a preallocated KV cache.

    engine = Engine.from_lm(lm, max_batch=16)
    rid = engine.add_request("Once upon", GenerationParams(max_new_tokens=50, temperature=0.8))
    while engine.has_work():
        for out in engine.step():   # StepOutput: new token(s), text delta, finish reason
            ...
    engine.generate(["a", "b"], params)  # or run a batch to completion

Each `step()` admits waiting requests into free slots (one prefill for all of them; identical
prompts, e.g. the n samples of one request or a GRPO group, are prefilled once and their keys
copied), then runs one decode step for every running sequence. Finished sequences leave at once
and their slot is reused by the next request. Per token the host work is one `.tolist()` and a
few list operations: masks and positions are updated in place (batch.py), logits are computed
for the last position only, and sampling is vectorized over rows (sampler.py). The forward is
decoder.FastDecoder (same math as the model's, half the ops) whenever it covers the model.

Precision: `dtype="bfloat16"` and/or `quantize="int8"` (weight-only, per-channel scales) run a
converted copy of the model (quantize.py); the caller's model is untouched. On CPU, int8 reads
4x fewer weight bytes per token than fp32 and prefill / large batches use bf16 GEMMs.

`compile=True` compiles the decode step: on CPU ahead of time with AOTInductor (exported_step.py,
~1.6x faster decoding after ~20 s of compiling per range of batch sizes), elsewhere with
torch.compile (compiled_step.py).

On a GPU the decode step replays as a CUDA graph (cuda_graphs.py; on by default there): one
launch per token instead of ~100. On an H100, bf16, the bench model decodes ~11x faster than
transformers' `generate` at batch 1 and 16 (benchmarks/bench_generate.py --device cuda).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from lmforge.errors import ConfigError
from lmforge.infer.batch import SlotCache
from lmforge.infer.compiled_step import compile_decode_step
from lmforge.infer.cuda_graphs import StaticDecodeStep
from lmforge.infer.decoder import fixed_step_unsupported, inference_forward
from lmforge.infer.detokenize import IncrementalDecoder, StopMatcher
from lmforge.infer.exported_step import ExportedDecodeStep, exportable
from lmforge.infer.params import Completion, GenerationParams, StepOutput
from lmforge.infer.sampler import BatchSampler

__all__ = ["Engine", "GenerationParams", "StepOutput", "Completion"]


@dataclass
class _Sequence:
    request_id: str
    index: int
    prompt: list[int]
    params: GenerationParams
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    decoder: IncrementalDecoder | None
    matcher: StopMatcher
    output: list[int] = field(default_factory=list)


class Engine:
    """Continuous-batching generation for a Transformer (thread-safe add/abort; one stepper)."""

    def __init__(
        self,
        model,
        tokenizer=None,
        max_batch: int = 16,
        max_len: int | None = None,
        eos_ids: Sequence[int] | None = None,
        max_prefill_tokens: int = 8192,
        compile: bool = False,
        dtype: torch.dtype | str | None = None,
        quantize: str | None = None,
        cuda_graphs: bool | None = None,
    ):
        config = model.config
        plain = getattr(config, "attention", "softmax") == "softmax" and not (
            getattr(config, "attention_pattern", None) or getattr(config, "sliding_window", None)
        )
        if not plain:
            raise ConfigError("Engine needs full softmax attention (no sliding window/pattern)")
        self.tokenizer, self.config = tokenizer, config
        self.quantize = quantize
        self.model, self.forward = inference_forward(model.eval(), dtype, quantize)
        self.max_len = min(max_len or config.max_seq_len, config.max_seq_len)
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        if eos_ids is None:
            eos_ids = [tokenizer.eos_id] if tokenizer and tokenizer.eos_id is not None else []
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        weight = self.model.embed.weight if hasattr(self.model, "embed") else None
        weight = weight if weight is not None else next(self.model.parameters())
        self.device, self.dtype = weight.device, weight.dtype  # activations and KV cache
        self.cache = SlotCache(config, max_batch, self.max_len, self.dtype, self.device)
        self.sampler = BatchSampler(max_batch, config.vocab_size, self.device)
        self.next_tokens = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.rows: list[_Sequence] = []  # running sequences, in cache-row order
        self.waiting: deque[_Sequence] = deque()
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._decode = self.forward
        # CPU + compile: the AOTInductor step (no dynamo per call); else torch.compile, which
        # the CUDA-graph step (on by default on GPUs) captures.
        self._exported = None
        if compile and not cuda_graphs and exportable(self.forward, self.device):
            self._exported = ExportedDecodeStep(self.forward, self.cache)
        elif compile:
            self._decode = compile_decode_step(self.forward, self.cache)
        self._static = self._static_step(cuda_graphs)

    def _static_step(self, cuda_graphs: bool | None) -> StaticDecodeStep | None:
        """The CUDA-graph decode step (cuda_graphs.py): by default on whenever the engine runs
        on a GPU with the fast decoder. cuda_graphs=True on a CPU runs the same static step
        without graphs (what the tests compare against the dynamic step)."""
        why_not = fixed_step_unsupported(self.forward)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and why_not is None
        if not cuda_graphs:
            return None
        if why_not:
            raise ConfigError(f"cuda_graphs needs a static decode step, but {why_not}")
        return StaticDecodeStep(self._decode, self.cache, self.next_tokens,
                                use_graphs=self.device.type == "cuda")  # fmt: skip

    @property
    def precision(self) -> str:
        """What the engine computes in, e.g. 'float32' or 'int8 weights, bfloat16 activations'."""
        act = str(self.dtype).removeprefix("torch.")
        return f"{self.quantize} weights, {act} activations" if self.quantize else act

    @classmethod
    def from_lm(cls, lm, **kwargs) -> Engine:
        """An engine for an `LM` (its tokenizer and EOS ids, incl. generation_config's)."""
        kwargs.setdefault("eos_ids", lm._eos_ids(None))
        return cls(lm.model, lm.tokenizer, **kwargs)

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("this engine has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def check_prompt(self, ids: list[int]) -> None:
        """Raise ConfigError when a prompt cannot run (empty, too long, ids out of range)."""
        if not ids:
            raise ConfigError("the prompt is empty")
        if len(ids) >= self.max_len:
            raise ConfigError(
                f"the prompt has {len(ids)} tokens; the context holds {self.max_len} "
                "(prompt plus at least one new token)"
            )
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:
            raise ConfigError(f"prompt token ids must be in [0, {self.config.vocab_size})")

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: GenerationParams | None = None,
        n: int = 1,
        request_id: str | None = None,
    ) -> str:
        """Queue a prompt (text or ids) for n samples; returns the request id."""
        params = params or GenerationParams()
        ids = self.encode(prompt)
        self.check_prompt(ids)
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"n must be an integer >= 1, got {n!r}")
        rid = request_id or f"req-{next(self._ids)}"
        stop_ids = self.eos_ids if params.stop_token_ids is None else params.stop_token_ids
        seqs = []
        for i in range(n):
            gen = None
            if params.temperature > 0:
                seed = params.seed + i if params.seed is not None else None
                if seed is None:  # follow torch.manual_seed, like the rest of lmforge
                    seed = int(torch.randint(2**62, ()))
                gen = torch.Generator(device=self.device).manual_seed(seed)
            decoder = None
            if self.tokenizer is not None:
                decoder = IncrementalDecoder(self.tokenizer, params.skip_special_tokens)
            seqs.append(
                _Sequence(rid, i, ids, params, frozenset(stop_ids), gen, decoder,
                          StopMatcher(params.stop))
            )  # fmt: skip
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
        self.cache.n = 0

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Admit waiting requests, then advance every running sequence by one token."""
        if not torch.is_inference_mode_enabled():  # loops over steps enter it once (~20 us)
            with torch.inference_mode():
                return self.step()
        outputs = self._drop_aborted()
        admitted = self._take_waiting()
        if admitted:
            outputs += self._prefill(admitted)
        if self.rows:
            outputs += self._decode_step()
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

    def _take_waiting(self) -> list[_Sequence]:
        """FIFO, as many as free slots and the prefill token budget allow (at least one)."""
        taken: list[_Sequence] = []
        with self._lock:
            width = 0
            while self.waiting and len(self.rows) + len(taken) < self.max_batch:
                seq = self.waiting[0]
                width = max(width, len(seq.prompt))
                if taken and width * (len(taken) + 1) > self.max_prefill_tokens:
                    break
                taken.append(self.waiting.popleft())
        return taken

    def _prefill(self, seqs: list[_Sequence]) -> list[StepOutput]:
        """One forward pass over the distinct prompts, written straight into the new rows."""
        unique: dict[tuple[int, ...], int] = {}
        for s in seqs:
            unique.setdefault(tuple(s.prompt), len(unique))
        # Rows: the first sample of each distinct prompt, then the copies.
        firsts = {}
        for s in seqs:
            firsts.setdefault(tuple(s.prompt), s)
        ordered = list(firsts.values()) + [s for s in seqs if firsts[tuple(s.prompt)] is not s]
        prompts = [list(p) for p in unique]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        pad = torch.zeros(len(prompts), width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.as_tensor(p)
            pad[i, width - len(p) :] = True
        cache, lo = self.cache, len(self.rows)
        cache.room_for(width)
        pad_mask = None if bool(pad.all()) else pad.to(self.device)
        view = cache.prefill_view(lo, lo + len(prompts), width, pad_mask)
        logits = self.forward(ids.to(self.device), cache=view, last_only=True)[:, -1]
        lengths = [len(s.prompt) for s in ordered]
        cache.start_rows(lo, lengths, lengths)
        source = [lo + unique[tuple(s.prompt)] for s in ordered]
        for row, src in enumerate(source[len(prompts) :], start=lo + len(prompts)):
            cache.copy_kv(src, row, cache.length - width)
        for row, s in enumerate(ordered, start=lo):
            self.sampler.start_row(row, s.params, s.prompt, s.generator)
        self.rows.extend(ordered)
        cache.n = len(self.rows)
        row_logits = logits[torch.as_tensor(source, device=self.device) - lo]
        return self._emit(row_logits, lo=lo)

    def _decode_step(self) -> list[StepOutput]:
        cache, n = self.cache, len(self.rows)
        cache.begin_decode()
        if self._exported is not None:  # also advances the positions, and argmaxes
            return self._emit(*self._exported(self.next_tokens[:n, None]), lo=0)
        if self._static is not None:
            logits = self._static(n)
            cache.advance(1)
        else:
            logits = self._decode(
                self.next_tokens[:n, None], positions=cache.positions[:n, None], cache=cache,
                last_only=True,
            )[:, -1]  # fmt: skip
        cache.positions[:n] += 1
        return self._emit(logits, lo=0)

    def _emit(self, logits: torch.Tensor, greedy: torch.Tensor | None = None, lo: int = 0):
        """Sample rows lo.. (greedy: their argmax, if already known), record tokens, build
        outputs, retire finished rows."""
        tokens_t, tokens, logprobs = self.sampler.sample(logits, lo, greedy)
        self.next_tokens[lo : lo + len(tokens)] = tokens_t
        outputs, done = [], []
        for i, token in enumerate(tokens):
            row = lo + i
            seq = self.rows[row]
            seq.output.append(token)
            reason = None
            if token in seq.stop_ids:
                reason = "stop"
            elif len(seq.output) >= seq.params.max_new_tokens:
                reason = "length"
            elif len(seq.prompt) + len(seq.output) >= self.max_len:
                reason = "length"
            text = ""
            if seq.decoder is not None:
                delta = seq.decoder.push(token)
                if reason is not None:
                    delta += seq.decoder.flush()
                text = seq.matcher.push(delta)
                if seq.matcher.stopped:
                    reason = "stop"
                elif reason is not None:
                    text += seq.matcher.flush()
            lp = [logprobs[i]] if logprobs[i] is not None else None
            outputs.append(StepOutput(seq.request_id, seq.index, [token], text, lp, reason))
            if reason is not None:
                done.append(row)
        self._remove(done)
        return outputs

    def _remove(self, rows: list[int]) -> None:
        """Retire rows; the last running row moves into each freed slot (dense batch)."""
        for row in sorted(rows, reverse=True):
            last = len(self.rows) - 1
            if row != last:
                self.cache.copy_row(last, row)
                self.sampler.move_row(last, row)
                self.next_tokens[row] = self.next_tokens[last]
                self.rows[row] = self.rows[last]
            self.rows.pop()
            self.cache.n = len(self.rows)

    # ---- convenience drivers (single caller; the server uses AsyncEngine instead) --------------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: GenerationParams | None = None,
        n: int = 1,
    ) -> list[Completion]:
        """Run prompts to completion; n consecutive Completions per prompt."""
        rids = [self.add_request(p, params, n) for p in prompts]
        tokens = {(r, i): [] for r in rids for i in range(n)}
        texts = {k: [] for k in tokens}
        lps = {k: [] for k in tokens}
        reasons = {}
        with torch.inference_mode():
            while self.has_work():
                for out in self.step():
                    key = (out.request_id, out.index)
                    if key not in tokens:
                        continue
                    tokens[key] += out.token_ids
                    texts[key].append(out.text)
                    lps[key] += out.logprobs or []
                    if out.finished:
                        reasons[key] = out.finish_reason
        want_lp = (params or GenerationParams()).logprobs is not None
        return [
            Completion(self.encode(prompts[j]), tokens[k], "".join(texts[k]), reasons[k],
                       lps[k] if want_lp else None)
            for j, r in enumerate(rids) for k in [(r, i) for i in range(n)]
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
