"""The links between pipeline stages stay in step when a step fails anywhere: three processes over gloo, each a
`Worker.execute_model` around a runner that fails where a step tells it to."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.executor import UpstreamStageFailed
from workers.parallel_state import PipelineStage
from workers.worker import Worker

STAGES = 3
# (tokens, where it fails: (stage, "before receive" | "before send") or None)
STEPS = [
    (4, None),
    (5, (1, "before receive")),  # the middle stage fails before reading stage 0's activations
    (3, (0, "before send")),  # the first stage fails: both later stages are told
    (6, None),
    (2, (2, "before receive")),  # the last stage fails before reading the middle stage's
    (7, (1, "before send")),  # the middle stage fails after reading, before sending on
    (4, None),
    (5, (0, "4-D send")),  # a tensor the header cannot describe: refused before anything is sent
    (3, None),
]


class _Runner:
    """A runner whose stage adds 1 to what it receives (the first starts from the step's number)."""

    def __init__(self, stage: PipelineStage) -> None:
        self.stage = stage
        self.received = self.handed_over = False

    def execute_model(self, step):
        failing = step.fails == (self.stage.rank, "before receive")
        if self.stage.is_first:
            x = torch.full((step.tokens, 3), float(step.index))
        else:
            if failing:
                raise ValueError("failed before its receive")
            x = self.stage.recv((step.tokens, 3), torch.float32, torch.device("cpu"), started=self._receiving)
        if step.fails == (self.stage.rank, "before send") or (failing and self.stage.is_first):
            raise ValueError("failed before its send")
        if self.stage.is_last:
            return x
        if step.fails == (self.stage.rank, "4-D send"):
            x = x.reshape(1, 1, step.tokens, 3)
        self.stage.send(x + 1, started=self._handing_over)
        return None

    def _receiving(self) -> None:
        self.received = True

    def _handing_over(self) -> None:
        self.handed_over = True


def _stage_process(rank: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=STAGES,
                            timeout=datetime.timedelta(seconds=60))
    stage = PipelineStage(rank, STAGES, rank, rank + 1, STAGES, rank - 1 if rank else None,
                          rank + 1 if rank < STAGES - 1 else None)
    worker = object.__new__(Worker)
    worker.runner, worker.dtype, worker.device = _Runner(stage), torch.float32, torch.device("cpu")
    outcome = []
    for index, (tokens, fails) in enumerate(STEPS):
        step = SimpleNamespace(index=index, tokens=tokens, fails=fails, kv_offloads=[], kv_restores=[])
        try:
            out = worker.execute_model(step)
            outcome.append(None if out is None else (tuple(out.shape), sorted(set(out.flatten().tolist()))))
        except (ValueError, UpstreamStageFailed) as exc:
            outcome.append(type(exc).__name__)
    results.put((rank, outcome))
    dist.destroy_process_group()


def test_every_step_reads_its_own_message_whoever_failed_before(tmp_path) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_stage_process, args=(r, str(tmp_path / "store"), results), daemon=True)
             for r in range(STAGES)]
    try:
        for p in procs:
            p.start()
        got = dict(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        assert [p.exitcode for p in procs] == [0] * STAGES
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    ok = lambda index, tokens: ((tokens, 3), [float(index + 2)])  # noqa: E731 - two sends, +1 each
    assert got[0] == [None, None, "ValueError", None, None, None, None, "ValueError", None]
    assert got[1] == [None, "ValueError", "UpstreamStageFailed", None, None, "ValueError", None,
                      "UpstreamStageFailed", None]
    assert got[2] == [ok(0, 4), "UpstreamStageFailed", "UpstreamStageFailed", ok(3, 6), "ValueError",
                      "UpstreamStageFailed", ok(6, 4), "UpstreamStageFailed", ok(8, 3)]
