"""Benchmark workloads as token-id prompts cut from the shipped corpus: the same text every run, the
same prompts for kvserve and for every peer.

A workload is a list of requests. Multi-turn conversations make some requests wait for others: turn
k of a user is sent when turn k-1 has finished, with the history (earlier prompts and replies) in
front of it. The replies in the history are scripted text, not the generated tokens, so every
system sees byte-identical prompts.

Every builder takes a ``variant``: the same shape (request count, lengths, structure) with other
tokens. `kvserve bench` runs variant 0 as the first instance in a fresh process and variant 1 as the
steady instance after it. Variants 0 and 1 share no prompt prefix beyond BOS (the system prompt of
one is not the other's), so the first instance leaves nothing in a prefix cache that the steady one
could hit. ``varied`` goes further: no two of its requests, across variants 0 and 1, have the same
prompt length or the same output length.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from functools import lru_cache

from tokenizers import Tokenizer

from workers.model_builder import CORPUS_PATH

WORKLOADS = ("shared-system-prompt", "multi-turn", "independent", "mixed", "varied")
VARIANTS = 2  # variants guaranteed to share no prefix (and, for `varied`, no length): first and steady


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int
    user: int | None = None  # multi-turn: the conversation it belongs to
    turn: int = 0  # sent once turn - 1 of the same user has finished


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    description: str = ""
    variant: int = 0

    @property
    def prompts(self) -> list[list[int]]:
        return [r.prompt for r in self.requests]

    @property
    def output_len(self) -> int:
        """The longest output asked for (the length when every request asks the same)."""
        return max(r.output_len for r in self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def max_len(self) -> int:
        return max(len(r.prompt) + r.output_len for r in self.requests)

    def rounds(self) -> list[list[int]]:
        """Request indices by turn: every request of a round may run together once the round before
        it has finished (all of a single-turn workload is one round)."""
        turns = sorted({r.turn for r in self.requests})
        return [[i for i, r in enumerate(self.requests) if r.turn == t] for t in turns]

    def predecessor(self) -> dict[int, int]:
        """request index -> index of the request it waits for (the same user's previous turn)."""
        last: dict[int, int] = {}
        after = {}
        for i, r in sorted(enumerate(self.requests), key=lambda item: item[1].turn):
            if r.user is not None:
                if r.user in last:
                    after[i] = last[r.user]
                last[r.user] = i
        return after

    def to_dict(self) -> dict:
        """Plain JSON data: what a benchmark process in another interpreter reads."""
        return {"name": self.name, "description": self.description, "variant": self.variant,
                "requests": [asdict(r) for r in self.requests]}

    @classmethod
    def from_dict(cls, data: dict) -> Workload:
        return cls(data["name"], [BenchRequest(**r) for r in data["requests"]], data.get("description", ""),
                   data.get("variant", 0))


class _Corpus:
    """Token spans of the corpus from a start position, consecutive and wrapping around at its end."""

    def __init__(self, model_dir: str, start: int = 0) -> None:
        self.ids = corpus_token_ids(model_dir)
        self.bos = _tokenizer(model_dir).encode("").ids
        self.pos = start % len(self.ids)

    def take(self, n: int) -> list[int]:
        if n > len(self.ids):
            raise ValueError(f"the corpus has {len(self.ids)} tokens, too few for a {n}-token span")
        end = self.pos + n
        span = self.ids[self.pos:end] + self.ids[:max(0, end - len(self.ids))]
        self.pos = end % len(self.ids)
        return span

    def variant_start(self, variant: int) -> int:
        """Where variant ``variant`` starts: variants 0 and 1 in opposite halves of the corpus."""
        return variant * (len(self.ids) // VARIANTS)

    def random_start(self, rng: random.Random, variant: int) -> int:
        """A random position owned by ``variant`` (positions are dealt out modulo VARIANTS), so two
        variants never start a span at the same token."""
        return rng.randrange(len(self.ids) // VARIANTS) * VARIANTS + variant % VARIANTS


@lru_cache(maxsize=8)
def _tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer.from_file(f"{model_dir}/tokenizer.json")


@lru_cache(maxsize=8)
def _corpus_ids(model_dir: str) -> tuple[int, ...]:
    return tuple(_tokenizer(model_dir).encode(CORPUS_PATH.read_text(), add_special_tokens=False).ids)


def corpus_token_ids(model_dir: str) -> list[int]:
    return list(_corpus_ids(model_dir))


def shared_system_prompt(model_dir: str, num_requests: int = 64, system_chars: int = 2048, user_len: int = 32,
                         output_len: int = 64, variant: int = 0) -> Workload:
    """One system prompt (as many tokens as the corpus's first ``system_chars`` characters, ~2 KB of
    text) before each of ``num_requests`` distinct user messages of ``user_len`` ± 4 tokens: the
    classic prefix-caching case. Each variant has its own system prompt."""
    corpus = _Corpus(model_dir)
    system_len = len(_tokenizer(model_dir).encode(CORPUS_PATH.read_text()[:system_chars],
                                                  add_special_tokens=False).ids)
    corpus.pos = corpus.variant_start(variant)
    system = corpus.bos + corpus.take(system_len)
    requests = [BenchRequest(system + corpus.take(user_len + (i % 9) - 4), output_len) for i in range(num_requests)]
    return Workload("shared-system-prompt", requests,
                    f"{num_requests} requests: a {len(system)}-token system prompt + ~{user_len}-token user "
                    f"messages, {output_len} output tokens", variant)


def multi_turn(model_dir: str, num_users: int = 16, num_turns: int = 4, system_len: int = 128, user_len: int = 48,
               reply_len: int = 48, output_len: int = 48, variant: int = 0) -> Workload:
    """``num_users`` conversations of ``num_turns`` turns; each turn resends the whole history (a
    per-user system prompt, earlier user messages and scripted replies) plus a new message."""
    corpus = _Corpus(model_dir)
    corpus.pos = corpus.variant_start(variant)
    requests = []
    for user in range(num_users):
        history = corpus.bos + corpus.take(system_len)
        for turn in range(num_turns):
            history = history + corpus.take(user_len)
            requests.append(BenchRequest(history, output_len, user=user, turn=turn))
            history = history + corpus.take(reply_len)
    return Workload("multi-turn", requests,
                    f"{num_users} users x {num_turns} turns: {system_len}-token system prompt, {user_len}-token "
                    f"messages, {reply_len}-token scripted replies in the history, {output_len} output tokens",
                    variant)


def independent(model_dir: str, num_requests: int = 64, prompt_len: int = 256, output_len: int = 64,
                variant: int = 0) -> Workload:
    """``num_requests`` prompts with nothing in common beyond BOS. The prompts of all VARIANTS
    variants start at distinct, evenly spaced corpus positions (request i of variant v at slot
    i * VARIANTS + v); they overlap in text when the corpus is short, never in their first tokens."""
    corpus = _Corpus(model_dir)
    span = prompt_len - len(corpus.bos)
    stride = max(1, (len(corpus.ids) - span) // (num_requests * VARIANTS))
    requests = []
    for i in range(num_requests):
        corpus.pos = (i * VARIANTS + variant % VARIANTS) * stride
        requests.append(BenchRequest(corpus.bos + corpus.take(span), output_len))
    return Workload("independent", requests,
                    f"{num_requests} requests of {prompt_len} distinct prompt tokens, {output_len} output tokens",
                    variant)


def mixed(model_dir: str, num_requests: int = 64, prompt_range: tuple[int, int] = (16, 1024),
          output_range: tuple[int, int] = (8, 256), seed: int = 0, variant: int = 0) -> Workload:
    """Prompt and output lengths drawn log-uniformly from the ranges (many short, a few long); each
    variant draws its own (seed + variant)."""
    rng = random.Random(seed + variant)
    corpus = _Corpus(model_dir)

    def draw(lo: int, hi: int) -> int:
        return int(round(lo * (hi / lo) ** rng.random()))

    requests = []
    for _ in range(num_requests):
        prompt_len, output_len = draw(*prompt_range), draw(*output_range)
        corpus.pos = corpus.random_start(rng, variant)
        requests.append(BenchRequest(corpus.bos + corpus.take(prompt_len), output_len))
    return Workload("mixed", requests,
                    f"{num_requests} requests: prompts {prompt_range[0]}-{prompt_range[1]} tokens, outputs "
                    f"{output_range[0]}-{output_range[1]} tokens, log-uniform (seed {seed})", variant)


def distinct_lengths(count: int, lo: int, hi: int) -> list[int]:
    """``count`` strictly increasing integers from ``lo`` to at most ``hi``, spaced geometrically
    where the range allows (many short, a few long) and one apart where it does not."""
    if hi - lo + 1 < count:
        raise ValueError(f"{count} distinct lengths do not fit in {lo}..{hi}")
    values: list[int] = []
    for j in range(count):
        target = lo * (hi / lo) ** (j / max(1, count - 1))
        floor = values[-1] + 1 if values else lo
        ceiling = hi - (count - 1 - j)  # leave room for the ones after
        values.append(min(ceiling, max(floor, int(round(target)))))
    return values


def varied(model_dir: str, num_requests: int = 64, prompt_range: tuple[int, int] = (16, 1024),
           output_range: tuple[int, int] = (8, 256), variant: int = 0) -> Workload:
    """Lengths that never repeat: num_requests * VARIANTS distinct prompt lengths and as many distinct
    output lengths are spread over the ranges, and variant v takes every VARIANTS-th of each from
    offset v, paired at random (seeded by the variant). A system that specialises on shapes (compiled
    graphs per batch or sequence size) meets a new one at every request of both instances."""
    count = num_requests * VARIANTS
    v = variant % VARIANTS
    prompt_lens = distinct_lengths(count, *prompt_range)[v::VARIANTS]
    output_lens = distinct_lengths(count, *output_range)[v::VARIANTS]
    rng = random.Random(1000 + variant)
    rng.shuffle(prompt_lens)
    rng.shuffle(output_lens)
    corpus = _Corpus(model_dir)
    requests = []
    for prompt_len, output_len in zip(prompt_lens, output_lens):
        corpus.pos = corpus.random_start(rng, variant)
        requests.append(BenchRequest(corpus.bos + corpus.take(prompt_len - len(corpus.bos)), output_len))
    return Workload("varied", requests,
                    f"{num_requests} requests, every prompt length ({prompt_range[0]}-{prompt_range[1]} tokens) "
                    f"and output length ({output_range[0]}-{output_range[1]} tokens) distinct across the first "
                    f"and steady instances", variant)


def build_workload(name: str, model_dir: str, scale: float = 1.0, output_len: int | None = None,
                   variant: int = 0) -> Workload:
    """A named workload at its standard size (``scale`` < 1 for smoke runs). ``output_len`` sets every
    request's output length; for ``mixed`` and ``varied``, which draw lengths, it is the longest
    (the shortest is an eighth of it, and ``varied`` widens the range as far as distinct lengths need)."""
    n = max(2, int(round(64 * scale)))
    out = {} if output_len is None else {"output_len": output_len}
    if name == "shared-system-prompt":
        return shared_system_prompt(model_dir, num_requests=n, variant=variant, **out)
    if name == "multi-turn":
        return multi_turn(model_dir, num_users=max(2, n // 4), variant=variant, **out)
    if name == "independent":
        return independent(model_dir, num_requests=n, variant=variant, **out)
    if name == "mixed":
        if output_len is not None:
            return mixed(model_dir, num_requests=n, output_range=(max(1, output_len // 8), output_len),
                         variant=variant)
        return mixed(model_dir, num_requests=n, variant=variant)
    if name == "varied":
        if output_len is not None:
            lo = max(1, output_len // 8)
            return varied(model_dir, num_requests=n, output_range=(lo, max(output_len, lo + n * VARIANTS - 1)),
                          variant=variant)
        return varied(model_dir, num_requests=n, variant=variant)
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


# --- the fixed-shape workload of the TP and Serve benchmarks ---------------------------------------

def distinct(model_dir: str, num_requests: int, prompt_len: int, output_len: int) -> Workload:
    """``num_requests`` prompts of ``prompt_len`` tokens with nothing in common."""
    ids = corpus_token_ids(model_dir)
    step = max(1, (len(ids) - prompt_len) // max(1, num_requests))
    return Workload("distinct", [BenchRequest(ids[i * step:i * step + prompt_len], output_len)
                                 for i in range(num_requests)])
