"""Admission from the waiting queue: which waiting requests a step takes, with their prefix hits or forked blocks."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


def admit_waiting(scheduler: Scheduler, budget: int, num_scheduled: dict[str, int], new_reqs: list[Request],
                  only: str | None = None, slot: int | None = None, num_slots: int = 1) -> int:
    """Admit waiting requests into the step being planned, from the head of the queue, while the budget,
    ``max_num_seqs`` and the slot's share allow and their blocks fit; returns the budget left. ``only``:
    admit that request alone. n > 1 siblings whose shared prompt is not computed yet stay queued."""
    blocked: list[Request] = []  # n > 1 siblings whose shared prompt is not computed yet
    now = time.time()
    room = len(scheduler.waiting)  # requests this step may admit: all, or its slot's share
    if slot is not None and num_slots > 1:
        share = -(-(len(scheduler.running) + len(scheduler.waiting)) // num_slots)
        room = share - sum(r.slot == slot for r in scheduler.running)
    while scheduler.waiting and budget > 0 and len(scheduler.running) < scheduler.max_num_seqs and room > 0:
        request = scheduler.waiting[0]
        if only is not None and request.request_id != only:
            break
        scheduler._plan.touch(request)
        source = request.fork_source
        if source is not None and source.is_finished:
            source = request.fork_source = None
        if source is not None and source.num_computed_tokens < source.num_prompt_tokens:
            blocked.append(scheduler.waiting.popleft())
            continue
        # a request still computing prompt logprobs looks nothing up: a hit would skip their logits
        no_lookup = source is None and request.needs_prompt_logprobs
        if source is not None:
            computed, num_cached = scheduler.kv.get_forkable_blocks(request, source)
        elif no_lookup:
            computed, num_cached = [], 0
        else:
            computed, num_cached = scheduler.kv.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_cached, budget)
        if scheduler.kv.allocate_slots(request, num_new, computed, num_cached) is None:
            break
        scheduler.waiting.popleft()
        if request.num_cached_tokens < 0:  # first time scheduled; recomputation is not counted
            request.num_cached_tokens = 0 if source is not None else num_cached
            request.first_scheduled_time = now
            scheduler.stats.queue_time.observe(now - request.arrival_time)
            scheduler.stats.num_prompt_tokens += request.num_prompt_tokens
            if source is None and scheduler.kv.enable_caching and not no_lookup:
                scheduler.stats.prefix_cache_queries += request.num_tokens
                scheduler.stats.prefix_cache_hits += num_cached
        request.fork_source = None
        scheduler._num_admitted += 1
        request.admitted_step = scheduler._num_plans + 1  # this plan's id
        request.slot = slot if slot is not None else scheduler._num_admitted % scheduler.num_slots
        room -= 1
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        scheduler.running.append(request)
        scheduler._step_started.append(request)
        new_reqs.append(request)
        num_scheduled[request.request_id] = num_new
        budget -= num_new
    scheduler.waiting.extendleft(reversed(blocked))
    return budget
