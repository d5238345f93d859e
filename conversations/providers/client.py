"""Model providers over the official SDKs: ``openai`` (chat completions, any
OpenAI-compatible server) and ``anthropic`` (messages).

Keys come from the environment as the SDKs' users expect (``OPENAI_API_KEY``,
``ANTHROPIC_API_KEY``, or ``*_FILE`` variables naming a file that holds the key; base URLs
from ``OPENAI_BASE_URL`` / ``ANTHROPIC_BASE_URL`` unless the registry names one). They are
never put in a message, an exception or a log line.

The SDKs retry 408/409/429/5xx and connection errors themselves, honouring Retry-After;
we bound how many times (``max_retries``), how long a single wait may be
(``max_retry_after``) and how long a request may take (``timeout``), then turn whatever
is left into the errors in errors.py.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import json
import logging
import os
import socket
import ssl
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, cast
from urllib.parse import urlsplit

import anthropic
import httpx2
import openai

from conversations.providers.base import Done, LoadBlob, Reply, Request, StreamEvent
from conversations.providers.convert import (
    AnthropicStreamAccumulator,
    OpenAIStreamAccumulator,
    from_anthropic,
    from_openai,
    to_anthropic,
    to_openai,
)
from conversations.providers.errors import (
    AuthenticationFailed,
    BadRequest,
    ContextOverflow,
    ProviderError,
    ProviderUnavailable,
    RateLimited,
    parse_overflow,
    redact,
    register_secret,
)
from conversations.providers.registry import ModelSpec, resolve_model

log = logging.getLogger("arbor.providers")

OPENAI_DEFAULT_HOST = "api.openai.com"
# Sent to servers that take no key (Ollama, a local vLLM): the SDK insists on one.
NO_KEY = "no-key-needed"
FAKE_KEY = "arbor-fake-provider"


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


@dataclass(frozen=True)
class ClientSettings:
    """Retry and timeout bounds for provider calls."""

    # Retries after the first attempt, for 408/409/429/5xx and connection errors.
    max_retries: int = 2
    # Seconds a request may wait for the server: the whole non-streamed answer, or the
    # gap between two stream events (a stalled stream fails after this long).
    timeout: float = 300.0
    connect_timeout: float = 10.0
    # A Retry-After longer than this is not waited for: the error is raised at once, with
    # retry_after set, so a turn never hangs for an hour on a server's say-so.
    max_retry_after: float = 60.0
    # The whole model call, retries included, from the request to the last byte: a stall
    # fails after ``timeout`` without a byte, a stream that trickles (or sends keep-alive
    # comments forever) after this.
    deadline: float = 600.0
    # A streamed call's wait for the response to begin (its headers), each attempt: a
    # server that accepts the connection and then says nothing fails after this, not
    # after the whole read timeout. A non-streamed answer arrives whole, so only
    # ``timeout`` bounds its wait.
    first_byte: float = 60.0

    @classmethod
    def from_env(cls) -> ClientSettings:
        return cls(
            max_retries=_env_int("ARBOR_PROVIDER_MAX_RETRIES", cls.max_retries),
            timeout=_env_float("ARBOR_PROVIDER_TIMEOUT", cls.timeout),
            connect_timeout=_env_float("ARBOR_PROVIDER_CONNECT_TIMEOUT", cls.connect_timeout),
            max_retry_after=_env_float("ARBOR_PROVIDER_MAX_RETRY_AFTER", cls.max_retry_after),
            deadline=_env_float("ARBOR_PROVIDER_DEADLINE", cls.deadline),
            first_byte=_env_float("ARBOR_PROVIDER_FIRST_BYTE", cls.first_byte),
        )

    def httpx_timeout(self) -> httpx2.Timeout:
        return httpx2.Timeout(self.timeout, connect=self.connect_timeout)


class DeadlineExceeded(httpx2.ReadTimeout):
    """The model call ran past ClientSettings.deadline."""


class FirstByteTimeout(httpx2.ReadTimeout):
    """A streamed call's response did not begin within ClientSettings.first_byte."""


class CallCancelled(BaseException):
    """``Provider.cancel()`` cut the call. A BaseException on purpose: the SDKs retry a
    call after any Exception (with a backoff of a second or more), and a cancelled call
    must end at once; the turn engine catches it."""


class _DeadlineStream(httpx2.SyncByteStream):
    def __init__(self, inner: Any, deadline_at: float, request: httpx2.Request) -> None:
        self.inner, self.deadline_at, self.request = inner, deadline_at, request

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            if time.monotonic() > self.deadline_at:
                raise DeadlineExceeded("the model call ran past its deadline", request=self.request)
            yield chunk

    def close(self) -> None:
        self.inner.close()


class DeadlineTransport(httpx2.HTTPTransport):
    """The HTTP transport of a provider's client, holding one deadline for the whole
    call it is making (set by the provider before each call): every attempt's timeouts
    are capped by what is left, and the response body is cut when it passes. For a
    streamed call, ``first_byte`` also caps each attempt's wait for the response to
    begin; the body's reads then get the ordinary read timeout back."""

    deadline_at: float | None = None
    first_byte: float | None = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # The sockets this transport opened, so that ``cancel`` can cut them from
        # another thread: closing the client does not wake a thread blocked reading.
        self._streams: weakref.WeakSet[Any] = weakref.WeakSet()
        self.cancelled = False

    def cancel(self) -> None:
        """Cut the call in progress, from any thread: its blocked read fails at once,
        and any later request (an SDK retry) fails before it is sent."""
        self.cancelled = True
        for stream in list(self._streams):
            sock = stream.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _trace(self, event: str, info: dict[str, Any]) -> None:
        # The TLS stream wraps the TCP one and takes its socket over: shutting the TCP
        # one's socket down then fails (a closed descriptor), so both are kept.
        if event in (
            "connection.connect_tcp.complete",
            "connection.connect_unix_socket.complete",
            "connection.start_tls.complete",
        ):
            stream = info.get("return_value")
            if stream is not None:
                self._streams.add(stream)

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        if self.cancelled:
            raise CallCancelled
        request.extensions["trace"] = self._trace
        deadline_at, first_byte = self.deadline_at, self.first_byte
        timeout = dict(request.extensions.get("timeout") or {})
        if deadline_at is not None:
            left = deadline_at - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded("the model call ran past its deadline", request=request)
            for key in ("connect", "read", "write", "pool"):
                timeout[key] = min(timeout.get(key) or left, left)
        body_timeout = dict(timeout)
        waiting = dict(timeout)
        if first_byte is not None:
            waiting["read"] = min(timeout.get("read") or first_byte, first_byte)
        request.extensions["timeout"] = waiting
        try:
            response = super().handle_request(request)
        except httpx2.ReadTimeout as exc:
            if first_byte is not None and waiting["read"] == first_byte:
                raise FirstByteTimeout(
                    f"no response within {first_byte:g} s", request=request
                ) from exc
            raise
        except Exception as exc:
            if self.cancelled:  # the socket was shut down under the waiting read
                raise CallCancelled from exc
            raise
        # httpcore reads the timeouts of the body from this same mapping when the body
        # is first read, which is after this returns.
        request.extensions["timeout"] = body_timeout
        if deadline_at is not None:
            response.stream = _DeadlineStream(response.stream, deadline_at, request)
        return response


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return False
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def read_api_key(env_name: str) -> str | None:
    """The key in ``env_name``, else in the file named by ``<env_name>_FILE`` (Docker and
    Kubernetes secrets), else None."""
    value = os.environ.get(env_name, "").strip()
    if not value:
        path = os.environ.get(env_name + "_FILE", "").strip()
        if path:
            try:
                with open(path, encoding="utf-8") as fh:
                    value = fh.read().strip()
            except OSError as exc:
                raise AuthenticationFailed(
                    f"{env_name}_FILE names a file that cannot be read ({exc.strerror})",
                    code="missing_api_key",
                ) from None
    if not value:
        return None
    register_secret(value)
    return value


def retry_after_seconds(headers: Any) -> float | None:
    """Seconds from Retry-After-Ms / Retry-After (number or HTTP date), or None."""
    if headers is None:
        return None
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return float(value) / divisor
        except ValueError:
            parsed = email.utils.parsedate_tz(value)
            if parsed is not None:
                return max(0.0, email.utils.mktime_tz(parsed) - time.time())
    return None


def _bound_retry_after(max_wait: float) -> Callable[[httpx2.Response], None]:
    # Both SDKs obey `x-should-retry: false`; the Anthropic SDK would otherwise sleep for
    # whatever Retry-After says, however long.
    def hook(response: httpx2.Response) -> None:
        status = response.status_code
        if status in (408, 409, 429) or status >= 500:
            wait = retry_after_seconds(response.headers)
            if wait is not None and wait > max_wait:
                response.headers["x-should-retry"] = "false"

    return hook


# --- error normalisation --------------------------------------------------------------

_UNAVAILABLE_TYPES = {"overloaded_error", "api_error", "server_error", "timeout_error"}


def _error_fields(body: Any) -> tuple[str, str | None]:
    """(message, code) from an error body in either protocol's shape."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            message = inner.get("message")
            code = inner.get("code") or inner.get("type")
            return (str(message) if message else ""), (str(code) if code else None)
        if isinstance(inner, str):
            return inner, None
    if isinstance(body, str):
        return body, None
    return "", None


def _deadline_error(exc: BaseException, provider: str) -> ProviderError | None:
    """The error for a call our own clocks cut short, or None when they did not."""
    # Checked before the SDK's classes: our timeouts subclass httpx's and may be wrapped
    # in an SDK timeout error, which would otherwise read as a plain "did not answer".
    if _caused_by(exc, DeadlineExceeded):
        return ProviderUnavailable(
            "the model did not finish its answer within the call's deadline "
            "(ARBOR_PROVIDER_DEADLINE)",
            code="deadline",
            provider=provider,
        )
    if _caused_by(exc, FirstByteTimeout):
        return ProviderUnavailable(
            "the model's stream did not begin within ARBOR_PROVIDER_FIRST_BYTE seconds (each try)",
            code="first_byte_timeout",
            provider=provider,
        )
    return None


def _status_error(
    exc: openai.APIStatusError | anthropic.APIStatusError, provider: str
) -> ProviderError:
    """The error for an HTTP error answer, classified by status and the body's code."""
    status = exc.status_code
    headers = exc.response.headers
    request_id = headers.get("x-request-id") or headers.get("request-id")
    if 300 <= status < 400:
        # Not followed (the client's follow_redirects=False): the body is the
        # redirecting server's, not an error worth showing.
        return ProviderError(
            f"the model provider answered HTTP {status} (a redirect); Arbor does not follow "
            "redirects with its key: the operator must point the model's base URL at the "
            "final address",
            code="provider_redirect",
            status=status,
            provider=provider,
            request_id=request_id,
        )
    message, code = _error_fields(exc.body)
    message = message or f"the provider answered HTTP {status}"
    common: dict[str, Any] = {
        "status": status,
        "provider": provider,
        "request_id": request_id,
    }
    # A 429 whose text mentions tokens is a rate limit, not an overflow.
    if status != 429:
        overflow = parse_overflow(message, code)
        if overflow is not None or status == 413:
            measured, limit = overflow or (None, None)
            return ContextOverflow(measured, limit, message=message, **common)
    retry_after = retry_after_seconds(headers)
    if status == 429 or code in ("rate_limit_error", "rate_limit_exceeded"):
        return RateLimited(message, code=None, retry_after=retry_after, **common)
    if status in (401, 403):
        return AuthenticationFailed(message, **common)
    if status == 408 or status >= 500 or code in _UNAVAILABLE_TYPES:
        return ProviderUnavailable(message, retry_after=retry_after, **common)
    if 400 <= status < 500:
        return BadRequest(message, **common)
    return ProviderError(message, **common)


def _client_error(exc: BaseException, provider: str) -> ProviderError | None:
    """The error for a failure without an HTTP answer, or None for a foreign exception."""
    if isinstance(
        exc, openai.APITimeoutError | anthropic.APITimeoutError | httpx2.TimeoutException
    ):
        return ProviderUnavailable(
            "the model provider did not answer in time", code="timeout", provider=provider
        )
    if isinstance(
        exc, openai.APIConnectionError | anthropic.APIConnectionError | httpx2.TransportError
    ):
        return ProviderUnavailable(
            "could not reach the model provider", code="connection_failed", provider=provider
        )
    if isinstance(exc, openai.APIError | anthropic.APIError):
        message, _code = _error_fields(exc.body)
        return ProviderError(message or "the model provider reported an error", provider=provider)
    # The SDKs raise a bare TypeError when neither a key nor an auth header is set.
    if isinstance(exc, TypeError) and "authentication method" in str(exc):
        return AuthenticationFailed(
            "no credentials for the model provider are configured", provider=provider
        )
    if isinstance(exc, openai.OpenAIError | anthropic.AnthropicError | httpx2.HTTPError):
        return ProviderError(
            f"the model provider client failed ({type(exc).__name__})", provider=provider
        )
    return None


def normalize_error(exc: BaseException, *, provider: str) -> ProviderError:
    """An SDK or transport exception → one of the errors in errors.py.

    The message is the provider's own error text (redacted), never ``str(exc)``.
    Anything that is not a provider failure (a bug of ours) is raised again unchanged.
    """
    if isinstance(exc, ProviderError):
        return exc
    error = _deadline_error(exc, provider)
    if error is not None:
        return error
    if isinstance(exc, openai.APIStatusError | anthropic.APIStatusError):
        return _status_error(exc, provider)
    error = _client_error(exc, provider)
    if error is None:
        raise exc
    return error


def _raise_normalized(exc: BaseException, provider: str) -> NoReturn:
    error = normalize_error(exc, provider=provider)
    log.warning("model request failed: %s %s", error.code, error.message)
    # No exception chaining: the SDK exception's text and request are not ours to show.
    raise error from None


_TRANSPORT_ERRORS = (openai.OpenAIError, anthropic.AnthropicError, httpx2.HTTPError, TypeError)
# The SDKs' own connection limits.
_LIMITS = httpx2.Limits(max_connections=1000, max_keepalive_connections=100)


# --- request bodies -------------------------------------------------------------------


def openai_body(
    spec: ModelSpec,
    request: Request,
    *,
    load_blob: LoadBlob | None = None,
    base_url: str | None = None,
) -> dict[str, Any]:
    """The Chat Completions body Arbor sends for ``request`` (no ``stream`` flags)."""
    payload = to_openai(
        request.messages, system=request.system, tools=request.tools, load_blob=load_blob
    )
    body: dict[str, Any] = {"model": spec.model, "messages": payload.messages}
    if payload.tools:
        body["tools"] = payload.tools
        if request.tool_choice:
            body["tool_choice"] = request.tool_choice
    base_url = base_url or spec.base_url or os.environ.get("OPENAI_BASE_URL") or None
    host = urlsplit(base_url).hostname if base_url else OPENAI_DEFAULT_HOST
    # OpenAI's newer models refuse max_tokens; most compatible servers only know it.
    param = spec.max_tokens_param or (
        "max_completion_tokens" if host == OPENAI_DEFAULT_HOST else "max_tokens"
    )
    body[param] = request.max_output or spec.max_output
    if request.temperature is not None:
        body["temperature"] = request.temperature
    return body


def anthropic_body(
    spec: ModelSpec, request: Request, *, load_blob: LoadBlob | None = None
) -> dict[str, Any]:
    """The Messages API body Arbor sends for ``request`` (no ``stream`` flag)."""
    payload = to_anthropic(
        request.messages, system=request.system, tools=request.tools, load_blob=load_blob
    )
    body: dict[str, Any] = {
        "model": spec.model,
        "messages": payload.messages,
        "max_tokens": request.max_output or spec.max_output,
    }
    if payload.system:
        body["system"] = payload.system
    if payload.tools:
        body["tools"] = payload.tools
        if request.tool_choice:
            body["tool_choice"] = {"type": request.tool_choice}
    if request.temperature is not None:
        body["temperature"] = request.temperature
    return body


def request_body(
    spec: ModelSpec, request: Request, *, load_blob: LoadBlob | None = None
) -> dict[str, Any]:
    """The provider-ready body of ``request`` for ``spec``'s protocol: exactly what the
    provider client sends (the fake models speak OpenAI's)."""
    if spec.provider == "anthropic":
        return anthropic_body(spec, request, load_blob=load_blob)
    return openai_body(spec, request, load_blob=load_blob)


# --- providers ------------------------------------------------------------------------


class Provider(ABC):
    """One model behind one protocol. ``complete`` answers with a Reply; ``stream``
    yields TextDelta / ThinkingDelta / ToolCallStarted / ToolCallFinished events and ends
    with Done(reply). Both raise ProviderError subclasses only."""

    kind: str = ""
    # Where the SDK's users set the server, as its own client reads it.
    base_url_env: str = ""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        load_blob: LoadBlob | None = None,
        settings: ClientSettings | None = None,
    ) -> None:
        self.spec = spec
        self.load_blob = load_blob
        self.settings = settings or ClientSettings.from_env()
        if api_key:
            register_secret(api_key)
        self._transport = DeadlineTransport(verify=_tls(), limits=_LIMITS)
        self._http = self._make_http_client()
        self.base_url = base_url or spec.base_url or os.environ.get(self.base_url_env) or None
        self.client = self._make_client(api_key)

    @abstractmethod
    def _make_http_client(self) -> httpx2.Client: ...

    @abstractmethod
    def _make_client(self, api_key: str | None) -> Any:
        """The SDK client, with its key resolved as the SDK's users expect."""

    def _incomplete(self) -> NoReturn:
        # The body ended without the protocol's end marker: the server died mid-answer.
        # A partial reply must not be mistaken for a whole one.
        raise ProviderUnavailable(
            "the model's answer stopped before it was complete",
            code="stream_incomplete",
            provider=self.kind,
        )

    @abstractmethod
    def complete(self, request: Request) -> Reply: ...

    @abstractmethod
    def stream(self, request: Request) -> Iterator[StreamEvent]: ...

    def close(self) -> None:
        self._http.close()

    def cancel(self) -> None:
        """Stop the call in progress from another thread (a user pressed Stop): the
        request is cut at once, even while the model is silent; the thread that made it
        gets a ProviderError (the answer had begun) or CallCancelled (it had not)."""
        self._transport.cancel()

    def _start_call(self, *, streaming: bool = False) -> None:
        """One deadline for the call about to be made, its retries included; and for a
        stream, the first-byte wait of each attempt."""
        self._transport.deadline_at = time.monotonic() + self.settings.deadline
        self._transport.first_byte = self.settings.first_byte if streaming else None

    def __enter__(self) -> Provider:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _hooks(self) -> dict[str, list[Any]]:
        return {"response": [_bound_retry_after(self.settings.max_retry_after)]}


class OpenAIProvider(Provider):
    """Chat completions on any OpenAI-compatible server."""

    kind = "openai"
    base_url_env = "OPENAI_BASE_URL"

    def _make_client(self, api_key: str | None) -> Any:
        spec = self.spec
        host = urlsplit(self.base_url).hostname if self.base_url else OPENAI_DEFAULT_HOST
        official = host == OPENAI_DEFAULT_HOST
        env_name = spec.api_key_env or "OPENAI_API_KEY"
        key = api_key or read_api_key(env_name)
        if not key:
            if spec.fake:
                key = FAKE_KEY
            elif official:
                self.close()
                raise AuthenticationFailed(
                    f"no API key for {spec.id}: set {env_name} (or {env_name}_FILE)",
                    code="missing_api_key",
                    provider=self.kind,
                )
            else:
                key = NO_KEY
        return openai.OpenAI(
            api_key=key,
            base_url=self.base_url,
            max_retries=self.settings.max_retries,
            timeout=self.settings.httpx_timeout(),
            http_client=self._http,
        )

    def _make_http_client(self) -> httpx2.Client:
        return openai.DefaultHttpxClient(
            timeout=self.settings.httpx_timeout(),
            event_hooks=self._hooks(),
            transport=self._transport,
            # The SDKs follow redirects by default, and httpx strips only Authorization
            # on a cross-origin hop: x-api-key (and the body) would go wherever a 3xx
            # points. Not followed; a 3xx is an error (_status_error).
            follow_redirects=False,
        )

    def _kwargs(self, request: Request) -> dict[str, Any]:
        return openai_body(self.spec, request, load_blob=self.load_blob, base_url=self.base_url)

    def _post(self, body: dict[str, Any], *, stream: bool) -> Any:
        """POST the body as ``openai_body`` built it, through the SDK's client (its
        retries, auth, errors and SSE parsing). ``chat.completions.create`` would first
        walk every message against the SDK's TypedDicts (``maybe_transform``): 26 ms of
        CPU for a 70-message request here, 111 ms for 300, growing with the history, for
        a body that is plain JSON already. Replies come back as the JSON dicts they are
        (``cast_to=object``), not as models turned back into dicts."""
        return self.client.post(
            "/chat/completions",
            body=body,
            cast_to=object,
            stream=stream,
            stream_cls=openai.Stream[object],
        )

    def complete(self, request: Request) -> Reply:
        kwargs = self._kwargs(request)
        self._start_call()
        try:
            response = self._post(kwargs, stream=False)
        except _TRANSPORT_ERRORS as exc:
            _raise_normalized(exc, self.kind)
        if isinstance(response, str):
            # The SDK hands back the text of a body not labelled as JSON; servers that
            # label JSON as text/plain still answer in JSON.
            with contextlib.suppress(ValueError):
                response = json.loads(response)
        if not isinstance(response, dict):
            raise ProviderUnavailable(
                "the model's answer is not a JSON object", code="bad_response", provider=self.kind
            )
        return from_openai(response)

    def stream(self, request: Request) -> Iterator[StreamEvent]:
        kwargs = self._kwargs(request)
        kwargs["stream"] = True
        kwargs["stream_options"] = {"include_usage": True}
        accumulator = OpenAIStreamAccumulator()
        self._start_call(streaming=True)
        try:
            with self._post(kwargs, stream=True) as chunks:
                for chunk in chunks:
                    if not isinstance(chunk, dict):
                        raise ProviderUnavailable(
                            "the model's answer is not a JSON object",
                            code="bad_response",
                            provider=self.kind,
                        )
                    yield from accumulator.feed(chunk)
        except _TRANSPORT_ERRORS as exc:
            _raise_normalized(exc, self.kind)
        if accumulator.raw_finish is None:  # no finish_reason arrived
            self._incomplete()
        yield from accumulator.finish()


class AnthropicProvider(Provider):
    """The Anthropic Messages API."""

    kind = "anthropic"
    base_url_env = "ANTHROPIC_BASE_URL"

    def _make_client(self, api_key: str | None) -> Any:
        key = api_key or read_api_key(self.spec.api_key_env or "ANTHROPIC_API_KEY")
        if not key and self.base_url and not os.environ.get("ANTHROPIC_AUTH_TOKEN"):
            # A gateway or local proxy that takes no key; api.anthropic.com without a key
            # is left to the SDK's own discovery (profiles, workload identity).
            key = NO_KEY
        return anthropic.Anthropic(
            api_key=key,
            base_url=self.base_url,
            max_retries=self.settings.max_retries,
            timeout=self.settings.httpx_timeout(),
            http_client=self._http,
        )

    def _make_http_client(self) -> httpx2.Client:
        return anthropic.DefaultHttpxClient(
            timeout=self.settings.httpx_timeout(),
            event_hooks=self._hooks(),
            transport=self._transport,
            # The SDKs follow redirects by default, and httpx strips only Authorization
            # on a cross-origin hop: x-api-key (and the body) would go wherever a 3xx
            # points. Not followed; a 3xx is an error (_status_error).
            follow_redirects=False,
        )

    def _kwargs(self, request: Request) -> dict[str, Any]:
        return anthropic_body(self.spec, request, load_blob=self.load_blob)

    def complete(self, request: Request) -> Reply:
        kwargs = self._kwargs(request)
        self._start_call()
        try:
            response = cast(Any, self.client.messages).create(**kwargs)
        except _TRANSPORT_ERRORS as exc:
            _raise_normalized(exc, self.kind)
        return from_anthropic(response.to_dict())

    def stream(self, request: Request) -> Iterator[StreamEvent]:
        kwargs = self._kwargs(request)
        kwargs["stream"] = True
        accumulator = AnthropicStreamAccumulator()
        stopped = False
        self._start_call(streaming=True)
        try:
            with cast(Any, self.client.messages).create(**kwargs) as events:
                for event in events:
                    data = event.to_dict()
                    stopped = stopped or data.get("type") == "message_stop"
                    yield from accumulator.feed(data)
        except _TRANSPORT_ERRORS as exc:
            _raise_normalized(exc, self.kind)
        if not stopped:  # no message_stop arrived
            self._incomplete()
        yield from accumulator.finish()


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every client: loading the CA bundle costs ~20 ms, which a
    context per turn would add to every chat turn."""
    return httpx2.create_ssl_context()


def make_provider(
    model: str | ModelSpec,
    *,
    api_key: str | None = None,
    base_url: str | None = None,
    load_blob: LoadBlob | None = None,
    settings: ClientSettings | None = None,
) -> Provider:
    """The provider for a model id (``openai/…``, ``anthropic/…``, ``fake/…``) or spec.

    ``fake/*`` models without a base URL get the in-process loopback fake server, started
    on first use, so the demo works offline with no setup.
    """
    spec = resolve_model(model) if isinstance(model, str) else model
    if spec.fake and not (base_url or spec.base_url):
        from conversations.providers.fake import shared_server

        server = shared_server()
        server.set_window(spec.model, spec.context_window)
        base_url = server.openai_base_url
    cls: type[Provider] = AnthropicProvider if spec.provider == "anthropic" else OpenAIProvider
    return cls(spec, api_key=api_key, base_url=base_url, load_blob=load_blob, settings=settings)


def complete_reply(provider: Provider, request: Request) -> Reply:
    """Drain ``provider.stream`` and return the final reply (for callers that want
    streaming's failure modes but not its events)."""
    for event in provider.stream(request):
        if isinstance(event, Done):
            return event.reply
    raise ProviderUnavailable("the stream ended without a reply", code="stream_incomplete")


__all__ = [
    "AnthropicProvider",
    "ClientSettings",
    "OpenAIProvider",
    "Provider",
    "complete_reply",
    "make_provider",
    "normalize_error",
    "read_api_key",
    "redact",
    "retry_after_seconds",
]
