"""A step's inputs to the device in one copy per dtype (``InputBatch.prepare``).

On CUDA each step's small index arrays (token ids, positions, slots, the block-table rows, lengths)
would be as many copies from pageable memory, each staged by the driver. ``Staging`` packs the arrays
of one dtype into a pinned host buffer and copies it with one non-blocking transfer; the device
tensors are views of the device buffer. Two pairs of buffers take turns, and a pair is reused only
after the event recorded behind its last copy has passed, so a step never overwrites host memory a
transfer of the step before may still be reading. Buffers grow (doubling) when a step needs more.

With ``pin=False`` the same packing runs host to host (the CPU engine does not need it, since
``torch.from_numpy`` already shares the arrays; tests run the engine through it on CPU).
"""

from __future__ import annotations

import numpy as np
import torch


class _Pair:
    def __init__(self, dtype: torch.dtype, numel: int, device: torch.device, pin: bool) -> None:
        self.host = torch.empty(numel, dtype=dtype, pin_memory=pin)
        self.device = torch.empty(numel, dtype=dtype, device=device)
        self.done = torch.cuda.Event() if device.type == "cuda" else None


class Staging:
    def __init__(self, device: torch.device, pin: bool | None = None, initial: int = 4096) -> None:
        self.device = device
        self.pin = device.type == "cuda" if pin is None else pin
        self.initial = initial
        self._pairs: dict[torch.dtype, list[_Pair]] = {}
        self._turn = 0
        self.num_copies = 0  # transfers made (one per dtype per step)

    def _pair(self, dtype: torch.dtype, numel: int) -> _Pair:
        pairs = self._pairs.setdefault(dtype, [None, None])
        pair = pairs[self._turn]
        if pair is not None and pair.done is not None:
            pair.done.synchronize()  # the copy that last read this host buffer has finished
        if pair is None or pair.host.numel() < numel:
            size = max(self.initial, 1 << (numel - 1).bit_length())
            pair = pairs[self._turn] = _Pair(dtype, size, self.device, self.pin)
        return pair

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """The arrays (int32 or int64, any shapes) as device tensors of the same shapes and dtypes."""
        out: list[torch.Tensor | None] = [None] * len(arrays)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, a in enumerate(arrays):
            by_dtype.setdefault(torch.from_numpy(a[:0]).dtype, []).append(i)
        for dtype, indices in by_dtype.items():
            total = sum(arrays[i].size for i in indices)
            pair = self._pair(dtype, total)
            host = pair.host.numpy()
            offset = 0
            spans = []
            for i in indices:
                n = arrays[i].size
                host[offset:offset + n] = arrays[i].reshape(-1)
                spans.append((i, offset, n))
                offset += n
            pair.device[:total].copy_(pair.host[:total], non_blocking=self.pin)
            if pair.done is not None:
                pair.done.record()
            self.num_copies += 1
            for i, start, n in spans:
                out[i] = pair.device[start:start + n].view(arrays[i].shape)
        self._turn ^= 1
        return out
