"""One local Ray cluster per test module (8 logical CPUs on any machine); the pipeline-parallel tests' model
and greedy helper."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.conftest import HFOracle
from workers.model_builder import make_model


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def generate(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    """A llama ``tiny`` with 5 layers (2 + 2 + 1, 1 + 3 + 1: splits that are not even) and its oracle."""
    path = str(make_model("llama", "tiny", tmp_path_factory.mktemp("pp") / "llama-5", seed=3, num_layers=5))
    return path, HFOracle(path)


def count_in_flight(llm) -> list[int]:
    """How many steps were out each time one was sent."""
    counts, submit = [], llm.core.executor.submit

    def counted(scheduler_output):
        counts.append(len(llm.core._in_flight) + 1)
        return submit(scheduler_output)

    llm.core.executor.submit = counted
    return counts
