"""Calling the upstream provider for the gateway: where, with which key and headers.

The key is Arbor's, from the environment (the model registry names the variable), and
goes only to the model's configured base URL: redirects are not followed (``send``).

Of the client's headers only an allow-list is forwarded, what the protocols and SDKs
need and nothing that chooses an account:

- ``anthropic-version``, ``anthropic-beta``, ``openai-beta``: the API version and the
  features the request uses;
- ``accept``, ``user-agent`` and the SDKs' ``x-stainless-*`` (language, version, OS,
  retry count: telemetry that changes nothing upstream).

Everything else stays behind: the client's credentials (``authorization``,
``x-api-key``, ``cookie``), hop-by-hop headers, Arbor's own (``x-arbor-conversation``)
and, above all, organisation, project and billing headers (``OpenAI-Organization``,
``OpenAI-Project``, ``chatgpt-account-id``…): with Arbor's key they would let the client
choose who pays. Arbor's own organisation and project are sent instead when the
operator sets them, from the variables the OpenAI SDK reads (``OPENAI_ORG_ID``,
``OPENAI_PROJECT_ID``), as chat turns send them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import weakref
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import aiohttp

from conversations.providers import ModelSpec, read_api_key

log = logging.getLogger("arbor.gateway")

# The client's headers that go upstream (see the module docstring): exact names, and
# prefixes. Anything else is dropped.
FORWARD = frozenset({"anthropic-version", "anthropic-beta", "openai-beta", "accept", "user-agent"})
FORWARD_PREFIXES = ("x-stainless-",)
# Arbor's own OpenAI organisation and project, by the OpenAI SDK's variables.
_OPENAI_ACCOUNT_ENV = {
    "openai-organization": "OPENAI_ORG_ID",
    "openai-project": "OPENAI_PROJECT_ID",
}

# Response headers worth passing back to the client.
KEEP_RESPONSE = (
    "content-type",
    "retry-after",
    "request-id",
    "x-request-id",
    "anthropic-organization-id",
    "openai-processing-ms",
)
KEEP_PREFIXES = ("anthropic-ratelimit-", "x-ratelimit-")

_DEFAULT_BASE = {"anthropic": "https://api.anthropic.com", "openai": "https://api.openai.com/v1"}
_BASE_ENV = {"anthropic": "ANTHROPIC_BASE_URL", "openai": "OPENAI_BASE_URL"}
_KEY_ENV = {"anthropic": "ANTHROPIC_API_KEY", "openai": "OPENAI_API_KEY"}


def url_for(spec: ModelSpec, path: str, query: str = "") -> str:
    """``path`` is the endpoint below the protocol's base (``/v1/messages``,
    ``/chat/completions``), as each SDK appends it to its base URL."""
    base = spec.base_url or os.environ.get(_BASE_ENV[spec.provider]) or _DEFAULT_BASE[spec.provider]
    if spec.fake and not spec.base_url:
        from conversations.providers.fake import shared_server

        base = shared_server().openai_base_url
    url = base.rstrip("/") + path
    return f"{url}?{query}" if query else url


def forwarded(name: str) -> bool:
    """Whether a client's header goes upstream (the allow-list)."""
    name = name.lower()
    return name in FORWARD or name.startswith(FORWARD_PREFIXES)


def headers_for(spec: ModelSpec, client_headers: Mapping[str, str]) -> dict[str, str]:
    out = {k.lower(): v for k, v in client_headers.items() if forwarded(k)}
    out["content-type"] = "application/json"
    if spec.provider == "openai":
        for header, env in _OPENAI_ACCOUNT_ENV.items():
            value = os.environ.get(env, "").strip()
            if value:
                out[header] = value
    key = read_api_key(spec.api_key_env or _KEY_ENV[spec.provider])
    if key:
        if spec.provider == "anthropic":
            out["x-api-key"] = key
        else:
            out["authorization"] = f"Bearer {key}"
    return out


def response_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in headers.items()
        if k.lower() in KEEP_RESPONSE or k.lower().startswith(KEEP_PREFIXES)
    }


class Response:
    """The upstream's answer, its body not yet read: stream it (``aiter_bytes``) or read
    it whole (``aread``), then ``aclose``."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status_code = response.status
        self.headers: Mapping[str, str] = response.headers

    async def aread(self) -> bytes:
        return await self._response.read()

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.content.iter_any():
            yield chunk

    async def aclose(self) -> None:
        """Done with it: a connection whose answer was read whole goes back to the pool;
        one cut short (the client went away mid-stream) is closed, which ends the
        upstream's generation."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class Refusal:
    """An answer Arbor gives in the upstream's place, with the interface of
    :class:`Response`: the upstream's redirect, which is not followed (see ``send``).

    Its body is an error both protocols' SDKs read: Anthropic's shape (``type``,
    ``error.type``, ``error.message``) with OpenAI's fields (``param``, ``code``) beside."""

    def __init__(self, status: int, message: str, *, code: str) -> None:
        self.status_code = status
        self.headers: Mapping[str, str] = {"content-type": "application/json"}
        error = {"type": "api_error", "message": message, "param": None, "code": code}
        self._body = json.dumps({"type": "error", "error": error}).encode()

    async def aread(self) -> bytes:
        return self._body

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        yield self._body

    async def aclose(self) -> None:
        return None


def _redirect_refusal(response: aiohttp.ClientResponse) -> Refusal:
    location = response.headers.get("location", "")
    # The host only, for the operator's log: never a query or userinfo (a signed URL's
    # token), and nothing of it for the client.
    target = urlsplit(location).hostname or "the same host"
    log.warning(
        "gateway: the upstream %s answered %d (a redirect to %s); not followed: Arbor "
        "sends its key only to the configured base URL",
        response.url.host,
        response.status,
        target,
    )
    return Refusal(
        502,
        f"the upstream answered HTTP {response.status} (a redirect); Arbor does not follow "
        "redirects with its key: the operator must point the model's base URL at the "
        "final address",
        code="upstream_redirect",
    )


# One connection pool per event loop (uvicorn runs one; a test client makes one a
# request), dropped with its loop. aiohttp rather than httpx: with its C HTTP parser a
# gateway request costs ~1.6-2 ms less than through httpx over pure-Python h11 (the two
# measured alternately, in the same minutes).
_sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
    weakref.WeakKeyDictionary()
)


def session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    found = _sessions.get(loop)
    if found is None or found.closed:
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=10.0,
            # Between two reads of the answer (a model may think a long while).
            sock_read=float(os.environ.get("ARBOR_GATEWAY_READ_TIMEOUT", "600")),
        )
        found = _sessions[loop] = aiohttp.ClientSession(
            timeout=timeout,
            trust_env=False,
            # The client's own User-Agent is forwarded; none is added when it sent none.
            skip_auto_headers=("User-Agent",),
        )
    return found


async def close_sessions() -> None:
    """Close this loop's connection pool (the server's shutdown)."""
    found = _sessions.pop(asyncio.get_running_loop(), None)
    if found is not None and not found.closed:
        await found.close()


async def send(url: str, headers: Mapping[str, str], content: bytes) -> Response | Refusal:
    """POST and return the response with its body not yet read (stream it, or read).

    Redirects are not followed: the request carries Arbor's key, and a 3xx would send
    it (with the user's conversation) wherever the upstream points. A 3xx is answered
    as a 502 naming it instead (:class:`Refusal`)."""
    response = await session().post(url, data=content, headers=dict(headers), allow_redirects=False)
    if 300 <= response.status < 400:
        refusal = _redirect_refusal(response)
        response.close()  # nothing of a redirecting upstream's connection is reused
        return refusal
    return Response(response)
