"""Validation of message parts. Pure Python: no database access here.

Part shapes (DESIGN.md §2)::

    {"type": "text", "text": str}
    {"type": "image", "blob": sha256, "mime": str, "width": int, "height": int}
    {"type": "tool_call", "id": str, "name": str, "arguments": {...}}
    {"type": "tool_result", "call_id": str, "is_error": bool, "parts": [text | image]}
    {"type": "thinking", "text": str, "signature"?: str}
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from conversations.errors import InvalidInput

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
ROLES = ("system", "user", "assistant", "tool")
MAX_ID_CHARS = 200

Part = dict[str, Any]


@dataclass
class DraftMessage:
    """A validated message that is not yet written."""

    role: str
    parts: list[Part]
    metadata: dict[str, Any] = field(default_factory=dict)


# A code point of a UTF-16 pair alone in a str (Python's json reads ``"\\ud83d"`` so):
# no UTF-8 text holds one, so no page, export or request body can be written with it.
_SURROGATE = re.compile("[\ud800-\udfff]")
_NOT_TEXT = re.compile("[\x00\ud800-\udfff]")
_NOT_TEXT_OR_TOO_DEEP = "contains a NUL character or a lone surrogate, or is nested too deeply"


class _Errors:
    def __init__(self) -> None:
        self.items: list[dict[str, str]] = []

    def add(self, loc: str, msg: str) -> None:
        self.items.append({"loc": loc, "msg": msg})


def _check_str(
    errors: _Errors, loc: str, value: Any, *, max_chars: int, allow_empty: bool = True
) -> None:
    if not isinstance(value, str):
        errors.add(loc, "must be a string")
    elif not allow_empty and not value.strip():
        errors.add(loc, "must not be empty")
    elif len(value) > max_chars:
        errors.add(loc, f"is longer than {max_chars} characters")
    elif "\x00" in value:
        errors.add(loc, "contains a NUL character")
    elif _SURROGATE.search(value):
        errors.add(loc, "contains a lone surrogate (half of a UTF-16 pair), which is not text")


def contains_nul(value: Any, *, _depth: int = 0) -> bool:
    """True if a NUL character (or a lone surrogate) hides anywhere in a JSON value
    (PostgreSQL refuses them in text and jsonb, so they must be rejected before a write,
    not at the database)."""
    if _depth > 100:
        return True  # absurd nesting is refused with the same error
    if isinstance(value, str):
        return _NOT_TEXT.search(value) is not None
    if isinstance(value, dict):
        return any(
            contains_nul(k, _depth=_depth + 1) or contains_nul(v, _depth=_depth + 1)
            for k, v in value.items()
        )
    if isinstance(value, list):
        return any(contains_nul(v, _depth=_depth + 1) for v in value)
    return False


def without_lone_surrogates(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings and keys replaced by U+FFFD
    (what an older Arbor could store on SQLite, see models.TextJSONField)."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {without_lone_surrogates(k): without_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_lone_surrogates(v) for v in value]
    return value


MAX_METADATA_BYTES = 64 * 1024


# The keys each part type may carry; anything else is reported (and dropped).
_PART_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type", "text"}),
    "image": frozenset({"type", "blob", "mime", "width", "height"}),
    "tool_call": frozenset({"type", "id", "name", "arguments"}),
    "tool_result": frozenset({"type", "call_id", "is_error", "parts"}),
    "thinking": frozenset({"type", "text", "signature"}),
}
# What a tool result may hold: no calls, results or thinking inside a result.
_NESTED_KINDS = frozenset({"text", "image"})


def _clean_text(errors: _Errors, loc: str, part: Part, *, role: str, max_chars: int) -> Part:
    _check_str(errors, f"{loc}.text", part.get("text"), max_chars=max_chars)
    return {"type": "text", "text": part.get("text")}


def _clean_image(
    errors: _Errors, loc: str, part: Part, *, role: str, max_chars: int
) -> Part | None:
    blob = part.get("blob")
    if not isinstance(blob, str) or not SHA256_RE.match(blob):
        errors.add(f"{loc}.blob", "must be the lowercase hex sha256 of an uploaded blob")
        return None
    # mime and size are filled in from the Blob row, never trusted from the client.
    return {"type": "image", "blob": blob}


def _clean_thinking(errors: _Errors, loc: str, part: Part, *, role: str, max_chars: int) -> Part:
    if role != "assistant":
        errors.add(loc, "thinking parts belong to assistant messages")
    _check_str(errors, f"{loc}.text", part.get("text"), max_chars=max_chars)
    out: Part = {"type": "thinking", "text": part.get("text")}
    if "signature" in part:
        _check_str(errors, f"{loc}.signature", part["signature"], max_chars=max_chars)
        out["signature"] = part["signature"]
    return out


def _clean_tool_call(errors: _Errors, loc: str, part: Part, *, role: str, max_chars: int) -> Part:
    if role != "assistant":
        errors.add(loc, "tool calls belong to assistant messages")
    _check_str(errors, f"{loc}.id", part.get("id"), max_chars=MAX_ID_CHARS, allow_empty=False)
    _check_str(errors, f"{loc}.name", part.get("name"), max_chars=MAX_ID_CHARS, allow_empty=False)
    arguments = part.get("arguments", {})
    if not isinstance(arguments, dict):
        errors.add(f"{loc}.arguments", "must be an object")
    elif contains_nul(arguments):
        errors.add(f"{loc}.arguments", _NOT_TEXT_OR_TOO_DEEP)
    return {
        "type": "tool_call",
        "id": part.get("id"),
        "name": part.get("name"),
        "arguments": arguments,
    }


def _clean_tool_result(errors: _Errors, loc: str, part: Part, *, role: str, max_chars: int) -> Part:
    if role != "tool":
        errors.add(loc, "tool results belong to tool messages")
    _check_str(
        errors, f"{loc}.call_id", part.get("call_id"), max_chars=MAX_ID_CHARS, allow_empty=False
    )
    is_error = part.get("is_error", False)
    if not isinstance(is_error, bool):
        errors.add(f"{loc}.is_error", "must be true or false")
    inner = part.get("parts", [])
    if not isinstance(inner, list):
        errors.add(f"{loc}.parts", "must be a list")
        inner = []
    cleaned = [
        _clean_part(errors, f"{loc}.parts[{i}]", p, role=role, max_chars=max_chars, nested=True)
        for i, p in enumerate(inner)
    ]
    return {
        "type": "tool_result",
        "call_id": part.get("call_id"),
        "is_error": is_error,
        "parts": [p for p in cleaned if p is not None],
    }


class _PartCleaner(Protocol):
    def __call__(
        self, errors: _Errors, loc: str, part: Part, *, role: str, max_chars: int
    ) -> Part | None: ...


_CLEANERS: dict[str, _PartCleaner] = {
    "text": _clean_text,
    "image": _clean_image,
    "thinking": _clean_thinking,
    "tool_call": _clean_tool_call,
    "tool_result": _clean_tool_result,
}


def _clean_part(
    errors: _Errors, loc: str, part: Any, *, role: str, max_chars: int, nested: bool = False
) -> Part | None:
    """One part checked and rebuilt from its allowed keys; every problem goes to
    ``errors`` (None when the part cannot be kept at all)."""
    if not isinstance(part, dict):
        errors.add(loc, "a part must be an object")
        return None
    kind = part.get("type")
    if kind not in _PART_KEYS:
        errors.add(
            f"{loc}.type", f"unknown part type {kind!r}; expected one of {sorted(_PART_KEYS)}"
        )
        return None
    extra = set(part) - _PART_KEYS[kind]
    if extra:
        errors.add(loc, f"unexpected keys {sorted(extra)} for a {kind} part")
    if nested and kind not in _NESTED_KINDS:
        errors.add(loc, "a tool result may only contain text and image parts")
        return None
    return _CLEANERS[kind](errors, loc, part, role=role, max_chars=max_chars)


def _clean_metadata(errors: _Errors, loc: str, metadata: Any) -> dict[str, Any]:
    """A message's metadata: an object, free of NUL, at most MAX_METADATA_BYTES as JSON
    (it is stored with the message and sent back with it)."""
    if not isinstance(metadata, dict):
        errors.add(f"{loc}.metadata", "must be an object")
        return {}
    if contains_nul(metadata):
        errors.add(f"{loc}.metadata", _NOT_TEXT_OR_TOO_DEEP)
    elif len(json.dumps(metadata)) > MAX_METADATA_BYTES:
        errors.add(f"{loc}.metadata", f"is larger than {MAX_METADATA_BYTES} bytes as JSON")
    return metadata


def _clean_message(errors: _Errors, loc: str, item: Any, *, max_chars: int) -> DraftMessage | None:
    """One ``{role, parts, metadata?}`` object; None when its role or parts are unusable
    (its problems are in ``errors``)."""
    if not isinstance(item, dict):
        errors.add(loc, "must be an object")
        return None
    role = item.get("role")
    if role not in ROLES:
        errors.add(f"{loc}.role", f"must be one of {list(ROLES)}")
        return None
    parts = item.get("parts")
    if not isinstance(parts, list) or not parts:
        errors.add(f"{loc}.parts", "must be a non-empty list")
        return None
    cleaned = [
        _clean_part(errors, f"{loc}.parts[{j}]", p, role=role, max_chars=max_chars)
        for j, p in enumerate(parts)
    ]
    if role == "tool" and any(p and p["type"] != "tool_result" for p in cleaned):
        errors.add(f"{loc}.parts", "a tool message holds only tool_result parts")
    if role == "system" and any(p and p["type"] != "text" for p in cleaned):
        errors.add(f"{loc}.parts", "a system message holds only text parts")
    metadata = _clean_metadata(errors, loc, item.get("metadata", {}))
    return DraftMessage(role=role, parts=[p for p in cleaned if p is not None], metadata=metadata)


def clean_messages(raw: Any, *, max_messages: int, max_chars: int) -> list[DraftMessage]:
    """Validate a list of ``{role, parts, metadata?}`` objects; raise InvalidInput listing
    every problem at once."""
    errors = _Errors()
    if not isinstance(raw, list) or not raw:
        raise InvalidInput("messages must be a non-empty list")
    if len(raw) > max_messages:
        raise InvalidInput(f"a turn holds at most {max_messages} messages, got {len(raw)}")
    drafts: list[DraftMessage] = []
    for i, item in enumerate(raw):
        draft = _clean_message(errors, f"messages[{i}]", item, max_chars=max_chars)
        if draft is not None:
            drafts.append(draft)
    if errors.items:
        raise InvalidInput("the messages are not valid", errors=errors.items)
    return drafts


def tool_calls(parts: Iterable[Part]) -> Iterator[Part]:
    return (p for p in parts if p["type"] == "tool_call")


def tool_results(parts: Iterable[Part]) -> Iterator[Part]:
    return (p for p in parts if p["type"] == "tool_result")


def image_blobs(parts: Iterable[Part]) -> Iterator[str]:
    for p in parts:
        if p["type"] == "image":
            yield p["blob"]
        elif p["type"] == "tool_result":
            yield from image_blobs(p["parts"])


def check_turn_pairing(drafts: list[DraftMessage], *, ends_in_rewind: bool = False) -> None:
    """A turn is complete: every tool call is answered by a result later in the same turn,
    every result answers a call made earlier in it, and the turn does not end waiting on a
    tool (it ends with a user message or an assistant message without tool calls).

    A turn the model abandoned with its rewind tool ends on that tool's result instead:
    still fully paired, it is the end of the branch left behind."""
    errors = _Errors()
    open_calls: dict[str, int] = {}
    seen_calls: set[str] = set()
    for i, draft in enumerate(drafts):
        for part in draft.parts:
            if part["type"] == "tool_call":
                if part["id"] in seen_calls:
                    errors.add(f"messages[{i}]", f"tool call id {part['id']!r} is used twice")
                seen_calls.add(part["id"])
                open_calls[part["id"]] = i
            elif part["type"] == "tool_result":
                if part["call_id"] not in open_calls:
                    errors.add(
                        f"messages[{i}]",
                        f"tool result for {part['call_id']!r} has no earlier tool call "
                        "in this turn",
                    )
                else:
                    del open_calls[part["call_id"]]
    for call_id, i in open_calls.items():
        errors.add(f"messages[{i}]", f"tool call {call_id!r} has no tool result in this turn")
    last = drafts[-1]
    if ends_in_rewind and last.role == "tool":
        pass
    elif last.role == "tool" or (last.role == "assistant" and any(tool_calls(last.parts))):
        errors.add(
            f"messages[{len(drafts) - 1}]",
            "a turn must end at a boundary: a user message or a final assistant message",
        )
    if errors.items:
        raise InvalidInput(
            "the turn is not complete: tool calls and results must pair up",
            code="unpaired_tool_call",
            errors=errors.items,
        )


def readable_text(parts: Any, *, results: bool = True) -> str:
    """A message's parts as a reader sees them, one line per part: text as it is,
    ``[thinking]``, ``[call <name>]``, a tool result's text (or ``[tool result]`` and
    ``error`` with ``results=False``), ``[image]``. The compare page diffs this; previews
    squash it to one line."""
    bits: list[str] = []
    for part in parts if isinstance(parts, list) else []:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "text":
            bits.append(str(part.get("text", "")))
        elif kind == "thinking":
            bits.append("[thinking]")
        elif kind == "tool_call":
            bits.append(f"[call {part.get('name')}]")
        elif kind == "tool_result":
            if results:
                bits.extend(
                    str(inner.get("text", ""))
                    for inner in part.get("parts") or []
                    if isinstance(inner, dict) and inner.get("type") == "text"
                )
            else:
                bits.append("[tool result]" + (" error" if part.get("is_error") else ""))
        elif kind == "image":
            bits.append("[image]")
    return "\n".join(bits)


# A message's searchable text is capped: tool results can hold megabytes (a whole file
# read by an agent), and the column would otherwise double them. 200,000 characters keeps
# everything but such dumps whole; past the cap a word is not found.
SEARCH_TEXT_MAX_CHARS = 200_000


def searchable_text(parts: Any) -> str:
    """The words of a message for search (``Message.search_text``): text and thinking,
    tool call names and arguments, the text of tool results — never image data. Runs of
    whitespace become one space, so a phrase matches across line breaks."""
    pieces: list[str] = []
    size = 0

    def add(value: Any) -> None:
        nonlocal size
        if isinstance(value, str) and size <= SEARCH_TEXT_MAX_CHARS:
            # Slice before splitting: a 2 MB part is cut first, not split into words whole.
            words = " ".join(value[: SEARCH_TEXT_MAX_CHARS + 1].split())
            if words:
                pieces.append(words)
                size += len(words) + 1

    for part in parts if isinstance(parts, list) else []:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind in ("text", "thinking"):
            add(part.get("text"))
        elif kind == "tool_call":
            add(part.get("name"))
            if part.get("arguments"):
                # Sorted keys: PostgreSQL's jsonb reorders them, and the text must not
                # depend on whether the parts were read back from it.
                add(json.dumps(part["arguments"], ensure_ascii=False, sort_keys=True))
        elif kind == "tool_result":
            for inner in part.get("parts") or []:
                if isinstance(inner, dict) and inner.get("type") == "text":
                    add(inner.get("text"))
    # PostgreSQL refuses NUL in text; validated parts hold none, but stay safe.
    return " ".join(pieces)[:SEARCH_TEXT_MAX_CHARS].replace("\x00", "")


class NotJSON(ValueError):
    """A JSON text refused although a parser would read it: NaN and Infinity, nesting
    deeper than ``MAX_JSON_DEPTH``, a key repeated in one object, or an escaped lone
    surrogate (``"\\ud83d"``, half an emoji) that no UTF-8 text can hold."""


def reject_constant(name: str) -> Any:
    """json.loads hook: NaN and Infinity are not JSON and PostgreSQL refuses them."""
    raise NotJSON(f"{name} is not valid JSON (numbers must be finite)")


def finite_float(text: str) -> float:
    """json.loads hook: a number too large for a float (``1e999``) is Infinity too."""
    value = float(text)
    if math.isinf(value):
        raise NotJSON(f"{text[:40]} is too large a number (numbers must be finite)")
    return value


# An integer too long for 64 bits, which orjson would read as a float, shows as a run of
# twenty digits: every digit byte mapped to "0", every other byte to " " (C speed).
_DIGIT_RUNS = bytes(ord("0") if ord("0") <= i <= ord("9") else ord(" ") for i in range(256))
_LONG_INTEGER = b"0" * 20

# Arrays and objects nest at most this deep in a request body: no API or provider body
# needs more, and Python's parser (and every walk over the value) recurses per level.
MAX_JSON_DEPTH = 64

# Where a key ends: a ``"`` then ``:``, perhaps with blanks between; an escaped quote
# (``\\"``) followed by a colon inside a string looks the same, and is told apart only
# when the count is in doubt.
_KEY_END = re.compile(rb'"[ \t\n\r]*:')
_ESCAPED_KEY_END = re.compile(rb'\\"[ \t\n\r]*:')
# The text without its strings (escaped backslashes and quotes removed first, so every
# ``"`` left opens or closes one): what remains shows the nesting.
_STRING_BODIES = re.compile(rb'"[^"]*+"')
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(set(range(256)) - {ord("["), ord("]"), ord("{"), ord("}")})
_STEP = tuple(1 if i == ord("[") else -1 if i == ord("]") else 0 for i in range(256))


def _text_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in a JSON text, without parsing it (linear, at
    C speed but for one step per bracket). Anything goes for an invalid text."""
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    nesting = _STRING_BODIES.sub(b"", text).translate(_BRACKETS, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_STEP.__getitem__, nesting)), default=0)


def _no_repeated_key(raw: bytes, keys: int) -> bool:
    """Whether a valid JSON text with ``keys`` keys in its parsed value wrote no key twice
    in one object: it did not when it has no more key ends than that (each key written
    ends in a quote and a colon). Regex scans at C speed; False when in doubt."""
    if len(_KEY_END.findall(raw)) == keys:
        return True
    # Not counting escaped quotes then (``\\\\`` is an escaped backslash, not one).
    text = raw.replace(b"\\\\", b"")
    return len(_KEY_END.findall(text)) - len(_ESCAPED_KEY_END.findall(text)) == keys


def _keys_and_depth(value: Any) -> tuple[int, int]:
    """The keys of all objects in an orjson value, and how deep it nests (counted up to
    one level past ``MAX_JSON_DEPTH``), level by level: no recursion."""
    keys = depth = 0
    level = [value] if type(value) is dict or type(value) is list else []
    while level and depth <= MAX_JSON_DEPTH:
        depth += 1
        below: list[Any] = []
        for item in level:
            if type(item) is dict:
                keys += len(item)
            children = item.values() if type(item) is dict else item
            below += [c for c in children if type(c) is dict or type(c) is list]
        level = below
    return keys, depth


def _shown(key: str) -> str:
    """A key as an error message may quote it: short, and text (a lone surrogate would
    break the JSON that carries the message)."""
    return _SURROGATE.sub("\ufffd", key[:40] + ("…" if len(key) > 40 else ""))


def _path(path: tuple[str | int, ...]) -> str:
    shown = "".join(f"[{p}]" if isinstance(p, int) else f".{_shown(p)}" for p in path)
    shown = shown.lstrip(".")
    return shown if len(shown) <= 200 else f"{shown[:100]}…{shown[-100:]}"


def _at(path: tuple[str | int, ...]) -> str:
    return f" (at {_path(path)})" if path else ""


class _Object(dict[str, Any]):
    """An object as json.loads builds it here: the first repeated key noted, not lost."""

    repeated: str | None = None


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    value = _Object(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                value.repeated = key
                break
            seen.add(key)
    return value


def _refuse_inside(value: Any) -> None:
    """NotJSON naming the first repeated key, lone surrogate or too deep a level in a
    value json.loads built (with ``_object``), and where it is."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict | list) and len(path) >= MAX_JSON_DEPTH:
            raise NotJSON(f"the JSON nests deeper than {MAX_JSON_DEPTH} levels{_at(path)}")
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise NotJSON(
                    "a string holds an escaped lone surrogate (half of a UTF-16 pair, such "
                    f"as \\ud83d), which is not text{_at(path)}"
                )
        elif isinstance(item, dict):
            if isinstance(item, _Object) and item.repeated is not None:
                raise NotJSON(
                    f'the key "{_shown(item.repeated)}" appears twice in one object{_at(path)}'
                )
            for key, child in reversed(item.items()):
                if _SURROGATE.search(key):
                    raise NotJSON(
                        "a key holds an escaped lone surrogate (half of a UTF-16 pair), "
                        f"which is not text{_at(path)}"
                    )
                stack.append((child, (*path, key)))
        elif isinstance(item, list):
            stack.extend((child, (*path, i)) for i, child in reversed(list(enumerate(item))))


def strict_json(raw: str | bytes) -> Any:
    """``json.loads`` that refuses what JSON (or PostgreSQL, or a provider) does not take
    although a parser reads it: NaN and Infinity, spelt out or overflowing; nesting
    deeper than ``MAX_JSON_DEPTH``; a key repeated in one object (a parser keeps one
    value, the provider a body is forwarded to may read the other); an escaped lone
    surrogate. NotJSON, a ValueError, says which, and where when it can.

    Bytes go through orjson first (a tenth of the time on a large body: every API and
    gateway request), which refuses the same numbers and lone surrogates and nests at
    most 1,024 deep; its value's depth is then checked, and its keys counted against the
    text's (one fewer for each repeated key). Python's parser reads what orjson refuses
    or what that count doubts (so the message names the problem), and long integers
    (kept exact), after the depth is checked on the text, since it recurses per level."""
    if isinstance(raw, bytes) and _LONG_INTEGER not in raw.translate(_DIGIT_RUNS):
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        else:
            keys, depth = _keys_and_depth(value)
            if depth > MAX_JSON_DEPTH:
                _refuse_inside(value)  # names where
                raise NotJSON(f"the JSON nests deeper than {MAX_JSON_DEPTH} levels")
            if _no_repeated_key(raw, keys):
                return value
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    if _text_depth(data) > MAX_JSON_DEPTH:
        with contextlib.suppress(orjson.JSONDecodeError):
            _refuse_inside(orjson.loads(data))  # names where, when orjson can read it
        raise NotJSON(f"the JSON nests deeper than {MAX_JSON_DEPTH} levels")
    value = json.loads(
        raw, parse_constant=reject_constant, parse_float=finite_float, object_pairs_hook=_object
    )
    _refuse_inside(value)
    return value
