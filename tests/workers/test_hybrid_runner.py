"""The rank side of the hybrid KV layout (``engine.kv_layout``), driven by hand-built scheduler
outputs on the tiny Gemma 3 (5 window layers + 1 full: 1 pool pair, 5 window groups) and Gemma 2
(2 + 2: 2 pairs, 1 group) presets, against transformers by teacher forcing.

A small scheduler here plays the contract: a block gets a full page and one window page per group when
first needed; after each step the window pages of blocks below ``first_needed_block`` of a request's
computed tokens are released (the rank's table entries are not rewritten), filled with NaN (the
compiled kernels) or large garbage (torch, whose full-layer SDPA multiplies unwritten slots of a
sequence's last block) and handed to later blocks. Request A prefills a prompt of several windows in
chunks, then decodes; request B arrives as a prefix-cache hit on A's first blocks (its window table
holds 0 below its window, A's pages above) and runs beside A (a shared-prefix group on the compiled
kernels), then decodes. Every position's logits are compared with HF's over the whole sequence, and
(compiled kernels) are the same bits as the plain layout's run of the same steps."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.messages import CachedRequestData, NewRequestData, SchedulerOutput
from engine.sampling_params import SamplingParams
from tests.compiled import cpu_backend_or_skip
from tests.gemma_models import gemma_dir, gemma_oracle
from workers.model_runner import ModelRunner
from workers.parallel_state import TPGroup
from workers.staging import Staging

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def make_runner(arch, backend, block_size, hybrid):
    model = ModelConfig.from_dir(gemma_dir(arch), dtype="float32", max_model_len=512)
    config = EngineConfig(model=model, device="cpu", attention_backend=backend,
                          cache=CacheConfig(block_size=block_size, disable_hybrid_kv_cache_manager=not hybrid),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    return ModelRunner(config, TPGroup(), torch.device("cpu"), torch.float32)


class MiniScheduler:
    """Pages, refcounts and the diffs of the hybrid contract for a few requests run step by step."""

    def __init__(self, runner, num_pages, garbage):
        self.runner, self.layout, self.bs = runner, runner.layout, runner.block_size
        self.groups = self.layout.num_window_groups
        self.free = list(range(num_pages - 1, 0, -1))
        self.refs: dict[int, int] = {}
        self.garbage = garbage
        self.reqs: dict[str, dict] = {}
        self.reused = 0  # released window pages handed out again
        self.released: set[int] = set()

    def take(self):
        page = self.free.pop()
        self.reused += page in self.released
        self.refs[page] = 1
        return page

    def drop(self, page):
        self.refs[page] -= 1
        if self.refs[page] == 0:
            del self.refs[page]
            for k, v in self.runner.kv_pool:  # whatever a later user leaves unwritten stays poisoned
                k[page] = self.garbage
                v[page] = self.garbage
            self.free.append(page)
            self.released.add(page)

    def add(self, req_id, tokens, computed=0, shared_from=None):
        """A request; ``shared_from``: a prefix-cache hit on that request's first ``computed`` tokens."""
        req = {"tokens": tokens, "computed": computed, "full": [], "window": [[] for _ in range(self.groups)],
               "new": True}
        if shared_from is not None:
            src, n = self.reqs[shared_from], computed // self.bs
            first = self.layout.first_needed_block(computed, self.bs)
            req["full"] = src["full"][:n]
            for p in req["full"]:
                self.refs[p] += 1
            for g in range(self.groups):
                req["window"][g] = [0] * first + src["window"][g][first:n]
                for p in req["window"][g][first:]:
                    assert p, "the source request must still hold these window pages"
                    self.refs[p] += 1
        self.reqs[req_id] = req

    def step(self, plan):
        """``plan``: req_id -> tokens to compute. Returns the SchedulerOutput."""
        new, cached, finished = [], [], set()
        for req_id, n in plan.items():
            req = self.reqs[req_id]
            start = len(req["full"])
            need = -(-(req["computed"] + n) // self.bs)
            for _ in range(start, need):
                req["full"].append(self.take())
                for g in range(self.groups):
                    req["window"][g].append(self.take())
            if req["new"]:
                req["new"] = False
                new.append(NewRequestData(req_id, req["tokens"][:req["computed"] + n], len(req["tokens"]), GREEDY,
                                          list(req["full"]), req["computed"], [list(w) for w in req["window"]]))
            else:
                end = req["computed"] + n
                cached.append(CachedRequestData(req_id, req["tokens"][req["sent"]:end], req["full"][start:],
                                                req["computed"], [w[start:] for w in req["window"]]))
            req["sent"] = req["computed"] + n
        so = SchedulerOutput(new, cached, dict(plan), sum(plan.values()), finished)
        return so

    def done(self, plan):
        """After the step: computed tokens advance, window pages behind the windows are released."""
        for req_id, n in plan.items():
            req = self.reqs[req_id]
            req["computed"] += n
            first = self.layout.first_needed_block(req["computed"], self.bs)
            for g in range(self.groups):
                for i in range(first):
                    if req["window"][g][i]:
                        self.drop(req["window"][g][i])
                        req["window"][g][i] = 0  # (the scheduler's view; the rank's entry stays stale)


def run(arch, backend, block_size, hybrid, garbage, staging=False, decodes=5):
    runner = make_runner(arch, backend, block_size, hybrid)
    if staging:  # the inputs as a CUDA step sends them: the tables' writes scattered into copies, rows gathered
        runner.batch.use_staging(Staging(torch.device("cpu"), pin=False))
    runner.initialize_kv_cache(400)
    window = runner.config.model.hf_config["sliding_window"]
    gen = torch.Generator().manual_seed(7)
    vocab = runner.config.model.hf_config["vocab_size"]
    a = torch.randint(3, vocab, (4 * window + 11,), generator=gen).tolist()
    k = (window + 3 * block_size) // block_size * block_size  # B's cache hit: A's first k tokens
    b = a[:k] + torch.randint(3, vocab, (2 * window + 5,), generator=gen).tolist()
    prompt_a, prompt_b = len(a) - decodes, len(b) - decodes
    sched = MiniScheduler(runner, 400, garbage)
    sched.add("A", a)
    hidden = []
    runner.model.register_forward_hook(lambda module, args, out: hidden.append(out))
    logits = {"A": {}, "B": {}}
    # B arrives (a hit of k tokens) right after A's first chunk, while A still holds those window pages
    plans = [{"A": k}, {"A": 29, "B": 37}, {"A": 31, "B": 41}, {"A": 23, "B": prompt_b - k - 78},
             {"A": prompt_a - k - 83, "B": 1}] + [{"A": 1, "B": 1}] * (decodes - 1) + [{"A": 1}]
    for plan in plans:
        if "B" in plan and "B" not in sched.reqs:
            sched.add("B", b, computed=k, shared_from="A")
        so = sched.step(plan)
        before = {r: sched.reqs[r]["computed"] for r in plan}
        out = runner.execute_model(so)
        with torch.inference_mode():
            rows = runner.model.compute_logits(hidden.pop())
        offset = 0
        for req_id in out.req_ids:  # the step's order: decodes first
            n = plan[req_id]
            for j in range(n):
                logits[req_id][before[req_id] + j] = rows[offset + j]
            offset += n
        sched.done(plan)
    assert sorted(logits["A"]) == list(range(len(a))) and sorted(logits["B"]) == list(range(k, len(b)))
    return runner, sched, a, b, logits


def compare_with_hf(arch, seq, rows, tol=2e-3):
    hf = gemma_oracle(arch).logits(seq)
    positions = sorted(rows)
    ours = torch.stack([rows[p] for p in positions])
    assert torch.isfinite(ours).all()
    assert (ours - hf[positions]).abs().max().item() < tol
    assert torch.equal(ours.argmax(-1), hf[positions].argmax(-1))


@pytest.mark.parametrize("arch,block_size", [("gemma3", 8), ("gemma2", 4)])
def test_compiled_kernels_match_hf_and_the_plain_layout(arch, block_size):
    cpu_backend_or_skip()
    runner, sched, a, b, logits = run(arch, "cpu", block_size, True, float("nan"))
    layout = runner.layout
    assert layout.hybrid and len(runner.kv_pool) == layout.page_layers < layout.num_layers
    assert runner.kv_spec.num_layers == layout.page_layers
    k0 = runner.kv_pool[0][0]
    assert runner.kv_spec.bytes_per_block == 2 * layout.page_layers * k0[0].numel() * k0.element_size()
    assert [runner.kv_caches[l][0] is runner.kv_pool[layout.placement(l)[0]][0] for l in range(layout.num_layers)] \
        == [True] * layout.num_layers
    assert sched.reused > 0  # released window pages were given to later blocks and overwritten
    # the rank's window tables still name A's released pages, some now another block's (of A or B)
    req = runner.batch.requests["A"]
    first = layout.first_needed_block(req.num_computed_tokens, block_size)
    stale = {int(p) for t in runner.batch.window_blocks for p in t.table[req.row, :first]} - {0}
    assert stale & set(sched.refs)
    assert runner.batch.num_cascade_steps > 0  # A and B's shared blocks attended as a group
    compare_with_hf(arch, a, logits["A"])
    compare_with_hf(arch, b, logits["B"])
    plain, _, _, _, plain_logits = run(arch, "cpu", block_size, False, 0.0)
    assert not plain.layout.hybrid and len(plain.kv_pool) == plain.layout.num_layers
    for req_id in ("A", "B"):
        assert all(torch.equal(logits[req_id][p], plain_logits[req_id][p]) for p in logits[req_id])


def test_device_tables_give_the_same_bits():
    """Off CPU each window group's table is kept on the device by the same diffs (run here on CPU)."""
    cpu_backend_or_skip()
    runner, _, _, _, logits = run("gemma2", "cpu", 4, True, float("nan"), staging=True)
    assert [t.num_ids_written > 0 for t in runner.batch.device_window_tables] == [True]
    _, _, _, _, host = run("gemma2", "cpu", 4, True, float("nan"))
    for req_id in ("A", "B"):
        assert all(torch.equal(logits[req_id][p], host[req_id][p]) for p in logits[req_id])


def test_torch_backend_matches_hf():
    _, sched, a, b, logits = run("gemma3", "torch", 8, True, 1e4)
    assert sched.reused > 0
    compare_with_hf("gemma3", a, logits["A"])
    compare_with_hf("gemma3", b, logits["B"])


def test_a_hybrid_runner_refuses_requests_without_window_ids():
    runner = make_runner("gemma2", "torch", 8, True)
    runner.initialize_kv_cache(16)
    new = NewRequestData("r", [5] * 10, 10, GREEDY, [1, 2], 0)  # an old scheduler: no window_block_ids
    with pytest.raises(ValueError, match=r"1 window groups' block ids parallel to its 2 blocks expected"):
        runner.execute_model(SchedulerOutput([new], [], {"r": 10}, 10, set()))
