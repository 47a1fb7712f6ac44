"""Constrained decoding below the model: the tokenizer as xgrammar sees it, the JSON schema keywords
refused, the compile cache, bitmask rows (min_tokens, a padded vocab), the masking of logits rows,
and the scheduler's matchers across a failed step and a rejected token (a model-free runner that
samples the smallest token each bitmask row allows)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from engine.messages import ModelRunnerOutput, SchedulerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.sampling_params import StructuredOutputsParams as SO
from engine.scheduler import Scheduler
from engine.structured_output import StructuredOutputManager, cache_key
from engine.tokenizer import Tokenizer
from workers.structured_output import XgrammarBackend, apply_bitmask, check_json_schema

EOS = (2, 4)
SPECIAL = (0, 1, 3)  # <pad>, <s>, <|im_start|>: special tokens that are not stop tokens


@pytest.fixture(scope="module")
def tokenizer(model_dirs) -> Tokenizer:
    return Tokenizer(model_dirs["llama"])


@pytest.fixture(scope="module")
def vocab(tokenizer) -> int:
    return tokenizer.vocab_size


@pytest.fixture(scope="module")
def manager(tokenizer, vocab):
    m = StructuredOutputManager(tokenizer, vocab, EOS)
    yield m
    m.shutdown()


def allowed(row: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def accepts(backend, compiled, tokenizer, text: str, end: bool = True) -> bool:
    matcher = backend.matcher(compiled)
    ok = all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return ok and (not end or (matcher.accept_token(EOS[0]) and matcher.is_terminated()))


# --- the vocabulary -----------------------------------------------------------------------------------


def test_special_tokens_are_never_allowed_and_stop_tokens_only_at_the_end(tokenizer, vocab, manager):
    backend = manager.backend
    grammar = backend.compile("json", {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    matcher = backend.matcher(grammar)
    for t in tokenizer.encode('{"s": "', add_special_tokens=False):
        assert matcher.accept_token(t)
    inside = allowed(backend.fill_bitmask([matcher], [()])[0], vocab)
    assert len(inside) > vocab // 2  # almost any text goes inside a string ...
    assert not inside & set(SPECIAL + EOS)  # ... but no special token, and the object is not complete
    for t in tokenizer.encode('x"}', add_special_tokens=False):
        assert matcher.accept_token(t)
    assert allowed(backend.fill_bitmask([matcher], [()])[0], vocab) == set(EOS)
    assert matcher.accept_token(EOS[1]) and backend.is_terminated(matcher)


def test_a_padded_vocab_masks_the_ids_beyond_the_tokenizer(tokenizer, vocab):
    backend = XgrammarBackend(tokenizer, vocab + 70, EOS)  # a model whose vocab is padded past the tokenizer's
    matcher = backend.matcher(backend.compile("regex", ".{0,40}"))
    row = backend.fill_bitmask([matcher], [()])[0]
    assert row.shape == ((vocab + 70 + 31) // 32,)
    ok = allowed(row, vocab + 70)
    assert max(ok) < vocab and len(ok) > vocab // 2
    logits = torch.zeros(2, vocab + 70)
    apply_bitmask(logits, row[None, :], [1], [0])
    assert torch.isinf(logits[1, vocab:]).all() and not torch.isinf(logits[0]).any()


def test_added_tokens_that_are_not_special_are_their_text(model_dirs, tmp_path):
    """A literal added token (special=False) is the text it stands for, its space included."""
    import tokenizers

    source = model_dirs["llama"]
    for name in ("tokenizer_config.json", "config.json"):
        (tmp_path / name).write_text(open(f"{source}/{name}").read())
    tok = tokenizers.Tokenizer.from_file(f"{source}/tokenizer.json")
    tok.add_tokens([tokenizers.AddedToken("hello world", special=False)])
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path)
    token_id = tok.token_to_id("hello world")
    backend = XgrammarBackend(tokenizer, tokenizer.vocab_size, EOS)
    matcher = backend.matcher(backend.compile("regex", "hello world!"))
    assert token_id in allowed(backend.fill_bitmask([matcher], [()])[0], tokenizer.vocab_size)
    assert matcher.accept_token(token_id) and matcher.accept_token(tok.token_to_id("!"))
    other = backend.matcher(backend.compile("regex", "helloworld!"))
    assert token_id not in allowed(backend.fill_bitmask([other], [()])[0], tokenizer.vocab_size)


# --- what is refused ----------------------------------------------------------------------------------


@pytest.mark.parametrize("schema, named", [
    ({"not": {"type": "string"}}, "'not'"),
    ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 4}}, "'if'/'then'/'else'"),
    ({"type": "array", "contains": {"const": 1}}, "'contains'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
     "'dependentRequired'"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf'"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "'allOf'"),
    ({"type": "string", "format": "password"}, "format 'password'"),
    ({"type": "object", "required": ["a"]}, "requires 'a'"),
    ({"$ref": "https://example.com/schema.json"}, "$ref 'https://example.com/schema.json'"),
    ({"type": "object", "properties": {"x": {"anyOf": [{"type": "string"}, {"not": {"const": 1}}]}}},
     "'not' (at the schema.properties.x.anyOf[1])"),
    ({"$defs": {"a": {"type": "array", "maxContains": 2}}, "$ref": "#/$defs/a"}, "(at the schema.$defs.a)"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "string", "format": "email", "maxLength": 8}, "'maxLength' beside 'format'"),  # xgrammar drops the length
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, "'minLength' beside 'pattern'"),
    ({"type": "integer", "enum": ["a", 1]}, "enum value 'a' (at the schema) is not of its declared type"),
    ({"const": "ab", "minLength": 5}, "'minLength' beside 'const'"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf'"),  # 5 matches both
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"enum": ["b", "a"]}}, "required": ["k"]}]}, "'oneOf'"),
])
def test_keywords_xgrammar_would_not_enforce_are_refused(schema, named):
    refusal = "not supported|do not support|supported on integers only|supported only when|declared type"
    with pytest.raises(ValueError, match=refusal) as info:
        check_json_schema(schema)
    assert named in str(info.value)


def test_one_of_schemas_that_cannot_overlap_are_enforced(tokenizer, manager):
    """A discriminated union (pydantic's shape: oneOf of $refs whose required "kind" differ), or
    branches of different types: oneOf then means anyOf, which xgrammar enforces."""
    union = {"$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                               "required": ["kind", "lives"]},
                       "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "bark": {"type": "string"}},
                               "required": ["kind", "bark"]}},
             "type": "object", "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                                                      "discriminator": {"propertyName": "kind"}}},
             "required": ["pet"]}
    compiled = manager.compile(SO(json=union))
    assert accepts(manager.backend, compiled, tokenizer, '{"pet": {"kind": "dog", "bark": "woof"}}')
    assert not accepts(manager.backend, compiled, tokenizer, '{"pet": {"kind": "dog", "lives": 9}}', end=False)
    check_json_schema({"oneOf": [{"type": "integer"}, {"type": ["string", "null"]}, {"const": True}]})
    check_json_schema({"type": "string", "const": "cat", "title": "Kind"})  # pydantic's Literal: type and title


def test_property_names_that_look_like_keywords_are_just_names(manager):
    schema = {"type": "object", "properties": {"not": {"type": "string", "maxLength": 3},
                                               "if": {"type": "integer", "multipleOf": 2}},
              "required": ["not", "if"]}
    check_json_schema(schema)
    manager.compile(SO(json=schema))


def test_length_bounded_strings_exclude_control_characters(tokenizer, manager):
    """A raw control character is not JSON; xgrammar lets it into strings with minLength/maxLength
    unless the backend excludes it."""
    compiled = manager.compile(SO(json={"type": "string", "minLength": 1, "maxLength": 8}))
    assert accepts(manager.backend, compiled, tokenizer, '"abc"')
    assert not accepts(manager.backend, compiled, tokenizer, '"a\x05c"', end=False)
    assert not accepts(manager.backend, compiled, tokenizer, '"' + "a" * 9 + '"', end=False)


# --- the compile cache ------------------------------------------------------------------------------


def test_one_compilation_per_constraint_whatever_the_key_order(tokenizer, vocab):
    manager = StructuredOutputManager(tokenizer, vocab, EOS)
    try:
        a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}, "required": ["x"]}
        b = {"required": ["x"], "properties": {"y": {"type": "string"}, "x": {"type": "integer"}}, "type": "object"}
        assert cache_key(SO(json=a)) == cache_key(SO(json=b)) == cache_key(SO(json=json.dumps(b)))
        futures = [manager.compile_async(SO(json=s)) for s in (a, b, json.dumps(a))]
        futures += [manager.compile_async(SO(regex="[a-z]+")) for _ in range(3)]
        grammars = [f.result() for f in futures]
        assert grammars[0] is grammars[1] is grammars[2] and grammars[3] is grammars[5]
        assert manager.num_compiled == 2
        with pytest.raises(ValueError, match="parenthesis is not closed"):
            manager.compile(SO(regex="(a"))
        with pytest.raises(ValueError, match="parenthesis is not closed"):
            manager.compile(SO(regex="(a"))
        assert manager.num_compiled == 3  # the failure is remembered too
    finally:
        manager.shutdown()


def test_compilation_runs_off_the_calling_thread(manager):
    caller = threading.get_ident()
    seen = []
    original = manager.backend.compile

    def spy(kind, spec):
        seen.append(threading.get_ident())
        return original(kind, spec)

    manager.backend.compile = spy
    try:
        manager.compile(SO(regex="[0-9]{2,7}q"))
    finally:
        del manager.backend.compile
    assert seen and seen[0] != caller


def test_the_engine_does_not_load_the_backend_without_a_constrained_request(tokenizer, vocab):
    manager = StructuredOutputManager(tokenizer, vocab, EOS)
    assert manager._backend is None and manager._pool is None
    manager.shutdown()


# --- bitmask rows -----------------------------------------------------------------------------------


def test_min_tokens_forbids_stop_tokens_unless_nothing_else_is_allowed(tokenizer, vocab, manager):
    backend = manager.backend
    free = backend.matcher(manager.compile(SO(regex="[a-z]{0,5}")))
    done = backend.matcher(manager.compile(SO(choice=["ok"])))
    for t in tokenizer.encode("ok", add_special_tokens=False):
        assert done.accept_token(t)
    rows = backend.fill_bitmask([free, done, free], [EOS, EOS, ()])
    assert not allowed(rows[0], vocab) & set(EOS) and allowed(rows[0], vocab)  # letters, no end yet
    assert allowed(rows[1], vocab) == set(EOS)  # only the end is left: it stays allowed
    assert set(EOS) <= allowed(rows[2], vocab)
    # token 31 of a word is its sign bit
    assert 31 not in allowed(backend.fill_bitmask([free], [(31,)])[0], vocab)


def test_apply_bitmask_masks_the_named_rows_only():
    vocab = 70
    bitmask = np.zeros((2, 3), dtype=np.int32)
    bitmask[0, 0] = 1 << 5  # token 5
    bitmask[1, 2] = 1 << 1  # token 65
    logits = torch.randn(4, vocab)
    before = logits.clone()
    apply_bitmask(logits, bitmask, [3, 1], [0, 1])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == [5]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [65]


# --- the scheduler's matchers ------------------------------------------------------------------------


class MaskRunner:
    """A model-free rank: samples the smallest token its bitmask row allows (token 7 unconstrained)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.masks_seen: list[dict[str, set[int]]] = []

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        rows = {r: allowed(so.grammar_bitmask[i], self.vocab) for i, r in enumerate(so.grammar_req_ids)}
        self.masks_seen.append(rows)
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + [r.req_id for r in so.scheduled_cached_reqs]
        sampled = [[min(rows[r])] if r in rows else [7] for r in req_ids]
        return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))


def constrained_request(manager, request_id: str, so: SO, max_tokens: int = 30) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
    request = Request(request_id, [5, 6, 7, 8, 9], params, eos_token_ids=frozenset(EOS), block_size=4,
                      max_tokens=max_tokens)
    request.grammar = manager.new_matcher(manager.compile(so))
    return request


def test_a_failed_step_advances_no_matcher_and_a_grammar_ends_its_request(tokenizer, vocab, manager):
    sched = Scheduler(num_kv_blocks=64, block_size=4, enable_prefix_caching=True, max_num_seqs=8,
                      max_num_batched_tokens=64, max_model_len=64, structured_outputs=manager)
    runner = MaskRunner(vocab)
    a = constrained_request(manager, "a", SO(regex="[0-9]{3}"))
    sched.add_request(a)
    free = Request("free", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3), eos_token_ids=frozenset(EOS),
                   block_size=4, max_tokens=3)
    sched.add_request(free)
    assert sched.num_constrained == 1
    first = sched.schedule()
    assert first.grammar_req_ids == ["a"]  # the unconstrained request has no row
    sched.rollback(first)  # the step failed: nothing sampled, nothing advanced
    again = sched.schedule()
    assert again.grammar_req_ids == ["a"] and np.array_equal(again.grammar_bitmask, first.grammar_bitmask)
    finished = {}
    so = again
    while sched.has_unfinished_requests():
        for out in sched.update_from_output(so, runner.execute_model(so)):
            if out.finish_reason is not None:
                finished[out.req_id] = out.finish_reason
        so = sched.schedule()
    assert finished == {"a": "stop", "free": "length"}
    # the smallest allowed token three times (a digit), then the only token left: the first stop token
    assert tokenizer.decode(a.output_token_ids) == "000" and a.output_token_ids[-1] == EOS[0]
    assert len(a.output_token_ids) == 4 and free.output_token_ids == [7, 7, 7]
    assert sched.num_constrained == 0 and a.grammar is None and sched.kv.block_pool.num_used_blocks == 0


def test_a_rejected_token_fails_its_request_alone(tokenizer, vocab, manager):
    sched = Scheduler(num_kv_blocks=64, block_size=4, enable_prefix_caching=True, max_num_seqs=8,
                      max_num_batched_tokens=64, max_model_len=64, structured_outputs=manager)
    a = constrained_request(manager, "a", SO(regex="[0-9]{3}"))
    b = constrained_request(manager, "b", SO(regex="[0-9]{3}"))
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    digit = tokenizer.encode("1", add_special_tokens=False)[0]
    outputs = sched.update_from_output(so, ModelRunnerOutput(["a", "b"], [[letter], [digit]], [None, None]))
    assert [o.req_id for o in outputs] == ["b"] and b.output_token_ids == [digit]
    assert sched.take_grammar_failures() == ["a"] and a.output_token_ids == []
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ERROR)
    assert sched.num_constrained == 0 and a.grammar is None and b.grammar is None
