"""RequestStatus holds statuses only: the prompt-logprob helpers are Request's."""

from __future__ import annotations

from engine.request import Request, RequestStatus


def test_prompt_logprob_helpers_live_on_request_not_on_the_status_enum():
    for name in ("needs_prompt_logprobs", "add_prompt_logprobs"):
        assert name not in vars(RequestStatus)
        assert name in vars(Request)
    assert RequestStatus.FINISHED_ERROR.is_finished and not RequestStatus.PREEMPTED.is_finished
    assert RequestStatus.FINISHED_ERROR.finish_reason == "error"
