"""The tensor-parallel group of one rank, passed explicitly to every layer that shards.

At size 1 every collective is the identity, so the single-process engine pays nothing for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from engine.executor import UpstreamStageFailed


@dataclass(frozen=True)
class TPGroup:
    """Rank ``rank`` of ``size``; ``group`` is the torch.distributed process group when size > 1."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside a group of {self.size}")

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def shard(self, total: int, what: str = "dimension") -> tuple[int, int]:
        """This rank's [start, end) of ``total`` split evenly across the group."""
        if total % self.size:
            raise ValueError(f"{what} of {total} does not split across {self.size} tensor-parallel ranks")
        per_rank = total // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns it."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, on every rank."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather_to_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along ``dim`` on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.gather(x, parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``rank`` of ``size``: the model's layers [start, end) of ``num_layers``. ``prev``/``next``:
    the global ranks (in the default process group) of the neighbouring stages' rank of this one's
    tensor-parallel index, which the activations come from and go to (None at the ends).
    ``header_group``: the process group of the messages' headers (a gloo group where the activations
    go over NCCL, so that a header is a host-side exchange that waits for no device work; None: the
    default group, gloo on CPU)."""

    rank: int = 0
    size: int = 1
    start: int = 0
    end: int = 0
    num_layers: int = 0
    prev: int | None = None
    next: int | None = None
    header_group: Any = field(default=None, compare=False)

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        return cls(0, 1, 0, num_layers, num_layers)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.end

    # Every step, each stage but the last sends the next exactly one message, whatever happens to the
    # step: a header [status, ndim, *shape] (int64, HEADER long, on the host), then, where the status is
    # OK, the activations of that shape. FAILED (this stage or one before it failed the step before
    # sending) has no activations: the next stage raises UpstreamStageFailed instead of waiting for
    # them, and passes the word on. A stage that fails before its receive still reads the message
    # (``drain``), so the link never falls out of step: every step's message is read by that step.
    # ``started`` is called just before the header goes over the link (``Worker.execute_model``: from
    # then on the message is this step's, or the link is broken).
    OK, FAILED = 0, 1
    HEADER = 5

    def _header(self, status: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor([status, len(shape), *shape, *[0] * (self.HEADER - 2 - len(shape))], dtype=torch.int64)

    def send(self, x: torch.Tensor, started: Callable[[], None] | None = None) -> None:
        """The activations to the next stage (blocking until handed over)."""
        if x.dim() > self.HEADER - 2:
            raise ValueError(f"pipeline stages pass tensors of at most {self.HEADER - 2} dimensions, not {x.dim()}")
        x = x.contiguous()
        header = self._header(self.OK, tuple(x.shape))
        if started is not None:
            started()
        dist.send(header, dst=self.next, group=self.header_group)
        dist.send(x, dst=self.next)

    def send_failure(self) -> None:
        """Tell the next stage that this step failed here or before: it has no activations to wait for."""
        dist.send(self._header(self.FAILED, ()), dst=self.next, group=self.header_group)

    def _recv_message(self, dtype: torch.dtype, device: torch.device,
                      started: Callable[[], None] | None = None) -> torch.Tensor | None:
        header = torch.empty(self.HEADER, dtype=torch.int64)
        if started is not None:
            started()
        dist.recv(header, src=self.prev, group=self.header_group)
        status, ndim, *dims = header.tolist()
        if status == self.FAILED:
            return None
        x = torch.empty(dims[:ndim], dtype=dtype, device=device)
        dist.recv(x, src=self.prev)
        return x

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
             started: Callable[[], None] | None = None) -> torch.Tensor:
        """The previous stage's activations, of ``shape``; UpstreamStageFailed if it failed the step."""
        x = self._recv_message(dtype, device, started)
        if x is None:
            raise UpstreamStageFailed(f"pipeline stage {self.rank - 1} failed this step before sending its activations")
        if tuple(x.shape) != tuple(shape):
            raise RuntimeError(f"pipeline stage {self.rank - 1} sent activations of shape {tuple(x.shape)} for a step "
                               f"whose activations here are {tuple(shape)}")
        return x

    def drain(self, dtype: torch.dtype, device: torch.device) -> None:
        """Read and drop this step's message from the previous stage (this stage failed before its receive)."""
        self._recv_message(dtype, device)

