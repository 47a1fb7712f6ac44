"""What crosses process boundaries each step, and what users get back.

Scheduler -> every rank: ``SchedulerOutput``, as diffs. A request a rank has not seen (or has dropped
after a preemption) comes once in full as ``NewRequestData``; after that only ``CachedRequestData``
(tokens and blocks added since). Rank 0 -> scheduler: ``ModelRunnerOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams

# one dict per generated token: {token_id: logprob} for the top-k tokens plus the chosen one
SampleLogprobs = list[dict[int, float]]
# one entry per prompt token: None for the first (nothing predicts it), then {token_id: (logprob, rank)}
# for the top-k tokens at that position plus the prompt's own token (rank 1 = the most likely)
PromptLogprobs = list[dict[int, tuple[float, int]] | None]


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt + whatever output exists (a request resumed after preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # a hybrid KV layout (``engine.kv_layout``): one list per window group, parallel to ``block_ids``,
    # the pages holding those blocks of the group's layers (0 where the request holds none); else []
    window_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class CachedRequestData:
    req_id: str
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int
    # a hybrid KV layout: one list per window group, parallel to ``new_block_ids``; else []
    new_window_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's plan. Requests run in the order new, then cached; ``num_scheduled_tokens[id]``
    tokens each, starting at their ``num_computed_tokens``."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished, aborted or preempted since the last step: drop their state
    # constrained decoding: row i of ``grammar_bitmask`` (the structured output backend's token
    # bitmask, opaque to the engine) holds the tokens ``grammar_req_ids[i]`` may sample this step
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: object | None = None  # None when no request that samples this step is constrained
    # host KV tier copies every rank runs before the forward, in this order: (pool block, tier slot)
    # offloads (the block may be rewritten in this step), then (tier slot, pool block) restores
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)
    kv_restores: list[tuple[int, int]] = field(default_factory=list)
    # the plan's number: with batches in flight (pipeline parallelism) a request's tokens are taken only
    # from the step that last scheduled it (one preempted and planned again since gets none from an
    # older step); 0 for a plan made by hand (tests), which every request accepts
    step_id: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # [] for a request whose prompt is still being prefilled
    logprobs: list[dict[int, float] | None]  # per request, when it asked for logprobs and sampled
    forward_time_s: float = 0.0  # model forward + logits, in the step
    execute_time_s: float = 0.0  # the whole execute_model call on rank 0
    # requests with prompt_logprobs whose step computed prompt positions: req_id -> (first position p,
    # entries for the prompt tokens p + 1, p + 2, ...)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, tuple[float, int]]]]] = field(default_factory=dict)
    # under pipeline parallelism: the time this (last) stage waited for the previous one's activations
    stage_wait_s: float = 0.0


@dataclass(frozen=True)
class StageTiming:
    """What a pipeline stage before the last answers a step with (its first rank): the time it waited
    for the previous stage's activations and the time it computed its layers."""

    stage: int
    wait_s: float
    compute_s: float


@dataclass
class EngineCoreOutput:
    """What one step did to one request (scheduler -> output processor)."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: dict[int, float] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # once, on the first output after they are complete


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    """One of the ``n`` samples of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: SampleLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = field(default=None, repr=False)
    error: str | None = None  # why the engine failed this request (it is finished, and failed alone)
    # with prompt_logprobs: every output once they are complete (a delta stream: its first such output)
    prompt_logprobs: PromptLogprobs | None = None


def merge_outputs(first: RequestOutput, second: RequestOutput, kind) -> RequestOutput:
    """Two consecutive outputs of one request as one: deltas concatenate per sample; otherwise the
    later output already carries everything."""
    if kind.value != "delta":
        return second
    samples = {s.index: s for s in first.outputs}
    for s in second.outputs:
        before = samples.get(s.index)
        if before is None:
            samples[s.index] = s
            continue
        logprobs = (before.logprobs or []) + (s.logprobs or []) if (before.logprobs or s.logprobs) else None
        samples[s.index] = CompletionOutput(s.index, before.text + s.text, before.token_ids + s.token_ids,
                                            s.finish_reason, s.stop_reason, logprobs)
    return RequestOutput(second.request_id, second.prompt, second.prompt_token_ids,
                         [samples[i] for i in sorted(samples)], second.finished, second.num_cached_tokens,
                         second.metrics, second.error,
                         second.prompt_logprobs if second.prompt_logprobs is not None else first.prompt_logprobs)
