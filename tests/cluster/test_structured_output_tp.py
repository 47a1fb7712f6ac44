"""Structured outputs at TP=2 on Ray worker actors: the grammar bitmask travels with each step to the
ranks and rank 0 applies it, so constrained requests give exactly the tokens of TP=1, every output that
stops satisfies its constraint, and nothing is left held afterwards."""

from __future__ import annotations

import json
import re

import jsonschema

from engine import LLM, SamplingParams, StructuredOutputsParams
from tests.e2e.prompts import test_prompts as make_prompts
from tests.e2e.test_structured_output import REGEXES, SCHEMAS


def test_tp2_constrained_requests_match_tp1(ray_cluster, model_dirs):
    model = model_dirs["llama"]
    prompts = make_prompts(model)[:4]
    constraints = [StructuredOutputsParams(json=SCHEMAS[0]), StructuredOutputsParams(regex=REGEXES[0]),
                   StructuredOutputsParams(choice=["red", "green", "blue"]), None]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=64, structured_outputs=c)
              for seed in range(2) for c in constraints]
    requests = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(len(params))]
    settings = {"attention_backend": "torch", "num_kv_blocks": 400}
    with LLM(model=model, **settings) as llm1:
        tp1 = [o.outputs[0] for o in llm1.generate(requests, params)]
    with LLM(model=model, tensor_parallel_size=2, **settings) as llm:
        tp2 = [o.outputs[0] for o in llm.generate(requests, params)]
        stats = llm.stats()
        assert stats["num_blocks_in_use"] == 0 and llm.core.scheduler.num_constrained == 0
    assert [s.token_ids for s in tp2] == [s.token_ids for s in tp1]
    stopped = 0
    for p, s in zip(params, tp2):
        c = p.structured_outputs
        if c is None or s.finish_reason != "stop":
            continue
        stopped += 1
        if c.json is not None:
            jsonschema.validate(json.loads(s.text), c.json)
        elif c.regex is not None:
            assert re.fullmatch(c.regex, s.text), s.text
        else:
            assert s.text in c.choice
    assert stopped >= 2  # the choices always end within 64 tokens
