"""A request as the scheduler sees it: tokens, progress, status, and its block hashes."""

from __future__ import annotations

import enum
import time

from engine.block_hash import ROOT_BLOCK_HASH, BlockHash, hash_blocks
from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # finished states come last: status > PREEMPTED <=> finished
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # a step failed on this request alone

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated.

    ``all_token_ids`` is prompt + output. ``num_computed_tokens`` counts the tokens whose KV is in the
    pool (or is being written by the step just scheduled). ``block_hashes`` covers every full block of
    ``all_token_ids`` and grows as tokens are appended.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: frozenset[int],
        block_size: int,
        max_tokens: int,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        fork_source: Request | None = None,
        long_rope_from: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.first_scheduled_time: float | None = None
        # n > 1: the sibling whose computed prompt blocks this request shares once they exist
        self.fork_source = fork_source

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache, set when first scheduled
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # what the workers hold of this request (the scheduler sends only what is new)
        self.num_tokens_sent = 0
        self.num_blocks_sent = 0
        self.scheduled_step = 0  # the id of the last step that scheduled it (SchedulerOutput.step_id)
        self.slot = 0  # with steps in flight, the ones it runs in (Scheduler.schedule(slot=...))
        self.admitted_step = 0  # the id of the step that last took it from the queue
        # constrained decoding: this sample's grammar matcher (opaque, from the structured output
        # backend), advanced with every accepted token; None when unconstrained or once finished
        self.grammar = None
        # prompt_logprobs: one entry per prompt token computed so far (the first token's is None); a
        # request whose list is short of its prompt takes no prefix-cache hit (they need the logits)
        self.prompt_logprobs: list | None = [None] if sampling_params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False

        self._block_size = block_size
        # a prompt past LongRoPE's original length is rotated with the long factors (engine.config.long_rope_threshold)
        self.long_rope = long_rope_from is not None and self.num_prompt_tokens > long_rope_from
        self.block_hashes: list[BlockHash] = hash_blocks(self.all_token_ids, block_size, cache_salt,
                                                         long_rope=self.long_rope)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are still to be computed (a prefix hit would skip their logits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def add_prompt_logprobs(self, first: int, entries: list) -> None:
        """Entries for prompt tokens ``first + 1``, ...; positions already held (a recomputation) are skipped."""
        have = len(self.prompt_logprobs)
        if first + 1 <= have:
            self.prompt_logprobs.extend(entries[have - first - 1:])

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        """Append sampled tokens and hash every block they complete."""
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if len(self.all_token_ids) >= (len(self.block_hashes) + 1) * self._block_size:
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_BLOCK_HASH
            self.block_hashes.extend(hash_blocks(
                self.all_token_ids, self._block_size, self.cache_salt, parent, len(self.block_hashes), self.long_rope
            ))

    def block_token_ids(self, index: int) -> tuple[int, ...]:
        """The token ids of full block ``index``."""
        return tuple(self.all_token_ids[index * self._block_size:(index + 1) * self._block_size])

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
