"""Where a checkpoint comes from: the one place that turns what users write as ``model=`` into a local
directory.

- nothing: the default checkpoint, built into kvserve's cache on first use (``model_builder``);
- a directory holding a ``config.json``;
- a Hugging Face repo id (``org/name``, optionally with a ``revision``): the snapshot in this node's
  Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``), downloaded into it first where the hub is reachable
  and the snapshot is missing. Only what the engine reads is fetched: configs, tokenizer files, chat
  templates and safetensors weights.

Every process that reads the checkpoint resolves it on its own node: a config built on one machine carries
the repo id (``ModelConfig.source``) and ``localize`` points it at the copy where it lands.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from engine.config import EngineConfig, ModelConfig

# what the engine reads from a checkpoint; the rest of a repo (other weight formats, images) stays on the hub
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


DEFAULT_MODEL = ("llama", "small", 0)  # (arch, preset, seed) of the checkpoint served when none is given


def cached_model_path(arch: str, preset: str, seed: int = 0, dtype: str = "float32") -> Path:
    """Where ``workers.model_builder.ensure_model`` keeps a built preset:
    ``$KVSERVE_CACHE_DIR/models/{arch}-{preset}-seed{seed}`` (default cache dir ~/.cache/kvserve;
    ``-{dtype}`` appended for other dtypes than float32)."""
    models_dir = Path(os.environ.get("KVSERVE_CACHE_DIR", "~/.cache/kvserve")).expanduser() / "models"
    return models_dir / (f"{arch}-{preset}-seed{seed}" + ("" if dtype == "float32" else f"-{dtype}"))


class ModelNotFoundError(ValueError):
    """``model=`` names neither a checkpoint directory nor a repo that can be found or downloaded."""


def is_repo_id(model: str) -> bool:
    """Whether ``model`` reads as a Hugging Face repo id (``name`` or ``org/name``) rather than a path."""
    return bool(_REPO_ID.match(model)) and ".." not in model and not model.startswith(("./", "~"))


def resolve_model(model: str | os.PathLike | None, revision: str | None = None) -> Path:
    """The local checkpoint directory for ``model`` (see the module's docstring). Raises
    ``ModelNotFoundError`` in one sentence when there is none."""
    if model is None:
        built = cached_model_path(*DEFAULT_MODEL)
        if built.is_dir():  # builds are renamed into place when complete: no need for the builder (and torch)
            return built
        from workers.model_builder import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is not a model directory: it has no config.json")
        return path.resolve()
    text = str(model)
    if not is_repo_id(text):
        raise ModelNotFoundError(f"model {text!r} is neither an existing directory nor a Hugging Face repo id")
    return _from_hub(text, revision)


def _from_hub(repo_id: str, revision: str | None) -> Path:
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:  # the cached snapshot first: no network when it is there
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                                      local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    where = f"{repo_id!r}" + (f" at revision {revision}" if revision else "")
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"model {where} is not a directory, nor in the Hugging Face cache "
                                 f"({huggingface_hub.constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set")
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(f"model {where} is not a directory, nor in the Hugging Face cache "
                                 f"({huggingface_hub.constants.HF_HUB_CACHE}), and could not be downloaded: "
                                 f"{reason}") from None


def localize_model(model: ModelConfig) -> ModelConfig:
    """``model`` with a path valid on this node: a checkpoint that came from the hub is looked up (or
    downloaded) in this node's cache when the path recorded where the config was built does not exist here."""
    if model.source is None or Path(model.path, "config.json").is_file():
        return model
    return dataclasses.replace(model, path=str(resolve_model(model.source, model.revision)))


def localize(config: EngineConfig) -> EngineConfig:
    """``config`` with its model path valid on this node (see ``localize_model``)."""
    model = localize_model(config.model)
    return config if model is config.model else dataclasses.replace(config, model=model)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a Hugging Face model directory, sharded or not."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    present = sorted(p.name for p in model_dir.iterdir()) if model_dir.is_dir() else []
    raise FileNotFoundError(
        f"no safetensors checkpoint in {model_dir}: expected model.safetensors or "
        f"model.safetensors.index.json (found: {', '.join(present) or 'nothing'}); "
        "convert other formats with transformers' save_pretrained(safe_serialization=True)"
    )
