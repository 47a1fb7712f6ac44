"""The tiny llama engine, prompts and greedy reference shared by the end-to-end sampling, stopping and input tests."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.e2e.prompts import test_prompts as make_prompts

ARCH = "llama"
EOS_IDS = (2, 4)
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = dict(temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> str:
    return model_dirs[ARCH]


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model=model_dir, num_kv_blocks=600, max_n=800) as engine:  # 800 samples of one prompt
        yield engine


@pytest.fixture(scope="module")
def oracle(hf_oracle):
    return hf_oracle(ARCH)


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    return make_prompts(model_dir)[:5]


@pytest.fixture(scope="module")
def greedy(llm, prompts) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (checked against HF in test_greedy_vs_hf.py)."""
    return [o.outputs[0].token_ids for o in llm.generate(as_inputs(prompts), GREEDY)]


def as_inputs(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def tokens_of(outputs) -> list[list[int]]:
    return [s.token_ids for o in outputs for s in o.outputs]


def assert_clean(llm):
    stats = llm.stats()
    assert stats["num_blocks_in_use"] == 0
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
