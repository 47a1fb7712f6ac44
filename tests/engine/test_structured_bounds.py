"""Bounds on structured-output constraints (engine/structured_bounds.py, engine/structured_output.py,
the compile path of engine/async_engine.py): each bound refuses a constraint past it with one sentence
naming the setting, before anything parses or compiles it (a schema nested 5000 deep is the same
ValueError as one nested 70 deep, never a RecursionError); pending compiles have their own bound and
do not count as waiting requests, so plain requests run while compiles are slow; a compile past its
timeout fails its request; an aborted request's queued compile is cancelled."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import AsyncLLM, EngineOverloadedError, RequestFailedError, SamplingParams
from engine.sampling_params import StructuredOutputsParams as SO
from engine.structured_bounds import StructuredOutputBounds
from tests.engine.test_engine_failures import FakeExecutor, make_core


def nested(depth: int) -> dict:
    """A schema of ``depth`` objects each holding the next (2 JSON levels per object, 2 * depth + 1 in all)."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_text(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth


TOO_DEEP = "the JSON schema for structured outputs nests more than structured_output_max_depth=64 levels deep."
CASES = [  # (kind, spec past a default bound, the exact message)
    ("json", {"type": "string", "maxLength": 4097},
     "JSON schema keyword 'maxLength' is 4097, more than structured outputs allow (structured_output_max_count=4096)."),
    ("json", {"type": "string", "minLength": 10**9},
     "JSON schema keyword 'minLength' is 1000000000, more than structured outputs allow "
     "(structured_output_max_count=4096)."),
    ("json", {"type": "array", "items": {"type": "integer"}, "minItems": 5000},
     "JSON schema keyword 'minItems' is 5000, more than structured outputs allow (structured_output_max_count=4096)."),
    ("json", {"type": "object", "properties": {"x": {"type": "array", "maxItems": 4097}}},
     "JSON schema keyword 'maxItems' is 4097, more than structured outputs allow (structured_output_max_count=4096)."),
    ("json", {"type": "object", "minProperties": 4097},
     "JSON schema keyword 'minProperties' is 4097, more than structured outputs allow "
     "(structured_output_max_count=4096)."),
    ("json", {"type": "string", "pattern": "[a-z]{0,5000}"},
     "a JSON schema 'pattern' for structured outputs repeats {0,5000} times, more than "
     "structured_output_max_count=4096 allows."),
    ("json", nested(32), TOO_DEEP),  # 65 levels
    ("json", nested(5000), TOO_DEEP),
    ("json", nested_text(5000), TOO_DEEP),
    ("json", {"type": "string", "enum": ["x" * 65536]},
     "the JSON schema for structured outputs is 65568 characters long, more than "
     "structured_output_max_length=65536 allows."),
    ("json", '{"type": "string", "description": "' + "x" * 65536 + '"}',
     "the JSON schema for structured outputs is 65573 characters long, more than "
     "structured_output_max_length=65536 allows."),
    ("regex", "a{4097}", "the regex for structured outputs repeats {4097} times, more than "
                         "structured_output_max_count=4096 allows."),
    ("regex", "(" * 65 + "a" + ")" * 65,
     "the regex for structured outputs nests more than structured_output_max_depth=64 levels deep."),
    ("regex", "a" * 65537, "the regex for structured outputs is 65537 characters long, more than "
                           "structured_output_max_length=65536 allows."),
    ("grammar", 'root ::= "a"{1,99999}', "the grammar for structured outputs repeats {1,99999} times, more than "
                                         "structured_output_max_count=4096 allows."),
    ("regex", "a{" + "9" * 5000 + "}",  # digits compared before int(), which refuses past 4300 digits
     "the regex for structured outputs repeats {999999999999...} (5000 digits) times, more than "
     "structured_output_max_count=4096 allows."),
    ("regex", "[(]" * 3 + "(" * 65 + "[)]" + ")" * 65,  # groups around classes still nest
     "the regex for structured outputs nests more than structured_output_max_depth=64 levels deep."),
    ("grammar", 'root ::= "{1}" [a-z]{0,4097}', "the grammar for structured outputs repeats {0,4097} times, more "
                                                "than structured_output_max_count=4096 allows."),
    ("choice", ("x" * 40000, "y" * 30000), "the choices for structured outputs is 70000 characters long, more than "
                                           "structured_output_max_length=65536 allows."),
]


@pytest.mark.parametrize("kind, spec, message", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_bound_refuses_with_a_sentence_naming_it(kind, spec, message):
    with pytest.raises(ValueError) as info:
        StructuredOutputBounds().check(kind, spec)
    assert str(info.value) == message


def test_constraints_at_the_bounds_pass():
    bounds = StructuredOutputBounds()
    bounds.check("json", nested(31))  # 63 levels
    bounds.check("json", nested_text(31))
    bounds.check("json", {"type": "array", "minItems": 4096, "maxItems": 4096, "items": {"maxLength": 4096}})
    bounds.check("regex", "[a-z]{0,4096}" + "(" * 64 + ")" * 64)
    bounds.check("grammar", 'root ::= "a"{1,4096}')
    bounds.check("choice", ("x" * 65536,))


def test_class_contents_and_grammar_literals_neither_nest_nor_repeat():
    bounds = StructuredOutputBounds()
    bounds.check("regex", "[(]" * 70)  # a flat regex: 70 one-character classes
    bounds.check("regex", r"[\](]" * 70 + "[]([]" * 70 + "[^](]" * 70)  # escaped or leading ] inside a class
    bounds.check("regex", "[{99999}]")
    bounds.check("json", {"type": "string", "pattern": "[(]" * 70 + "[{9999}]"})
    bounds.check("grammar", 'root ::= "{99999}" | "' + "(" * 70 + '" | "\\"{2}" | [(]' + "[(]" * 70)


def test_the_bounds_are_the_engine_settings(model_dirs):
    core = make_core(model_dirs, FakeExecutor(), structured_output_max_depth=3, structured_output_max_count=10,
                     structured_output_max_length=100)
    add = core.structured_outputs.compile_async
    with pytest.raises(ValueError, match=r"nests more than structured_output_max_depth=3 levels deep\.$"):
        add(SO(json=nested(2)))
    with pytest.raises(ValueError, match=r"'maxLength' is 11, .*\(structured_output_max_count=10\)\.$"):
        add(SO(json={"type": "string", "maxLength": 11}))
    with pytest.raises(ValueError, match=r"is 101 characters long, more than structured_output_max_length=100"):
        add(SO(regex="a" * 101))
    with pytest.raises(ValueError, match="structured_output_max_depth must be between 1 and 256, got 257"):
        make_core(model_dirs, FakeExecutor(), structured_output_max_depth=257)


def test_a_schema_nested_5000_deep_is_refused_at_admission_like_one_nested_40_deep(model_dirs):
    core = make_core(model_dirs, FakeExecutor())
    engine = AsyncLLM(core.config, core=core)

    async def main():
        for i, schema in enumerate((nested(40), nested(5000), nested_text(5000))):
            with pytest.raises(ValueError) as info:
                engine.submit(f"r{i}", [5, 6], SamplingParams(structured_outputs=SO(json=schema)),
                              lambda item: None)
            assert str(info.value) == TOO_DEEP
        with pytest.raises(ValueError, match=TOO_DEEP):  # the offline path too
            core.add_request("offline", [5, 6], SamplingParams(structured_outputs=SO(json=nested(5000))))

    asyncio.run(main())
    assert not engine._sinks and not engine._compiling and core.structured_outputs.num_pending == 0
    engine.shutdown()


class Gate:
    """Holds every compile of an engine until opened (the real compile runs then)."""

    def __init__(self, manager) -> None:
        self.open, self.started = threading.Event(), []
        backend = manager.backend
        real = backend.compile

        def compile(kind, spec):
            self.started.append(spec)
            self.open.wait(30)
            return real(kind, spec)

        backend.compile = compile


GRAMMAR_REJECTED = "the engine failed while running this request (its grammar rejected a sampled token)"


def ended(item) -> bool:
    return isinstance(item, BaseException) or item.finished


def choice(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=3, structured_outputs=SO(choice=(f"yes{i}", f"no{i}")))


async def finish(engine, request_id: str, params: SamplingParams) -> list:
    return [out async for out in engine.generate([5, 6, 7], params, request_id)]


def test_plain_requests_run_while_compiles_are_pending_and_compiles_have_their_own_bound(model_dirs):
    core = make_core(model_dirs, FakeExecutor(), max_num_seqs=2, structured_output_max_pending_compiles=5,
                     structured_output_compile_threads=1)
    engine = AsyncLLM(core.config, core=core, max_waiting_requests=6)  # 6 compiling requests at most
    gate = Gate(core.structured_outputs)
    got: dict[str, list] = {}

    async def main():
        for i in range(5):  # five slow compiles, one thread: one running, four queued
            got[f"c{i}"] = []
            engine.submit(f"c{i}", [5, 6], choice(i), got[f"c{i}"].append)
        assert core.structured_outputs.num_pending == 5 and engine.num_waiting_requests == 0
        with pytest.raises(EngineOverloadedError) as info:  # a sixth new grammar: refused, naming the bound
            engine.submit("c5", [5, 6], choice(5), lambda item: None)
        assert str(info.value) == ("5 structured output grammars are already compiling "
                                   "(structured_output_max_pending_compiles=5); retry later")
        got["c0-again"] = []  # the same grammar as a pending one joins it: no new compile
        engine.submit("c0-again", [5, 6], choice(0), got["c0-again"].append)
        plain = await asyncio.gather(*(finish(engine, f"p{i}", SamplingParams(max_tokens=4, ignore_eos=True))
                                       for i in range(4)))
        assert [len([t for out in outs for t in out.outputs[0].token_ids]) for outs in plain] == [4] * 4
        assert core.structured_outputs.num_pending == 5 and all(not items for items in got.values())
        for i in range(1, 5):  # aborted while queued: their compiles are cancelled, never run
            engine.abort(f"c{i}")
        assert core.structured_outputs.num_pending == 1
        assert gate.started in ([("yes0", "no0")], ['root ::= "yes0" | "no0"'])
        gate.open.set()
        while core.structured_outputs.num_pending:
            await asyncio.sleep(0.01)
        for _ in range(500):
            if all(items and ended(items[-1]) for items in (got["c0"], got["c0-again"])):
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert len(gate.started) == 1  # the four aborted compiles never ran
    # both were admitted once compiled (the fake runner ignores bitmasks, so the grammar rejects its token)
    assert [str(got[k][-1]) for k in ("c0", "c0-again")] == [GRAMMAR_REJECTED] * 2
    for i in range(1, 5):  # each aborted one ended at once with no tokens
        assert [(out.finished, out.outputs) for out in got[f"c{i}"]] == [(True, [])]
    assert not engine._sinks and not engine._compiling
    engine.shutdown()


def test_a_compile_past_its_timeout_fails_its_request_and_the_grammar_is_kept(model_dirs):
    core = make_core(model_dirs, FakeExecutor(), structured_output_compile_timeout_s=0.2)
    engine = AsyncLLM(core.config, core=core)
    gate = Gate(core.structured_outputs)

    async def main():
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(ValueError) as info:
            await finish(engine, "slow", choice(0))
        assert 0.2 <= loop.time() - start < 2
        assert str(info.value) == ("the structured output constraint did not compile within "
                                   "structured_output_compile_timeout_s=0.2 s; make it smaller or shallower.")
        assert not engine._sinks and not engine._compiling
        gate.open.set()  # the compile went on (native code cannot be stopped) and is cached when done
        while core.structured_outputs.num_pending:
            await asyncio.sleep(0.01)
        with pytest.raises(RequestFailedError) as failed:  # admitted at once: the cached grammar
            await finish(engine, "again", choice(0))
        assert str(failed.value) == GRAMMAR_REJECTED and len(gate.started) == 1

    asyncio.run(main())
    with pytest.raises(ValueError, match="did not compile within structured_output_compile_timeout_s=0.2 s"):
        gate.open.clear()  # the offline path waits at most the timeout too
        core.add_request("offline", [5, 6], choice(7))
    gate.open.set()
    engine.shutdown()
