"""Hugging Face transformers as benchmark peers, on the same workloads and records as kvserve:

* ``run_hf_static``: ``model.generate`` on static batches of left-padded prompts, the baseline a user
  would start from;
* ``run_hf_continuous``: HF's own continuous batching over a paged KV cache (the manager behind
  ``model.generate_batch``), with its default configuration.

Both decode greedily in float32 with EOS disabled, so each request gets exactly its ``output_len``
tokens, and run a multi-turn workload round by round: round k is submitted once round k-1 has
finished, which is also when its requests count as arrived. Each is a class that loads once and runs
any number of workloads, with no warm-up request before the first (`kvserve bench` measures that
first one as such).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from benchmarks.records import RequestRecord, summarize
from benchmarks.workloads import Workload

Progress = Callable[[int], None] | None


def _load(model_dir: str):
    """The checkpoint in float32, with EOS disabled: generation only stops at max_new_tokens. (Suppressing
    EOS with min_new_tokens would instead change the greedy choice wherever EOS is the best token.)"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _pad_id(model) -> int:
    pad = model.generation_config.pad_token_id
    return 0 if pad is None else pad


def _record(prompt: list[int], arrival: float, tokens: list[int], times: list[float],
            error: str | None = None) -> RequestRecord:
    """A request's record with one chunk per token, ending at its last token."""
    record = RequestRecord(len(prompt), arrival, token_ids=tokens, error=error)
    for t in times:
        record.add_tokens(1, t)
    record.end = times[-1] if times else None
    return record


# --- static batches through generate ----------------------------------------------------------------

class _StepClock:
    """A streamer (``generate`` only calls ``put`` and ``end``) stamping each decoding step: ``generate``
    puts the prompt first, then every step's new tokens, for the whole batch, right after choosing them."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


class HFStatic:
    """The checkpoint loaded once; ``run`` takes a workload in static batches (no warm-up of its own)."""

    def __init__(self, model_dir: str, batch_size: int = 8) -> None:
        self.model = _load(model_dir)
        self.pad = _pad_id(self.model)
        self.batch_size = batch_size

    def _generate(self, prompts: list[list[int]], new_tokens: int, streamer=None) -> list[list[int]]:
        width = max(map(len, prompts))
        input_ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                                      do_sample=False, pad_token_id=self.pad, streamer=streamer)
        return out[:, width:].tolist()

    def run(self, workload: Workload, progress: Progress = None) -> tuple[list[RequestRecord], float, dict]:
        """``batch_size`` prompts at a time, left-padded, in workload order within each round. A batch
        decodes for its longest output; each request counts only its own ``output_len`` tokens, the
        rest is the waste of static batching. Returns records (with token ids), seconds and extras."""
        records: list[RequestRecord | None] = [None] * len(workload.requests)
        start = eligible = time.perf_counter()
        for round_ in workload.rounds():
            for b in range(0, len(round_), self.batch_size):
                batch = round_[b:b + self.batch_size]
                clock = _StepClock()
                outputs = self._generate([workload.requests[i].prompt for i in batch],
                                         max(workload.requests[i].output_len for i in batch), clock)
                for i, generated in zip(batch, outputs):
                    request = workload.requests[i]
                    tokens = generated[:request.output_len]
                    records[i] = _record(request.prompt, eligible, tokens, clock.times[:len(tokens)])
                if progress is not None:
                    progress(len(batch))
            eligible = time.perf_counter()
        return records, time.perf_counter() - start, {"batch_size": self.batch_size}


def run_hf_static(model_dir: str, workload: Workload, batch_size: int = 8, progress: Progress = None) -> dict:
    """The workload on a freshly loaded model, summarised (with ``token_ids``)."""
    records, elapsed, extra = HFStatic(model_dir, batch_size).run(workload, progress)
    return summarize(f"hf-static-b{batch_size}", records, elapsed, **extra,
                     token_ids=[r.token_ids for r in records])


# --- continuous batching with a paged KV cache ------------------------------------------------------

def _finished(manager, count: int):
    """Yield the next ``count`` results of the manager as their requests finish."""
    while count:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"HF continuous batching stopped with {count} requests unfinished")
        elif result.is_finished():
            count -= 1
            yield result


class HFContinuous:
    """HF's continuous batching manager, started once for every workload ``run`` will be given (its
    workload hints are the largest of them); no warm-up request. ``cb_kwargs`` are
    ``ContinuousBatchingConfig`` fields (HF's defaults otherwise: 256-token pages, prefix sharing on,
    cache sized from free memory). Close it (or use it as a context manager) to stop the manager."""

    def __init__(self, model_dir: str, workloads: list[Workload], **cb_kwargs) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        model = _load(model_dir)
        # What generate_batch would tell the manager, with the largest round as the number of requests in flight.
        hints = WorkloadHints(max_prompt_length=max(len(p) for w in workloads for p in w.prompts),
                              max_generated_length=max(w.output_len for w in workloads),
                              num_requests=max(len(r) for w in workloads for r in w.rounds()))
        # -1: the manager's "no EOS", which every request falls back on.
        generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=_pad_id(model),
                                             max_new_tokens=hints.max_generated_length)
        self._context = model.continuous_batching_context_manager(
            generation_config=generation_config, continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs),
            workload_hints=hints, block=True, timeout=5)
        self.manager = self._context.__enter__()
        self.attn_implementation = model.config._attn_implementation  # what the manager switched the model to
        self._ids = itertools.count()

    def run(self, workload: Workload, progress: Progress = None) -> tuple[list[RequestRecord], float, dict]:
        """Every request of a round is added to the manager at once, each with its own
        ``max_new_tokens``; results are collected as they finish."""
        manager = self.manager
        records: list[RequestRecord | None] = [None] * len(workload.requests)
        run_id = next(self._ids)
        start = eligible = time.perf_counter()
        for round_ in workload.rounds():
            for i in round_:
                manager.add_request(workload.requests[i].prompt, request_id=f"{run_id}-{i}",
                                    max_new_tokens=workload.requests[i].output_len, record_timestamps=True)
            for result in _finished(manager, len(round_)):
                i = int(result.request_id.split("-")[1])
                tokens = list(result.generated_tokens)
                # HF stamps each token with perf_counter() as its loop appends it; without stamps, use arrival here.
                times = (result.timestamps or [time.perf_counter()] * len(tokens))[:len(tokens)]
                records[i] = _record(workload.requests[i].prompt, eligible, tokens, times, result.error)
                if progress is not None:
                    progress(1)
            eligible = time.perf_counter()
        elapsed = time.perf_counter() - start
        config = manager.continuous_batching_config
        return records, elapsed, {"attn_implementation": self.attn_implementation, "page_size": config.page_size,
                                  "num_blocks": config.num_blocks, "max_batch_tokens": config.max_batch_tokens,
                                  "allow_block_sharing": config.allow_block_sharing}

    def close(self) -> None:
        self._context.__exit__(None, None, None)

    def __enter__(self) -> HFContinuous:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_hf_continuous(model_dir: str, workload: Workload, progress: Progress = None, **cb_kwargs) -> dict:
    """The workload through a freshly started manager, summarised (with ``token_ids``)."""
    with HFContinuous(model_dir, [workload], **cb_kwargs) as peer:
        records, elapsed, extra = peer.run(workload, progress)
    return summarize("hf-continuous", records, elapsed, **extra, token_ids=[r.token_ids for r in records])
