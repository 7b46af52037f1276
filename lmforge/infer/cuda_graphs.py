"""CUDA graphs for the decode step: one launch per token instead of one per kernel.

Decoding a small model on a GPU is bound by kernel launches, not by the GPU: a step is about a
hundred small kernels of a few microseconds each, and the host spends more time launching them
than the GPU spends running them. Recorded once as a CUDA graph, a step replays with a single
launch. A graph replays fixed shapes and fixed addresses, so the recorded step is static:

- the batch is padded up to a bucket (1, 2, 4, 8, ... rows), one graph per bucket;
- attention covers the whole KV buffer, the padding mask hiding the columns not yet written
  (the decoder slices the mask to `length + 1` columns; the static view reports the last one);
- the column the new keys go to is a device tensor (`index_copy_`), not a Python int;
- the inputs are the engine's persistent tensors (next tokens, the cache's positions and mask),
  updated in place between steps, so a replay copies nothing in.

Rows past the running ones compute values nobody reads, and write keys into free slots that a
joining sequence overwrites. `StaticDecodeStep` also runs without graphs (`use_graphs=False`):
that is how the CPU tests check the static step decodes the same tokens as the dynamic one.
"""

from __future__ import annotations

import torch


class StaticCacheView:
    """The engine's SlotCache as a full-width, fixed-shape KV cache for the first `rows` rows."""

    def __init__(self, cache, rows: int, column: torch.Tensor):
        self.cache, self.rows, self.column = cache, rows, column
        self.length = cache.max_len - 1  # the decoder attends to length + 1 = all columns
        self.key_mask = cache.mask[:rows]

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        k, v = self.cache.k[layer][: self.rows], self.cache.v[layer][: self.rows]
        k.index_copy_(2, self.column, k_new)
        v.index_copy_(2, self.column, v_new)
        return k, v

    def advance(self, n: int) -> None:
        pass


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: powers of two up to max_batch, and max_batch itself."""
    below = [1 << i for i in range((max_batch - 1).bit_length())]  # 1, 2, 4, ... < max_batch
    return sorted({1, *below, max_batch})


class StaticDecodeStep:
    """Logits [n, vocab] for the next token of the cache's first n rows, via a static step."""

    def __init__(self, forward, cache, next_tokens: torch.Tensor, use_graphs: bool = True):
        self.forward, self.cache, self.next_tokens = forward, cache, next_tokens
        self.use_graphs = use_graphs
        self.column = torch.zeros(1, dtype=torch.long, device=next_tokens.device)
        self.buckets = buckets(cache.slots)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None

    def __call__(self, n: int) -> torch.Tensor:
        rows = next(b for b in self.buckets if b >= n)
        self.column.fill_(self.cache.length)
        if not self.use_graphs:
            return self._step(rows)[:n]
        if rows not in self.graphs:
            self._record(rows)
        self.graphs[rows].replay()
        return self.outputs[rows][:n]

    def _step(self, rows: int) -> torch.Tensor:
        view = StaticCacheView(self.cache, rows, self.column)
        ids, positions = self.next_tokens[:rows, None], self.cache.positions[:rows, None]
        return self.forward(ids, positions=positions, cache=view, last_only=True)[:, -1]

    def _record(self, rows: int) -> None:
        """Warm up on a side stream (cuBLAS handles, lazily made buffers), then record. The
        warm-up writes the same keys the real step writes, so it changes nothing."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[rows] = self._step(rows)
        self.graphs[rows] = graph
