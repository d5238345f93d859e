"""The gateway's endpoints: the Anthropic Messages API and OpenAI Chat Completions, as a
harness expects them, with Arbor's tree and ladder behind them.

- ``POST /gateway/anthropic/v1/messages`` (+ ``/count_tokens``)
- ``POST /gateway/openai/v1/chat/completions``, ``GET /gateway/openai/v1/models``
- ``GET /gateway/status``: the token's exchanges not yet written (``?wait=S`` waits)

The client's key is an Arbor API token (``x-api-key`` or ``Authorization: Bearer``).
Errors answer in the provider's own shape. Streams are relayed event by event. The
exchange is written once the upstream's answer is complete, behind the answer: the
answer goes out at once, and the harness's next request waits for the write before it
is placed (conversations/gateway/pending.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from compaction import services as compaction
from conversations.errors import ArborError
from conversations.gateway import pending, responses, services, upstream, wire
from conversations.gateway.dbthreads import on_db_thread
from conversations.parts import NotJSON, strict_json
from conversations.providers import ContextOverflow, ModelSpec, parse_overflow, resolve_model
from conversations.providers.registry import ModelsFileError, declared_models
from conversations.services import api_token_authenticate

log = logging.getLogger("arbor.gateway")


# --- the two protocols ----------------------------------------------------------------------


@dataclass(frozen=True)
class Protocol:
    name: str  # "anthropic" | "openai"
    path: str  # the upstream endpoint below its base URL

    def error(self, status: int, kind: str, message: str, **extra: Any) -> JsonResponse:
        if self.name == "anthropic":
            body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
        else:
            body = {
                "error": {
                    "message": message,
                    "type": kind,
                    "param": None,
                    "code": extra.get("code"),
                }
            }
        response = JsonResponse(body, status=status)
        for key, value in extra.get("headers", {}).items():
            response[key] = value
        return response


ANTHROPIC = Protocol("anthropic", "/v1/messages")
OPENAI = Protocol("openai", "/chat/completions")

_ANTHROPIC_KIND = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    503: "api_error",
}
_OPENAI_KIND = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "server_error",
}


def _arbor_error(protocol: Protocol, exc: ArborError) -> JsonResponse:
    status = 400 if exc.status == 422 else exc.status
    table = _ANTHROPIC_KIND if protocol.name == "anthropic" else _OPENAI_KIND
    return protocol.error(
        status, table.get(status, "invalid_request_error"), exc.detail, code=exc.code
    )


# Harness requests outgrow Django's 2.5 MB form-data limit (Anthropic takes 32 MB).
MAX_BODY = int(getattr(settings, "ARBOR_GATEWAY_MAX_BODY", 32 * 1024 * 1024))


def _read_body(request: HttpRequest) -> bytes | None:
    """The raw body, read past DATA_UPLOAD_MAX_MEMORY_SIZE up to MAX_BODY (None if
    larger)."""
    length = int(request.META.get("CONTENT_LENGTH") or 0)
    if length > MAX_BODY:
        return None
    data = request.read(MAX_BODY + 1)
    return None if len(data) > MAX_BODY else data


def _credential(request: HttpRequest) -> str:
    bearer = request.headers.get("authorization", "")
    if bearer.lower().startswith("bearer "):
        return bearer[7:].strip()
    return request.headers.get("x-api-key", "").strip()


async def _user(request: HttpRequest) -> Any:
    """The token's user, or None; an expired token raises TokenExpired (an ArborError)."""
    secret = _credential(request)
    if not secret:
        return None
    return await on_db_thread(api_token_authenticate)(secret=secret)


async def _user_or_refusal(protocol: Protocol, request: HttpRequest) -> Any:
    """The token's user, or the refusal to answer with (an HttpResponse, in the
    protocol's error shape) when the token is missing, unknown or expired."""
    try:
        user = await _user(request)
    except ArborError as exc:
        return _arbor_error(protocol, exc)
    return user if user is not None else _unauthorized(protocol)


class Misconfigured(ArborError):
    """The server's own configuration is broken (the models file): a 5xx whose message
    names no server path; the details are in the server's log."""

    status = 503
    code = "server_misconfigured"


def _spec(protocol: Protocol, model: Any) -> ModelSpec:
    if not isinstance(model, str) or not model.strip():
        raise ArborError("model: a model name is required", code="invalid_model")
    name = model if model.startswith(f"{protocol.name}/") else f"{protocol.name}/{model}"
    try:
        spec = resolve_model(name)  # the operator's model policy decides (registry)
    except ModelsFileError as exc:
        raise Misconfigured(str(exc)) from None
    except ValueError as exc:
        raise ArborError(str(exc), code="invalid_model") from None
    if spec.fake:
        raise ArborError("fake/* models are Arbor's demo, not an upstream", code="invalid_model")
    return spec


# --- one request ----------------------------------------------------------------------------


@dataclass
class Prepared:
    protocol: Protocol
    spec: ModelSpec
    exchange: services.Exchange
    user: Any
    raw_estimate: int
    body: bytes  # what goes upstream
    conversation_id: str | None = None  # the X-Arbor-Conversation header
    placement: services.Placement | None = None
    # Placing the request in the tree while the upstream answers (see _prepared).
    placing: asyncio.Future[None] | None = None
    forward: services.Forward | None = None
    attempts: list[bytes] = field(default_factory=list)
    estimate: int = 0
    budget: int = 0
    learn: bool = True
    secret: str = ""  # the client's token: its writes are awaited by its next request
    # Set once the answer is sent: the exchange is written then (pending.WRITE_BEHIND).
    answered: asyncio.Event | None = None

    async def placed(self) -> services.Placement:
        """The request's place in the tree, once placing it has finished."""
        if self.placing is not None:
            placing, self.placing = self.placing, None
            await placing
        assert self.placement is not None, "the request was never placed"
        return self.placement


def _body_bytes(prep_body: dict[str, Any]) -> bytes:
    return json.dumps(prep_body, ensure_ascii=False, separators=(",", ":")).encode()


def _compacted_body(
    protocol: Protocol, exchange: services.Exchange, spec: ModelSpec, forward: services.Forward
) -> bytes:
    body = dict(exchange.body)
    body["model"] = spec.model
    messages = list(forward.messages)
    if protocol.name == "anthropic":
        messages = _cache_breakpoint(body, messages, forward.prefix_end)
        body["messages"] = messages
    else:
        leading = [
            m
            for m in body.get("messages", [])[
                : len(body.get("messages", [])) - len(exchange.messages)
            ]
        ]
        body["messages"] = leading + messages
    return _body_bytes(body)


MAX_BREAKPOINTS = 4


def _count_breakpoints(value: Any) -> int:
    if isinstance(value, dict):
        own = 1 if isinstance(value.get("cache_control"), dict) else 0
        return own + sum(_count_breakpoints(v) for k, v in value.items() if k != "cache_control")
    if isinstance(value, list):
        return sum(_count_breakpoints(v) for v in value)
    return 0


def _without_breakpoints(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    blocks = [
        {k: v for k, v in b.items() if k != "cache_control"} if isinstance(b, dict) else b
        for b in content
    ]
    return {**message, "content": blocks}


def _cache_breakpoint(
    body: dict[str, Any], messages: list[dict[str, Any]], prefix_end: int | None
) -> list[dict[str, Any]]:
    """A ``cache_control`` breakpoint on the last block of the compacted prefix, so the
    provider caches it for the requests that reuse it; the client's own breakpoints are
    kept within the provider's limit of four (the earliest in the messages go first)."""
    if prefix_end is None or not (0 <= prefix_end < len(messages)):
        return messages
    target = messages[prefix_end]
    content = target.get("content")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content or not isinstance(content[-1], dict):
        return messages
    if isinstance(content[-1].get("cache_control"), dict):
        return messages
    messages = list(messages)
    messages[prefix_end] = {
        **target,
        "content": [*content[:-1], {**content[-1], "cache_control": {"type": "ephemeral"}}],
    }
    total = (
        _count_breakpoints(body.get("system"))
        + _count_breakpoints(body.get("tools"))
        + _count_breakpoints(messages)
    )
    i = 0
    while total > MAX_BREAKPOINTS and i < len(messages):
        if i != prefix_end and _count_breakpoints(messages[i]):
            total -= _count_breakpoints(messages[i])
            messages[i] = _without_breakpoints(messages[i])
        i += 1
    if total > MAX_BREAKPOINTS:
        messages[prefix_end] = target
    return messages


class _Unauthorized(Exception):
    pass


def _unauthorized(protocol: Protocol) -> JsonResponse:
    kind = "authentication_error" if protocol.name == "anthropic" else "invalid_request_error"
    return protocol.error(
        401,
        kind,
        "send an Arbor API token as x-api-key or Authorization: Bearer",
        code="invalid_api_key",
    )


def _prepare(protocol: Protocol, secret: str, headers: dict[str, str], raw: bytes) -> Prepared:
    user = api_token_authenticate(secret=secret)
    if user is None:
        raise _Unauthorized
    try:
        body = strict_json(raw)
    except NotJSON as exc:
        raise ArborError(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    except (ValueError, UnicodeDecodeError):
        raise ArborError("the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ArborError("the request body must be a JSON object", code="invalid_json")
    spec = _spec(protocol, body.get("model"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ArborError("messages: at least one message is required", code="invalid_messages")
    if protocol.name == "anthropic":
        system = wire.anthropic_system_text(body.get("system"))
        conversation_messages = messages
    else:
        system, conversation_messages = wire.openai_split_system(messages)
        if not conversation_messages:
            raise ArborError("messages: a user message is required", code="invalid_messages")
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
    try:
        exchange = services.exchange_read(
            protocol=protocol.name,
            body=body,
            wire_messages=conversation_messages,
            system=system,
            tools=tools,
            headers=headers,
        )
    except wire.WireError as exc:
        raise ArborError(str(exc), code="invalid_messages") from None
    calibration, reported = _calibration(spec.calibration_key)
    raw_estimate = exchange.raw_tokens(spec.image_billing)
    prep = Prepared(protocol, spec, exchange, user, raw_estimate, raw, secret=secret)
    prep.conversation_id = headers.get(services.CONVERSATION_HEADER) or None
    prep.budget = services.request_budget(exchange, spec, calibration, reported)
    prep.estimate = calibration.apply(raw_estimate)
    # Far below the threshold the factor decides nothing: learn near it (and at first).
    prep.learn = prep.estimate >= LEARN_SHARE * prep.budget or calibration.samples < LEARN_FIRST
    if body.get("model") != spec.model:
        prep.body = _body_bytes({**body, "model": spec.model})
    if _place_first(prep):
        _place(prep)
    return prep


def _place_first(prep: Prepared) -> bool:
    """Whether the request must be placed before anything goes upstream: when it names
    its conversation (another user's is refused, not forwarded) or must be compacted
    (the ladder runs on the stored path). Otherwise it goes as the client sent it, and
    is placed while the upstream answers."""
    return prep.conversation_id is not None or prep.estimate > prep.budget


def _place(prep: Prepared) -> None:
    """Find the request's place in the tree; over the threshold, build what to send.
    Under it the request goes as it is: the ladder would send the originals (a record
    only ever stands for a request over it, and requests only grow until the harness
    rewinds, when its prefix changes anyway)."""
    prep.placement = services.placement_find(
        user=prep.user, exchange=prep.exchange, conversation_id=prep.conversation_id
    )
    if prep.estimate > prep.budget:
        prep.forward = services.forward_build(
            placement=prep.placement, exchange=prep.exchange, spec=prep.spec
        )
        prep.body = _compacted_body(prep.protocol, prep.exchange, prep.spec, prep.forward)


# The estimator's calibration per model, read at most every few seconds (this process
# writes it itself; a worker's write is seen within CALIBRATION_TTL).
CALIBRATION_TTL = 5.0
LEARN_SHARE = 0.5
LEARN_FIRST = 8
_CALIBRATIONS: dict[str, tuple[float, Any]] = {}


def _calibration(model_id: str) -> Any:
    now = time.monotonic()
    cached = _CALIBRATIONS.get(model_id)
    if cached is None or now - cached[0] > CALIBRATION_TTL:
        cached = _CALIBRATIONS[model_id] = (now, compaction.calibration_get(model_id))
    return cached[1]


def _recover(prep: Prepared, overflow: ContextOverflow) -> bytes | None:
    """After the upstream said the request was too long: compact from the originals
    below the limit it reported. None when no smaller request can be made. The request
    is placed (``Prepared.placed``) before this runs."""
    assert prep.placement is not None
    try:
        forward = services.forward_build(
            placement=prep.placement,
            exchange=prep.exchange,
            spec=prep.spec,
            overflow=overflow,
            sent=prep.forward.context if prep.forward else None,
        )
    except ContextOverflow:
        return None
    finally:
        _CALIBRATIONS.pop(prep.spec.calibration_key, None)  # the overflow taught the estimator
    body = _compacted_body(prep.protocol, prep.exchange, prep.spec, forward)
    if body in prep.attempts:
        return None  # never resend a rejected payload
    prep.forward = forward
    return body


def _finish(prep: Prepared, answer: dict[str, Any], metadata: dict[str, Any]) -> None:
    """The exchange is complete: write it, and learn from the upstream's count."""
    usage = metadata.get("usage") or {}
    measured = usage.get("input_tokens")
    if measured and prep.protocol.name == "anthropic":
        measured += (usage.get("cache_read_input_tokens") or 0) + (
            usage.get("cache_creation_input_tokens") or 0
        )
    sent_raw = (
        prep.forward.context.view.raw_tokens
        if prep.forward and prep.forward.context.view
        else prep.raw_estimate
    )
    if prep.learn or prep.forward is not None:
        services.usage_learn(spec=prep.spec, raw_estimate=sent_raw, input_tokens=measured)
        _CALIBRATIONS.pop(prep.spec.calibration_key, None)
    services.record_measured(prep.forward, measured)
    metadata = {**metadata, "gateway_forwarded": _forwarded_summary(prep)}
    assert prep.placement is not None  # placed before the exchange is written
    services.exchange_store(
        placement=prep.placement, exchange=prep.exchange, answer=answer, answer_metadata=metadata
    )


def _forwarded_summary(prep: Prepared) -> dict[str, Any]:
    """What went upstream for this request, for the context panel."""
    forward = prep.forward
    if forward is None:
        return {
            "model": prep.spec.id,
            "messages": len(prep.exchange.messages),
            "estimate": prep.estimate,
            "compacted": False,
        }
    context = forward.context
    return {
        "model": prep.spec.id,
        "messages": len(forward.messages),
        "estimate": context.estimate,
        "compacted": compaction.compacts(context.rungs) or context.record is not None,
        "rungs": [r for r in (context.record.rung_names if context.record else context.rungs)],
        "record": str(context.record.pk) if context.record else None,
    }


def _json_object(raw: bytes | str) -> dict[str, Any] | None:
    """An upstream's body as a JSON object, or None when it is not one (a hostile
    upstream's too deeply nested body included)."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _overflow_of(status: int, raw: bytes) -> ContextOverflow | None:
    if status not in (400, 413):
        return None
    try:
        error = json.loads(raw).get("error") or {}
    except (ValueError, AttributeError, RecursionError):  # a hostile upstream's body
        return None
    message = str(error.get("message", "")) if isinstance(error, dict) else str(error)
    code = error.get("code") if isinstance(error, dict) else None
    found = parse_overflow(message, code if isinstance(code, str) else None)
    if found is None:
        return None
    return ContextOverflow(found[0], found[1], message=message)


def _sse_data(event: bytes) -> str | None:
    lines = [
        line[5:].lstrip()
        for line in event.decode("utf-8", "replace").splitlines()
        if line.startswith("data:")
    ]
    return "\n".join(lines) if lines else None


async def _relay(prep: Prepared, response: Any) -> AsyncIterator[bytes]:
    """Relay the upstream's SSE stream event by event, building the answer; when it is
    complete, start writing the exchange (see ``_write``), then send the last event."""
    anthropic = prep.protocol.name == "anthropic"
    answer: Any = wire.AnthropicAnswer() if anthropic else wire.OpenAIAnswer()
    buffer = b""
    stored = False
    try:
        async for chunk in response.aiter_bytes():
            buffer += chunk.replace(b"\r\n", b"\n")
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                data = _sse_data(event)
                final = False
                if data == "[DONE]":
                    final = not anthropic
                elif data:
                    try:
                        parsed = json.loads(data)
                    except (ValueError, RecursionError):
                        parsed = None
                    if isinstance(parsed, dict):
                        answer.feed(parsed)
                        final = anthropic and parsed.get("type") == "message_stop"
                if final and not stored:
                    stored = True
                    await _write(prep, _store_answer(prep, answer))
                yield event + b"\n\n"
        if buffer.strip():
            yield buffer
    finally:
        await response.aclose()


async def _store_answer(prep: Prepared, answer: Any) -> None:
    if isinstance(answer, wire.AnthropicAnswer):
        result = answer.result()
        message = {"role": "assistant", "content": result.get("content") or []}
        metadata = wire.answer_metadata(result, model_id=prep.spec.id)
    else:
        message = answer.result()
        metadata = wire.openai_answer_metadata(
            message,
            model_id=prep.spec.id,
            finish_reason=answer.finish_reason,
            usage=answer.usage,
            response_id=answer.id,
        )
    await _write_exchange(prep, message, metadata)


async def _write(prep: Prepared, write: Coroutine[Any, Any, None]) -> None:
    """Write the exchange behind the answer where the server's loop outlives the
    request; else before the answer goes out."""
    if prep.answered is not None:
        pending.start(prep.secret, write, after=prep.answered)
    else:
        await write


async def _write_exchange(
    prep: Prepared, message: dict[str, Any], metadata: dict[str, Any]
) -> None:
    try:
        await prep.placed()
        await on_db_thread(_finish)(prep, message, metadata)
    except Exception:  # the harness still gets its answer; its next request stores it
        log.exception("gateway: writing the exchange failed")


def _whole_answer(prep: Prepared, result: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The assistant message and its metadata from a non-streamed upstream answer."""
    if prep.protocol.name == "anthropic":
        message = {"role": "assistant", "content": result.get("content") or []}
        return message, wire.answer_metadata(result, model_id=prep.spec.id)
    choice = (result.get("choices") or [{}])[0]
    message = dict(choice.get("message") or {"role": "assistant", "content": ""})
    metadata = wire.openai_answer_metadata(
        message,
        model_id=prep.spec.id,
        finish_reason=choice.get("finish_reason"),
        usage=result.get("usage") or {},
        response_id=str(result.get("id", "")),
    )
    return message, metadata


# How long a request waits for its token's previous write (a database lock may hold it);
# past that it is placed anyway, and exchange_store re-checks its place.
WRITE_WAIT = 30.0


async def _prepared(
    protocol: Protocol, request: HttpRequest, raw_body: bytes | None = None
) -> Prepared | HttpResponseBase:
    """The request checked, read and placed in the tree; or the error to answer with.
    ``raw_body``: the body to use instead of the request's (a translated one)."""
    if request.method != "POST":
        return protocol.error(405, "invalid_request_error", "use POST")
    secret = _credential(request)
    if not secret:
        return _unauthorized(protocol)
    if raw_body is None:
        raw_body = _read_body(request)
    if raw_body is None:
        return protocol.error(
            413, "request_too_large", f"the request is larger than {MAX_BODY} bytes"
        )
    headers = {k.lower(): v for k, v in request.headers.items()}
    # The token's previous exchange may still be being written (behind its answer): this
    # request continues it, so it is placed only once that write is done.
    if not await pending.settle(secret, timeout=WRITE_WAIT):
        log.warning("gateway: a previous exchange is still being written; placing anyway")
    try:
        # One trip to a database thread: the token, the request read, and (when it must
        # come first) its place in the tree and what to send.
        prep = await on_db_thread(_prepare)(protocol, secret, headers, raw_body)
    except _Unauthorized:
        return _unauthorized(protocol)
    except ArborError as exc:
        return _arbor_error(protocol, exc)
    prep.answered = getattr(request, "scope", {}).get(pending.WRITE_BEHIND)
    if prep.placement is None:
        # Placed while the upstream answers: the request goes out as it came.
        prep.placing = asyncio.ensure_future(on_db_thread(_place)(prep))
        prep.placing.add_done_callback(_log_failure)
    return prep


def _log_failure(placing: asyncio.Future[None]) -> None:
    if not placing.cancelled() and placing.exception() is not None:
        log.error("gateway: placing a request failed", exc_info=placing.exception())


async def _send_upstream(
    prep: Prepared, url: str, headers: dict[str, str]
) -> Any | HttpResponseBase:
    """The upstream's response, its body not yet read; or the answer for the client when
    the upstream is unreachable or refused (its own error, relayed as it is)."""
    for tries_left in (1, 0):  # the request, and at most one retry after an overflow
        prep.attempts.append(prep.body)
        try:
            response = await upstream.send(url, headers, prep.body)
        except Exception as exc:
            return prep.protocol.error(
                502, "api_error", f"the upstream is unreachable: {type(exc).__name__}"
            )
        if response.status_code == 200:
            return response
        raw = await response.aread()
        await response.aclose()
        overflow = _overflow_of(response.status_code, raw) if tries_left else None
        retry = None
        if overflow is not None:
            try:
                await prep.placed()
            except Exception:  # logged by _log_failure: relay the upstream's error
                overflow = None
            else:
                retry = await on_db_thread(_recover)(prep, overflow)
        if retry is None:
            # Not an overflow, no way to recover, or the retry overflowed too: the
            # client sees the upstream's own error.
            return HttpResponse(
                raw,
                status=response.status_code,
                headers=upstream.response_headers(response.headers),
            )
        prep.body = retry
    raise AssertionError("unreachable: the last try always returns")


async def _handle(protocol: Protocol, request: HttpRequest) -> HttpResponseBase:
    prep = await _prepared(protocol, request)
    if not isinstance(prep, Prepared):
        return prep
    url = upstream.url_for(prep.spec, protocol.path, request.META.get("QUERY_STRING", ""))
    out_headers = upstream.headers_for(prep.spec, dict(request.headers))
    response = await _send_upstream(prep, url, out_headers)
    if isinstance(response, HttpResponseBase):
        return response
    relayed = upstream.response_headers(response.headers)
    if prep.exchange.body.get("stream"):
        return StreamingHttpResponse(
            _relay(prep, response), headers={**relayed, "cache-control": "no-cache"}
        )
    raw = await response.aread()
    await response.aclose()
    result = _json_object(raw)
    if result is not None:
        await _write(prep, _write_exchange(prep, *_whole_answer(prep, result)))
    return HttpResponse(raw, status=200, headers=relayed)


@csrf_exempt
async def anthropic_messages(request: HttpRequest) -> HttpResponseBase:
    return await _handle(ANTHROPIC, request)


@csrf_exempt
async def openai_chat(request: HttpRequest) -> HttpResponseBase:
    return await _handle(OPENAI, request)


@csrf_exempt
async def openai_responses(request: HttpRequest) -> HttpResponseBase:
    """``POST /gateway/openai/v1/responses``: the Responses API (Codex, the openai SDK's
    ``responses.create``) in front of the model's Chat Completions upstream. The request
    is translated (conversations/gateway/responses.py) and then placed, compacted,
    forwarded and written exactly as a Chat Completions one; the answer goes back as a
    Response, or streamed as its SSE events."""
    if request.method != "POST":
        return OPENAI.error(405, "invalid_request_error", "use POST")
    if not _credential(request):
        return _unauthorized(OPENAI)
    raw = _read_body(request)
    if raw is None:
        return OPENAI.error(
            413, "invalid_request_error", f"the request is larger than {MAX_BODY} bytes"
        )
    try:
        body = strict_json(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return OPENAI.error(
            400,
            "invalid_request_error",
            f"the request body is not valid JSON: {exc}",
            code="invalid_json",
        )
    if not isinstance(body, dict):
        return OPENAI.error(
            400,
            "invalid_request_error",
            "the request body must be a JSON object",
            code="invalid_json",
        )
    try:
        chat = responses.to_chat(body)
    except responses.ResponsesError as exc:
        return OPENAI.error(400, "invalid_request_error", str(exc), code="invalid_input")
    prep = await _prepared(OPENAI, request, _body_bytes(chat))
    if not isinstance(prep, Prepared):
        return prep
    url = upstream.url_for(prep.spec, OPENAI.path, "")
    answer = await _send_upstream(prep, url, upstream.headers_for(prep.spec, dict(request.headers)))
    if isinstance(answer, HttpResponseBase):
        return answer
    raw_answer = await answer.aread()
    await answer.aclose()
    result = _json_object(raw_answer)
    if result is None:
        return OPENAI.error(
            502, "api_error", "the upstream's answer is not a JSON object", code="bad_response"
        )
    await _write(prep, _write_exchange(prep, *_whole_answer(prep, result)))
    response = responses.from_chat(result, model=str(body["model"]))
    if body.get("stream"):
        return HttpResponse(
            responses.sse(responses.stream_events(response)),
            content_type="text/event-stream",
            headers={"cache-control": "no-cache"},
        )
    return JsonResponse(response)


def _count(
    protocol: Protocol, user: Any, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, int]:
    """Arbor's estimate of the request as sent, and the threshold above which Arbor
    compacts it before forwarding."""
    spec = _spec(protocol, body.get("model"))
    system = wire.anthropic_system_text(body.get("system"))
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
    try:
        exchange = services.exchange_read(
            protocol="anthropic",
            body=body,
            wire_messages=list(body.get("messages") or []),
            system=system,
            tools=tools,
            headers=headers,
        )
    except wire.WireError as exc:
        raise ArborError(str(exc), code="invalid_messages") from None
    calibration, reported = compaction.calibration_get(spec.calibration_key)
    budget = services.request_budget(exchange, spec, calibration, reported)
    return calibration.apply(exchange.raw_tokens(spec.image_billing)), budget


@csrf_exempt
async def anthropic_count_tokens(request: HttpRequest) -> HttpResponse:
    """What Arbor would forward, counted: the upstream's own count where it has the
    endpoint, else Arbor's estimate; but never more than the compaction threshold, since
    a request over it is compacted below it before it goes upstream. A harness that
    sizes its own compaction from this count (Claude Code does) then leaves to Arbor
    what Arbor handles."""
    user = await _user_or_refusal(ANTHROPIC, request)
    if isinstance(user, HttpResponse):
        return user
    try:
        body = strict_json(_read_body(request) or b"")
    except (ValueError, UnicodeDecodeError) as exc:
        return ANTHROPIC.error(
            400, "invalid_request_error", f"the request body is not valid JSON: {exc}"
        )
    if not isinstance(body, dict):
        return ANTHROPIC.error(
            400, "invalid_request_error", "the request body must be a JSON object"
        )
    headers = {k.lower(): v for k, v in request.headers.items()}
    try:
        spec = await on_db_thread(_spec)(ANTHROPIC, body.get("model"))
        estimate, budget = await on_db_thread(_count)(ANTHROPIC, user, body, headers)
    except ArborError as exc:
        return _arbor_error(ANTHROPIC, exc)
    if estimate > budget:
        return JsonResponse({"input_tokens": budget})
    url = upstream.url_for(spec, "/v1/messages/count_tokens", request.META.get("QUERY_STRING", ""))
    try:
        response = await upstream.send(
            url,
            upstream.headers_for(spec, dict(request.headers)),
            _body_bytes({**body, "model": spec.model}),
        )
        raw = await response.aread()
        await response.aclose()
        counted = json.loads(raw).get("input_tokens") if response.status_code == 200 else None
        if isinstance(counted, int):
            return JsonResponse({"input_tokens": min(counted, budget)})
    except Exception:
        pass
    return JsonResponse({"input_tokens": estimate})


def _model_list() -> list[dict[str, Any]]:
    names = sorted(m.split("/", 1)[1] for m in declared_models() if m.startswith("openai/"))
    return [{"id": n, "object": "model", "created": 0, "owned_by": "arbor"} for n in names]


@csrf_exempt
async def openai_models(request: HttpRequest) -> HttpResponse:
    refusal = await _user_or_refusal(OPENAI, request)
    if isinstance(refusal, HttpResponse):
        return refusal
    try:
        data = await on_db_thread(_model_list)()
    except ModelsFileError as exc:
        return _arbor_error(OPENAI, Misconfigured(str(exc)))
    return JsonResponse({"object": "list", "data": data})


async def _not_found(protocol: Protocol, request: HttpRequest) -> HttpResponse:
    return protocol.error(
        404,
        "not_found_error" if protocol.name == "anthropic" else "invalid_request_error",
        f"no such endpoint: {request.method} {request.path}",
        code="unknown_url",
    )


@csrf_exempt
async def anthropic_unknown(request: HttpRequest, rest: str = "") -> HttpResponse:
    """Any other path below /gateway/anthropic: a 404 in Anthropic's shape."""
    return await _not_found(ANTHROPIC, request)


@csrf_exempt
async def openai_unknown(request: HttpRequest, rest: str = "") -> HttpResponse:
    """Any other path below /gateway/ (OpenAI's shape: the SDKs of most harnesses)."""
    return await _not_found(OPENAI, request)


async def base(request: HttpRequest) -> HttpResponse:
    """The base URLs themselves answer (harnesses probe them before the first request)."""
    return JsonResponse({"gateway": "arbor", "endpoints": ["/v1/messages", "/v1/chat/completions"]})


MAX_STATUS_WAIT = 30.0


async def status(request: HttpRequest) -> HttpResponse:
    """``GET /gateway/status``: how many of the token's exchanges are answered but not
    yet written in this process; with ``?wait=S`` (at most 30 s), once they are
    written or S seconds have passed. For readers that must see the last answer in the
    tree right after it arrived (tests, scripts)."""
    refusal = await _user_or_refusal(ANTHROPIC, request)
    if isinstance(refusal, HttpResponse):
        return refusal
    secret = _credential(request)
    raw_wait = request.GET.get("wait", "0")
    try:
        wait = float(raw_wait)
    except ValueError:
        wait = -1.0
    if not 0 <= wait <= MAX_STATUS_WAIT:  # NaN fails this too
        return ANTHROPIC.error(
            400,
            "invalid_request_error",
            f"wait: a number of seconds from 0 to {MAX_STATUS_WAIT:g}, not {raw_wait!r}",
        )
    if wait:
        await pending.settle(secret, timeout=wait)
    return JsonResponse({"pending_writes": pending.count(secret)})
