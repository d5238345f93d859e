"""Calling the upstream provider for the gateway: where, with which key and headers.

The client's headers are forwarded (``anthropic-version``, ``anthropic-beta``, the
SDK's own) except its credentials, hop-by-hop headers and Arbor's own; the key is
Arbor's, from the environment (the model registry names the variable).
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Mapping
from typing import Any

import httpx2

from conversations.providers import ModelSpec, read_api_key

_DROP = {
    "host",
    "content-length",
    "authorization",
    "x-api-key",
    "api-key",
    "cookie",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "proxy-authorization",
    "accept-encoding",
    "x-arbor-conversation",
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


def headers_for(spec: ModelSpec, client_headers: Mapping[str, str]) -> dict[str, str]:
    out = {k: v for k, v in client_headers.items() if k.lower() not in _DROP}
    out["content-type"] = "application/json"
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


# One connection pool per event loop (uvicorn runs one; a test client makes one a
# request), dropped with its loop.
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx2.AsyncClient] = (
    weakref.WeakKeyDictionary()
)


def client() -> httpx2.AsyncClient:
    loop = asyncio.get_running_loop()
    found = _clients.get(loop)
    if found is None or found.is_closed:
        timeout = httpx2.Timeout(
            connect=10.0,
            read=float(os.environ.get("ARBOR_GATEWAY_READ_TIMEOUT", "600")),
            write=60.0,
            pool=10.0,
        )
        found = _clients[loop] = httpx2.AsyncClient(timeout=timeout, trust_env=False)
    return found


async def send(url: str, headers: Mapping[str, str], content: bytes) -> Any:
    """POST and return the response with its body not yet read (stream it, or read)."""
    request = client().build_request("POST", url, headers=dict(headers), content=content)
    return await client().send(request, stream=True)
