"""The ranks of one engine instance: actors in a placement group, their process group, and the
per-step dispatch. Under pipeline parallelism the ranks are ``pipeline_parallel_size`` stages of
``tensor_parallel_size`` (global rank = stage * tp + tensor-parallel index); each stage passes its
activations to the next (``workers.parallel_state.PipelineStage``) and the last stage's first rank
samples.

    scheduler ──execute_model(SchedulerOutput)──► rank 0 … rank N-1    (same plan to every rank, pickled once)
              ◄────────── ModelRunnerOutput ──── the sampling rank      (the others return None)

A step waits for every rank, polling so that a rank that dies is noticed within a second even
while the survivors block in a collective; the group is then killed whole. An exception raised
inside a rank (the rank alive) is not a death: once every rank has answered, the step fails with
StepFailedError and the group is kept; if the others do not answer within ``RAISED_GRACE_S`` (they
wait in a collective the raising rank left), the group is wedged and counts as failed.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time

import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.memory_plan import bundle_memory, memory_refusal
from cluster.placement import PlacementError, create_placement_group, rank_bundles
from cluster.ray_env import cluster_has_gpus
from cluster.scheduler_actor import task_events_enabled
from cluster.worker_actor import WorkerActor
from engine.config import EngineConfig
from engine.executor import RankRaised, StepFailedError, UpstreamStageFailed, WorkerFailedError
from engine.messages import ModelRunnerOutput, SchedulerOutput, StageTiming

POLL_S = 1.0  # how often a step waiting on the ranks checks whether one of them has died
RAISED_GRACE_S = 5.0  # after a rank raised, how long the others may take to answer


def raised_inside(exc: BaseException) -> BaseException | None:
    """The ordinary exception a rank raised, if ``exc`` is one (the rank alive); None for a dead or
    unreachable rank (the actor died, its node died, the task was lost)."""
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        return None if cause is None or isinstance(cause, RayError) else cause
    return None


def step_failed(cause: BaseException, ranks_stuck: bool = False) -> StepFailedError:
    return RankRaised.of(cause).error(ranks_stuck)


def rank_config(config: EngineConfig) -> EngineConfig:
    """The ranks' config: the device decided (``auto``: CUDA where the cluster has GPUs)."""
    use_gpu = config.device == "cuda" or (config.device == "auto" and cluster_has_gpus())
    return dataclasses.replace(config, device="cuda" if use_gpu else "cpu")


def spawn_ranks(config: EngineConfig, placement_group: PlacementGroup, first_bundle: int = 0) -> list:
    """Create the rank actors in bundles [first_bundle, first_bundle + world size) (a pipeline stage's ranks
    on one node where the group's bundles allow: ``placement.rank_bundles``) without waiting for them:
    their processes start (imports, about 3 s) while the caller does something else, e.g. a Serve
    replica starting the scheduler actor that takes them (``WorkerGroup(actors=...)``)."""
    config = rank_config(config)
    actor_cls = ray.remote(WorkerActor)
    parallel = config.parallel
    bundles = rank_bundles(placement_group, first_bundle, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    return [
        actor_cls.options(
            num_cpus=1, num_gpus=1 if config.device == "cuda" else 0, max_restarts=0,
            enable_task_events=task_events_enabled(),  # off: one call per rank per step
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, bundle),
        ).remote(config, rank)
        for rank, bundle in enumerate(bundles)
    ]


class PipelineTimes:
    """Per pipeline stage, summed over steps: the seconds it computed and the seconds it waited for the
    previous stage's activations (the bubble, as that stage sees it)."""

    def __init__(self, num_stages: int) -> None:
        self.steps = 0
        self.compute_s = [0.0] * num_stages
        self.wait_s = [0.0] * num_stages

    def add(self, stages: list[StageTiming], last: ModelRunnerOutput) -> None:
        self.steps += 1
        for s, timing in enumerate(stages):
            self.compute_s[s] += timing.compute_s
            self.wait_s[s] += timing.wait_s
        self.compute_s[-1] += last.forward_time_s
        self.wait_s[-1] += last.stage_wait_s

    def report(self) -> dict:
        return {"steps": self.steps, "stage_compute_s": list(self.compute_s), "stage_wait_s": list(self.wait_s)}


@dataclasses.dataclass
class _CompiledStep:
    """A step sent through the compiled graph: one output per rank, read once, in the order the steps
    were sent (``reading``: a read under way, which an interruption leaves set, its answers lost)."""

    refs: list
    reading: bool = False


class WorkerGroup:
    """``placement_group``/``first_bundle``: place the ranks in bundles [first_bundle, first_bundle + tp)
    of a group someone else owns (a Serve replica's); by default the group makes and owns its own.
    ``actors``: ranks ``spawn_ranks`` already created there, taken instead of new ones."""

    def __init__(self, config: EngineConfig, *, placement_group: PlacementGroup | None = None,
                 first_bundle: int = 0, step_timeout_s: float = 600.0, placement_timeout_s: float = 60.0,
                 actors: list | None = None):
        self.num_ranks = config.parallel.world_size
        self.stage_ranks = list(range(0, self.num_ranks, config.parallel.tensor_parallel_size))  # each stage's first
        self.output_rank = self.stage_ranks[-1]  # the rank that samples and answers the step: the last stage's first
        self.pipeline = PipelineTimes(len(self.stage_ranks))
        self.config = rank_config(config)
        self.use_gpu = self.config.device == "cuda"
        self.step_timeout_s = step_timeout_s
        self.owns_placement_group = placement_group is None
        if placement_group is None:
            memory = [n["Resources"].get("memory", 0.0) for n in ray.nodes() if n.get("Alive")]
            refusal = memory_refusal(self.config, self.use_gpu, memory)
            if refusal is not None:
                raise PlacementError(refusal)
            placement_group = create_placement_group(
                self.num_ranks, self.use_gpu, config.parallel.placement_strategy, placement_timeout_s,
                memory_per_rank=bundle_memory(self.config, self.use_gpu, memory))
        elif not ray.wait([placement_group.ready()], timeout=placement_timeout_s)[0]:
            raise PlacementError(f"the placement group for {self.num_ranks} ranks is not ready after "
                                 f"{placement_timeout_s:g}s")
        self.placement_group = placement_group
        if actors is not None and len(actors) != self.num_ranks:
            raise ValueError(f"{len(actors)} rank actors given for {self.num_ranks} ranks")
        self.actors = list(actors) if actors is not None else spawn_ranks(self.config, placement_group, first_bundle)
        self.dispatch = config.parallel.tp_dispatch
        self.max_in_flight = config.parallel.steps_in_flight
        self._compiled = None
        try:
            init_method = ray.get(self.actors[0].rendezvous_address.remote())
            self._call_all("start", init_method)
            self.node_info = self._call_all("node_info")
        except BaseException:
            self.kill()
            raise

    def _call_all(self, method: str, *args):
        return self._wait_all([getattr(a, method).remote(*args) for a in self.actors])

    def _wait_all(self, refs: list) -> list:
        """Results of every rank; WorkerFailedError as soon as any rank dies (or all of them do not
        answer within the step timeout), StepFailedError when a rank raised and all have answered."""
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            ready, pending = ray.wait(refs, num_returns=len(refs), timeout=POLL_S)
            try:
                if not pending:
                    return ray.get(refs)
                ray.get(ready)  # raises if a finished rank failed
            except RayError as exc:
                cause = raised_inside(exc)
                if cause is None:
                    raise WorkerFailedError(f"a tensor-parallel rank failed: {exc}") from exc
                return self._after_raise(refs, cause)
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"ranks {sorted(refs.index(r) for r in pending)} did not finish a "
                                        f"call within {self.step_timeout_s:g}s")

    def _after_raise(self, refs: list, cause: BaseException):
        """A rank raised: the group is sound if every other rank answers (each alive); else wedged,
        unless every rank that has not answered is in a later pipeline stage than one that raised. The
        step's cause is the error of the first rank (in rank order) that raised anything but
        ``UpstreamStageFailed``."""
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=RAISED_GRACE_S)
        tp = self.config.parallel.tensor_parallel_size
        raised_stages, first = [], None
        for ref in sorted(ready, key=refs.index):
            try:
                ray.get(ref)
            except RayError as exc:
                inner = raised_inside(exc)
                if inner is None:
                    raise WorkerFailedError(f"a tensor-parallel rank failed: {exc}") from exc
                if first is None and not isinstance(inner, UpstreamStageFailed):
                    first = inner  # the earliest rank where the step failed, not one that was told so
                raised_stages.append(refs.index(ref) // tp)
        cause = first if first is not None else cause
        if not pending:
            raise step_failed(cause) from cause
        if raised_stages and min(refs.index(r) // tp for r in pending) > min(raised_stages):
            # a stage raised before it sent its activations: the later stages wait for them (until
            # gloo's timeout) but are sound; the step failed, and the ranks must be rebuilt to go on
            raise step_failed(cause, ranks_stuck=True) from cause
        raise WorkerFailedError(f"a tensor-parallel rank raised {type(cause).__name__} and ranks "
                                f"{sorted(refs.index(r) for r in pending)} did not finish the call")

    def determine_num_kv_blocks(self) -> int:
        return min(self._call_all("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.submit(scheduler_output))

    def submit(self, scheduler_output: SchedulerOutput):
        """Send a step to every rank without waiting (each rank runs its steps in the order sent): one
        actor call per rank, or one execution of the compiled graph (whose channels hold as many
        executions as may be in flight). The plan goes pickled, once for every rank, and each rank
        unpickles it inside its step (``Worker.execute_model``: a plan one rank cannot read fails the
        step in step with the other stages, where Ray's own reading of it would fail the call first)."""
        plan = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        if self.dispatch == "compiled":
            return _CompiledStep(list(self._graph().execute(plan)))
        return [a.execute_model.remote(plan) for a in self.actors]

    def collect(self, handle) -> ModelRunnerOutput:
        if isinstance(handle, _CompiledStep):
            return self._answer(self._get_compiled(handle))
        return self._answer(self._wait_all(handle))

    def _answer(self, results: list) -> ModelRunnerOutput:
        """The sampling rank's output; the stages' timings summed."""
        output = results[self.output_rank]
        if len(self.stage_ranks) > 1:
            self.pipeline.add([results[r] for r in self.stage_ranks[:-1]], output)
        return output

    def _graph(self):
        """The Ray Compiled Graph of a step (shared-memory channels, no per-call task), compiled at the
        first step: the plan in, every rank's answer out."""
        if self._compiled is None:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as plan:
                dag = MultiOutputNode([a.execute_model_in_graph.bind(plan) for a in self.actors])
            # as many executions out as the engine keeps in flight (Ray's channels then hold one
            # buffer per execution; its default would be 10)
            self._compiled = dag.experimental_compile(_max_inflight_executions=self.max_in_flight)
        return self._compiled

    def _get_compiled(self, step: _CompiledStep) -> list:
        """Every rank's answer to one execution of the compiled graph (executions are answered in the
        order they were sent). RuntimeError where an earlier read of it was interrupted: its answers
        can be read once, so they are lost, and the engine rebuilds the ranks (not held against the
        restart budget). A rank that raised answers ``RankRaised`` (Ray's reader, given a raised error,
        raises the first one it happens to read and drops the other ranks' answers, which may leave a
        later stage's ``UpstreamStageFailed`` as the step's cause): the step fails with the error of the
        earliest rank that raised anything but that echo."""
        if step.reading:
            raise RuntimeError("a step's answer from the compiled graph was lost: its read was interrupted")
        step.reading = True
        try:
            results = ray.get(step.refs, timeout=self.step_timeout_s)
        except Exception as exc:
            cause = raised_inside(exc)
            if cause is not None:  # every output arrived: the ranks are alive
                raise step_failed(cause) from cause
            raise WorkerFailedError(f"a tensor-parallel rank failed: {exc}") from exc
        step.reading = False
        raised = [r for r in results if isinstance(r, RankRaised)]
        if raised:
            raise next((r for r in raised if not r.upstream), raised[0]).error()
        return results

    def kv_cache_info(self) -> list[dict]:
        return self._call_all("kv_cache_info")

    def pids(self) -> list[int]:
        return [info["pid"] for info in self.node_info]

    def shutdown(self) -> None:
        try:
            if self._compiled is not None:  # the ranks' graph loops end, so they take the calls below
                self._compiled.teardown()
                self._compiled = None
            ray.wait([a.shutdown.remote() for a in self.actors], num_returns=len(self.actors), timeout=10)
        finally:
            self.kill()

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self._compiled is not None:
            # after the ranks are gone: a teardown before would wait for a step stuck in a rank (a
            # stage waiting for activations that never come); once torn down, a step the engine
            # dropped no longer waits for its answer. Its calls to the dead ranks fail, as expected.
            quiet = logging.getLogger("ray.dag.compiled_dag_node")
            level = quiet.level
            quiet.setLevel(logging.CRITICAL)
            try:
                self._compiled.teardown()
            finally:
                quiet.setLevel(level)
            self._compiled = None
        if self.owns_placement_group:
            remove_placement_group(self.placement_group)
