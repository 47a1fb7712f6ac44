"""CUDA graphs for decode-only steps (``enforce_eager=False``; off by default until a GPU run has
checked them).

A decode step of a 1B model is some 850 kernel launches and the Python between them; a CUDA graph
replays them as one. At start, after the KV pool exists, one graph is captured per batch-size bucket
(``graph_batch_sizes``: 1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs``, at most 512), the
largest first, all in one memory pool. Where ``gpu_memory_utilization`` sizes the pool, the buckets
are captured once before, over a one-block throwaway pool, and released: the device memory they took
(``memory_bytes``: the graphs' pool and what the driver holds for them, measured after the largest
bucket's eager warm-up, whose activations the profile's peak already counts; and the static buffers)
is taken off the KV budget, and the real capture must fit in it (``ModelRunner.capture_graphs``).
Each graph runs the model over static buffers: a decode-only step of n sequences takes the smallest
bucket of at least n, copies its token ids, positions, slots, lengths and block-table rows into the
first n rows of the buffers, and reads the first n rows of the graph's output. The padding rows write nothing (slot -1: the KV store skips it) and attend to one key
of a valid block (length 1; every id in the table is a valid block). The logits and the sampler run
after the graph, eagerly, over the rows that sample.

Only kernels that take every length from device memory can be replayed for other steps: the
``triton`` backend's (``supports_graphs``). A bucket's launch plan (its tiles; its keys split for a
``max_model_len`` context, splits that find no keys weighing nothing in the merge) is made in the
warm-up forward before capture and kept with the bucket's metadata, whose tensors the graph reads.

``capture=False`` runs the same buffers, padding and plans with the model called eagerly instead of a
graph replay: that is how the path is tested on CPU (under the Triton interpreter). A capture that
fails is a warning and every step runs eagerly; at tensor-parallel size > 1 the ranks agree (one
all-reduce) before any graph is used, since their collectives must match step for step.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from kernels import PagedAttentionMetadata

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512


def graph_memory_reserve(measured: int) -> int:
    """What the KV budget leaves the graphs for ``measured`` bytes taken by the capture at start: 5%
    more, at least 16 MiB, for what the second capture may differ by (allocator rounding, the driver's
    objects); nothing where the capture at start failed."""
    return measured + max(measured // 20, 16 << 20) if measured else 0


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH) -> list[int]:
    """The buckets: 1, 2, 4, then multiples of 8, and the largest decode batch itself (capped)."""
    top = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    """Static buffers, metadata and (on CUDA) a captured graph per bucket of decode-only steps."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, backend, sizes: list[int], max_blocks: int,
                 max_model_len: int, deterministic: bool, device: torch.device, capture: bool = True,
                 kv_format: str = "auto") -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = sorted(sizes)
        self.deterministic = deterministic
        self.capture_graphs = capture
        n = self.sizes[-1]
        long = dict(dtype=torch.long, device=device)
        int32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, **long)
        self.positions = torch.zeros(n, **long)
        self.slots = torch.full((n,), -1, **long)
        self.query_start = torch.arange(n + 1, **int32)  # one query token per sequence
        self.seq_lens = torch.ones(n, **int32)
        self.block_tables = torch.zeros(n, max_blocks, **int32)
        self.buffer_bytes = sum(t.numel() * t.element_size() for t in (
            self.input_ids, self.positions, self.slots, self.query_start, self.seq_lens, self.block_tables))
        self.metas = {
            bs: PagedAttentionMetadata(
                slot_mapping=self.slots[:bs], query_start_loc=self.query_start[:bs + 1], seq_lens=self.seq_lens[:bs],
                block_tables=self.block_tables[:bs], query_lens=[1] * bs, context_lens=[max_model_len] * bs,
                num_decodes=bs, backend=backend, deterministic=deterministic, kv_format=kv_format,
            )
            for bs in self.sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0  # steps that ran through a bucket
        self.capture_s = 0.0
        self.pool_bytes = 0  # device memory the capture took (the graphs' pool, the driver's graph objects)

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self.metas[bs])

    @property
    def memory_bytes(self) -> int:
        """Device memory the buckets hold: what the capture took, and the static buffers."""
        return self.pool_bytes + self.buffer_bytes

    def _device_memory(self) -> tuple[int, int]:
        """(bytes torch's allocator has reserved, bytes free on the device)."""
        return torch.cuda.memory_reserved(self.device), torch.cuda.mem_get_info(self.device)[0]

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every bucket up (Triton compiles its kernels; the plan is made and kept), then capture
        it, largest first so the smaller graphs reuse the largest one's memory. Padding rows only: the
        buffers say slot -1, so the pool is not written. What the capture takes is measured from
        after the largest bucket's warm-up (the smaller ones' reuse its activations' memory): the
        growth of torch's reserved memory or of the device's used memory, whichever is larger."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.capture_graphs else None
        before = None
        for bs in sorted(self.sizes, reverse=True):
            self._forward(bs)
            if not self.capture_graphs:
                continue
            torch.cuda.synchronize(self.device)
            if before is None:
                before = self._device_memory()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            self.graphs[bs] = graph
        if self.capture_graphs:
            torch.cuda.synchronize(self.device)
            reserved, free = self._device_memory()
            self.pool_bytes = max(0, reserved - before[0], before[1] - free)
        self.capture_s = time.perf_counter() - start

    def bucket(self, meta: PagedAttentionMetadata) -> int | None:
        """The bucket a step runs in, or None when it runs eagerly (not decode-only, larger than the
        largest bucket, or shared-prefix groups planned)."""
        n = meta.num_seqs
        if n == 0 or meta.num_decodes != n or n > self.sizes[-1] or meta.cascade is not None \
                or meta.deterministic != self.deterministic:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata,
            bs: int) -> torch.Tensor:
        """The step's hidden states [n, hidden] through bucket ``bs``."""
        n, width = meta.num_seqs, meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if n < bs:  # padding: no KV written, one key read
            self.slots[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
        self.num_replays += 1
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.outputs[bs][:n]
        return self._forward(bs)[:n]
