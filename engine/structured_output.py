"""Constrained decoding, the engine's side: compiled grammars (cached per constraint), one matcher per
constrained request, and the token bitmask of each step.

The grammar library runs in this process, beside the scheduler: the scheduler knows every
request's accepted tokens, so it advances the matchers (only after a step succeeded) and fills the
step's bitmask rows, which travel in the ``SchedulerOutput`` to the sampling rank as plain data.
The ranks hold no grammar state, so preemption, a failed step and rebuilt ranks need no grammar
rollback. The backend (``workers.structured_output``, which imports torch) is loaded by name on the
first constrained request: an engine that never sees one never loads it.

Compilation runs on a small thread pool, off the step loop, and a request enters the scheduler
only once its grammar compiled; a constraint that does not compile raises ValueError at admission.
Before anything parses, hashes or compiles a constraint, its size, nesting and counts are checked
against the engine's bounds (``engine.structured_bounds``). A compile that nobody waits for any more
(its requests aborted or timed out) is cancelled if it has not started; a started one runs to its end
(native code cannot be stopped; it releases the GIL, and the bounds keep its length in check) and
counts as pending until then, so ``max_pending`` bounds the threads and the queue it all takes.
"""

from __future__ import annotations

import importlib
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError  # not the builtin TimeoutError on 3.10

from engine.sampling_params import StructuredOutputsParams
from engine.structured_bounds import StructuredOutputBounds

BACKENDS = {"xgrammar": "workers.structured_output:XgrammarBackend"}


def _load(target: str):
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise RuntimeError(f"the structured output backend {target} is not available: {exc}") from exc
    return getattr(module, class_name)


class CompileQueueFullError(RuntimeError):
    """As many compiles as the engine allows are queued or running; a new one is refused (overload)."""


def cache_key(params: StructuredOutputsParams) -> tuple:
    """(kind, spec) with the spec in a canonical form: a schema's key order does not matter."""
    kind = params.kind
    if kind == "json":
        spec = params.json
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError:
                return kind, params.json
        return kind, json.dumps(spec, sort_keys=True, separators=(",", ":"))
    if kind == "json_object":
        return kind, True
    return kind, getattr(params, kind)


def compile_queue_message(timeout_s: float, threads: int) -> str:
    """A compile that never started within the timeout: the engine is busy (503), not the client's fault."""
    return (f"the structured output constraint waited more than structured_output_compile_timeout_s={timeout_s:g} s "
            f"for one of the structured_output_compile_threads={threads} compile threads; retry later.")


def compile_started_at(future: Future) -> float | None:
    """When the compile of ``future`` started (``time.monotonic()``); None while it is queued."""
    return future.compile_started[0]


def compile_timeout_message(timeout_s: float) -> str:
    return (f"the structured output constraint did not compile within structured_output_compile_timeout_s="
            f"{timeout_s:g} s; make it smaller or shallower.")


class StructuredOutputManager:
    """Compiled grammars and matchers of one engine (one tokenizer). ``max_cached`` compiled grammars
    are kept, least recently used evicted; a failed compilation is cached too (it would fail again)."""

    @classmethod
    def from_config(cls, tokenizer, config) -> StructuredOutputManager:
        """The manager of an engine with ``config`` (an ``EngineConfig``): its bounds and compile settings."""
        bounds = StructuredOutputBounds(config.structured_output_max_length, config.structured_output_max_depth,
                                        config.structured_output_max_count)
        return cls(tokenizer, config.model.vocab_size, config.model.eos_token_ids, bounds=bounds,
                   compile_threads=config.structured_output_compile_threads,
                   max_pending=config.structured_output_max_pending_compiles,
                   compile_timeout_s=config.structured_output_compile_timeout_s)

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, *, backend: str = "xgrammar",
                 compile_threads: int = 2, max_cached: int = 256, bounds: StructuredOutputBounds | None = None,
                 max_pending: int | None = None, compile_timeout_s: float | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.backend_name = backend
        self.compile_threads = compile_threads
        self.max_cached = max_cached
        self.bounds = bounds or StructuredOutputBounds()
        self.max_pending = max_pending  # compiles queued or running at once (None: unbounded)
        self.compile_timeout_s = compile_timeout_s  # how long ``compile`` waits (None: until it is done)
        self._backend = None
        # guards the cache, the pending compiles and the backend's creation (reentrant: a cancel runs _done)
        self._lock = threading.RLock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._pending: dict[Future, list] = {}  # compile not done -> [its cache key, requests waiting for it]
        self._pool: ThreadPoolExecutor | None = None
        self.num_compiled = 0  # grammars compiled (cache misses)
        self.compile_time_s = 0.0  # their total compile time

    @property
    def backend(self):
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    cls = _load(BACKENDS[self.backend_name])
                    self._backend = cls(self.tokenizer, self.vocab_size, self.stop_token_ids, self.compile_threads)
        return self._backend

    # --- compilation (any thread) -------------------------------------------------------------------

    def compile_async(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar of ``params`` (already done on a cache hit); its exception
        is a ValueError when the constraint does not compile. ValueError at once when the constraint
        exceeds a bound; CompileQueueFullError when it needs a new compile and ``max_pending`` are
        queued or running. The caller waits for the future: ``release`` it if it stops waiting."""
        self.bounds.check(params.kind, getattr(params, params.kind))
        key = cache_key(params)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                if future in self._pending:
                    self._pending[future][1] += 1
                return future
            if self.max_pending is not None and len(self._pending) >= self.max_pending:
                raise CompileQueueFullError(
                    f"{len(self._pending)} structured output grammars are already compiling "
                    f"(structured_output_max_pending_compiles={self.max_pending}); retry later")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.compile_threads, thread_name_prefix="kvserve-grammar")
            spec = params.json if params.kind == "json" else key[1]
            started: list = [None]  # the compile thread writes its start time here
            future = self._pool.submit(self._compile, params.kind, spec, started)
            future.compile_started = started
            self._pending[future] = [key, 1]
            self._cache[key] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        future.add_done_callback(self._done)
        return future

    def release(self, future: Future) -> None:
        """One waiter of ``future`` stopped waiting (its request ended); the last one cancels the
        compile if it has not started (a started compile runs on: native code cannot be stopped)."""
        with self._lock:
            entry = self._pending.get(future)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                future.cancel()  # runs _done here (not started), or nothing (running: it runs on)

    def _done(self, future: Future) -> None:
        """A compile ended (done or cancelled): no longer pending; a cancelled one leaves the cache."""
        with self._lock:
            entry = self._pending.pop(future, None)
            if entry is not None and future.cancelled() and self._cache.get(entry[0]) is future:
                del self._cache[entry[0]]

    @property
    def num_pending(self) -> int:
        """Compiles queued or running."""
        return len(self._pending)

    def compile(self, params: StructuredOutputsParams, timeout_s: float | None = None):
        """The compiled grammar of ``params``, waiting for it (at most ``timeout_s`` from when its
        compile starts); ValueError if it does not compile or exceeds a bound, or its compile takes
        longer than the timeout."""
        future = self.compile_async(params)
        try:
            return self.result(future, timeout_s)
        finally:
            self.release(future)

    def result(self, future: Future, timeout_s: float | None = None):
        """Wait for ``future`` (from ``compile_async``) and return its grammar; the timeout (default
        ``compile_timeout_s``) counts from when its compile started, not the time queued before."""
        timeout_s = self.compile_timeout_s if timeout_s is None else timeout_s
        if timeout_s is None:
            return future.result()
        while compile_started_at(future) is None and not future.done():
            time.sleep(0.005)  # queued behind other compiles
        started = compile_started_at(future)
        remaining = timeout_s if started is None else started + timeout_s - time.monotonic()
        try:
            return future.result(max(0.0, remaining))
        except FutureTimeoutError:
            raise ValueError(compile_timeout_message(timeout_s)) from None

    @property
    def backend_ready(self) -> bool:
        """Whether the backend is built (at the first compile: the tokenizer's vocabulary read once, about
        2 s on the 2-core VM, more beside other work)."""
        return self._backend is not None

    def _compile(self, kind: str, spec, started: list):
        # the backend's one-time set-up is not the constraint's compile: it runs before the compile's
        # clock starts (counted in it, a trivial schema failed as "did not compile within 10 s; make it
        # smaller" on a busy node)
        backend = self.backend
        started[0] = time.monotonic()
        start = time.perf_counter()
        try:
            return backend.compile(kind, spec)
        finally:
            with self._lock:
                self.num_compiled += 1
                self.compile_time_s += time.perf_counter() - start

    # --- requests (the step's thread, under the engine's lock) --------------------------------------

    def new_matcher(self, compiled):
        """A fresh matcher of a compiled grammar (each sample of a request has its own)."""
        return self.backend.matcher(compiled)

    def fill_bitmask(self, requests: list) -> object:
        """The bitmask rows of ``requests`` (each holding a matcher), in that order, opaque here."""
        forbidden = [self._forbidden(r) for r in requests]
        return self.backend.fill_bitmask([r.grammar for r in requests], forbidden)

    @staticmethod
    def _forbidden(request) -> tuple[int, ...]:
        """Stop tokens a request may not sample yet (fewer than min_tokens out): the sampler leaves
        constrained rows to the bitmask, which keeps them allowed when nothing else is."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            return ()
        return tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(request.eos_token_ids))

    def accept(self, request, token_ids: list[int]) -> bool:
        """Advance a request's matcher over its new tokens; False if the grammar rejects one."""
        backend = self.backend
        return all(backend.accept(request.grammar, t) for t in token_ids)

    def is_terminated(self, request) -> bool:
        return self.backend.is_terminated(request.grammar)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
