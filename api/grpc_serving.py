"""The KVServe gRPC service on any engine client: protobuf in, engine request, protobuf out.

Engine-agnostic: it needs an ``api.engine_client.EngineClient`` (an in-process ``AsyncLLM`` through
``AsyncLLMClient``, or the Serve app's client of its scheduler actors) and the model's ``Tokenizer``::

    GenerateRequest ─request_to_engine─► (prompt ids, SamplingParams, cache_salt)
        ─client.generate─► RequestOutput deltas ─► GenerateResponse per delta (stream) or merged (unary)

With an ``api_key``, every RPC must carry the metadata ``authorization: Bearer <key>`` (as the HTTP API's
header), else it ends with UNAUTHENTICATED before anything runs; a call without an RPC context (a Python
caller inside the cluster, a Serve handle) is not checked.

Errors become gRPC status codes (``grpc_status``): ValueError → INVALID_ARGUMENT, EngineOverloadedError →
RESOURCE_EXHAUSTED, EngineDeadError → UNAVAILABLE, a bad key → UNAUTHENTICATED, anything else → INTERNAL;
the details are a ValueError's message or, for every other failure, one fixed sentence (the HTTP API's).
``generate`` and
``generate_stream`` take the RPC's context and report errors on it (``abort_with_status``):

- a plain ``grpc.aio`` servicer context: ``await context.abort(code, details)``;
- Ray Serve's ``RayServegRPCContext`` (the ``grpc_context`` argument of a Serve ingress method; it has
  ``set_code``/``set_details`` but no ``abort``): the code and details are set, then the exception is
  re-raised. Serve's replica wraps an exception raised with a code set into ``gRPCStatusError``, and the
  proxy answers with that code and details. Raising matters on a stream: the proxy copies the context
  onto the call only along with a message, so a code set before returning would be lost;
- no context (a Python caller, a Serve handle call): the exception propagates.

A Serve ingress method is then two lines::

    async def GenerateStream(self, request, grpc_context=None):
        async for message in generate_stream(request, self.client, self.tokenizer, grpc_context,
                                             api_key=self.api_key):
            yield message

Whenever the consumer leaves before the engine finished (client cancel, deadline, disconnect), the
request is aborted in the engine. Behind Ray Serve's gRPC proxy (2.60) that needs the proxy to cancel
the replica call; it does not when the client's cancel lands while the proxy is sending a message
(its ``send_request_to_replica`` catches the GeneratorExit), and the request then runs to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc

from api import kvserve_pb2 as pb
from api import kvserve_pb2_grpc
from api.engine_client import EngineClient, aclose_quietly
from api.errors import OpenAIError, clean_message
from api.limits import check_float, check_int, check_ints
from engine.messages import CompletionOutput, RequestOutput
from engine.config import STRUCTURED_OUTPUT_DEPTH_CEILING
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from engine.structured_bounds import json_text_depth
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16  # as OpenAI's completions API


# --- protobuf -> engine --------------------------------------------------------------------------------


def _field(message: Any, name: str, default: Any) -> Any:
    return getattr(message, name) if message.HasField(name) else default


def check_ranges(p: pb.SamplingParameters) -> None:
    """The ranges of ``api.limits`` (as the HTTP API's): ValueError naming the first field outside."""
    for name in ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"):
        if name not in ("top_k", "min_tokens") and not p.HasField(name):
            continue
        check_int(name, getattr(p, name))
    check_ints("stop_token_ids", p.stop_token_ids)
    for name in ("temperature", "top_p", "repetition_penalty"):
        if p.HasField(name):
            check_float(name, getattr(p, name))
    for name in ("min_p", "presence_penalty", "frequency_penalty"):
        check_float(name, getattr(p, name))


def constraint_from_proto(p: pb.SamplingParameters) -> StructuredOutputsParams | None:
    """The ``constraint`` oneof as the engine's constraint (None when unset, or ``json_object`` false).
    ValueError for a schema that is not a JSON object's text and for an empty choice list; whether
    the constraint compiles is the engine's to say, at admission."""
    kind = p.WhichOneof("constraint")
    if kind == "json_schema":
        if json_text_depth(p.json_schema) > STRUCTURED_OUTPUT_DEPTH_CEILING:  # too deep to parse here: the
            return StructuredOutputsParams(json=p.json_schema)  # engine's depth bound refuses the text
        try:
            schema = json.loads(p.json_schema)
        except ValueError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema must be a JSON schema (a JSON object), got {type(schema).__name__}")
        return StructuredOutputsParams(json=schema)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True) if p.json_object else None
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(p.choice.choices))
    if kind in ("regex", "grammar"):
        return StructuredOutputsParams(**{kind: getattr(p, kind)})
    return None


def sampling_params_from_proto(p: pb.SamplingParameters) -> SamplingParams:
    """Unset optional fields take the OpenAI defaults; ranges are checked (``check_ranges``), then
    SamplingParams validates the rest (ValueError)."""
    check_ranges(p)
    return SamplingParams(
        n=_field(p, "n", 1), temperature=_field(p, "temperature", 1.0), top_p=_field(p, "top_p", 1.0),
        top_k=p.top_k, min_p=p.min_p, seed=_field(p, "seed", None),
        max_tokens=_field(p, "max_tokens", DEFAULT_MAX_TOKENS), min_tokens=p.min_tokens,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=_field(p, "skip_special_tokens", True), logprobs=_field(p, "logprobs", None),
        prompt_logprobs=_field(p, "prompt_logprobs", None),
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=_field(p, "repetition_penalty", 1.0), output_kind=RequestOutputKind.DELTA,
        structured_outputs=constraint_from_proto(p),
    )


def request_to_engine(req: pb.GenerateRequest, tokenizer: Tokenizer) -> tuple[list[int], SamplingParams, str | None]:
    """(prompt token ids, sampling params, cache salt or None). Raises ValueError for a missing or
    empty prompt and for invalid parameters; the engine checks the rest (length, vocab range)."""
    kind = req.WhichOneof("prompt")
    if kind == "text":
        if not req.text:
            raise ValueError("the prompt text is empty")
        token_ids = tokenizer.encode(req.text)
    elif kind == "token_ids":
        token_ids = list(req.token_ids.ids)
        check_ints("token_ids", token_ids)
    else:
        raise ValueError("the request has no prompt: set `text` or `token_ids`")
    if not token_ids:
        raise ValueError("the prompt is empty")
    if req.params.HasField("truncate_prompt_tokens"):
        keep = req.params.truncate_prompt_tokens
        check_int("truncate_prompt_tokens", keep, "prompt_logprobs")  # within int32
        if keep == 0:
            raise ValueError("truncate_prompt_tokens must be at least 1, got 0")
        token_ids = token_ids[-keep:]
    return token_ids, sampling_params_from_proto(req.params), req.cache_salt or None


# --- engine -> protobuf --------------------------------------------------------------------------------


def _completion_to_proto(c: CompletionOutput, num_top_logprobs: int) -> pb.Completion:
    message = pb.Completion(index=c.index, text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason or "")
    if isinstance(c.stop_reason, str):
        message.stop_string = c.stop_reason
    elif isinstance(c.stop_reason, int):
        message.stop_token_id = c.stop_reason
    for token_id, candidates in zip(c.token_ids, c.logprobs or []):
        ranked = sorted(candidates.items(), key=lambda kv: -kv[1])[:num_top_logprobs]
        message.logprobs.append(pb.TokenLogprob(
            token_id=token_id, logprob=candidates.get(token_id, float("nan")),
            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in ranked]))
    return message


async def _engine_outputs(client: EngineClient, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, cache_salt: str | None) -> AsyncIterator[RequestOutput]:
    """The request's outputs until it finishes; ``request_id`` is one this server made
    (``new_request_id``), never the client's. If the consumer leaves first (closes this generator, or
    is cancelled while it waits), the stream is closed and ``client.abort`` called: in process
    (``AsyncLLMClient``) that aborts the engine request; behind Serve (``ServeEngineClient``) it does
    nothing, as closing the stream ends the request. When the engine ends the stream itself
    (finished, or raised: a bad request, overload) there is nothing to abort."""
    stream = client.generate(request_id, prompt_token_ids, params, cache_salt)
    ended = False
    try:
        while not ended:
            try:
                output = await stream.__anext__()
            except StopAsyncIteration:
                ended = True
                return
            except Exception:
                ended = True
                raise
            ended = output.finished
            yield output
    finally:
        await aclose_quietly(stream)
        if not ended:
            try:  # shielded: a second cancellation must not stop the abort
                await asyncio.shield(client.abort(request_id))
            except Exception:
                logger.exception("aborting request %s failed", request_id)


def new_request_id() -> str:
    return f"grpc-{uuid.uuid4().hex}"


def _prompt_logprobs_to_proto(entries: list, prompt_token_ids: list[int], k: int) -> list[pb.PromptLogprob]:
    """One message per prompt token after the first: its logprob and rank, and the k most likely tokens
    (most likely first; the prompt's token among them only where it is one of them)."""
    messages = []
    for token_id, entry in zip(prompt_token_ids[1:], entries[1:]):
        logprob, rank = entry[token_id]
        ranked = sorted(entry.items(), key=lambda item: item[1][1])
        top = [(t, lp) for t, (lp, r) in ranked if t != token_id or r <= k][:k]
        messages.append(pb.PromptLogprob(token_id=token_id, logprob=logprob, rank=rank,
                                         top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top]))
    return messages


async def _responses(req: pb.GenerateRequest, client: EngineClient, tokenizer: Tokenizer
                     ) -> AsyncIterator[pb.GenerateResponse]:
    """One GenerateResponse per engine delta (only the samples with news), the usage on the last.
    Raises ValueError (before anything is sent) for a bad request; engine errors propagate."""
    prompt_token_ids, params, cache_salt = request_to_engine(req, tokenizer)
    # the engine's id is always made here: a client's id is only the label its responses carry (two
    # requests with one id, or an id another request holds, must not share or steal an engine entry)
    engine_id = new_request_id()
    request_id = req.request_id or engine_id
    usage = pb.Usage(prompt_tokens=len(prompt_token_ids))
    num_top = params.logprobs or 0
    async with contextlib.aclosing(_engine_outputs(client, engine_id, prompt_token_ids, params,
                                                   cache_salt)) as outputs:
        async for output in outputs:
            usage.completion_tokens += sum(len(c.token_ids) for c in output.outputs)
            usage.cached_tokens = output.num_cached_tokens
            message = pb.GenerateResponse(request_id=request_id,
                                          completions=[_completion_to_proto(c, num_top) for c in output.outputs])
            if output.prompt_logprobs is not None:
                message.prompt_logprobs.extend(_prompt_logprobs_to_proto(output.prompt_logprobs, prompt_token_ids,
                                                                         params.prompt_logprobs or 0))
            if output.finished:
                message.usage.CopyFrom(usage)
            yield message
            if output.finished:
                return
    yield pb.GenerateResponse(request_id=request_id, usage=usage)  # a stream that ended unfinished


# --- authentication ------------------------------------------------------------------------------------


class Unauthenticated(Exception):
    """The RPC lacks the right ``authorization`` metadata (UNAUTHENTICATED)."""


def check_api_key(context: Any, api_key: str | None) -> None:
    """Raises Unauthenticated unless ``api_key`` is None, there is no RPC context (an in-cluster Python
    call), or the call's metadata holds ``authorization: Bearer <api_key>`` (compared in constant time)."""
    if api_key is None or context is None:
        return
    given = next((value for key, value in context.invocation_metadata() or () if key.lower() == "authorization"), "")
    if isinstance(given, str):
        given = given.encode("utf-8", "replace")
    if not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
        raise Unauthenticated("invalid or missing API key: send the metadata `authorization: Bearer <key>`")


# --- errors --------------------------------------------------------------------------------------------


_GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
               404: grpc.StatusCode.NOT_FOUND, 503: grpc.StatusCode.UNAVAILABLE}


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details for an exception: the HTTP API's error (``OpenAIError.from_exception``:
    a ValueError's message, every other exception one fixed sentence by its type, its text logged)
    with its status mapped; an engine that failed is UNAVAILABLE (retry), a full queue
    RESOURCE_EXHAUSTED. Never Ray's traceback, task name, pid, address or an exception's repr."""
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    error = OpenAIError.from_exception(exc)
    if error.code == "engine_overloaded":
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    elif error.code == "engine_dead":
        code = grpc.StatusCode.UNAVAILABLE
    else:
        code = _GRPC_CODES.get(error.status, grpc.StatusCode.INTERNAL)
    return code, clean_message(error.message)


async def abort_with_status(context: Any, exc: Exception) -> NoReturn:
    """End the RPC with ``exc``'s status: ``context.abort`` on a grpc.aio context; on Serve's
    ``RayServegRPCContext`` set the code and details and re-raise ``exc`` (see the module docstring);
    with no context (a Serve handle call) re-raise ``exc``."""
    code, details = grpc_status(exc)  # (the details of a failure are logged there)
    if context is not None and hasattr(context, "abort"):
        await context.abort(code, details)  # raises
    if context is not None:
        context.set_code(code)
        context.set_details(details)
    raise exc


async def generate_stream(req: pb.GenerateRequest, client: EngineClient, tokenizer: Tokenizer,
                          context: Any = None, *, api_key: str | None = None) -> AsyncIterator[pb.GenerateResponse]:
    """GenerateStream: one GenerateResponse per engine delta (only the samples with news), the usage
    on the last. Errors, also after messages were sent, are reported on ``context``; with ``api_key``
    the call must carry it (``check_api_key``)."""
    try:
        check_api_key(context, api_key)
        async with contextlib.aclosing(_responses(req, client, tokenizer)) as stream:
            async for message in stream:
                yield message
    except Exception as exc:
        await abort_with_status(context, exc)


async def generate(req: pb.GenerateRequest, client: EngineClient, tokenizer: Tokenizer,
                   context: Any = None, *, api_key: str | None = None) -> pb.GenerateResponse:
    """Generate: the stream's messages merged per sample (text, tokens and logprobs concatenated, the
    last finish and stop reasons), completions ordered by index, and the usage. Errors are reported
    on ``context``; with ``api_key`` the call must carry it (``check_api_key``)."""
    merged: dict[int, pb.Completion] = {}
    response = pb.GenerateResponse()
    try:
        check_api_key(context, api_key)
        async with contextlib.aclosing(_responses(req, client, tokenizer)) as stream:
            async for message in stream:
                response.request_id = message.request_id
                response.prompt_logprobs.extend(message.prompt_logprobs)
                if message.HasField("usage"):
                    response.usage.CopyFrom(message.usage)
                for c in message.completions:
                    into = merged.setdefault(c.index, pb.Completion(index=c.index))
                    into.text += c.text
                    into.token_ids.extend(c.token_ids)
                    into.logprobs.extend(c.logprobs)
                    into.finish_reason = c.finish_reason or into.finish_reason
                    if (reason := c.WhichOneof("stop_reason")) is not None:
                        setattr(into, reason, getattr(c, reason))
    except Exception as exc:
        await abort_with_status(context, exc)
    response.completions.extend(merged[i] for i in sorted(merged))
    return response


class KVServeServicer(kvserve_pb2_grpc.KVServeServicer):
    """The service for a plain ``grpc.aio`` server::

        server = grpc.aio.server()
        kvserve_pb2_grpc.add_KVServeServicer_to_server(KVServeServicer(client, tokenizer, api_key), server)

    With ``api_key`` every call must carry the metadata ``authorization: Bearer <api_key>``.
    """

    def __init__(self, client: EngineClient, tokenizer: Tokenizer, api_key: str | None = None) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.api_key = api_key

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        return await generate(request, self.client, self.tokenizer, context, api_key=self.api_key)

    async def GenerateStream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.GenerateResponse]:
        async for message in generate_stream(request, self.client, self.tokenizer, context, api_key=self.api_key):
            yield message
