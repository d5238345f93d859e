"""Model providers: the registry, the SDK-backed clients, conversions and the fake.

Typical use::

    from conversations.providers import Request, make_provider

    with make_provider("openai/gpt-4o-mini", load_blob=read_blob) as provider:
        reply = provider.complete(Request(messages=path, system=prompt, tools=tools))

See DESIGN.md §4. Nothing here touches the database.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conversations.lazy import lazy_getattr

if TYPE_CHECKING:
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
        CallCancelled,
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

# Loaded on first use (PEP 562): the pure modules that need only the billing rules
# (compaction.estimate, the renderer) must not pull in the SDK clients with them.
_LAZY = {
    "AnthropicPayload": "conversations.providers.convert",
    "AnthropicProvider": "conversations.providers.client",
    "AuthenticationFailed": "conversations.providers.errors",
    "BILLING_RULES": "conversations.providers.billing",
    "BadRequest": "conversations.providers.errors",
    "CallCancelled": "conversations.providers.client",
    "ClientSettings": "conversations.providers.client",
    "ContextOverflow": "conversations.providers.errors",
    "Done": "conversations.providers.base",
    "LoadBlob": "conversations.providers.base",
    "ModelSpec": "conversations.providers.registry",
    "OpenAIPayload": "conversations.providers.convert",
    "OpenAIProvider": "conversations.providers.client",
    "Part": "conversations.providers.base",
    "Provider": "conversations.providers.client",
    "ProviderError": "conversations.providers.errors",
    "ProviderUnavailable": "conversations.providers.errors",
    "RateLimited": "conversations.providers.errors",
    "Reply": "conversations.providers.base",
    "Request": "conversations.providers.base",
    "StreamEvent": "conversations.providers.base",
    "TextDelta": "conversations.providers.base",
    "ThinkingDelta": "conversations.providers.base",
    "ToolCallFinished": "conversations.providers.base",
    "ToolCallStarted": "conversations.providers.base",
    "ToolSpec": "conversations.providers.base",
    "Usage": "conversations.providers.base",
    "complete_reply": "conversations.providers.client",
    "from_anthropic": "conversations.providers.convert",
    "from_openai": "conversations.providers.convert",
    "image_tokens": "conversations.providers.billing",
    "make_provider": "conversations.providers.client",
    "normalize_error": "conversations.providers.client",
    "parse_arguments": "conversations.providers.convert",
    "parse_models_file": "conversations.providers.registry",
    "parse_overflow": "conversations.providers.errors",
    "read_api_key": "conversations.providers.client",
    "redact": "conversations.providers.errors",
    "request_body": "conversations.providers.client",
    "resolve_model": "conversations.providers.registry",
    "to_anthropic": "conversations.providers.convert",
    "to_openai": "conversations.providers.convert",
}


__getattr__ = lazy_getattr(__name__, globals(), _LAZY)


__all__ = [
    "BILLING_RULES",
    "AnthropicPayload",
    "AnthropicProvider",
    "AuthenticationFailed",
    "BadRequest",
    "CallCancelled",
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
