"""Model providers: the registry, the SDK-backed clients, conversions and the fake.

Typical use::

    from conversations.providers import Request, make_provider

    with make_provider("openai/gpt-4o-mini", load_blob=read_blob) as provider:
        reply = provider.complete(Request(messages=path, system=prompt, tools=tools))

See DESIGN.md §4. Nothing here touches the database.
"""

from __future__ import annotations

from conversations.providers.base import (
    Done,
    LoadBlob,
    Part,
    Reply,
    Request,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallFinished,
    ToolCallStarted,
    ToolSpec,
    Usage,
)
from conversations.providers.billing import BILLING_RULES, image_tokens
from conversations.providers.client import (
    AnthropicProvider,
    ClientSettings,
    OpenAIProvider,
    Provider,
    complete_reply,
    make_provider,
    normalize_error,
    read_api_key,
    request_body,
)
from conversations.providers.convert import (
    AnthropicPayload,
    OpenAIPayload,
    from_anthropic,
    from_openai,
    parse_arguments,
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
)
from conversations.providers.registry import ModelSpec, parse_models_file, resolve_model

__all__ = [
    "BILLING_RULES",
    "AnthropicPayload",
    "AnthropicProvider",
    "AuthenticationFailed",
    "BadRequest",
    "ClientSettings",
    "ContextOverflow",
    "Done",
    "LoadBlob",
    "ModelSpec",
    "OpenAIPayload",
    "OpenAIProvider",
    "Part",
    "Provider",
    "ProviderError",
    "ProviderUnavailable",
    "RateLimited",
    "Reply",
    "Request",
    "StreamEvent",
    "TextDelta",
    "ThinkingDelta",
    "ToolCallFinished",
    "ToolCallStarted",
    "ToolSpec",
    "Usage",
    "complete_reply",
    "from_anthropic",
    "from_openai",
    "image_tokens",
    "make_provider",
    "normalize_error",
    "parse_arguments",
    "parse_models_file",
    "parse_overflow",
    "read_api_key",
    "redact",
    "request_body",
    "resolve_model",
    "to_anthropic",
    "to_openai",
]
