"""`serve run serve_app:app key=value ...`: arguments are typed and checked before anything starts."""

from __future__ import annotations

import re
import pytest
from pydantic import ValidationError

from serve_app import AppArgs, build_app, cluster_cpus, plan_reservations


def test_cli_strings_are_converted_and_checked(model_dirs):
    args = AppArgs.model_validate({"model": model_dirs["llama"], "tensor_parallel_size": "2",
                                   "enable_prefix_caching": "false", "max_num_seqs": "8", "stream_interval": "4"})
    assert args.tensor_parallel_size == 2 and args.enable_prefix_caching is False and args.max_num_seqs == 8
    assert args.stream_interval == 4
    for bad in ({"tensor_parallel_size": "two"}, {"bogus_option": 1}, {"dtype": "int4"}, {"router": "random"},
                {"num_replicas": 2, "min_replicas": 1}, {"min_replicas": 3, "max_replicas": 2},
                {"stream_interval": 0}, {"engine_cpus": 0}, {"proxy_cpus": -1},
                {"tensor_parallel_size": 2, "engine_cpus": 0.5}, {"max_engine_restarts": -1}):
        with pytest.raises(ValidationError):
            AppArgs.model_validate(bad)


def test_mapping_arguments_as_json_text_from_the_command_line(model_dirs):
    """`serve run serve_app:app 'ingress_deployment_config={"num_replicas": 2}'` passes the value as
    text: the mapping-valued arguments read it as JSON, and text that is not a JSON object is refused
    in a sentence that shows the form."""
    app = build_app({"model": model_dirs["llama"], "ingress_deployment_config": '{"num_replicas": 2}',
                     "engine_kwargs": '{"max_num_seqs": 8}', "model_loading_config": '{"model_id": "m"}'})
    assert app._bound_deployment.num_replicas == 2
    args = AppArgs.model_validate({"engine_kwargs": '{"max_num_seqs": 8}', "deployment_config": '{"num_replicas": 1}'})
    assert (args.max_num_seqs, args.engine_kwargs, args.deployment_config) == (8, {"max_num_seqs": 8}, {"num_replicas": 1})
    with pytest.raises(ValidationError, match=r"deployment_config must be a mapping; on the command line, a JSON "
                                              r"object such as deployment_config='\{\"num_replicas\": 2\}' "
                                              r"\(got 'num_replicas=2'\)"):
        AppArgs.model_validate({"deployment_config": "num_replicas=2"})
    for name in ("engine_kwargs", "ingress_deployment_config", "model_loading_config"):
        with pytest.raises(ValidationError, match=f"{name} must be a"):
            AppArgs.model_validate({name: "[1]" if name != "engine_kwargs" else "{"})


def test_engine_settings_are_validated_when_the_app_is_built(model_dirs, tmp_path):
    with pytest.raises(ValueError, match="not a model directory"):
        build_app({"model": str(tmp_path)})
    with pytest.raises(ValueError, match="block_size"):
        build_app({"model": model_dirs["llama"], "block_size": 0})
    with pytest.raises(ValueError, match="max_model_len"):
        build_app({"model": model_dirs["llama"], "max_model_len": 10**6})
    for cap in ("max_n", "max_stop_sequences", "max_worker_restarts"):  # engine settings pass through
        with pytest.raises(ValueError, match=cap):
            build_app({"model": model_dirs["llama"], cap: -1})


def test_each_replica_reserves_its_engine_and_ranks():
    big = (8.0, 8.0)
    plan = plan_reservations(AppArgs(), use_gpu=False, cpus=big)  # the engine takes what the node leaves
    assert plan.bundles == [{"CPU": 0.5}, {"CPU": 7.0}]
    assert (plan.replica_cpus, plan.engine_bundle, plan.engine_cpus, plan.ingress_cpus) == (0.5, 1, 7.0, 0.5)
    plan = plan_reservations(AppArgs(engine_cpus=1), use_gpu=False, cpus=big)
    assert plan.bundles == [{"CPU": 0.5}, {"CPU": 1.0}] and plan.engine_cpus == 1.0
    plan = plan_reservations(AppArgs(engine_cpus=2), use_gpu=True, cpus=big)
    assert plan.bundles == [{"CPU": 0.5}, {"CPU": 2.0, "GPU": 1.0}]
    plan = plan_reservations(AppArgs(tensor_parallel_size=2), use_gpu=True, cpus=big)
    assert plan.bundles == [{"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert (plan.engine_bundle, plan.engine_cpus, plan.first_rank_bundle) == (1, 0.5, 2)
    assert plan_reservations(AppArgs(proxy_cpus=0.25), use_gpu=False, cpus=None).bundles == [
        {"CPU": 0.25}, {"CPU": 1.0}]  # an unknown cluster: what was asked, unchecked


def test_reservations_fit_a_small_node():
    """Two CPUs: tp = 1 keeps the defaults (2 CPUs in all with the Ingress); tp = 2 gives the ranks a
    CPU each and the replica, the scheduler actor and the Ingress none (they share rank 0's bundle);
    three CPUs leave 1 for the three of them."""
    two = (2.0, 2.0)
    plan = plan_reservations(AppArgs(), use_gpu=False, cpus=two)
    assert plan.bundles == [{"CPU": 0.5}, {"CPU": 1.0}] and plan.ingress_cpus == 0.5
    plan = plan_reservations(AppArgs(tensor_parallel_size=2), use_gpu=False, cpus=two)
    assert plan.bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert (plan.replica_cpus, plan.engine_bundle, plan.engine_cpus, plan.first_rank_bundle, plan.ingress_cpus) == (
        0.0, 0, 0.0, 0, 0.0)
    plan = plan_reservations(AppArgs(tensor_parallel_size=2), use_gpu=False, cpus=(3.0, 3.0))
    assert plan.bundles == [{"CPU": 0.33}, {"CPU": 0.33}, {"CPU": 1.0}, {"CPU": 1.0}] and plan.ingress_cpus == 0.33
    plan = plan_reservations(AppArgs(num_replicas=2), use_gpu=False, cpus=(3.0, 3.0))
    assert plan.bundles == [{"CPU": 0.33}, {"CPU": 1.0}] and plan.ingress_cpus == 0.33  # 2 x 1.33 + 0.33
    plan = plan_reservations(AppArgs(), use_gpu=False, cpus=(1.0, 1.0))
    assert plan.bundles == [{"CPU": 1.0}] and (plan.replica_cpus, plan.engine_bundle, plan.ingress_cpus) == (0, 0, 0)


@pytest.mark.parametrize("args, cpus, setting", [
    ({"tensor_parallel_size": 3}, (2.0, 2.0), "tensor_parallel_size=3"),
    ({"tensor_parallel_size": 2, "engine_cpus": 2}, (2.0, 4.0), "tensor_parallel_size=2"),  # STRICT_PACK: one node
    ({"engine_cpus": 4}, (2.0, 2.0), "engine_cpus=4"),
    ({"num_replicas": 3}, (2.0, 2.0), "num_replicas"),
    ({"min_replicas": 1, "max_replicas": 4}, (2.0, 2.0), "max_replicas"),
    ({"proxy_cpus": 0.5, "tensor_parallel_size": 2}, (2.0, 2.0), "proxy_cpus"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, (3.0, 3.0),
     "4 ranks (tensor_parallel_size=2 x pipeline_parallel_size=2) with engine_cpus=1 per rank needs 4 CPUs"),
])
def test_reservations_that_cannot_fit_name_the_setting(args, cpus, setting):
    with pytest.raises(ValueError, match=re.escape(setting)):
        plan_reservations(AppArgs(**args), use_gpu=False, cpus=cpus)
    plan_reservations(AppArgs(**args), use_gpu=False, cpus=(16.0, 16.0))  # fits a bigger node


def test_build_sizes_for_the_local_cluster_serve_run_will_start(model_dirs, monkeypatch):
    """`serve run serve_app:app` builds before Ray starts: the app is sized for this machine's CPUs
    (as Ray counts them), and a request for more stops the build."""
    import ray
    from ray._private.utils import get_num_cpus

    assert not ray.is_initialized()
    monkeypatch.setenv("RAY_ADDRESS", "local")
    local = float(get_num_cpus())
    assert cluster_cpus() == (local, local)
    app = build_app({"model": model_dirs["llama"], "tensor_parallel_size": 2 if local >= 2 else 1})
    llm_server = app._bound_deployment.init_args[0]._bound_deployment  # the Ingress's first argument
    bundles = llm_server._replica_config.placement_group_bundles
    assert sum(b["CPU"] for b in bundles) + app._bound_deployment.ray_actor_options["num_cpus"] <= local
    assert llm_server.ray_actor_options["num_cpus"] <= bundles[0]["CPU"]
    with pytest.raises(ValueError, match=f"tensor_parallel_size={int(local) + 1} with engine_cpus=1 per rank"):
        build_app({"model": model_dirs["llama"], "tensor_parallel_size": int(local) + 1})


def test_api_key_from_an_environment_variable(model_dirs, monkeypatch):
    """api_key_env names a variable: the Ingress reads the key from its node's environment, so Serve's
    stored config holds the variable's name only; a variable unset where the app is built stops the build."""
    with pytest.raises(ValidationError, match="give one of api_key, api_key_env and api_key_file, not api_key and "
                                              "api_key_env"):
        AppArgs(api_key="k", api_key_env="KVSERVE_API_KEY")
    monkeypatch.delenv("KVSERVE_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="^api_key_env=KVSERVE_TEST_KEY: the environment variable KVSERVE_TEST_KEY "
                                         "is not set \\(or empty\\) on this node$"):
        build_app({"model": model_dirs["llama"], "api_key_env": "KVSERVE_TEST_KEY"})
    monkeypatch.setenv("KVSERVE_TEST_KEY", "s3cret-key")
    app = build_app({"model": model_dirs["llama"], "api_key_env": "KVSERVE_TEST_KEY"})
    bound = app._bound_deployment
    args = ingress_args(bound)
    assert args["api_key"] is None and (args["api_key_env"], args["api_key_file"]) == ("KVSERVE_TEST_KEY", None)
    assert "s3cret-key" not in repr(bound.init_args) + repr(bound.init_kwargs)


def ingress_args(bound) -> dict:
    """The Ingress's bound arguments by name (positional and keyword alike), defaults filled in."""
    import inspect

    from serve_app import Ingress

    init = inspect.unwrap(getattr(Ingress, "func_or_class", Ingress).__init__)
    binding = inspect.signature(init).bind(None, *bound.init_args, **bound.init_kwargs)
    binding.apply_defaults()
    return binding.arguments


def test_api_key_from_a_file(model_dirs, tmp_path):
    """api_key_file names a file (a mounted Secret) the Ingress reads the key from; a file missing or
    empty where the app is built stops the build."""
    from serve_app import api_key_from_file

    with pytest.raises(ValueError, match=f"^api_key_file={tmp_path}/none: the file cannot be read on this node "):
        build_app({"model": model_dirs["llama"], "api_key_file": str(tmp_path / "none")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=f"^api_key_file={tmp_path}/empty: the file is empty$"):
        build_app({"model": model_dirs["llama"], "api_key_file": str(tmp_path / "empty")})
    (tmp_path / "key").write_text("s3cret-key\n")
    assert api_key_from_file(str(tmp_path / "key")) == "s3cret-key"
    bound = build_app({"model": model_dirs["llama"], "api_key_file": str(tmp_path / "key")})._bound_deployment
    args = ingress_args(bound)
    assert args["api_key"] is None and args["api_key_file"] == str(tmp_path / "key")
    assert "s3cret-key" not in repr(bound.init_args) + repr(bound.init_kwargs)


def test_ray_serve_llm_shapes_engine_kwargs_and_deployment_configs(model_dirs, monkeypatch):
    """engine_kwargs carries engine settings by name (as the flat keys); deployment_config and
    ingress_deployment_config set the two deployments' Serve options over what the app derives,
    its replica counts checked against the cluster (here two CPUs) like the flat keys'."""
    import serve_app

    monkeypatch.setattr(serve_app, "cluster_cpus", lambda: (2.0, 2.0))
    args = AppArgs.model_validate({"engine_kwargs": {"max_num_seqs": 8, "enable_prefix_caching": False,
                                                     "block_size": 32}})
    assert (args.max_num_seqs, args.enable_prefix_caching, args.block_size) == (8, False, 32)
    assert AppArgs.model_validate({"max_num_seqs": 8, "engine_kwargs": {"max_num_seqs": 8}}).max_num_seqs == 8
    with pytest.raises(ValidationError, match="max_num_seqs is given as 4 and in engine_kwargs as 8: give it once"):
        AppArgs.model_validate({"max_num_seqs": 4, "engine_kwargs": {"max_num_seqs": 8}})
    with pytest.raises(ValidationError, match="engine_kwargs: unknown engine setting 'swap_space'"):
        AppArgs.model_validate({"engine_kwargs": {"swap_space": 4}})
    with pytest.raises(ValidationError, match="deployment_config: unknown option 'ray_actor_options'"):
        AppArgs.model_validate({"deployment_config": {"ray_actor_options": {}}})

    app = build_app({"model": model_dirs["llama"], "engine_kwargs": {"max_num_seqs": 8},
                     "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2},
                                           "graceful_shutdown_timeout_s": 45, "max_ongoing_requests": 40},
                     "ingress_deployment_config": {"num_replicas": 2}})
    ingress = app._bound_deployment
    assert ingress.num_replicas == 2 and ingress.max_ongoing_requests == 10_000
    llm_server = ingress.init_args[0]._bound_deployment
    config = llm_server._deployment_config
    assert (config.autoscaling_config.min_replicas, config.autoscaling_config.max_replicas) == (1, 2)
    assert config.graceful_shutdown_timeout_s == 45 and llm_server.max_ongoing_requests == 40
    assert llm_server.init_args[0].scheduler.max_num_seqs == 8  # the engine config the replica builds
    flat = build_app({"model": model_dirs["llama"], "min_replicas": 1, "max_replicas": 2, "look_back_period_s": 15,
                      "upscale_delay_s": 1, "downscale_delay_s": 5})._bound_deployment.init_args[0]._bound_deployment
    auto = flat._deployment_config.autoscaling_config
    assert (auto.look_back_period_s, auto.upscale_delay_s, auto.downscale_delay_s) == (15.0, 1.0, 5.0)
    with pytest.raises(ValidationError, match="look_back_period_s"):
        AppArgs.model_validate({"look_back_period_s": 0})
    with monkeypatch.context() as env:
        env.setenv("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
        short = build_app({"model": model_dirs["llama"], "min_replicas": 1, "max_replicas": 2, "look_back_period_s": 3})
    auto = short._bound_deployment.init_args[0]._bound_deployment._deployment_config.autoscaling_config
    assert (auto.look_back_period_s, auto.metrics_interval_s) == (3.0, 1.0)  # checked against the real interval
    fixed = build_app({"model": model_dirs["llama"], "min_replicas": 1, "max_replicas": 4,
                       "deployment_config": {"num_replicas": 2}})._bound_deployment.init_args[0]._bound_deployment
    assert fixed.num_replicas == 2 and fixed._deployment_config.autoscaling_config is None
    with pytest.raises(ValueError, match="3 replicas need 3 CPUs for their engines but the cluster has 2"):
        build_app({"model": model_dirs["llama"], "deployment_config": {"autoscaling_config": {"max_replicas": 3}}})


def test_accelerator_type_means_gpu_engines_on_that_gpu_model():
    """accelerator_type implies GPU engines (whatever the cluster shows when the app is built, e.g. GPU
    workers scaled to zero) and puts each engine bundle on a node with that GPU model."""
    from serve_app import _use_gpu

    assert _use_gpu("auto", "A10G") and _use_gpu("cuda", "A10G") and _use_gpu("cuda")
    assert not _use_gpu("cpu")
    plan = plan_reservations(AppArgs(accelerator_type="A10G", tensor_parallel_size=2), use_gpu=True, cpus=(8.0, 8.0))
    gpu_bundle = {"CPU": 1.0, "GPU": 1.0, "accelerator_type:A10G": 0.001}
    assert plan.bundles == [{"CPU": 0.5}, {"CPU": 0.5}, gpu_bundle, gpu_bundle]
    with pytest.raises(ValidationError, match="accelerator_type=L4 asks for a GPU but device is cpu: give one"):
        AppArgs(device="cpu", accelerator_type="L4")


def test_model_as_a_repo_id_and_ray_serve_llm_model_loading_config(hf_cache, model_dirs, monkeypatch):
    """`model` takes a Hugging Face repo id (here from a cache laid out by hand, offline), served under
    the repo id; Ray Serve LLM's model_loading_config gives the source and the served name."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", hf_cache["cache"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    ingress = build_app({"model": hf_cache["repo_id"]})._bound_deployment
    model, served_name = ingress.init_args[1], ingress.init_args[2]
    assert (model.source, model.path, served_name) == (hf_cache["repo_id"], hf_cache["snapshot"], hf_cache["repo_id"])
    assert ingress.init_args[0]._bound_deployment.init_args[0].model.source == hf_cache["repo_id"]
    directory = build_app({"model": model_dirs["llama"]})._bound_deployment
    assert directory.init_args[1].source is None and directory.init_args[2] == "llama-tiny"

    args = AppArgs.model_validate({"model_loading_config": {"model_id": "tiny-chat",
                                                            "model_source": hf_cache["repo_id"]}})
    assert (args.model, args.served_model_name) == (hf_cache["repo_id"], "tiny-chat")
    assert build_app(args)._bound_deployment.init_args[2] == "tiny-chat"
    with pytest.raises(ValidationError, match="model is given as 'a/b' and in model_loading_config as 'c/d': give it once"):
        AppArgs.model_validate({"model": "a/b", "model_loading_config": {"model_source": "c/d"}})
    with pytest.raises(ValidationError, match="model_loading_config: unknown key 'model_path'"):
        AppArgs.model_validate({"model_loading_config": {"model_path": "x"}})
    with pytest.raises(ValueError, match="'kvserve-test/absent' is not a directory, nor in the Hugging Face cache"):
        build_app({"model": "kvserve-test/absent"})


def test_tool_call_parser_reaches_the_ingress(model_dirs):
    hermes = build_app({"model": model_dirs["llama"], "tool_call_parser": "hermes"})._bound_deployment
    assert ingress_args(hermes)["tool_call_parser"] == "hermes"
    assert ingress_args(build_app({"model": model_dirs["llama"]})._bound_deployment)["tool_call_parser"] == "generic"
    with pytest.raises(ValidationError, match="tool_call_parser must be one of generic, hermes, llama3_json, got 'xml'"):
        AppArgs.model_validate({"tool_call_parser": "xml"})


def test_host_tier_and_deterministic_settings_reach_the_engine(model_dirs):
    config = build_app({"model": model_dirs["llama"], "num_host_kv_blocks": 64,
                        "deterministic": True})._bound_deployment.init_args[0]._bound_deployment.init_args[0]
    assert config.cache.num_host_kv_blocks == 64 and config.deterministic is True
    by_bytes = build_app({"model": model_dirs["llama"], "engine_kwargs": {"kv_offload_bytes": 1 << 20}})
    assert by_bytes._bound_deployment.init_args[0]._bound_deployment.init_args[0].cache.kv_offload_bytes == 1 << 20
    assert config.enforce_eager is True  # CUDA graphs are asked for: enforce_eager False, flat or in engine_kwargs
    for args in ({"enforce_eager": False}, {"engine_kwargs": {"enforce_eager": False}}):
        graphs = build_app({"model": model_dirs["llama"], **args})
        assert graphs._bound_deployment.init_args[0]._bound_deployment.init_args[0].enforce_eager is False


def test_pipeline_parallel_arguments_from_the_command_line(model_dirs):
    """`serve run serve_app:app pipeline_parallel_size=2 pipeline_layer_split=1,1`: the split as text (or
    JSON), a bundle per rank of every stage, and a split that does not fit the model refused at build."""
    args = AppArgs.model_validate({"pipeline_parallel_size": "2", "pipeline_layer_split": "1,1"})
    assert (args.pipeline_parallel_size, args.pipeline_layer_split) == (2, [1, 1])
    assert AppArgs.model_validate({"pipeline_layer_split": "[3, 4]"}).pipeline_layer_split == [3, 4]
    with pytest.raises(ValidationError, match="such as pipeline_layer_split=10,12,10"):
        AppArgs.model_validate({"pipeline_layer_split": "one,two"})
    plan = plan_reservations(AppArgs(tensor_parallel_size=2, pipeline_parallel_size=2), use_gpu=False,
                             cpus=(8.0, 8.0))
    assert plan.bundles[plan.first_rank_bundle:] == [{"CPU": 1.0}] * 4
    build_app({"model": model_dirs["llama"], "pipeline_parallel_size": "2", "pipeline_layer_split": "1,1"})
    with pytest.raises(ValueError, match=r"pipeline_layer_split \[1, 2\] gives 3 layers; the model has 2"):
        build_app({"model": model_dirs["llama"], "pipeline_parallel_size": "2", "pipeline_layer_split": "1,2"})
