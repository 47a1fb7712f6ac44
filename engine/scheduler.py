"""Continuous batching under one token budget per step.

Each step: running requests first (decodes, and the next chunk of prompts still being prefilled),
then waiting ones, until ``max_num_batched_tokens`` or ``max_num_seqs`` runs out. Prefill and decode
share the batch; a prompt longer than the remaining budget is chunked across steps. When the pool
cannot hold a running request's next tokens, the newest running request is preempted: its blocks
are freed (full ones stay in the prefix cache) and it waits at the head of the queue to be
recomputed. A request's ``num_computed_tokens`` advances when it is scheduled, so the KV of a step's
tokens counts as present once the step is planned.
"""

from __future__ import annotations

import logging

from engine.admission import admit_waiting
from engine.kv_cache_manager import KVCacheManager
from engine.kv_layout import KVLayout
from engine.messages import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from engine.metrics import SchedulerStats
from engine.plan_undo import PlanQueue, PlanUndo, undo_sent_step
from engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, *, num_kv_blocks: int, block_size: int, enable_prefix_caching: bool, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, num_host_kv_blocks: int = 0,
                 host_kv_block_bytes: int = 0, structured_outputs=None, kv_layout: KVLayout | None = None) -> None:
        self.kv = KVCacheManager(num_kv_blocks, block_size, enable_prefix_caching, num_host_kv_blocks,
                                 host_kv_block_bytes, kv_layout)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: PlanQueue = PlanQueue()  # a deque that logs a plan's changes
        self.running: list[Request] = []  # in the order they started running: the last is the newest
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._dropped_ids: set[str] = set()  # finished or preempted since the last step
        self._num_plans = 0  # the last step's id (SchedulerOutput.step_id)
        # steps in flight (engine.pipelined_steps): the slots requests split into; a request admitted by a
        # plan of every slot (one step at a time) takes them in turn
        self.num_slots = 1
        self._num_admitted = 0
        self._step_started: list[Request] = []  # requests the step being planned took from the queue
        self._plan: PlanUndo | None = None  # while a step is planned: how to undo it
        self.failed_plan_requests: list[str] = []  # the requests the last plan that raised had reached
        # constrained decoding (engine.structured_output.StructuredOutputManager): unfinished
        # constrained requests, counted so that a step without any pays nothing
        self.structured_outputs = structured_outputs
        self.num_constrained = 0
        self.grammar_failures: list[str] = []  # samples whose grammar rejected a sampled token
        self.update_failures: list[tuple[str, str]] = []  # samples whose update raised, with its name

    # --- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.grammar is not None:
            self.num_constrained += 1

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string); frees their blocks."""
        ended = set()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                ended.add(request_id)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
        if ended:
            self.running = [r for r in self.running if r.request_id not in ended]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # --- one step --------------------------------------------------------------------------------

    def schedule(self, only: str | None = None, slot: int | None = None, num_slots: int = 1) -> SchedulerOutput:
        """Plan one step. ``only``: plan that request alone (nothing else runs in the step). ``slot`` of
        ``num_slots``: with steps in flight, plan only the running requests of that slot, and admit
        into it up to its share of the unfinished requests (so they split evenly between the steps in
        flight, as vLLM's virtual engines split them). A plan that raises midway (or is interrupted) is undone whole
        (``engine.plan_undo``) before the exception goes on; ``failed_plan_requests`` then names the
        requests it had reached."""
        self.kv.begin_step()
        self.kv.release_behind_windows(self.running, self.waiting)  # before the plan, whose undo keeps it
        plan = self._plan = PlanUndo(self)
        self.kv.begin_plan(plan)
        try:
            return self._schedule(only, slot, num_slots)
        except BaseException:
            plan.apply()
            self.failed_plan_requests = plan.touched_ids
            raise
        finally:
            self.kv.end_plan()
            self._plan = self.waiting.log = None

    def _schedule(self, only: str | None, slot: int | None = None, num_slots: int = 1) -> SchedulerOutput:
        self._step_started = []
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[Request] = []
        cached_reqs: list[Request] = []
        num_preemptions_before = self.stats.num_preemptions

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if (only is not None and request.request_id != only) or (slot is not None and request.slot != slot):
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget,
                          self.max_model_len - request.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            self._plan.touch(request)
            if not self._allocate_or_preempt(request, num_new):
                break  # it preempted itself: nothing newer is left running
            (cached_reqs if request.num_tokens_sent else new_reqs).append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            i += 1

        if only is not None and only not in num_scheduled:
            request = self.requests.get(only)
            if request is not None and request.status != RequestStatus.RUNNING:
                self.waiting.remove(request)  # to the head of the queue, to be planned alone
                self.waiting.appendleft(request)
                budget = admit_waiting(self, budget, num_scheduled, new_reqs, only, slot)
        elif only is None and self.stats.num_preemptions == num_preemptions_before:
            budget = admit_waiting(self, budget, num_scheduled, new_reqs, slot=slot, num_slots=num_slots)

        output = SchedulerOutput(
            scheduled_new_reqs=[self._new_request_data(r) for r in new_reqs],
            scheduled_cached_reqs=[self._cached_request_data(r) for r in cached_reqs],
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self._dropped_ids,
        )
        self._num_plans += 1
        output.step_id = self._num_plans
        for request_id, n in num_scheduled.items():
            request = self.requests[request_id]
            request.num_computed_tokens += n
            request.scheduled_step = output.step_id
        if self.num_constrained:
            self._fill_grammar_bitmask(output)
        self._track_kv_peak()
        if num_scheduled:  # an empty step is not sent: keep the ids (and the tier copies) for the next one
            self._dropped_ids = set()
            output.kv_offloads, output.kv_restores = self.kv.take_tier_copies()
        return output

    # --- KV occupancy ---------------------------------------------------------------------------------

    def kv_occupancy(self) -> tuple[int, int]:
        """(blocks held by requests, slots in them that hold no token). Shared blocks are full ones
        (prefix hits and forks share only full blocks), so the empty slots are the tails of each
        running request's last block: no walk over the tables is needed."""
        block_size = self.kv.block_size
        empty = sum(len(self.kv.req_to_blocks.get(r.request_id, ())) * block_size - r.num_computed_tokens
                    for r in self.running)
        return self.kv.block_pool.num_used_blocks, empty

    def _track_kv_peak(self) -> None:
        used = self.kv.block_pool.num_used_blocks
        if used > self.stats.kv_peak_blocks:
            self.stats.kv_peak_blocks = used
            self.stats.kv_waste_at_peak = self.kv_occupancy()[1] / (used * self.kv.block_size)

    def _allocate_or_preempt(self, request: Request, num_new: int) -> bool:
        """Allocate ``num_new`` slots for a running request, preempting the newest running requests
        until they fit; False if ``request`` itself had to be preempted."""
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _new_request_data(self, request: Request) -> NewRequestData:
        block_ids = self.kv.get_block_ids(request.request_id)
        request.num_tokens_sent, request.num_blocks_sent = request.num_tokens, len(block_ids)
        return NewRequestData(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            window_block_ids=self.kv.window_block_ids(request.request_id),
        )

    def _cached_request_data(self, request: Request) -> CachedRequestData:
        table = self.kv.req_to_blocks[request.request_id]
        data = CachedRequestData(
            req_id=request.request_id,
            new_token_ids=request.all_token_ids[request.num_tokens_sent:],
            new_block_ids=[b.block_id for b in table[request.num_blocks_sent:]],
            num_computed_tokens=request.num_computed_tokens,
            new_window_block_ids=self.kv.window_block_ids(request.request_id, request.num_blocks_sent),
        )
        request.num_tokens_sent, request.num_blocks_sent = request.num_tokens, len(table)
        return data

    def _preempt(self, request: Request, counted: bool = True) -> None:
        if self._plan is not None:
            self._plan.touch(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_tokens_sent = request.num_blocks_sent = 0
        if counted:
            request.num_preemptions += 1
            self.stats.num_preemptions += 1
        self._dropped_ids.add(request.request_id)
        self.waiting.appendleft(request)

    def recompute_all(self) -> None:
        """The ranks were replaced and the KV pool is empty: every running request goes back to the
        head of the queue to be recomputed (keeping its tokens), and the prefix cache is forgotten."""
        while self.running:
            self._preempt(self.running.pop(), counted=False)
        self.kv.reset_prefix_cache()
        self._dropped_ids = set()  # the new ranks hold nothing to drop

    def rollback(self, scheduler_output: SchedulerOutput) -> None:
        """The step planned as ``scheduler_output`` did not run (it raised, or was interrupted): undo
        it (``engine.plan_undo.undo_sent_step``)."""
        undo_sent_step(self, scheduler_output)

    # --- after the step ---------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, finish requests that stop, free their blocks."""
        outputs = []
        any_finished = False
        self.stats.num_steps += 1
        for request_id, (first, entries) in runner_output.prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request is not None and scheduler_output.step_id and scheduler_output.step_id < request.admitted_step:
                continue  # a step of before it was (re)admitted: another request's, or of KV it recomputes
            if request is not None and request.prompt_logprobs is not None:
                request.add_prompt_logprobs(first, entries)
        for request_id, sampled, logprobs in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, runner_output.logprobs
        ):
            request = self.requests.get(request_id)
            if not sampled or request is None or request.status != RequestStatus.RUNNING:
                continue
            if scheduler_output.step_id and request.scheduled_step != scheduler_output.step_id:
                continue  # planned again since this step (preempted meanwhile): its token is stale
            try:
                output = self._update_one(request, sampled, logprobs)
            except Exception as exc:  # this request fails alone (the engine ends it), not the step
                logger.exception("appending the tokens of %r failed", request_id)
                self.update_failures.append((request_id, type(exc).__name__))
                any_finished = True  # it may have finished midway
                continue
            if output is not None:
                any_finished = any_finished or output.finish_reason is not None
                outputs.append(output)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _update_one(self, request: Request, sampled: list[int], logprobs) -> EngineCoreOutput | None:
        if request.grammar is not None and not self.structured_outputs.accept(request, sampled):
            self.grammar_failures.append(request.request_id)  # the engine fails it alone
            return None
        request.append_output_token_ids(sampled)
        self.stats.num_generation_tokens += len(sampled)
        if request.grammar is not None and self.structured_outputs.is_terminated(request):
            status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        else:
            status = self._check_stop(request)
        if status is not None:
            self._finish(request, status)
        return EngineCoreOutput(
            req_id=request.request_id,
            new_token_ids=sampled,
            new_logprobs=logprobs,
            finish_reason=status.finish_reason if status is not None else None,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=self._take_prompt_logprobs(request),
        )

    def take_update_failures(self) -> list[tuple[str, str]]:
        """Samples whose tokens could not be appended since the last call, with the exception's
        name (the caller fails their requests)."""
        failures, self.update_failures = self.update_failures, []
        return failures

    @staticmethod
    def _take_prompt_logprobs(request: Request):
        """A request's prompt logprobs, once: with its first output after they are complete."""
        if request.prompt_logprobs is None or request.prompt_logprobs_sent or request.needs_prompt_logprobs:
            return None
        request.prompt_logprobs_sent = True
        return request.prompt_logprobs

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def take_grammar_failures(self) -> list[str]:
        """Samples whose grammar rejected their sampled token since the last call (not appended; the
        caller fails their requests)."""
        failures, self.grammar_failures = self.grammar_failures, []
        return failures

    def _fill_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """The bitmask rows of the constrained requests that sample in this step (those whose
        scheduled tokens reach their last known token), from their matchers' current state."""
        sampling = [r for r in (self.requests[i] for i in output.num_scheduled_tokens)
                    if r.grammar is not None and r.num_computed_tokens == r.num_tokens]
        if sampling:
            output.grammar_req_ids = [r.request_id for r in sampling]
            output.grammar_bitmask = self.structured_outputs.fill_bitmask(sampling)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request.grammar is not None:
            request.grammar = None  # its matcher is released
            self.num_constrained -= 1
        self.kv.free(request)
        self._dropped_ids.add(request.request_id)
        del self.requests[request.request_id]
