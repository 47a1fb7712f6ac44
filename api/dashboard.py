"""The live KV-cache map: the page at ``/dashboard`` and its data at ``/dashboard/data``.

The page (``api/static/dashboard.html``, one self-contained file: no request leaves the server it
came from) loads without a key; where the app has an API key it asks for one (or takes it from the
URL fragment, ``/dashboard#key=<key>``, which the browser never sends) and sends it as a Bearer
token to the data endpoint, which requires it like every other route.

``GET /dashboard/data`` answers, per engine replica, the snapshot of ``engine/kv_map.py``::

    {"object": "kv_map", "time": <the Ingress's clock>, "poll_interval_s": 1.5,
     "replicas": [{"replica": <name>, ...the engine's snapshot...}, ...]}     (sorted by replica)

Query parameters keep each poll small: ``since`` (a time: only history samples taken after it) and
``known`` (comma-separated ``grid_id`` values the viewer already holds: those grids come back as
null). Bodies over 1 KB are gzip-compressed for clients that accept it.

Polls that arrive while the engines' snapshots are being gathered wait for that gathering and share
it; each engine in turn reuses its snapshot for a second (``engine/kv_map.py``), so many viewers cost
the engines one build per interval.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from functools import lru_cache
from pathlib import Path

from fastapi import Query, Request
from fastapi.responses import HTMLResponse, Response

from api.errors import OpenAIError

PAGE = Path(__file__).with_name("static") / "dashboard.html"
POLL_INTERVAL_S = 1.5
GZIP_MIN_BYTES = 1024
MAX_KNOWN = 64  # grid ids a viewer can name (one per replica it draws)
# the page needs nothing from elsewhere: a policy that refuses anything else makes that checkable
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                           "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'")


@lru_cache(maxsize=2)
def page_html(auth_required: bool) -> str:
    """The page, told whether the data endpoint wants a key (so it asks before its first poll)."""
    html = PAGE.read_text(encoding="utf-8")
    if "__AUTH_REQUIRED__" not in html:
        raise RuntimeError(f"{PAGE} lacks its __AUTH_REQUIRED__ marker")
    return html.replace("__AUTH_REQUIRED__", "true" if auth_required else "false")


def kv_map_body(snapshots: dict, *, since: float | None = None, known: frozenset[str] = frozenset(),
                now: float | None = None) -> dict:
    """The data endpoint's body from each replica's ``KVMonitor.snapshot()`` (history already cut at
    ``since`` by the caller or not: samples at or before ``since`` are dropped here)."""
    replicas = []
    for name in sorted(snapshots):
        snapshot = dict(snapshots[name])
        if snapshot.get("grid_id") in known:
            snapshot["grid"] = None
        history = snapshot.get("history")
        if since is not None and history and history.get("t"):
            keep = [i for i, t in enumerate(history["t"]) if t > since]
            if len(keep) != len(history["t"]):
                history = {k: ([v[i] for i in keep] if isinstance(v, list) else v) for k, v in history.items()}
                snapshot["history"] = history
        replicas.append({"replica": str(name), **snapshot})
    return {"object": "kv_map", "time": round(time.time() if now is None else now, 3),
            "poll_interval_s": POLL_INTERVAL_S, "replicas": replicas}


def _known_ids(known: str) -> frozenset[str]:
    ids = [k for k in known.split(",") if k]
    if len(ids) > MAX_KNOWN or any(len(k) > 32 or not k.isalnum() for k in ids):
        raise OpenAIError.bad_request(f"known must be at most {MAX_KNOWN} comma-separated grid ids "
                                      f"(letters and digits, up to 32 each)", "known")
    return frozenset(ids)


async def gather_shared(state) -> dict:
    """``state.kv_map()``, one call at a time: a poll that arrives while one runs waits for it and
    shares its answer (or its error). A poll that goes away does not cancel the others' call."""
    pending = getattr(state, "kv_map_pending", None)
    if pending is None or pending.done():
        pending = state.kv_map_pending = asyncio.ensure_future(state.kv_map())
    return await asyncio.shield(pending)


# --- routes (module-level: see api/http_app.py) -------------------------------------------------------


async def dashboard_page(request: Request) -> Response:
    return HTMLResponse(page_html(request.app.state.api_key is not None), headers={
        "Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache",
        "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff"})


async def dashboard_data(request: Request, since: float | None = Query(None, allow_inf_nan=False),
                         known: str = Query("", max_length=4096)) -> Response:
    known_ids = _known_ids(known)
    snapshots = await gather_shared(request.app.state)
    body = json.dumps(kv_map_body(snapshots, since=since, known=known_ids), separators=(",", ":")).encode()
    headers = {"Cache-Control": "no-store", "Vary": "Accept-Encoding"}
    if len(body) >= GZIP_MIN_BYTES and "gzip" in request.headers.get("accept-encoding", ""):
        body = gzip.compress(body, compresslevel=6)
        headers["Content-Encoding"] = "gzip"
    return Response(body, media_type="application/json", headers=headers)
