"""Provider errors, normalised across the OpenAI-compatible and Anthropic protocols.

Every error carries a ``code`` and a message that is safe to show the user: it is built
from the provider's own error text with anything that looks like a credential removed,
and never from the SDK exception (whose string can include request details).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any


class ProviderError(Exception):
    """A model request failed. ``str(exc)`` is safe to show the user."""

    code = "provider_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        status: int | None = None,
        provider: str | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        message = redact(message)
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.status = status
        self.provider = provider
        self.request_id = request_id
        # Seconds the provider asked us to wait, when it said so (Retry-After).
        self.retry_after = retry_after

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape the API uses for errors: ``{"error": code, "detail": …}``."""
        out: dict[str, Any] = {"error": self.code, "detail": self.message}
        if self.status is not None:
            out["provider_status"] = self.status
        if self.retry_after is not None:
            out["retry_after"] = self.retry_after
        return out


class ContextOverflow(ProviderError):
    """The request was larger than the model's context window.

    ``measured_tokens`` is the prompt size the provider counted and ``limit`` the window
    it enforces, when its message says so (either may be None: some providers only give a
    code). They feed the estimator's calibration and the reactive compaction budget.
    """

    code = "context_overflow"

    def __init__(
        self,
        measured_tokens: int | None = None,
        limit: int | None = None,
        *,
        message: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.measured_tokens = measured_tokens
        self.limit = limit
        if message is None:
            if measured_tokens is not None and limit is not None:
                message = (
                    f"the conversation is too long for the model: {measured_tokens} tokens "
                    f"> {limit} maximum"
                )
            else:
                message = "the conversation is too long for the model's context window"
        super().__init__(message, **kwargs)

    def as_dict(self) -> dict[str, Any]:
        return {**super().as_dict(), "measured_tokens": self.measured_tokens, "limit": self.limit}


class RateLimited(ProviderError):
    """429 after the SDK's own retries (which honour Retry-After) ran out."""

    code = "rate_limited"


class ProviderUnavailable(ProviderError):
    """5xx, timeouts or connection failures after the bounded retries."""

    code = "provider_unavailable"


class BadRequest(ProviderError):
    """The provider rejected the request as invalid (4xx other than overflow and 429)."""

    code = "provider_bad_request"


class AuthenticationFailed(ProviderError):
    """401/403, or no credentials configured. The message never includes the key."""

    code = "provider_auth"


# --- overflow messages ----------------------------------------------------------------

_INT = r"(\d[\d,_]*)"


def _num(text: str) -> int:
    return int(text.replace(",", "").replace("_", ""))


# Each pattern names its groups ``measured`` and/or ``limit``. Real shapes, newest first
# where a provider has several. Matching is case-insensitive and tolerant of the
# punctuation around the numbers.
_OVERFLOW_PATTERNS: list[re.Pattern[str]] = [
    # OpenAI / vLLM / DeepSeek / OpenRouter: "…maximum context length is 8192 tokens.
    # However, you requested 9000 tokens (8000 in the messages, 1000 in the completion)."
    # The prompt alone is the part before the completion, so measured = messages (+
    # functions) rather than the requested total.
    re.compile(
        r"maximum context length is " + _INT + r" tokens.*?"
        r"requested (?:about )?" + _INT + r" tokens \((?P<parts>[^)]*)\)",
        re.I | re.S,
    ),
    # OpenAI chat: "…maximum context length is 8192 tokens. However, your messages
    # resulted in 9000 tokens…" (also "…resulted in 9000 tokens (8800 in the messages,
    # 200 in the functions)").
    re.compile(
        r"maximum context length is (?P<limit>\d[\d,_]*) tokens.*?"
        r"(?:resulted in|requested|has|contains) (?:about )?(?P<measured>\d[\d,_]*)"
        r"(?: input)? tokens",
        re.I | re.S,
    ),
    # (also vLLM's "…maximum context length is 8192 tokens and your request has 5000
    # input tokens (4096 > 8192 - 5000)")
    # Anthropic: "prompt is too long: 208310 tokens > 200000 maximum"
    re.compile(
        r"prompt is too long:\s*(?P<measured>\d[\d,_]*) tokens\s*>\s*(?P<limit>\d[\d,_]*)",
        re.I,
    ),
    # Anthropic (older): "input length and `max_tokens` exceed context limit: 198000 +
    # 8192 > 200000, decrease input length or `max_tokens` and try again"
    re.compile(
        r"exceed context limit:\s*(?P<measured>\d[\d,_]*)\s*\+\s*\d[\d,_]*\s*>\s*"
        r"(?P<limit>\d[\d,_]*)",
        re.I,
    ),
    # Gemini: "The input token count (1200000) exceeds the maximum number of tokens
    # allowed (1048576)."
    re.compile(
        r"input token count(?: \(| is |: )(?P<measured>\d[\d,_]*)\)? exceeds the maximum"
        r" number of tokens allowed(?: \(| is |: )?(?P<limit>\d[\d,_]*)?",
        re.I,
    ),
    # llama.cpp server: "request (9000 tokens) exceeds the available context size (8192
    # tokens), try increasing it"
    re.compile(
        r"request \((?P<measured>\d[\d,_]*) tokens\) exceeds the available context size"
        r" \((?P<limit>\d[\d,_]*) tokens\)",
        re.I,
    ),
    # Mistral: "Prompt contains 40000 tokens and 0 draft tokens, too large for model with
    # 32768 maximum context length"
    re.compile(
        r"prompt contains (?P<measured>\d[\d,_]*) tokens.*?too large for model with "
        r"(?P<limit>\d[\d,_]*) maximum context length",
        re.I | re.S,
    ),
]

# Overflow without numbers: OpenAI's code (chat completions and the Responses API), and
# wordings that name the condition only.
_OVERFLOW_CODES = {
    "context_length_exceeded",
    "exceed_context_size_error",
    "string_above_max_length",
}
_OVERFLOW_WORDS = re.compile(
    r"context_length_exceeded|maximum context length|context window|prompt is too long"
    r"|exceeds the available context size|input is too long"
    r"|exceeds the maximum number of tokens allowed",
    re.I,
)
OVERFLOW_SCAN_CHARS = 4096
_LIMIT_ONLY = re.compile(
    r"(?:maximum context length is|maximum number of tokens allowed(?: is|:)?\s*\(?)"
    r"\s*(?P<limit>\d[\d,_]*)",
    re.I,
)


def parse_overflow(message: str, code: str | None = None) -> tuple[int | None, int | None] | None:
    """Recognise a provider's context-overflow error.

    Returns ``(measured_tokens, limit)`` — either may be None when the provider does not
    say — or None when the message is not an overflow at all. ``code`` is the provider's
    error code where it gives one (OpenAI's ``context_length_exceeded``).
    """
    # Only the head of the message is read: the patterns' ``.*?`` rescans the rest of
    # the text from every "maximum context length is" (quadratic in a hostile upstream's
    # long message), and a provider names an overflow in its first sentences.
    text = (message or "")[:OVERFLOW_SCAN_CHARS]
    first = _OVERFLOW_PATTERNS[0].search(text)
    if first:
        limit = _num(first.group(1))
        measured = _num(first.group(2))
        # "(8000 in the messages, 1000 in the completion)" → the prompt is everything
        # except the completion; tokens reserved for output are not prompt size.
        prompt = 0
        found = False
        for amount, what in re.findall(r"(\d[\d,_]*) in the (\w+)", first.group("parts")):
            if what.lower() != "completion":
                prompt += _num(amount)
                found = True
        return (prompt if found else measured), limit
    for pattern in _OVERFLOW_PATTERNS[1:]:
        match = pattern.search(text)
        if match:
            groups = match.groupdict()
            measured_text = groups.get("measured")
            limit_text = groups.get("limit")
            return (
                _num(measured_text) if measured_text else None,
                _num(limit_text) if limit_text else None,
            )
    if (code and code in _OVERFLOW_CODES) or _OVERFLOW_WORDS.search(text):
        only = _LIMIT_ONLY.search(text)
        return None, (_num(only.group("limit")) if only else None)
    return None


# --- redaction ------------------------------------------------------------------------

# Shapes of provider keys: OpenAI (sk-…, sk-proj-…), Anthropic (sk-ant-…), Google (AIza…),
# OpenRouter (sk-or-…), Groq (gsk_…), and bearer tokens in echoed headers.
_KEY_SHAPES = re.compile(
    r"(?:\bsk-[A-Za-z0-9_\-*.]{6,}|\bAIza[0-9A-Za-z_\-]{20,}|\bgsk_[A-Za-z0-9]{10,}"
    r"|(?i:bearer)\s+[A-Za-z0-9_\-.=*]{8,})"
)

# Environment variables whose values are secrets, checked at redaction time so a key set
# after import is still covered.
_SECRET_ENV_SUFFIXES = ("_API_KEY", "_AUTH_TOKEN", "_KEY")
_extra_secrets: set[str] = set()


def register_secret(value: str | None) -> None:
    """Remember a secret (e.g. a key read from a *_FILE) so redact() removes it."""
    if value and len(value) >= 8:
        _extra_secrets.add(value)


def _known_secrets() -> Iterable[str]:
    yield from _extra_secrets
    for name, value in os.environ.items():
        if name.endswith(_SECRET_ENV_SUFFIXES) and value and len(value) >= 8:
            yield value


def redact(text: str) -> str:
    """Remove API keys from text meant for users or logs."""
    for secret in sorted(set(_known_secrets()), key=len, reverse=True):
        text = text.replace(secret, "[redacted]")
    return _KEY_SHAPES.sub("[redacted]", text)
