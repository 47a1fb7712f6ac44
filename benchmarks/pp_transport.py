"""`kvserve bench-pp-transport`: the two ways a pipeline stage's activations can reach the next stage,
each measured per step of a Ray Compiled Graph that drives both stages as the engine's does
(`tp_dispatch="compiled"`):

- gloo (what the engine does, ``workers.parallel_state.PipelineStage``): both stages take the step's plan
  from the driver, and the first sends its [rows, width] float32 activations to the second by
  torch.distributed send/recv over gloo, a header first;
- channel: the first stage returns the activations and the second takes them as its argument, so Ray's
  compiled-graph channel between the two actors carries them (shared memory within a node, Ray's own
  transfer between nodes).

The graphs differ as the two designs would: under gloo both stages answer the driver (two channels
back, as the engine's ranks do), through the channel only the second.

Per row count: the median time of a step (the driver's execute to the second stage's answer, which
checks the rows it got) and the CPU seconds each stage's process spent per step (its thread that runs
the graph and whatever polls for it). ``--two-nodes`` puts the stages on two nodes of a local cluster
(two raylets on this machine: Ray's cross-node path, not a network's speed)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

MODES = ("gloo", "channel")


class _Stage:
    """One stage: the first holds the activations it hands over, the second checks what arrives."""

    def __init__(self, rank: int, activations: torch.Tensor) -> None:
        torch.set_num_threads(1)
        self.rank, self.x = rank, activations

    def address(self) -> str:
        from cluster.worker_actor import rendezvous_address

        return rendezvous_address()

    def join(self, init_method: str) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init_method, rank=self.rank, world_size=2)

    # gloo: both stages take the plan (the row count), as the engine's ranks do; the first sends the rows,
    # the second receives them (a header, then the rows)
    def send(self, rows: int) -> float:
        import torch.distributed as dist

        dist.send(torch.tensor([rows, self.x.shape[1]], dtype=torch.int64), dst=1)
        dist.send(self.x[:rows].contiguous(), dst=1)
        return time.process_time()

    def receive(self, rows: int) -> tuple[float, float]:
        import torch.distributed as dist

        header = torch.empty(2, dtype=torch.int64)
        dist.recv(header, src=0)
        got = torch.empty(int(header[0]), int(header[1]))
        dist.recv(got, src=0)
        return float(got.sum(dim=1).double().sum()), time.process_time()

    # channel: the first stage's answer is the second's argument
    def produce(self, rows: int) -> tuple[torch.Tensor, float]:
        # a copy of the rows: a view would be pickled with the whole storage behind it
        return self.x[:rows].clone(), time.process_time()

    def consume(self, handed: tuple[torch.Tensor, float]) -> tuple[float, float, float]:
        got, first_cpu = handed
        return float(got.sum(dim=1).double().sum()), first_cpu, time.process_time()


def _graph(mode: str, first, second):
    """gloo: the plan to both stages, both answers out (the engine's graph; a chain would deadlock, the
    first stage's send waiting for a receive that starts only after its answer); channel: the plan into
    the first stage, its answer (the rows) into the second, the second's out."""
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as rows:
        if mode == "gloo":
            dag = MultiOutputNode([first.send.bind(rows), second.receive.bind(rows)])
        else:
            dag = second.consume.bind(first.produce.bind(rows))
    return dag.experimental_compile()


def _answer(mode: str, result) -> tuple[float, float, float]:
    """(the rows' checksum, the first stage's CPU seconds so far, the second's)."""
    if mode == "gloo":
        first_cpu, (checksum, second_cpu) = result
        return checksum, first_cpu, second_cpu
    return result


def measure(mode: str, first, second, rows_list: list[int], steps: int, expected: dict[int, float],
            last: bool = False) -> list[dict]:
    """``last``: the stages are not needed after (the graph's teardown kills them: a channel graph's
    stage was seen to keep running after a plain teardown)."""
    import ray

    graph = _graph(mode, first, second)
    results = []
    try:
        for rows in rows_list:
            for _ in range(3):  # warm-up: the channels' buffers sized, the gloo pair connected
                ray.get(graph.execute(rows))
            times, cpu = [], []
            for _ in range(steps):
                start = time.perf_counter()
                checksum, first_cpu, second_cpu = _answer(mode, ray.get(graph.execute(rows)))
                times.append(time.perf_counter() - start)
                cpu.append((first_cpu, second_cpu))
                if abs(checksum - expected[rows]) > 1e-6 * max(1.0, abs(expected[rows])):
                    raise RuntimeError(f"{mode}: the second stage got other activations than the first sent "
                                       f"({checksum} against {expected[rows]} for {rows} rows)")
            results.append({"mode": mode, "rows": rows, "step_ms_p50": 1000 * statistics.median(times),
                            "step_ms_min": 1000 * min(times),
                            "first_stage_cpu_ms": 1000 * (cpu[-1][0] - cpu[0][0]) / max(1, steps - 1),
                            "second_stage_cpu_ms": 1000 * (cpu[-1][1] - cpu[0][1]) / max(1, steps - 1)})
    finally:
        graph.teardown(kill_actors=last)
    return results


def bench_pp_transport(rows_list: list[int], width: int, steps: int, two_nodes: bool) -> dict:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cluster = None
    if two_nodes:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
        cluster.add_node(num_cpus=2)
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        activations = torch.randn(max(rows_list), width, generator=torch.Generator().manual_seed(0))
        expected = {rows: float(activations[:rows].sum(dim=1).double().sum()) for rows in rows_list}
        group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD" if two_nodes else "PACK")
        ray.get(group.ready())
        actor = ray.remote(_Stage)
        stages = [actor.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote(
            i, activations if i == 0 else torch.empty(0, width)) for i in range(2)]
        address = ray.get(stages[0].address.remote())
        ray.get([s.join.remote(address) for s in stages])
        nodes = len({n for n in ray.get([s.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                                         for s in stages])})
        results = []
        for mode in MODES:
            results += measure(mode, *stages, rows_list, steps, expected, last=mode == MODES[-1])
        remove_placement_group(group)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    return {"width": width, "steps": steps, "nodes": nodes, "results": results}


def format_pp_transport(report: dict) -> str:
    width = report["width"]
    lines = [f"activations of {width} float32 per row, stages on {report['nodes']} node(s), "
             f"{report['steps']} steps per cell; median step (ms) and CPU ms per step of each stage",
             "", "| rows | bytes | gloo step | channel step | gloo CPU (first / second) | channel CPU (first / second) |",
             "|---:|---:|---:|---:|---:|---:|"]
    by = {(r["mode"], r["rows"]): r for r in report["results"]}
    for rows in sorted({r["rows"] for r in report["results"]}):
        g, c = by[("gloo", rows)], by[("channel", rows)]
        lines.append(f"| {rows} | {rows * width * 4:,} | {g['step_ms_p50']:.3f} | {c['step_ms_p50']:.3f} | "
                     f"{g['first_stage_cpu_ms']:.2f} / {g['second_stage_cpu_ms']:.2f} | "
                     f"{c['first_stage_cpu_ms']:.2f} / {c['second_stage_cpu_ms']:.2f} |")
    return "\n".join(lines)


def add_bench_pp_transport_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", default="1,16,256,2048", help="comma-separated rows (tokens) of a step")
    parser.add_argument("--width", type=int, default=2 * 896,
                        help="floats per row (a stage hands over hidden and residual: 2 x Qwen2-0.5B's 896)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per row count and way")
    parser.add_argument("--two-nodes", action="store_true", help="the stages on two nodes of a local cluster")
    parser.add_argument("--out", help="write the report here as JSON")


def run_bench_pp_transport(args: argparse.Namespace) -> int:
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        rows = [0]
    if min(rows) < 1 or args.width < 1 or args.steps < 2:
        raise SystemExit("kvserve bench-pp-transport: rows and width must be positive and steps at least 2")
    report = bench_pp_transport(rows, args.width, args.steps, args.two_nodes)
    print(format_pp_transport(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0
