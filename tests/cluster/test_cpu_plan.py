"""The engine's default threads and core binding on a CPU node (cluster/cpu_plan.py), and the default
engine_cpus the reservations take from the node (cluster/reservations.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from cluster.app_args import AppArgs
from cluster.cpu_plan import choose_cores, claim_cores, default_threads
from cluster.reservations import plan_reservations
from tests.compiled import cpu_backend_or_skip

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# two sockets of 4 cores, 2 logical CPUs per core: CPUs c and c + 8 are siblings
HT = {cpu: (cpu % 8 // 4, cpu % 4) for cpu in range(16)}


@pytest.mark.parametrize("reserved,node,cores,expected", [
    (2.0, 2, 2, 2),      # this VM, one replica: every core (1 thread measured 0.73x of 2)
    (1.0, 2, 2, 1),      # two replicas on 2 cores: one each
    (16.0, 16, 16, 15),  # a 16-core node: one core left to the serving actors
    (8.0, 16, 16, 7),    # two replicas on it
    (128.0, 128, 64, 63),  # hyper-threads: physical cores count
    (4.0, 4, 4, 4),
    (100.0, 8, 8, 7),    # a share above the node is the node
])
def test_default_threads(reserved, node, cores, expected):
    assert default_threads(reserved, node, cores) == expected


def test_choose_cores_one_per_physical_core_on_one_socket():
    assert choose_cores(4, HT, set()) == [0, 1, 2, 3]
    assert choose_cores(3, HT, {0, 9}) == [4, 5, 6]  # socket 1 has 4 free cores, socket 0 two
    # CPU 8 is CPU 0's sibling: claiming 0 takes the core, not only the logical CPU
    assert 8 not in choose_cores(7, HT, {0})
    assert choose_cores(6, HT, set()) == [0, 1, 2, 3, 4, 5]  # spans sockets only when one is too small
    assert choose_cores(9, HT, set()) is None


def test_claims_are_exclusive_and_dead_claims_are_dropped(tmp_path):
    path = tmp_path / "claims.json"
    first = claim_cores(4, HT, pid=os.getpid(), path=path)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    second = claim_cores(4, HT, pid=os.getppid(), path=path)  # a live process: the pytest parent
    assert first == [0, 1, 2, 3] and second == [4, 5, 6, 7]
    assert claim_cores(1, HT, pid=child.pid, path=path) is None  # every core is taken
    path.write_text(json.dumps({str(child.pid): [0, 1, 2, 3], **json.loads(path.read_text())}))
    # the dead child's claim is dropped; a process claiming again replaces its own claim
    assert claim_cores(2, HT, pid=os.getpid(), path=path) == [0, 1]
    assert json.loads(path.read_text()) == {str(os.getppid()): [4, 5, 6, 7], str(os.getpid()): [0, 1]}


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_bind_threads_pins_every_thread_of_the_step_threads_regions(threads):
    """In a fresh process (binding changes its threads for good): after bind_threads each thread of the
    step thread's parallel regions runs on its core, in every later region too, after a torch product
    ran on the same team (oversubscribed where there are fewer CPUs than threads)."""
    cpu_backend_or_skip()
    cpus = sorted(os.sched_getaffinity(0))
    cores = [cpus[i % len(cpus)] for i in range(threads)]
    script = textwrap.dedent(f"""
        import json, threading, torch
        from kernels.cpu import load
        ops = load()
        torch.set_num_threads({threads})
        out = {{}}
        def step():
            out["bound"] = list(ops.bind_threads({cores}))
            torch.mm(torch.randn(256, 256), torch.randn(256, 256))  # torch's regions reuse the team
            out["where"] = [list(ops.thread_cores({threads})) for _ in range(20)]
        t = threading.Thread(target=step); t.start(); t.join()
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["bound"] == cores
    assert all(where == cores for where in out["where"])


def test_default_engine_cpus_follow_the_node():
    def plan(cpus, **kw):
        p = plan_reservations(AppArgs(**kw), use_gpu=False, cpus=cpus)
        return p.rank_cpus, p.cpu_share

    assert plan((2.0, 2.0)) == (1.0, 2.0)  # the engine's 1 + the replica's and the Ingress's 0.5
    assert plan((16.0, 16.0)) == (15.0, 16.0)
    assert plan((16.0, 16.0), num_replicas=2) == (7.0, 8.0)
    assert plan((16.0, 32.0), num_replicas=2) == (15.0, 16.0)  # a node each
    assert plan((16.0, 16.0), deployment_config={"num_replicas": 4}) == (3.0, 4.0)  # 4 replicas on one node
    assert plan((16.0, 16.0), min_replicas=1, max_replicas=2) == (7.0, 8.0)  # room for the most
    assert plan((16.0, 16.0), proxy_cpus=0) == (16.0, 16.0)
    assert plan((16.0, 16.0), tensor_parallel_size=2)[0] == 1.0  # a rank actor runs on the CPU it is made with
    assert plan((16.0, 16.0), engine_cpus=3) == (3.0, 4.0)  # given: it wins
    assert plan_reservations(AppArgs(), use_gpu=True, cpus=(16.0, 16.0)).rank_cpus == 1.0


def test_binding_refuses_more_threads_than_cores_and_never_raises(monkeypatch):
    from cluster import cpu_plan

    class Ops:
        def bind_threads(self, cores):
            raise RuntimeError("no such op")

    cores = cpu_plan.physical_cores(cpu_plan.cpu_topology())
    assert cpu_plan.bind_engine_threads(cores + 1, ops=Ops()) == (
        [], f"not bound: {cores + 1} threads are more than this node's {cores} physical cores")
    monkeypatch.setattr(cpu_plan, "claims_path", lambda: __import__("pathlib").Path(os.devnull + "-no-such-dir/x"))
    bound, why = cpu_plan.bind_engine_threads(1, ops=Ops())  # the claims file cannot be written
    assert bound == [] and why.startswith("not bound: ")
    monkeypatch.setattr(cpu_plan.sys, "platform", "darwin")
    assert cpu_plan.bind_engine_threads(1, ops=Ops()) == (
        [], "not bound: binding threads to cores is implemented on Linux only")
