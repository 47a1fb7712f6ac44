"""Prompts for end-to-end tests: slices of the shipped corpus, from 1 to 500 tokens, some sharing
long prefixes so that the prefix cache is exercised."""

from __future__ import annotations

from functools import lru_cache

from workers.model_builder import CORPUS_PATH


@lru_cache(maxsize=4)
def corpus_ids(tokenizer_path: str) -> tuple[int, ...]:
    from tokenizers import Tokenizer

    return tuple(Tokenizer.from_file(tokenizer_path).encode(CORPUS_PATH.read_text()).ids)


def test_prompts(model_dir: str) -> list[list[int]]:
    ids = corpus_ids(f"{model_dir}/tokenizer.json")
    shared = list(ids[2000:2300])
    return [
        list(ids[:1]),
        list(ids[100:107]),
        list(ids[200:233]),
        shared + list(ids[5000:5020]),  # these two share 300 tokens
        shared + list(ids[6000:6041]),
        list(ids[8000:8500]),
        list(ids[3000:3129]),
    ]
