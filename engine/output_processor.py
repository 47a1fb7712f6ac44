"""Turns per-step token outputs into user-facing ``RequestOutput``s: text, stop strings, the ``n``
samples of a request, streaming deltas, and latency metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.messages import CompletionOutput, EngineCoreOutput, RequestMetrics, RequestOutput
from engine.metrics import Histogram, RequestStats
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Sample:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens_sent: int = 0
    final_sent: bool = False
    last_token_time: float | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    samples: list[_Sample]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None  # once the first sample's prompt logprobs arrived
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass
class LatencyMetrics:
    time_to_first_token: Histogram = field(default_factory=Histogram)
    inter_token_latency: Histogram = field(default_factory=Histogram)
    e2e_latency: Histogram = field(default_factory=Histogram)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self._by_sample_id: dict[str, tuple[_RequestState, _Sample]] = {}
        self._failed: dict[str, str] = {}
        self.latency = LatencyMetrics()
        self.finished = RequestStats()  # by finish reason, with prompt and generated tokens

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sample_ids: list[str],
        arrival_time: float,
    ) -> None:
        samples = [
            _Sample(i, IncrementalDetokenizer(self.tokenizer, params, prompt_token_ids),
                    logprobs=[] if params.logprobs is not None else None)
            for i in range(len(sample_ids))
        ]
        state = _RequestState(request_id, prompt, prompt_token_ids, params.output_kind, samples,
                              RequestMetrics(arrival_time=arrival_time))
        self.requests[request_id] = state
        for sample_id, sample in zip(sample_ids, samples):
            self._by_sample_id[sample_id] = (state, sample)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns the outputs to deliver and the sample ids that a stop
        string ended (the caller finishes them in the scheduler). A request whose output cannot be
        made (its detokenizer raised) is left out and named in ``take_failed()``; the others go on."""
        now = time.time()
        touched: dict[str, _RequestState] = {}
        stopped: list[str] = []
        for out in core_outputs:
            entry = self._by_sample_id.get(out.req_id)
            if entry is None or entry[0].request_id in self._failed:
                continue
            state, sample = entry
            try:
                stop = self._apply(state, sample, out, now)
            except Exception as exc:  # noqa: BLE001 - this request fails, not the step
                self._note_failure(state, exc)
                continue
            if stop:
                stopped.append(out.req_id)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.request_id in self._failed or not self._should_emit(state):
                continue
            try:
                outputs.append(self._make_output(state, now))
            except Exception as exc:  # noqa: BLE001
                self._note_failure(state, exc)
        return outputs, stopped

    def _apply(self, state: _RequestState, sample: _Sample, out: EngineCoreOutput, now: float) -> bool:
        """One sample's new tokens; True when a stop string ended it before the scheduler did."""
        self._observe_token(state, sample, now, len(out.new_token_ids))
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        sample.token_ids.extend(out.new_token_ids)
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = out.prompt_logprobs
        if sample.logprobs is not None and out.new_logprobs is not None:
            sample.logprobs.append(out.new_logprobs)
        stop_string = sample.detokenizer.update(out.new_token_ids, out.finish_reason == "stop")
        stopped = False
        if stop_string is not None:  # it cut the text, so it is the reason even on the last token
            sample.finish_reason, sample.stop_reason = "stop", stop_string
            stopped = out.finish_reason is None
        elif out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        if sample.finish_reason is not None:
            del self._by_sample_id[out.req_id]
        return stopped

    def _note_failure(self, state: _RequestState, exc: Exception) -> None:
        logger.error("making the output of request %r failed", state.request_id, exc_info=exc)
        self._failed.setdefault(state.request_id, type(exc).__name__)

    def take_failed(self) -> dict[str, str]:
        """Requests whose outputs could not be made since the last call: request id -> the
        exception's name. The caller ends them (``fail``)."""
        failed, self._failed = self._failed, {}
        return failed

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request from outside; returns its final output (finish reason "abort")."""
        state = self._end(request_id, "abort")
        return None if state is None else self._make_output(state, time.time())

    def fail(self, request_id: str, error: str) -> RequestOutput | None:
        """End a request the engine could not run; its final output carries ``error`` and its
        unfinished samples finish with reason "error"."""
        state = self._end(request_id, "error")
        if state is None:
            return None
        try:
            output = self._make_output(state, time.time())
        except Exception:  # noqa: BLE001 - its text cannot be made: the tokens alone
            self.requests.pop(request_id, None)
            output = RequestOutput(request_id, state.prompt, state.prompt_token_ids,
                                   [CompletionOutput(x.index, "", list(x.token_ids), x.finish_reason, x.stop_reason)
                                    for x in state.samples], True, state.num_cached_tokens, state.metrics)
        output.error = error
        return output

    def _end(self, request_id: str, reason: str) -> _RequestState | None:
        """Finish a request's unfinished samples with ``reason`` and forget its sample ids; its state,
        or None if it is unknown."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.finish_reason = reason
        self._by_sample_id = {k: v for k, v in self._by_sample_id.items() if v[0] is not state}
        return state

    def request_id_of(self, sample_id: str) -> str | None:
        entry = self._by_sample_id.get(sample_id)
        return entry[0].request_id if entry is not None else None

    def sample_ids_of(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return [k for k, (s, _) in self._by_sample_id.items() if s is state] if state else []

    def _observe_token(self, state: _RequestState, sample: _Sample, now: float, count: int) -> None:
        """Time to first token once per request; inter-token latency per sample, between its own
        consecutive tokens (the n samples of a request advance in the same steps)."""
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self.latency.time_to_first_token.observe(now - metrics.arrival_time)
        if count:
            if sample.last_token_time is not None:
                self.latency.inter_token_latency.observe(now - sample.last_token_time)
            sample.last_token_time = now
        metrics.last_token_time = now

    def _should_emit(self, state: _RequestState) -> bool:
        return state.output_kind != RequestOutputKind.FINAL_ONLY or state.finished

    def _make_output(self, state: _RequestState, now: float) -> RequestOutput:
        finished = state.finished
        delta = state.output_kind == RequestOutputKind.DELTA
        outputs = []
        for sample in state.samples:
            done = sample.finish_reason is not None
            if delta:
                if sample.final_sent:
                    continue
                new_tokens = sample.token_ids[sample.num_tokens_sent:]
                text = sample.detokenizer.take_delta(done)
                if not new_tokens and not text and not done:
                    continue
                logprobs = sample.logprobs[sample.num_tokens_sent:] if sample.logprobs is not None else None
                sample.num_tokens_sent, sample.final_sent = len(sample.token_ids), done
            else:
                new_tokens, logprobs = list(sample.token_ids), sample.logprobs
                text = sample.detokenizer.visible_text(done)
            outputs.append(CompletionOutput(sample.index, text, new_tokens, sample.finish_reason,
                                            sample.stop_reason, logprobs))
        if finished:
            state.metrics.finished_time = now
            self.latency.e2e_latency.observe(now - state.metrics.arrival_time)
            for sample in state.samples:
                self.finished.observe(sample.finish_reason, len(state.prompt_token_ids), len(sample.token_ids))
            del self.requests[state.request_id]
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:  # a delta stream carries them once
            prompt_logprobs = None if state.prompt_logprobs_sent else prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs, finished,
                             state.num_cached_tokens, state.metrics, prompt_logprobs=prompt_logprobs)
