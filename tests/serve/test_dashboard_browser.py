"""/dashboard in a real headless browser (Debian's ``chromium``, driven over the DevTools protocol):
the app served by uvicorn over a real engine with a host KV tier, requests finished and three held
in flight; the page asks for the key (and asks again when it is refused, or takes it from the URL
fragment), then draws the map without a console error; the counts it shows (and the pixels it
draws) match /metrics read at the same moment, and again after a request ends; a screenshot is
written.

Needs ``chromium`` on PATH or in $CHROMIUM (Debian/Ubuntu: ``apt-get install chromium``); skipped
without it, unless KVSERVE_REQUIRE_CHROMIUM=1 (CI), where its absence fails the test. With
$KVSERVE_SCREENSHOT_DIR set, the screenshot is also copied there as kv_map.png
(``KVSERVE_SCREENSHOT_DIR=docs/images`` refreshes the one in the docs)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.serve.dashboard_harness import (API_KEY, assert_counts_match_metrics, dash_app, engine_paused,  # noqa: F401
                                           metric, monitor, requests_in_flight)
from tests.e2e.prompts import corpus_ids
from tests.serve.openai_harness import MODEL, REPLICA, model_dir, prompts, run, until_clean  # noqa: F401
from tests.serve.serve_harness import free_port

CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
NO_CHROMIUM = "needs Debian's chromium on PATH or in $CHROMIUM (apt-get install chromium)"
# CI sets KVSERVE_REQUIRE_CHROMIUM=1: there a missing browser fails the test instead of skipping it
pytestmark = pytest.mark.skipif(CHROMIUM is None and os.environ.get("KVSERVE_REQUIRE_CHROMIUM") != "1",
                                reason=NO_CHROMIUM)

# the page's state colours (api/static/dashboard.html's --free, --cached, --used, --shared)
COLOURS = {"free": (0xE3, 0xE7, 0xEE), "cached": (0x7F, 0xB2, 0xE5), "used": (0xF0, 0xA0, 0x4B),
           "shared": (0xD6, 0x45, 0x41)}
WIDTH = 1280
HOST_BLOCKS = 128  # the engine's host KV tier


@pytest.fixture(scope="module")
def llm(model_dir, run):  # the harness's engine, with a host tier
    from engine import AsyncLLM, engine_config

    engine = AsyncLLM(engine_config(model_dir, num_kv_blocks=400, num_host_kv_blocks=HOST_BLOCKS))
    yield engine
    engine.shutdown()


class DevTools:
    """One headless chromium and a DevTools session on its first page. Events are kept in order;
    ``errors()`` lists console errors, uncaught exceptions and error log entries (failed loads, CSP)."""

    def __init__(self, binary: str, profile: Path, log: Path) -> None:
        import websocket

        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--remote-debugging-port=0", f"--user-data-dir={profile}", "--no-first-run",
                 "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--force-device-scale-factor=1",
                 f"--window-size={WIDTH},900", "about:blank"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            port_file = profile / "DevToolsActivePort"
            deadline = time.monotonic() + 60
            while not (port_file.exists() and port_file.read_text().strip()):
                assert self.proc.poll() is None, f"chromium exited: {log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, "chromium never opened its DevTools port"
                time.sleep(0.05)
            port = int(port_file.read_text().split()[0])
            pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
            self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], suppress_origin=True, timeout=30)
            self.next_id = 0
            self.events: list[dict] = []
            for domain in ("Runtime", "Log", "Page", "Network"):
                self.call(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                assert "error" not in message, (method, message["error"])
                return message["result"]
            self.events.append(message)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while True:  # the page may still be loading: a throw is a "not yet"
            value = self.evaluate(f"(() => {{ try {{ return ({expression}); }} catch (e) {{ return false; }} }})()")
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {what}; errors: {self.errors()}"
            time.sleep(0.05)

    def errors(self, since: int = 0) -> list[str]:
        """The errors among the events from the ``since``-th on."""
        found = []
        for event in self.events[since:]:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                found.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
            elif method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                found.append("exception: " + details.get("exception", {}).get("description", details["text"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                found.append(f"log ({params['entry']['source']}): {params['entry']['text']}")
        return found

    def requested(self, fragment: str, since: int = 0) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events[since:]
                if e.get("method") == "Network.requestWillBeSent" and fragment in e["params"]["request"]["url"]]

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            try:
                ws.close()
            except Exception:  # noqa: BLE001 - the browser is going away anyway
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)


def pixel_counts(png: bytes, box: dict) -> dict[str, int]:
    """Pixels of each state colour inside ``box`` (css pixels at scale 1) of a screenshot."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    region = image.crop((round(box["x"]), round(box["y"]), round(box["x"] + box["width"]),
                         round(box["y"] + box["height"])))
    by_colour = {colour: n for n, colour in region.getcolors(maxcolors=1 << 20)}
    return {state: by_colour.get(colour, 0) for state, colour in COLOURS.items()}


DOM_READ = """(() => {
  const section = document.querySelector('section.replica');
  const counts = {};
  for (const el of section.querySelectorAll('[data-count]')) counts[el.dataset.count] = Number(el.textContent);
  const rows = [...section.querySelectorAll('.prefixes tbody tr')].map((tr) => [...tr.children].map((td) => td.textContent));
  const box = section.querySelector('canvas.grid').getBoundingClientRect();
  return {replica: section.dataset.replica, counts, running: Number(section.dataset.running),
          waiting: Number(section.dataset.waiting), hitRate: Number(section.dataset.hitRate),
          kvUsage: Number(section.dataset.kvUsage), rows,
          usagePath: section.querySelector('svg[data-series=kv_usage] path.value:not(.second)').getAttribute('d'),
          hostShown: section.querySelector('li[data-state=host]').offsetParent !== null,
          box: {x: box.x + scrollX, y: box.y + scrollY, width: box.width, height: box.height},
          height: document.documentElement.scrollHeight};
})()"""


def test_the_page_in_chromium_matches_metrics(dash_app, llm, model_dir, prompts, monitor, run, tmp_path):
    import uvicorn

    assert CHROMIUM is not None, f"KVSERVE_REQUIRE_CHROMIUM=1: {NO_CHROMIUM}"

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    shared = prompts[3][:300]
    in_flight = [prompts[3], prompts[4], shared + prompts[2][:25]]  # 300 shared tokens: 18 full blocks
    # two more, aborted once the engine stands still, for free blocks on the map: the pool hands out
    # blank blocks (freed without a hash) first, so after the cycle below fills it nothing else stays
    # free. Their lengths differ by 8 and they decode in step, so one of them has a partial last block.
    ids = corpus_ids(f"{model_dir}/tokenizer.json")
    in_flight += [list(ids[16000:16020]), list(ids[16100:16128])]

    def browse() -> dict:
        """In a thread (the event loop serves the app meanwhile); the engine stands still."""
        browser = DevTools(CHROMIUM, tmp_path / "profile", tmp_path / "chromium.log")
        try:
            browser.call("Page.navigate", url=f"{base}/dashboard")
            browser.wait_for("document.body.dataset.status === 'ok' && !document.getElementById('key-form').hidden",
                             "the page to ask for the key")
            asked_before_polling = not browser.requested("/dashboard/data")
            submit = "document.getElementById('key-input').value = {}; document.getElementById('key-form').requestSubmit()"
            browser.evaluate(submit.format(json.dumps("sk-wrong")))
            browser.wait_for("!document.getElementById('key-form').hidden && "
                             "document.getElementById('key-why').textContent.includes('refused')", "the key refused")
            refused = browser.errors()  # the browser logs the 401 itself
            mark = len(browser.events)
            browser.evaluate(submit.format(json.dumps(API_KEY)))
            browser.wait_for("Number(document.body.dataset.polls || 0) >= 2", "two polls")
            polls = browser.requested("/dashboard/data", since=mark)
            dom = browser.evaluate(DOM_READ)
            metrics_text = httpx.get(f"{base}/metrics", timeout=30).text
            data = httpx.get(f"{base}/dashboard/data", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
            browser.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=dom["height"], deviceScaleFactor=1,
                         mobile=False)
            time.sleep(0.3)  # one frame at the new size
            dom = browser.evaluate(DOM_READ)  # the layout is the same; the box is read again at this size
            png = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
            # live: one request ends while the engine stands still; the page's next polls show it
            polls_before = int(browser.evaluate("document.body.dataset.polls"))
            llm.core.abort_request("in-flight-2")
            browser.wait_for(f"Number(document.body.dataset.polls) >= {polls_before + 2}", "two polls after an abort")
            live = browser.evaluate(DOM_READ)
            live_metrics = httpx.get(f"{base}/metrics", timeout=30).text
            live_data = httpx.get(f"{base}/dashboard/data", headers={"Authorization": f"Bearer {API_KEY}"},
                                  timeout=30).json()
            errors = browser.errors(since=mark)
            # the capture sees what it must: a console error and an uncaught exception, made on purpose
            browser.evaluate("console.error('probe-console'); setTimeout(() => { throw new Error('probe-throw'); }, 0); 1")
            time.sleep(0.3)
            browser.evaluate("1")  # collect the events the probes raised
            probes = [e for e in browser.errors() if "probe-" in e]
            # a fresh load with the key in the URL fragment (this tab's stored key cleared first)
            browser.evaluate("sessionStorage.clear(); 1")
            browser.call("Page.navigate", url="about:blank")
            loaded = len(browser.events)
            browser.call("Page.navigate", url=f"{base}/dashboard#key={API_KEY}")
            browser.wait_for("Number(document.body.dataset.polls || 0) >= 1", "a poll with the fragment's key")
            by_fragment = browser.evaluate("({hash: location.hash, shown: Number(document.querySelector("
                                           "'[data-count=shared]').textContent), form: !document.getElementById('key-form').hidden})")
            return {"live": live, "live_metrics": live_metrics, "live_data": live_data, "asked": asked_before_polling, "polls": polls, "dom": dom, "metrics": metrics_text, "data": data,
                    "png": png, "errors": errors, "probes": probes, "refused": refused, "by_fragment": by_fragment,
                    "fragment_errors": browser.errors(since=loaded)}
        finally:
            browser.close()

    async def main():
        server = uvicorn.Server(uvicorn.Config(dash_app, host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="off"))
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                await asyncio.sleep(0.02)
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"},
                                         timeout=60) as http:
                # 14 distinct prompts of 32 blocks cycle the 399-block pool: the oldest cached blocks are
                # evicted into the host tier; the last ones stay cached
                cycle = [list(ids[9000 + 500 * k:9500 + 500 * k]) for k in range(14)]
                for prompt in cycle:
                    response = await http.post("/v1/completions", json={
                        "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
                    assert response.status_code == 200, response.text
            async with requests_in_flight(llm, in_flight, max_tokens=1500):
                await asyncio.sleep(1.5)  # a few history samples while they run
                async with engine_paused(llm):
                    llm.core.abort_request("in-flight-3")
                    llm.core.abort_request("in-flight-4")
                    seen = await asyncio.to_thread(browse)
            await until_clean(llm)
        finally:
            server.should_exit = True
            await serving
        return seen

    seen = run(main())
    shot = tmp_path / "kv_map.png"
    shot.write_bytes(seen["png"])
    if os.environ.get("KVSERVE_SCREENSHOT_DIR"):
        target = Path(os.environ["KVSERVE_SCREENSHOT_DIR"]) / "kv_map.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target)

    assert seen["errors"] == [], seen["errors"]
    assert len(seen["probes"]) == 2, seen["probes"]  # the console capture works
    assert seen["asked"], "the page polled before it had the key"
    assert len(seen["refused"]) == 1 and "401" in seen["refused"][0], seen["refused"]
    assert seen["fragment_errors"] == [], seen["fragment_errors"]
    assert seen["by_fragment"]["hash"] == "" and not seen["by_fragment"]["form"]  # the key left the address bar
    first, second = seen["polls"][:2]
    assert "since=" not in first and "since=" in second and "known=" in second  # later polls are incremental

    dom, data, metrics_text = seen["dom"], seen["data"], seen["metrics"]
    (replica,) = data["replicas"]
    assert dom["replica"] == REPLICA
    shown = {state: dom["counts"][state] for state in COLOURS}
    assert shown == replica["counts"]  # the grid the page decoded is the engine's
    assert_counts_match_metrics(replica, metrics_text, shown)
    assert dom["running"] == metric(metrics_text, "kvserve:num_requests_running") == 3
    assert dom["waiting"] == metric(metrics_text, "kvserve:num_requests_waiting") == 0
    assert dom["hitRate"] == metric(metrics_text, "kvserve:prefix_cache_hit_rate") > 0
    assert dom["kvUsage"] == metric(metrics_text, "kvserve:kv_cache_usage_perc") > 0
    assert all(shown[state] > 0 for state in COLOURS), shown  # every state on the map
    # after the abort: one request fewer, its blocks released, the page redrawn to /metrics' numbers
    live, (live_replica,) = seen["live"], seen["live_data"]["replicas"]
    live_shown = {state: live["counts"][state] for state in COLOURS}
    assert live_shown == live_replica["counts"] and live_shown["used"] < shown["used"]
    assert_counts_match_metrics(live_replica, seen["live_metrics"], live_shown)
    assert live["running"] == metric(seen["live_metrics"], "kvserve:num_requests_running") == 2
    assert live["rows"][0][1:4] == [str(300 // 16), str(300 // 16 * 16), "2"]
    assert seen["by_fragment"]["shown"] == live_shown["shared"]
    top = dom["rows"][0]
    assert top[1:4] == [str(300 // 16), str(300 // 16 * 16), "3"]  # 18 blocks, 288 tokens, 3 requests
    assert dom["usagePath"].startswith("M") and "L" in dom["usagePath"]
    tier = replica["host_tier"]
    assert dom["hostShown"] and tier["num_blocks"] == HOST_BLOCKS == metric(metrics_text, "kvserve:host_kv_cache_blocks")
    assert 0 < dom["counts"]["host"] == tier["num_used"]
    assert tier["num_used"] / tier["num_blocks"] == metric(metrics_text, "kvserve:host_kv_cache_usage_perc")

    # the pixels: each block is one square of the state's colour, (cell - 1)^2 pixels with its gap
    png = seen["png"]
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = pixel_counts(png, dom["box"])
    cells = {state: pixels[state] / shown[state] for state in COLOURS}
    side = round(cells["free"] ** 0.5)
    assert side >= 2 and all(n == side * side for n in cells.values()), (pixels, shown)
