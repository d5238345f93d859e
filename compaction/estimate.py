"""The token estimator: how big a request will be, before a provider tells us.

Pure Python (no Django), the one estimator Arbor uses everywhere (DESIGN.md §5):

- text by script: Latin ≈ 4 characters a token, Hangul/CJK ≈ 1, other non-ASCII
  scripts ≈ 2, emoji and other astral characters 2 tokens each; code and JSON are
  denser, so the characters-per-token figure falls linearly from 4 to 3 as punctuation
  density rises from 6% to 14% of the non-blank characters (checked against the
  usage Claude measured on the pi and Claude Code samples: within 4% and 10%);
- images by the target provider's billing rule (``conversations.providers.billing``);
- tool calls as their compact JSON; a fixed overhead per part, message and request;
- the raw sum multiplied by a :class:`Calibration` factor learned from measured usage
  and from the numbers in ``ContextOverflow`` errors.

It also checks the limits that are not tokens (:class:`Limits`): images per request,
bytes per image, request bytes.

Raw estimates are what calibration learns from: always compare a *raw* estimate with
what the provider measured, never a calibrated one, or the factor would compound.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from conversations.providers.billing import image_tokens

Message = dict[str, Any]
Part = Mapping[str, Any]

# Overheads, as chat templates add role markers and separators around each item.
MESSAGE_OVERHEAD = 4
REQUEST_OVERHEAD = 3
TOOL_CALL_OVERHEAD = 6
TOOL_RESULT_OVERHEAD = 6
# An image whose size is unknown is billed as a large one: better to over-count.
UNKNOWN_IMAGE_SIZE = (2048, 2048)

PROSE_CHARS_PER_TOKEN = 4.0
CODE_CHARS_PER_TOKEN = 3.0
# Punctuation share of non-blank ASCII characters: at or below LOW it is prose, at or
# above HIGH it is code/JSON; in between the characters-per-token figure is blended.
PUNCT_LOW = 0.06
PUNCT_HIGH = 0.14
OTHER_SCRIPT_TOKENS_PER_CHAR = 0.5
ASTRAL_TOKENS_PER_CHAR = 2.0

# The margin kept free below a limit: a share of it, and at least a floor.
MARGIN_FRACTION = 0.05
MIN_MARGIN_TOKENS = 256

_CJK_RE = re.compile(
    "[\u1100-\u11ff\u2e80-\u2fdf\u3040-\u30ff\u3130-\u318f\u3400-\u4dbf"
    "\u4e00-\u9fff\ua960-\ua97f\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]"
)
# Accented Latin letters tokenize like Latin text.
_LATIN_EXT_RE = re.compile("[\u00c0-\u024f]")
_ASTRAL_RE = re.compile("[\U00010000-\U0010ffff]")
_PUNCTUATION = "{}[]()<>:;,\"'=/\\|`~!@#$%^&*+-.?_"


def margin_tokens(limit: int) -> int:
    """Tokens kept free below ``limit`` so an estimate that is a little low still fits."""
    return max(MIN_MARGIN_TOKENS, math.ceil(limit * MARGIN_FRACTION))


def count_text_tokens(text: str) -> int:
    """Raw token estimate of a piece of text (see the module docstring for the rules)."""
    if not text:
        return 0
    # Blanks count as characters: squeezing indentation runs undercounted real code
    # (line-numbered file reads) by a quarter against Claude's measured usage.
    if text.isascii():
        ascii_chars = len(text)
        cjk = latin_ext = astral = other = 0
    else:
        cjk = len(_CJK_RE.findall(text))
        latin_ext = len(_LATIN_EXT_RE.findall(text))
        astral = len(_ASTRAL_RE.findall(text))
        non_ascii = len(text) - len(text.encode("ascii", "ignore"))
        other = non_ascii - cjk - latin_ext - astral
        ascii_chars = len(text) - non_ascii + latin_ext
    punct = sum(map(text.count, _PUNCTUATION))
    blanks = text.count(" ") + text.count("\n") + text.count("\t")
    solid = max(1, ascii_chars - blanks)
    density = punct / solid
    code_share = min(1.0, max(0.0, (density - PUNCT_LOW) / (PUNCT_HIGH - PUNCT_LOW)))
    chars_per_token = PROSE_CHARS_PER_TOKEN - code_share * (
        PROSE_CHARS_PER_TOKEN - CODE_CHARS_PER_TOKEN
    )
    total = (
        ascii_chars / chars_per_token
        + cjk
        + other * OTHER_SCRIPT_TOKENS_PER_CHAR
        + astral * ASTRAL_TOKENS_PER_CHAR
    )
    return max(1, math.ceil(total))


# Every view a ladder builds estimates the same texts again, so they are cached (keyed
# by value, bounded). Throwaway strings such as slices should use count_text_tokens.
text_tokens = functools.lru_cache(maxsize=4096)(count_text_tokens)


def compact_json(value: Any) -> str:
    """Compact JSON: how tool calls are drawn on pages and quoted to a summarizer."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def wire_json(value: Any) -> str:
    """JSON as providers/convert.py sends tool arguments (what the provider counts)."""
    return json.dumps(value, ensure_ascii=False, default=str)


def part_tokens(part: Part, *, rule: str) -> int:
    """Raw token estimate of one Arbor part under an image billing rule."""
    kind = part.get("type")
    if kind == "text":
        return text_tokens(part.get("text") or "")
    if kind == "image":
        width = part.get("width") or UNKNOWN_IMAGE_SIZE[0]
        height = part.get("height") or UNKNOWN_IMAGE_SIZE[1]
        return image_tokens(rule, int(width), int(height))
    if kind == "tool_call":
        payload = {
            "id": part.get("id"),
            "name": part.get("name"),
            "arguments": part.get("arguments"),
        }
        return TOOL_CALL_OVERHEAD + text_tokens(wire_json(payload))
    if kind == "tool_result":
        inner = sum(part_tokens(p, rule=rule) for p in part.get("parts") or ())
        return TOOL_RESULT_OVERHEAD + text_tokens(str(part.get("call_id") or "")) + inner
    if kind == "thinking":
        # Only signed thinking is sent back to a provider (see providers/convert.py);
        # unsigned reasoning never reaches the prompt.
        return text_tokens(part.get("text") or "") if part.get("signature") else 0
    # An unknown part shape is counted as its JSON: over-counting is the safe side.
    return text_tokens(wire_json({k: v for k, v in part.items() if k not in ("png", "data")}))


def attr(message: Any, name: str, default: Any = None) -> Any:
    """A message attribute, whether the message is a dict or an object (a Django row,
    resume's ViewMessage)."""
    if isinstance(message, Mapping):
        return message.get(name, default)
    return getattr(message, name, default)


def as_message(message: Any) -> Message:
    """A message as a plain ``{"id", "role", "parts", "metadata"}`` dict. The parts list
    is the caller's own (not copied): nothing in compaction mutates it."""
    return {
        "id": str(attr(message, "id", "")),
        "role": str(attr(message, "role", "")),
        "parts": attr(message, "parts", None) or [],
        "metadata": attr(message, "metadata", None) or {},
    }


def message_tokens(message: Any, *, rule: str) -> int:
    """Raw token estimate of one message, overhead included."""
    parts = attr(message, "parts", None) or ()
    return MESSAGE_OVERHEAD + sum(part_tokens(p, rule=rule) for p in parts)


def request_tokens(
    messages: Iterable[Any],
    *,
    rule: str,
    system: str = "",
    tools: Iterable[Mapping[str, Any]] = (),
) -> int:
    """Raw token estimate of a whole request: messages, system prompt and tool schemas."""
    total = REQUEST_OVERHEAD + sum(message_tokens(m, rule=rule) for m in messages)
    if system:
        total += MESSAGE_OVERHEAD + text_tokens(system)
    for tool in tools:
        total += TOOL_CALL_OVERHEAD + text_tokens(wire_json(dict(tool)))
    return total


# --- calibration ------------------------------------------------------------------------

MIN_FACTOR = 0.5
MAX_FACTOR = 4.0
# Undercounting is what overflows a window, so the factor rises faster than it falls.
ALPHA_UP = 0.5
ALPHA_DOWN = 0.2
# How much one observation counts grows with its size: a request of this many raw
# tokens weighs half. A "Hi!" with three tool definitions (a hundred tokens, mostly
# fixed overheads the estimate models least well) barely moves the factor; a 20,000-
# token agent request moves it almost fully.
WEIGHT_TOKENS = 2000
# However far off one observation is, it moves the factor by at most this ratio: a
# provider's odd count (or a bogus overflow message) cannot pin every later request.
MAX_STEP = 1.25


def _bounded(factor: float) -> float:
    return min(MAX_FACTOR, max(MIN_FACTOR, factor))


@dataclass(frozen=True)
class Calibration:
    """How far the raw estimate is from what a provider counts, as a factor.

    ``observe`` folds in measured usage: a moving average of measured / raw estimate
    (each ratio bounded to [0.5, 4]) weighted by the request's size, starting from a
    prior of 1.0, one observation moving it by at most ``MAX_STEP``, and never below
    1.0 after the provider reported more than the raw estimate. ``after_overflow`` folds
    in the numbers of a rejected request: the factor becomes at least measured / raw, so
    the same payload is never again estimated below what the provider counted.
    """

    factor: float = 1.0
    samples: int = 0

    def apply(self, raw_tokens: int) -> int:
        """The calibrated estimate of something whose raw estimate is ``raw_tokens``."""
        return math.ceil(raw_tokens * self.factor)

    def observe(self, raw_estimate: int, measured: int) -> Calibration:
        """Learn from a request whose raw estimate was ``raw_estimate`` and whose prompt the
        provider measured at ``measured`` input tokens."""
        if raw_estimate <= 0 or measured <= 0:
            return self
        ratio = _bounded(measured / raw_estimate)
        weight = raw_estimate / (raw_estimate + WEIGHT_TOKENS)
        # The first observations move further (a running mean: the prior 1.0 is only a
        # guess), later ones by the moving average's rate.
        alpha = ALPHA_UP if ratio > self.factor else ALPHA_DOWN
        alpha = max(alpha, 1.0 / (self.samples + 1)) * weight
        factor = self.factor + alpha * (ratio - self.factor)
        factor = min(self.factor * MAX_STEP, max(self.factor / MAX_STEP, factor))
        if ratio > 1.0:
            # Undercounting overflows windows: never stay below the provider's count.
            factor = max(factor, 1.0)
        return Calibration(factor=_bounded(factor), samples=self.samples + 1)

    def after_overflow(self, raw_estimate: int, measured: int | None) -> Calibration:
        """Learn from a ``ContextOverflow``: the provider counted ``measured`` tokens for a
        request whose raw estimate was ``raw_estimate``."""
        if not measured or raw_estimate <= 0:
            return self
        factor = max(self.factor, measured / raw_estimate, 1.0)
        return Calibration(factor=_bounded(factor), samples=self.samples + 1)


def usage_pairs(
    messages: Iterable[Any], *, rule: str, fixed_tokens: int = 0
) -> list[tuple[int, int]]:
    """``(raw estimate, measured input tokens)`` for every assistant message that carries
    measured usage: its prompt was every message before it on the path, plus
    ``fixed_tokens`` for what the messages do not show (system prompt, tool schemas)."""
    pairs: list[tuple[int, int]] = []
    running = REQUEST_OVERHEAD + fixed_tokens
    for message in messages:
        usage = (attr(message, "metadata", None) or {}).get("usage") or {}
        measured = usage.get("input_tokens")
        if attr(message, "role") == "assistant" and isinstance(measured, int) and measured > 0:
            pairs.append((running, measured))
        running += message_tokens(message, rule=rule)
    return pairs


def calibrate_from_usage(
    messages: Iterable[Any],
    *,
    rule: str,
    calibration: Calibration | None = None,
    fixed_tokens: int = 0,
) -> Calibration:
    """Fold every measured usage on a path into ``calibration`` (oldest first)."""
    result = calibration or Calibration()
    for raw, measured in usage_pairs(messages, rule=rule, fixed_tokens=fixed_tokens):
        result = result.observe(raw, measured)
    return result


# --- limits that are not tokens ----------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Per-request limits other than tokens; None means no limit. The defaults are the
    strictest of the big providers (Anthropic: 100 images, 5 MB an image, 32 MB a
    request)."""

    max_images: int | None = 100
    max_image_bytes: int | None = 5 * 1024 * 1024
    max_request_bytes: int | None = 32 * 1024 * 1024


@dataclass(frozen=True)
class LimitViolation:
    limit: str  # "images", "image_bytes" or "request_bytes"
    allowed: int
    actual: int
    where: str = ""  # the message id (and blob) at fault, when there is one

    def __str__(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"{self.limit}: {self.actual} > {self.allowed}{at}"


def iter_images(parts: Iterable[Part]) -> Iterable[Part]:
    """Every image part among ``parts``, those inside tool results included."""
    for part in parts:
        if part.get("type") == "image":
            yield part
        elif part.get("type") == "tool_result":
            yield from iter_images(part.get("parts") or ())


def image_bytes(part: Part, blob_sizes: Mapping[str, int]) -> int | None:
    """Bytes of an image part, when known: a snapshot page carries its PNG, a stored
    blob's size comes from ``blob_sizes``."""
    for key in ("png", "data"):  # inline bytes: a snapshot page, a recompressed image
        inline = part.get(key)
        if isinstance(inline, bytes | bytearray):
            return len(inline)
    size = part.get("size")
    if isinstance(size, int):
        return size
    return blob_sizes.get(str(part.get("blob")))


def check_limits(
    messages: Iterable[Any],
    limits: Limits,
    *,
    blob_sizes: Mapping[str, int] | None = None,
    system: str = "",
    tools: Iterable[Mapping[str, Any]] = (),
) -> list[LimitViolation]:
    """Every non-token limit the request would break. Request bytes are the JSON of the
    text plus images as base64 (4/3 of their bytes); images of unknown size count 0."""
    sizes = blob_sizes or {}
    violations: list[LimitViolation] = []
    count = 0
    total_bytes = _utf8_bytes(system) + sum(_utf8_bytes(wire_json(dict(t))) for t in tools)
    for message in messages:
        parts = attr(message, "parts", None) or ()
        mid = str(attr(message, "id", ""))
        for image in iter_images(parts):
            count += 1
            size = image_bytes(image, sizes)
            if size is None:
                continue
            total_bytes += math.ceil(size * 4 / 3)
            if limits.max_image_bytes is not None and size > limits.max_image_bytes:
                violations.append(LimitViolation("image_bytes", limits.max_image_bytes, size, mid))
        total_bytes += _utf8_bytes(wire_json(_without_images(parts)))
    if limits.max_images is not None and count > limits.max_images:
        violations.append(LimitViolation("images", limits.max_images, count))
    if limits.max_request_bytes is not None and total_bytes > limits.max_request_bytes:
        violations.append(LimitViolation("request_bytes", limits.max_request_bytes, total_bytes))
    return violations


def _utf8_bytes(text: str) -> int:
    # "surrogatepass": a lone surrogate an older Arbor stored (on SQLite) counts three
    # bytes instead of failing the whole request.
    return len(text.encode("utf-8", "surrogatepass"))


def _without_images(parts: Iterable[Part]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        if part.get("type") == "image":
            continue
        if part.get("type") == "tool_result":
            part = {**part, "parts": _without_images(part.get("parts") or ())}
        out.append({k: v for k, v in part.items() if not isinstance(v, bytes | bytearray)})
    return out
