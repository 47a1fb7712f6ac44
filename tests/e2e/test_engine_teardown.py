"""An engine's weights and KV pool are freed when it goes, although the engine freezes what start-up
made out of the garbage collector's sight (``gc.freeze``): a frozen reference cycle is never freed,
so nothing start-up makes may hold the model in one (each parameter's loader was such a cycle:
parameter -> bound method -> layer -> parameter). On a GPU that was ~2 GB per 1B engine, kept
for the life of the process."""

from __future__ import annotations

import gc
import weakref

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore
from workers.executor import UniProcExecutor
from workers.worker import Worker

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [{"prompt_token_ids": [1, 5, 9, 13]}]


def _tensor_refs(worker) -> list[weakref.ref]:
    runner = worker.runner
    return [weakref.ref(p) for p in runner.model.parameters()] + \
        [weakref.ref(t) for kv in runner.kv_caches for t in kv]


def _alive(refs) -> int:
    gc.collect()
    return sum(r() is not None for r in refs)


@pytest.mark.parametrize("arch,backend,shutdown", [
    ("llama", "torch", True), ("opt", "auto", True), ("qwen2", "torch", False), ("opt", "torch", False)])
def test_an_engine_that_goes_frees_its_weights_and_pool(model_dirs, arch, backend, shutdown):
    """Shut down and dropped, or dropped without a shutdown; nothing is unfrozen either way."""
    llm = LLM(model_dirs[arch], num_kv_blocks=32, max_model_len=64, attention_backend=backend)
    assert gc.get_freeze_count() > 0  # start-up's objects are frozen
    llm.generate(PROMPT, GREEDY)
    llm.generate(PROMPT, SamplingParams(temperature=0.8, max_tokens=3, logprobs=2, seed=1))
    refs = _tensor_refs(llm.core.executor.worker)
    assert _alive(refs) == len(refs) > 0
    if shutdown:
        llm.shutdown()
    del llm
    assert _alive(refs) == 0


class RebuildingExecutor(UniProcExecutor):
    """The in-process executor with the Ray executor's ``restart``: the rank is replaced by a fresh one
    holding an empty pool of the same size (the Ray executor's ranks are processes, killed whole)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.config, self.num_blocks = config, 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        super().initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks

    def restart(self) -> None:
        self.worker.shutdown()
        self.worker = Worker(self.config)
        self.worker.init_device()
        self.worker.load_model()
        self.worker.initialize_kv_cache(self.num_blocks)


def test_a_rank_rebuilt_in_the_engine_process_frees_the_old_weights(model_dirs):
    llm = LLM(model_dirs["llama"], num_kv_blocks=32, max_model_len=64, attention_backend="torch")
    config = llm.config
    llm.shutdown()
    core = EngineCore(config, RebuildingExecutor(config))  # frozen at its start, rank and all
    try:
        first = core.executor.worker
        refs = _tensor_refs(first) + [weakref.ref(first)]
        llm.core = core
        out = llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
        core.executor.restart()
        del first
        assert _alive(refs) == 0
        assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == out
    finally:
        core.shutdown()
