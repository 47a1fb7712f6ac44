"""The checkpoint builder: tiny builds of every arch load in transformers and agree with the raw tokenizer."""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers import model_builder
from workers.model_builder import (
    CORPUS_PATH, PRESETS, SPECIAL_TOKENS, add_make_model_arguments, ensure_model, make_model, num_parameters,
    run_make_model, train_tokenizer,
)

ARCHS = ("llama", "qwen2", "opt")
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json")
CORPUS = CORPUS_PATH.read_text(encoding="utf-8")
PARAGRAPHS = [p for p in CORPUS.split("\n\n") if p.strip()]
SAMPLES = [p for p in PARAGRAPHS if any(s in p for s in ("café", "日本", "🎉", "9,192,631,770", "```python"))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(arch, "tiny", root / arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_build_loads_in_transformers(tiny: dict[str, Path], arch: str) -> None:
    out = tiny[arch]
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["vocab_size"] % 64 == 0
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, [2, 4], 0)

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "opt": "OPTForCausalLM"}[arch]
    ids = Tokenizer.from_file(str(out / "tokenizer.json")).encode("The quick brown fox").ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config["vocab_size"]) and torch.isfinite(logits).all()
    assert 0.3 < logits[0, -1].std().item() < 3  # initializer_range keeps random logits away from near-ties
    assert num_parameters(out) == sum(p.numel() for p in model.parameters())  # tied weights count once


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_tokenizer_matches_tokenizer_json(tiny: dict[str, Path], arch: str) -> None:
    auto = AutoTokenizer.from_pretrained(tiny[arch])
    raw = Tokenizer.from_file(str(tiny[arch] / "tokenizer.json"))
    for text in SAMPLES + ["", "  two  spaces\n\n\tand a tab", "I'LL pay 1,234.50 EUR on 2024-07-04."]:
        ids = auto(text)["input_ids"]
        assert ids == raw.encode(text).ids and ids[0] == 1
        assert auto.decode(ids, skip_special_tokens=True) == text
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (1, 2, 0)
    assert len(auto) == raw.get_vocab_size()


def test_chat_template(tiny: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny["llama"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est la gare ?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nOù est la gare ?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert not tokenizer.apply_chat_template(messages, tokenize=False).endswith("assistant\n")
    ids = Tokenizer.from_file(str(tiny["llama"] / "tokenizer.json")).encode(prompt).ids
    assert ids[:2] == [1, 3] and ids.count(3) == 3 and ids.count(4) == 2  # <s>, then one id per marker


def test_tokenizer_is_deterministic_and_round_trips_the_corpus() -> None:
    tokenizer = train_tokenizer()
    assert tokenizer.to_str() == train_tokenizer().to_str()
    assert tokenizer.get_vocab_size() == 4096
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert SPECIAL_TOKENS == ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
    assert any(ord(c) > 0xFFFF for c in CORPUS) and "naïve" in CORPUS  # 4-byte and 2-byte UTF-8
    encoding = tokenizer.encode(CORPUS)
    assert encoding.ids[0] == 1 and 1 not in encoding.ids[1:]
    assert tokenizer.decode(encoding.ids) == CORPUS
    assert len(encoding.ids) < len(CORPUS.encode()) / 3  # it learned real merges
    for text in SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_sharded_build_index_covers_every_tensor(tmp_path: Path) -> None:
    out = make_model("llama", "tiny", tmp_path / "sharded", max_shard_size="100KB")
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    stored = {}
    for shard in shards:
        with safe_open(shard, "pt") as f:
            stored.update(dict.fromkeys(f.keys(), shard.name))
    assert weight_map == stored
    model = AutoModelForCausalLM.from_pretrained(out)
    assert set(weight_map) == set(model.state_dict())  # llama unties lm_head: every parameter is stored


def test_same_seed_same_weights(tmp_path: Path) -> None:
    a, b, c = (make_model("qwen2", "tiny", tmp_path / name, seed=seed) for name, seed in zip("abc", (0, 0, 1)))
    weights = [(d / "model.safetensors").read_bytes() for d in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]
    for name in ("tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (c / name).read_bytes()


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama, qwen2, opt"):
        make_model("gpt2", "tiny", tmp_path / "x")
    with pytest.raises(ValueError, match="tiny, small, medium, 125m"):
        make_model("llama", "huge", tmp_path / "x")
    with pytest.raises(ValueError, match="float32"):
        make_model("llama", "tiny", tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError, match="unknown arch"):
        ensure_model("gpt2", "tiny")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        make_model("llama", "tiny", tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError):  # rejected by save_pretrained, after the temporary directory exists
        make_model("opt", "tiny", tmp_path / "out", max_shard_size="a lot")
    assert list(tmp_path.iterdir()) == []


def test_ensure_model_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    builds = []
    build = model_builder.make_model
    monkeypatch.setattr(model_builder, "make_model",
                        lambda *args, **kwargs: builds.append(args) or build(*args, **kwargs))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_model("opt", "tiny", 3))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    path = tmp_path / "models" / "opt-tiny-seed3"
    assert results == [path] * 3 and len(builds) == 1
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("opt", "tiny", seed=3) == path and len(builds) == 1
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    half = ensure_model("opt", "tiny", seed=3, dtype="bfloat16")  # another dtype is another checkpoint
    assert half == tmp_path / "models" / "opt-tiny-seed3-bfloat16" and len(builds) == 2
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_make_model_arguments(parser)
    args = parser.parse_args(["--arch=qwen2", "--preset=tiny", f"--out={tmp_path / 'm'}", "--dtype=bfloat16"])
    assert run_make_model(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(tmp_path / "m") and f"{num_parameters(tmp_path / 'm'):,} parameters" in lines[1]
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "bfloat16"
    assert run_make_model(args) == 2  # the directory is taken now
    assert "not empty" in capsys.readouterr().err


def test_presets_follow_the_spec() -> None:
    for arch in ARCHS:
        assert list(PRESETS[arch]) == ["tiny", "small", "medium", "125m", "1b", "odd"]
        assert PRESETS[arch]["125m"]["vocab_size"] == 50272 and PRESETS[arch]["1b"]["vocab_size"] == 32768
        assert PRESETS[arch]["odd"]["vocab_size"] == 4100 and PRESETS[arch]["odd"]["hidden_size"] == 200
        assert all("vocab_size" not in kwargs for name, kwargs in PRESETS[arch].items()
                   if name not in ("125m", "1b", "odd"))
    one_b = PRESETS["llama"]["1b"]
    assert (one_b["hidden_size"], one_b["num_hidden_layers"], one_b["num_attention_heads"],
            one_b["num_key_value_heads"], one_b["intermediate_size"]) == (2048, 16, 32, 8, 8192)
    llama, qwen2, opt = (PRESETS[arch]["small"] for arch in ARCHS)
    assert llama["num_key_value_heads"] == 2 and not llama["tie_word_embeddings"] and llama["rope_theta"] == 1e4
    assert qwen2["tie_word_embeddings"] and qwen2["rope_theta"] == 1e6 and not qwen2["use_sliding_window"]
    assert opt["ffn_dim"] == 2048 and opt["max_position_embeddings"] == 2048 and opt["word_embed_proj_dim"] == 512
