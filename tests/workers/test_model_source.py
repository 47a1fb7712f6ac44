"""`model=` as users write it: a directory, a Hugging Face repo id from the node's hub cache (laid out by
the `hf_cache` fixture), or downloaded from a hub (a local HTTP server speaking the hub's protocol)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub.constants
import pytest

from engine import LLM, SamplingParams, engine_config
from workers.model_source import ModelNotFoundError, is_repo_id, localize, resolve_model


@pytest.fixture
def hub_cache(hf_cache, monkeypatch):
    """The laid-out cache as this process's Hugging Face cache, offline."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", hf_cache["cache"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hf_cache


def test_repo_ids_and_paths_are_told_apart():
    assert is_repo_id("org/name") and is_repo_id("name") and is_repo_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert not is_repo_id("/abs/dir") and not is_repo_id("./rel") and not is_repo_id("a/b/c")
    assert not is_repo_id("../up") and not is_repo_id("~/models/x")


def test_a_directory_resolves_to_itself(model_dirs, tmp_path):
    assert resolve_model(model_dirs["llama"]) == Path(model_dirs["llama"]).resolve()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ModelNotFoundError, match="neither an existing directory nor a Hugging Face repo id"):
        resolve_model(str(tmp_path / "missing" / "deeper" / "still"))


def test_a_repo_id_resolves_to_its_snapshot_in_the_cache(hub_cache):
    assert resolve_model(hub_cache["repo_id"]) == Path(hub_cache["snapshot"])
    assert resolve_model(hub_cache["repo_id"], revision=hub_cache["commit"]) == Path(hub_cache["snapshot"])
    with pytest.raises(ModelNotFoundError, match="at revision v2 is not a directory, nor in the Hugging Face "
                                                 "cache .*, and HF_HUB_OFFLINE is set"):
        resolve_model(hub_cache["repo_id"], revision="v2")
    with pytest.raises(ModelNotFoundError, match="'kvserve-test/absent' is not a directory"):
        resolve_model("kvserve-test/absent")


def test_llm_from_a_repo_id_generates_what_the_directory_does(hub_cache, model_dirs):
    params = SamplingParams(max_tokens=6, temperature=0.0)
    with LLM(model_dirs["llama"], num_kv_blocks=160) as llm:
        expected = llm.generate([{"prompt_token_ids": [1, 17, 29, 40]}], params)[0].outputs[0].token_ids
        assert llm.config.model.source is None
    with LLM(hub_cache["repo_id"], num_kv_blocks=160) as llm:
        assert llm.config.model.source == hub_cache["repo_id"]
        assert llm.config.model.path == hub_cache["snapshot"]
        assert llm.generate([{"prompt_token_ids": [1, 17, 29, 40]}], params)[0].outputs[0].token_ids == expected


def test_localize_finds_the_checkpoint_in_this_nodes_cache(hub_cache, tmp_path, monkeypatch):
    """A config built where the cache lives elsewhere (another node) points at this node's copy."""
    config = engine_config(hub_cache["repo_id"], num_kv_blocks=160)
    elsewhere = dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(tmp_path / "gone")))
    assert localize(elsewhere).model.path == hub_cache["snapshot"]
    assert localize(config) is config  # already valid here: nothing looked up
    local_dir = dataclasses.replace(config, model=dataclasses.replace(config.model, source=None))
    assert localize(local_dir) is local_dir
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelNotFoundError, match="is not a directory, nor in the Hugging Face cache"):
        localize(elsewhere)


class _FakeHub(BaseHTTPRequestHandler):
    """The part of the hub's HTTP protocol a snapshot download uses: the revision's file list, then a
    HEAD (metadata) and a GET per file."""

    files: dict[str, bytes] = {}
    commit = ""
    requests: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def _file(self) -> tuple[str, bytes] | None:
        prefix = f"/{HUB_REPO}/resolve/"
        if not self.path.startswith(prefix):
            return None
        name = self.path[len(prefix):].split("/", 1)[1].split("?")[0]
        return (name, self.files[name]) if name in self.files else None

    def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool = False) -> None:
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.requests.append("HEAD " + self.path)
        self._get(head=True)

    def do_GET(self) -> None:
        self.requests.append("GET " + self.path)
        self._get(head=False)

    def _get(self, head: bool) -> None:
        path = self.path.split("?")[0]
        if path.startswith(f"/api/models/{HUB_REPO}/tree/"):  # the revision's files, one page
            tree = [{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                    for n, d in sorted(self.files.items())]
            return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
        if path.startswith(f"/api/models/{HUB_REPO}"):  # the repo at a revision
            info = {"id": HUB_REPO, "sha": self.commit, "siblings": [{"rfilename": n} for n in sorted(self.files)]}
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
        found = self._file()
        if found is None:
            return self._send(404, b'{"error": "not found"}', {"X-Error-Code": "EntryNotFound"}, head)
        name, data = found
        return self._send(200, data, {"X-Repo-Commit": self.commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                                      "Content-Type": "application/octet-stream"}, head)


HUB_REPO = "kvserve-test/from-hub"


def test_a_repo_missing_from_the_cache_is_downloaded_where_the_hub_is_reachable(model_dirs, tmp_path, monkeypatch):
    source = Path(model_dirs["llama"])
    files = {str(p.relative_to(source)): p.read_bytes() for p in source.rglob("*") if p.is_file()}
    files["pytorch_model.bin"] = b"not read by the engine: never downloaded"
    _FakeHub.files, _FakeHub.commit, _FakeHub.requests = files, "c" * 40, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}"  # what HF_ENDPOINT sets when the library loads
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        path = resolve_model(HUB_REPO)
        assert path.name == "c" * 40 and path.is_relative_to(tmp_path / "cache")
        assert sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) == \
            sorted(n for n in files if n != "pytorch_model.bin")
        assert (path / "model.safetensors").read_bytes() == files["model.safetensors"]
        downloads = len(_FakeHub.requests)
        assert resolve_model(HUB_REPO) == path  # now cached: the hub is not asked again
        assert len(_FakeHub.requests) == downloads
    finally:
        server.shutdown()
        server.server_close()


def test_a_hub_that_cannot_be_reached_is_one_clear_error(tmp_path, monkeypatch):
    endpoint = "http://127.0.0.1:9"  # nothing listens there
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    start = time.monotonic()
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("kvserve-test/unreachable")
    assert time.monotonic() - start < 30
    message = str(error.value)
    assert message.startswith("model 'kvserve-test/unreachable' is not a directory, nor in the Hugging Face cache")
    assert "could not be downloaded" in message and "\n" not in message
