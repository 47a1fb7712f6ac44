"""Benchmark workloads as token-id prompts cut from the shipped corpus (the same text every run)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from workers.model_builder import CORPUS_PATH


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_len: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


def corpus_token_ids(model_dir: str) -> list[int]:
    tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    return tokenizer.encode(CORPUS_PATH.read_text(), add_special_tokens=False).ids


def shared_prefix(model_dir: str, num_requests: int = 48, prefix_len: int = 512, suffix_len: int = 30,
                  output_len: int = 32) -> Workload:
    """``num_requests`` prompts: BOS + one ``prefix_len``-token prefix + a distinct suffix of
    ``suffix_len`` ± 4 tokens (a system prompt before short user messages)."""
    ids = corpus_token_ids(model_dir)
    bos = Tokenizer.from_file(f"{model_dir}/tokenizer.json").encode("").ids
    prefix = bos + ids[: prefix_len - len(bos)]
    prompts = []
    start = prefix_len
    for i in range(num_requests):
        length = suffix_len + (i % 9) - 4
        prompts.append(prefix + ids[start:start + length])
        start += length
    if start > len(ids):
        raise ValueError(f"the corpus has {len(ids)} tokens, too few for this workload")
    return Workload("shared-prefix", prompts, output_len)


def distinct(model_dir: str, num_requests: int, prompt_len: int, output_len: int) -> Workload:
    """``num_requests`` prompts of ``prompt_len`` tokens with no prefix in common beyond BOS."""
    ids = corpus_token_ids(model_dir)
    step = max(1, (len(ids) - prompt_len) // max(1, num_requests))
    prompts = [ids[i * step:i * step + prompt_len] for i in range(num_requests)]
    return Workload("distinct", prompts, output_len)
