"""`serve run serve_app:app key=value ...`: arguments are typed and checked before anything starts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serve_app import AppArgs, build_app, replica_bundles


def test_cli_strings_are_converted_and_checked(model_dirs):
    args = AppArgs.model_validate({"model": model_dirs["llama"], "tensor_parallel_size": "2",
                                   "enable_prefix_caching": "false", "max_num_seqs": "8", "stream_interval": "4"})
    assert args.tensor_parallel_size == 2 and args.enable_prefix_caching is False and args.max_num_seqs == 8
    assert args.stream_interval == 4
    for bad in ({"tensor_parallel_size": "two"}, {"bogus_option": 1}, {"dtype": "int4"}, {"router": "random"},
                {"num_replicas": 2, "min_replicas": 1}, {"min_replicas": 3, "max_replicas": 2},
                {"stream_interval": 0}):
        with pytest.raises(ValidationError):
            AppArgs.model_validate(bad)


def test_engine_settings_are_validated_when_the_app_is_built(model_dirs, tmp_path):
    with pytest.raises(ValueError, match="not a model directory"):
        build_app({"model": str(tmp_path)})
    with pytest.raises(ValueError, match="block_size"):
        build_app({"model": model_dirs["llama"], "block_size": 0})
    with pytest.raises(ValueError, match="max_model_len"):
        build_app({"model": model_dirs["llama"], "max_model_len": 10**6})


def test_each_replica_reserves_its_engine_and_ranks():
    assert replica_bundles(AppArgs(), use_gpu=False) == [{"CPU": 0.5}, {"CPU": 1.0}]
    assert replica_bundles(AppArgs(engine_cpus=2), use_gpu=True) == [{"CPU": 0.5}, {"CPU": 2.0, "GPU": 1.0}]
    assert replica_bundles(AppArgs(tensor_parallel_size=2), use_gpu=True) == [
        {"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
