"""Tensor parallelism without a process group: each rank runs in a thread of this process and the
collectives exchange tensors through a barrier, with the semantics of torch.distributed (sum in
rank order, concatenation in rank order, gather to rank 0 only)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from workers.parallel_state import TPGroup


class _Rendezvous:
    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * size

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x``, in rank order, on every rank."""
        self.slots[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # all have read before anyone's next exchange overwrites a slot
        return parts


@dataclass(frozen=True)
class ThreadedTPGroup(TPGroup):
    rendezvous: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.rendezvous.exchange(self.rank, x)
        return x.copy_(torch.stack(parts).sum(0))

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self.rendezvous.exchange(self.rank, x), dim=dim)

    def gather_to_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        parts = self.rendezvous.exchange(self.rank, x)
        return torch.cat(parts, dim=dim) if self.rank == 0 else None


def run_ranks(size: int, fn: Callable[[TPGroup], Any]) -> list[Any]:
    """``fn(tp)`` on each of ``size`` ranks, concurrently (size 1: a plain TPGroup); results by rank."""
    if size == 1:
        with torch.inference_mode():
            return [fn(TPGroup())]
    rendezvous = _Rendezvous(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            with torch.inference_mode():
                results[rank] = fn(ThreadedTPGroup(rank, size, None, rendezvous))
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)
            rendezvous.barrier.abort()

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results


@pytest.fixture
def tp_ranks() -> Callable[[int, Callable[[TPGroup], Any]], list[Any]]:
    return run_ranks
