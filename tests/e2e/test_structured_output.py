"""Constrained decoding end to end on the tiny random-weight llama: its outputs are nonsense, so the
test is the constraint itself. Every output that finishes with "stop" parses and validates against
its JSON schema (jsonschema), matches its regex, is one of its choices or belongs to its grammar's
language; unconstrained requests in the same steps are unaffected; preemption, n = 2 and prefix
hits keep the constraint; bad constraints are refused at admission and leave the engine clean."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncLLM
from engine.llm import engine_config
from engine.sampling_params import RequestOutputKind
from engine.sampling_params import StructuredOutputsParams as SO
from tests.e2e.prompts import test_prompts as make_prompts

ARCH = "llama"
EOS_IDS = (2, 4)
SEEDS = 8

SCHEMAS = [
    {  # nested objects, required and optional properties, bounded numbers
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                          "zip": {"type": "integer", "minimum": 10000,
                                                                  "maximum": 99999}},
                        "required": ["city"]},
        },
        "required": ["name", "age"],
    },
    {  # arrays with bounds, enums, booleans, numbers with exclusive bounds
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
            "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "score", "ok"],
    },
    {  # anyOf, null, const, a $ref to a definition
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"]}},
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": "^[a-z]{2,4}$"}]},
            "kind": {"const": "shape"},
            "at": {"$ref": "#/$defs/point"},
            "note": {"type": ["string", "null"], "maxLength": 8},
        },
        "required": ["id", "kind", "at"],
    },
    {  # a top-level array of small objects
        "type": "array",
        "items": {"type": "object", "properties": {"k": {"type": "string", "format": "date"}}, "required": ["k"]},
        "minItems": 1, "maxItems": 2,
    },
]
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"  # RFC 3339 full-date, its syntax
REGEXES = [r"\d{3}-\d{4}", r"[a-z]+@[a-z]+\.(com|org)", r"(yes|no), [A-Z][a-z]{1,6}!", r"-?(0|[1-9]\d{0,3})\.\d{2}"]
CHOICES = ["positive", "negative", "neutral", "it's \"mixed\"\n"]
# balanced parentheses, and a sum of one-digit numbers: a context-free language no regex describes
GRAMMAR = 'root ::= expr "=" [0-9]+\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "(" expr ")"'


def balanced_sum(text: str) -> bool:
    left, _, result = text.partition("=")
    if not re.fullmatch(r"[0-9()+]+", left) or not result.isdigit():
        return False
    depth = 0
    for ch in left:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0 and re.search(r"\(\)|\+\+|\(\+|\+\)|^\+|\+$|[0-9]{2}", left) is None


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> str:
    return model_dirs[ARCH]


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model=model_dir, num_kv_blocks=1200) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    return make_prompts(model_dir)


def sampled(seed: int, structured: SO | None = None, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 160)
    return SamplingParams(temperature=1.0, seed=seed, structured_outputs=structured, **kwargs)


def assert_clean(llm):
    stats = llm.stats()
    assert stats["num_blocks_in_use"] == 0
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert llm.core.scheduler.num_constrained == 0  # every matcher released


def stopped_texts(outputs) -> list[str]:
    return [s.text for o in outputs for s in o.outputs if s.finish_reason == "stop"]


# --- every kind of constraint, many seeds, one mixed batch ----------------------------------------------


def test_every_stopped_output_satisfies_its_constraint(llm, prompts):
    """Four schemas, four regexes, a choice, JSON mode and a grammar, 8 seeds each, all in one batch
    with unconstrained requests: each output that stops satisfies its own constraint."""
    cases = ([("json", s, SO(json=s)) for s in SCHEMAS] + [("regex", r, SO(regex=r)) for r in REGEXES]
             + [("choice", CHOICES, SO(choice=CHOICES)), ("object", None, SO(json_object=True)),
                ("grammar", None, SO(grammar=GRAMMAR)), ("free", None, None)])
    requests = [(kind, spec, sampled(seed * 31 + i, so)) for i, (kind, spec, so) in enumerate(cases)
                for seed in range(SEEDS)]
    inputs = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(len(requests))]
    outputs = llm.generate(inputs, [p for _, _, p in requests])
    num_stopped = {kind: 0 for kind, _, _ in cases}
    for (kind, spec, _), output in zip(requests, outputs):
        sample = output.outputs[0]
        assert sample.finish_reason in ("stop", "length")
        if kind == "object":  # any object: a random model rarely closes its long strings in time
            assert sample.text.lstrip(" \t\r\n").startswith("{"), sample.text
        if sample.finish_reason != "stop" or kind == "free":
            continue
        num_stopped[kind] += 1
        assert sample.token_ids[-1] in EOS_IDS  # the grammar ended with a stop token, removed from the text
        text = sample.text
        if kind == "json":
            value = json.loads(text)
            jsonschema.validate(value, spec)
            if isinstance(value, list):  # formats are enforced as syntax (a 31st of September passes)
                assert all(re.fullmatch(DATE, item["k"]) for item in value), value
        elif kind == "object":
            assert isinstance(json.loads(text), dict), text
        elif kind == "regex":
            assert re.fullmatch(spec, text), (spec, text)
        elif kind == "choice":
            assert text in CHOICES
        else:
            assert balanced_sum(text), text
    # the constraint leads a random model to the end of most outputs within 160 tokens
    assert num_stopped["json"] >= 3 * SEEDS and num_stopped["regex"] >= 3 * SEEDS, num_stopped
    assert num_stopped["choice"] == SEEDS and num_stopped["grammar"] >= SEEDS // 2, num_stopped
    assert len(set(stopped_texts(outputs))) > 6 * SEEDS  # the seeds really sampled different outputs
    assert_clean(llm)


def test_unconstrained_requests_are_unaffected_by_constrained_neighbours(llm, prompts):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], greedy)]
    mixed_inputs, mixed_params = [], []
    for i, p in enumerate(prompts[:3]):
        mixed_inputs += [{"prompt_token_ids": p}, {"prompt_token_ids": p}]
        mixed_params += [greedy, sampled(i, SO(json=SCHEMAS[i]))]
    outputs = llm.generate(mixed_inputs, mixed_params)
    assert [outputs[2 * i].outputs[0].token_ids for i in range(3)] == alone
    # and the constrained neighbours, greedy too, take the best token the grammar allows
    constrained = llm.generate({"prompt_token_ids": prompts[0]},
                               SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(regex="[0-9]{30}")))
    text = constrained[0].outputs[0].text
    assert re.fullmatch("[0-9]{30}", text) and constrained[0].outputs[0].finish_reason == "stop"


def test_logprobs_are_those_of_the_raw_distribution(llm, prompts):
    """A single choice forces every token: the masked distribution gives each chosen token log 1 = 0,
    the raw one (what is reported) does not."""
    out = llm.generate({"prompt_token_ids": prompts[2]},
                       sampled(3, SO(choice=["forced answer"]), logprobs=2))[0].outputs[0]
    assert out.text == "forced answer" and out.finish_reason == "stop"
    chosen = [lp[t] for t, lp in zip(out.token_ids, out.logprobs)]
    assert all(v < -0.01 for v in chosen), chosen


def test_min_tokens_holds_back_the_end_while_the_grammar_allows_more(llm, prompts):
    params = [sampled(s, SO(regex="[a-z ]+"), min_tokens=12, max_tokens=60) for s in range(6)]
    params += [sampled(s, SO(choice=["ok"]), min_tokens=12) for s in range(2)]  # nothing but the end is left
    outputs = llm.generate([{"prompt_token_ids": prompts[1]}] * len(params), params)
    for o in outputs[:6]:
        sample = o.outputs[0]
        assert re.fullmatch("[a-z ]+", sample.text)
        assert sample.finish_reason == "length" or len(sample.token_ids) > 12
    assert [o.outputs[0].text for o in outputs[6:]] == ["ok", "ok"]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs[6:])


def test_max_tokens_too_small_ends_with_length(llm, prompts):
    out = llm.generate({"prompt_token_ids": prompts[0]}, sampled(1, SO(json=SCHEMAS[0]), max_tokens=5))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith("{")  # the partial text is returned
    assert_clean(llm)


# --- scheduling: preemption, n > 1, prefix hits --------------------------------------------------------


def test_preemption_in_the_middle_of_constrained_requests(llm, model_dir, prompts):
    """A pool too small for the batch: constrained requests are preempted and recomputed (their
    grammar state stays with their tokens) and produce exactly the tokens they produce unpreempted."""
    params = [sampled(200 + i, SO(json=SCHEMAS[i % len(SCHEMAS)]), max_tokens=96) for i in range(6)]
    inputs = [{"prompt_token_ids": prompts[i][:60]} for i in range(6)]
    expected = [o.outputs[0].token_ids for o in llm.generate(inputs, params)]
    with LLM(model=model_dir, num_kv_blocks=24, max_model_len=160, max_num_batched_tokens=64,
             max_num_seqs=6) as small:
        outputs = small.generate(inputs, params)
        assert small.stats()["num_preemptions"] > 0
        assert [o.outputs[0].token_ids for o in outputs] == expected
        for p, o in zip(params, outputs):
            if o.outputs[0].finish_reason == "stop":
                jsonschema.validate(json.loads(o.outputs[0].text), p.structured_outputs.json)
        assert_clean(small)


def test_n_samples_each_follow_the_schema(llm, prompts):
    out = llm.generate({"prompt_token_ids": prompts[3]}, sampled(7, SO(json=SCHEMAS[1]), n=2, max_tokens=120))[0]
    assert len(out.outputs) == 2
    a, b = out.outputs
    assert a.token_ids != b.token_ids
    for sample in (a, b):
        if sample.finish_reason == "stop":
            jsonschema.validate(json.loads(sample.text), SCHEMAS[1])
    assert "stop" in (a.finish_reason, b.finish_reason)
    assert_clean(llm)


def test_prefix_cache_hit_on_a_constrained_request(llm, prompts):
    params = sampled(11, SO(json=SCHEMAS[2]))
    first = llm.generate({"prompt_token_ids": prompts[4]}, params)[0]
    second = llm.generate({"prompt_token_ids": prompts[4]}, params)[0]
    assert second.num_cached_tokens >= len(prompts[4]) - 16 > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    if first.outputs[0].finish_reason == "stop":
        jsonschema.validate(json.loads(first.outputs[0].text), SCHEMAS[2])


# --- bad constraints ------------------------------------------------------------------------------------


@pytest.mark.parametrize("structured, message", [
    (SO(json={"type": "object", "properties": {"a": {"type": "strng"}}}), 'Unsupported type "strng"'),
    (SO(json='{"type": "object",'), "not valid JSON"),
    (SO(json={"type": "integer", "not": {"const": 3}}), "keyword 'not'"),
    (SO(json={"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}}}),
     "'contains' (at the schema.properties.a)"),
    (SO(json={"type": "string", "format": "phone"}), "format 'phone'"),
    (SO(regex="(ab"), "The parenthesis is not closed"),
    (SO(regex="(?=a)b"), "Lookahead is not supported"),
    (SO(grammar='root ::= "a" rest'), 'Rule "rest" is not defined'),
])
def test_a_bad_constraint_is_refused_at_admission(llm, prompts, structured, message):
    good = sampled(1, SO(regex="[a-z]{4}"))
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        llm.generate([{"prompt_token_ids": prompts[0]}] * 2, [good, sampled(2, structured)])
    text = str(info.value)
    assert "\n" not in text and "/project/" not in text and text.endswith(".")  # one clean sentence
    assert_clean(llm)  # nothing was added
    assert re.fullmatch("[a-z]{4}", llm.generate({"prompt_token_ids": prompts[0]}, good)[0].outputs[0].text)


def test_async_engine_refuses_a_bad_constraint_and_serves_the_others(model_dir, prompts):
    async def main():
        engine = AsyncLLM(engine_config(model_dir, num_kv_blocks=200))
        try:
            async def run(request_id, params):
                final = None
                async for out in engine.generate(prompts[1], params, request_id,
                                                 output_kind=RequestOutputKind.FINAL_ONLY):
                    final = out
                return final

            results = await asyncio.gather(
                run("good-json", sampled(5, SO(json=SCHEMAS[1]), max_tokens=120)),
                run("bad", sampled(6, SO(json={"type": "object", "properties": {"a": {"type": "strng"}}}))),
                run("free", sampled(7, max_tokens=8)),
                run("bad-again", sampled(6, SO(json={"type": "object", "properties": {"a": {"type": "strng"}}}))),
                run("good-regex", sampled(8, SO(regex="[0-9]{5}"))),
                return_exceptions=True)
            assert isinstance(results[1], ValueError) and isinstance(results[3], ValueError)
            assert 'Unsupported type "strng"' in str(results[1]) and str(results[1]) == str(results[3])
            assert re.fullmatch("[0-9]{5}", results[4].outputs[0].text)
            assert len(results[2].outputs[0].token_ids) == 8
            if results[0].outputs[0].finish_reason == "stop":
                jsonschema.validate(json.loads(results[0].outputs[0].text), SCHEMAS[1])
            stats = engine.stats()
            assert stats["num_blocks_in_use"] == 0 and engine.core.scheduler.num_constrained == 0
        finally:
            engine.shutdown()

    asyncio.run(main())
