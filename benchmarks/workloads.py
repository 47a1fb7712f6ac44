"""Benchmark workloads as token-id prompts cut from the shipped corpus: the same text every run, the
same prompts for kvserve and for every peer.

A workload is a list of requests. Multi-turn conversations make some requests wait for others: turn
k of a user is sent when turn k-1 has finished, with the history (earlier prompts and replies) in
front of it. The replies in the history are scripted text, not the generated tokens, so every
system sees byte-identical prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import Tokenizer

from workers.model_builder import CORPUS_PATH

WORKLOADS = ("shared-system-prompt", "multi-turn", "independent", "mixed")


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


class _Corpus:
    """Consecutive, non-overlapping token spans of the corpus (wrapping around at its end)."""

    def __init__(self, model_dir: str) -> None:
        self.ids = corpus_token_ids(model_dir)
        self.bos = _tokenizer(model_dir).encode("").ids
        self.pos = 0

    def take(self, n: int) -> list[int]:
        if n > len(self.ids):
            raise ValueError(f"the corpus has {len(self.ids)} tokens, too few for a {n}-token span")
        if self.pos + n > len(self.ids):
            self.pos = 0
        span = self.ids[self.pos:self.pos + n]
        self.pos += n
        return span


@lru_cache(maxsize=8)
def _tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer.from_file(f"{model_dir}/tokenizer.json")


@lru_cache(maxsize=8)
def _corpus_ids(model_dir: str) -> tuple[int, ...]:
    return tuple(_tokenizer(model_dir).encode(CORPUS_PATH.read_text(), add_special_tokens=False).ids)


def corpus_token_ids(model_dir: str) -> list[int]:
    return list(_corpus_ids(model_dir))


def shared_system_prompt(model_dir: str, num_requests: int = 64, system_chars: int = 2048, user_len: int = 32,
                         output_len: int = 64) -> Workload:
    """One ``system_chars``-character system prompt (~2 KB of text) before each of ``num_requests``
    distinct user messages of ``user_len`` ± 4 tokens: the classic prefix-caching case."""
    corpus = _Corpus(model_dir)
    system = corpus.bos + _tokenizer(model_dir).encode(CORPUS_PATH.read_text()[:system_chars],
                                                       add_special_tokens=False).ids
    corpus.pos = len(system)
    requests = [BenchRequest(system + corpus.take(user_len + (i % 9) - 4), output_len) for i in range(num_requests)]
    return Workload("shared-system-prompt", requests,
                    f"{num_requests} requests: a {len(system)}-token system prompt + ~{user_len}-token user "
                    f"messages, {output_len} output tokens")


def multi_turn(model_dir: str, num_users: int = 16, num_turns: int = 4, system_len: int = 128, user_len: int = 48,
               reply_len: int = 48, output_len: int = 48) -> Workload:
    """``num_users`` conversations of ``num_turns`` turns; each turn resends the whole history (a
    per-user system prompt, earlier user messages and scripted replies) plus a new message."""
    corpus = _Corpus(model_dir)
    requests = []
    for user in range(num_users):
        history = corpus.bos + corpus.take(system_len)
        for turn in range(num_turns):
            history = history + corpus.take(user_len)
            requests.append(BenchRequest(history, output_len, user=user, turn=turn))
            history = history + corpus.take(reply_len)
    return Workload("multi-turn", requests,
                    f"{num_users} users x {num_turns} turns: {system_len}-token system prompt, {user_len}-token "
                    f"messages, {reply_len}-token scripted replies in the history, {output_len} output tokens")


def independent(model_dir: str, num_requests: int = 64, prompt_len: int = 256, output_len: int = 64) -> Workload:
    """``num_requests`` prompts with nothing in common beyond BOS."""
    corpus = _Corpus(model_dir)
    requests = [BenchRequest(corpus.bos + corpus.take(prompt_len - len(corpus.bos)), output_len)
                for _ in range(num_requests)]
    return Workload("independent", requests,
                    f"{num_requests} requests of {prompt_len} distinct prompt tokens, {output_len} output tokens")


def mixed(model_dir: str, num_requests: int = 64, prompt_range: tuple[int, int] = (16, 1024),
          output_range: tuple[int, int] = (8, 256), seed: int = 0) -> Workload:
    """Prompt and output lengths drawn log-uniformly from the ranges (many short, a few long)."""
    rng = random.Random(seed)
    corpus = _Corpus(model_dir)

    def draw(lo: int, hi: int) -> int:
        return int(round(lo * (hi / lo) ** rng.random()))

    requests = []
    for _ in range(num_requests):
        prompt_len, output_len = draw(*prompt_range), draw(*output_range)
        corpus.pos = rng.randrange(len(corpus.ids))
        requests.append(BenchRequest(corpus.bos + corpus.take(prompt_len), output_len))
    return Workload("mixed", requests,
                    f"{num_requests} requests: prompts {prompt_range[0]}-{prompt_range[1]} tokens, outputs "
                    f"{output_range[0]}-{output_range[1]} tokens, log-uniform (seed {seed})")


def build_workload(name: str, model_dir: str, scale: float = 1.0, output_len: int | None = None) -> Workload:
    """A named workload at its standard size (``scale`` < 1 for smoke runs)."""
    n = max(2, int(round(64 * scale)))
    out = {} if output_len is None else {"output_len": output_len}
    if name == "shared-system-prompt":
        return shared_system_prompt(model_dir, num_requests=n, **out)
    if name == "multi-turn":
        return multi_turn(model_dir, num_users=max(2, n // 4), **out)
    if name == "independent":
        return independent(model_dir, num_requests=n, **out)
    if name == "mixed":
        if output_len is not None:
            return mixed(model_dir, num_requests=n, output_range=(max(1, output_len // 8), output_len))
        return mixed(model_dir, num_requests=n)
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


# --- the fixed-shape workload of the TP and Serve benchmarks ---------------------------------------

def distinct(model_dir: str, num_requests: int, prompt_len: int, output_len: int) -> Workload:
    """``num_requests`` prompts of ``prompt_len`` tokens with nothing in common."""
    ids = corpus_token_ids(model_dir)
    step = max(1, (len(ids) - prompt_len) // max(1, num_requests))
    return Workload("distinct", [BenchRequest(ids[i * step:i * step + prompt_len], output_len)
                                 for i in range(num_requests)])
