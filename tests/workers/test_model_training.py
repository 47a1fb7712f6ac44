"""`kvserve make-model --train-steps N`: a build trained on the corpus, its report true to the saved weights."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from workers.model_builder import BOS_ID, add_make_model_arguments, make_model, run_make_model
from workers.model_training import HELD_OUT, _held_out_loss, corpus_ids, train_on_corpus


def _held_out(model_dir) -> float:
    """The held-out loss of the saved checkpoint, recomputed by transformers from the files."""
    ids = torch.tensor(corpus_ids(Tokenizer.from_file(str(model_dir / "tokenizer.json"))))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _held_out_loss(model, ids[int(len(ids) * (1 - HELD_OUT)):], 256, BOS_ID)


def test_a_trained_build_learned_the_corpus_and_says_so(tmp_path, capsys) -> None:
    untrained = make_model("llama", "tiny", tmp_path / "random", seed=3)
    parser = argparse.ArgumentParser()
    add_make_model_arguments(parser)
    args = parser.parse_args(["--arch", "llama", "--preset", "tiny", "--out", str(tmp_path / "trained"),
                              "--seed", "3", "--train-steps", "3"])
    assert run_make_model(args) == 0
    trained = tmp_path / "trained"
    assert not (untrained / "training.json").exists()
    report = json.loads((trained / "training.json").read_text())
    assert (report["steps"], report["batch_size"], report["seq_len"]) == (3, 8, 256)
    assert report["train_tokens_seen"] == 3 * 8 * 256
    assert report["held_out_loss"] < report["initial_held_out_loss"]
    # the same seed, the same initial weights: the report's starting point is the random build's, and its end
    # is what the saved weights give
    assert _held_out(untrained) == pytest.approx(report["initial_held_out_loss"], abs=1e-4)
    assert _held_out(trained) == pytest.approx(report["held_out_loss"], abs=1e-4)
    out = capsys.readouterr().out
    assert f"trained 3 steps ({3 * 8 * 256:,} tokens)" in out
    assert out.rstrip().endswith(f"held-out {report['initial_held_out_loss']:.2f} -> {report['held_out_loss']:.2f}")


def test_training_brings_the_loss_down_by_more_than_a_nat(tmp_path) -> None:
    model_dir = make_model("llama", "tiny", tmp_path / "m", seed=5)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    report = train_on_corpus(model, tokenizer, steps=40, seed=5, bos_id=BOS_ID, seq_len=64, batch_size=4, lr=3e-3)
    assert report.final_train_loss < report.initial_train_loss - 1.0
    assert report.held_out_loss < report.initial_held_out_loss - 1.0


def test_negative_train_steps_are_refused_before_anything_is_built(tmp_path) -> None:
    with pytest.raises(ValueError, match="train steps must be >= 0, got -1"):
        make_model("llama", "tiny", tmp_path / "m", train_steps=-1)
    assert not (tmp_path / "m").exists()
