"""The compaction ladder: what the model sees when a conversation outgrows its window.

Pure Python over a :class:`ContextView` (messages + budget + model + calibration); no
Django, no database, no network. Each rung returns a NEW view and a :class:`RungReport`;
the messages given in are never mutated (DESIGN.md invariant 8) and every placeholder,
page and summary names the ids of the originals it stands for.

Rungs, cheapest first (invariant 9), always run from the originals (``view.source``):

0. ``fit_images``: what the provider accepts at all, applied to every request: no image
   parts for a model without vision (placeholders naming blob and message), images over
   the bytes-per-image limit recompressed by an injected ``shrink`` (or replaced), the
   oldest images dropped when the request has too many or is too many bytes.
1. ``elide``: tool results between the head and the last K turns that are *uneventful*
   become ``[elided tool result <message id>: N chars]`` (inside the same tool_result
   part, so the call/result pairing stays valid). A result is eventful, and kept, when
   it is an error, when its call or message id is quoted anywhere later, or when later
   narration or a later tool call's arguments use what it revealed: a path, file name,
   id or code identifier first seen in it (not asked for by its own call), or a number
   it holds (line numbers included). Narration is never touched.
2. ``strip_images``: images between the head and the last K turns become
   ``[image <sha256> WxH removed; message <id>]``. Snapshot pages are never stripped.
3. ``snapshot``: head = leading system messages + the first user turn (or, when that turn
   alone exceeds the head budget, just up to the first user message: the task), tail =
   the newest turns that fit the tail budget, cut at a turn boundary; both are sent as
   the originals, byte for byte. The middle becomes pages drawn by an injected
   ``render`` callable from the archived original text (a result the elision rung
   judged uneventful is drawn as its placeholder), followed by the user's own messages
   of the middle, verbatim. Skipped for models without vision.
4. ``summarize_middle``: one model call over the middle through an injected
   ``summarize`` callable, chunked (and merged) so that no request's calibrated
   estimate plus its reserved output exceeds the window less the margin (invariant 11);
   head, tail and the user's own words stay verbatim beside it.

Turns start at each user message (the first turn also holds any leading system
messages). The view is only ever cut at a *safe boundary*: a point with no tool call
whose result comes after it. When even the last turn is over the tail budget (one long
agent turn), the tail is cut at a safe boundary inside it.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Any, Protocol

from compaction.estimate import (
    MESSAGE_OVERHEAD,
    REQUEST_OVERHEAD,
    Calibration,
    Limits,
    LimitViolation,
    Message,
    as_message,
    check_limits,
    compact_json,
    count_text_tokens,
    image_bytes,
    iter_images,
    margin_tokens,
    message_tokens,
    part_tokens,
    request_tokens,
    text_tokens,
)

DEFAULT_K_TURNS = 3
# How many model steps a turn is worth when counting recency inside long agent turns.
STEPS_PER_TURN = 4
# Default head and tail budgets, as shares of the view's budget.
HEAD_SHARE = 0.25
TAIL_SHARE = 0.25
# A summary's reserved output: at most this, the model's max output or 1/8 of the window.
SUMMARY_MAX_TOKENS = 4096

Part = dict[str, Any]


# --- what the ladder is told about the model and the renderer ---------------------------


@dataclass(frozen=True)
class ModelInfo:
    context_window: int
    max_output: int
    vision: bool
    image_billing: str = "claude"

    @classmethod
    def from_spec(cls, spec: Any) -> ModelInfo:
        """From anything with the registry's ModelSpec attributes."""
        return cls(
            context_window=int(spec.context_window),
            max_output=int(spec.max_output),
            vision=bool(spec.vision),
            image_billing=str(spec.image_billing),
        )


@dataclass(frozen=True)
class Segment:
    """One message's text, as the snapshot renderer takes it."""

    role: str
    message_id: str
    text: str


class PageLike(Protocol):
    @property
    def png(self) -> bytes: ...
    @property
    def width(self) -> int: ...
    @property
    def height(self) -> int: ...
    @property
    def billed_tokens(self) -> int: ...
    @property
    def chars(self) -> int: ...
    @property
    def first_message_id(self) -> str: ...
    @property
    def last_message_id(self) -> str: ...


class RenderResultLike(Protocol):
    @property
    def pages(self) -> Sequence[PageLike]: ...
    @property
    def missing_glyphs(self) -> int: ...
    @property
    def substituted(self) -> int: ...
    @property
    def settings(self) -> Mapping[str, Any]: ...


# compaction.render.render_pages(segments, *, rule, density="default", max_pages=None)
RenderFn = Callable[..., RenderResultLike]
# Takes Arbor messages (a leading system message holds the instructions), returns text.
SummarizeFn = Callable[[list[Message]], str]


class CompactionError(Exception):
    """The ladder cannot produce a request that fits (or would resend a rejected one)."""

    def __init__(self, message: str, *, result: LadderResult | None = None) -> None:
        super().__init__(message)
        self.result = result


class SummaryTooLong(Exception):
    """A summariser's answer: the provider rejected the summary request as too long
    (its count, and the window it enforces, where its error said them)."""

    def __init__(self, measured: int | None, limit: int | None) -> None:
        super().__init__(f"summary request rejected: {measured} tokens > {limit}")
        self.measured = measured
        self.limit = limit


# --- the view ----------------------------------------------------------------------------


def _is_normal(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and message.keys() == {"id", "role", "parts", "metadata"}
        and isinstance(message["id"], str)
    )


def _tool_calls(message: Message) -> Iterable[str]:
    return (p["id"] for p in message["parts"] if p.get("type") == "tool_call")


def _tool_results(message: Message) -> Iterable[str]:
    return (p["call_id"] for p in message["parts"] if p.get("type") == "tool_result")


@dataclass(frozen=True)
class ContextView:
    """What the model will see: messages (Arbor dicts or objects with ``id``, ``role``,
    ``parts``, ``metadata``) plus the token budget they must fit. Immutable; ``source``
    keeps the original messages so every rung can start from, and point back to, them.
    """

    messages: tuple[Message, ...]
    budget_tokens: int
    model: ModelInfo
    calibration: Calibration = field(default_factory=Calibration)
    limits: Limits = field(default_factory=Limits)
    system: str = ""
    tools: tuple[Mapping[str, Any], ...] = ()
    blob_sizes: Mapping[str, int] = field(default_factory=dict)
    source: tuple[Message, ...] = ()
    # Whether the model is offered a tool that fetches archived originals by id (the
    # chat's ``recall``): only then do page and summary headers say it can.
    recall: bool = True

    @classmethod
    def build(
        cls, messages: Iterable[Any], *, budget_tokens: int, model: ModelInfo, **options: Any
    ) -> ContextView:
        """A view of any messages: Arbor dicts, Message rows, resume's ViewMessages."""
        return cls(tuple(as_message(m) for m in messages), budget_tokens, model, **options)

    def __post_init__(self) -> None:
        # Normalised once: plain dicts sharing the callers' part lists (never mutated).
        messages = tuple(m if _is_normal(m) else as_message(m) for m in self.messages)
        object.__setattr__(self, "messages", messages)
        source = tuple(m if _is_normal(m) else as_message(m) for m in self.source)
        object.__setattr__(self, "source", source or messages)
        object.__setattr__(self, "tools", tuple(self.tools))

    # -- sizes --

    @property
    def rule(self) -> str:
        return self.model.image_billing

    @cached_property
    def message_raw(self) -> tuple[int, ...]:
        """Raw token estimate of each message."""
        return tuple(message_tokens(m, rule=self.rule) for m in self.messages)

    @cached_property
    def raw_tokens(self) -> int:
        """Raw estimate of the whole request (compare this with measured usage)."""
        fixed = request_tokens((), rule=self.rule, system=self.system, tools=self.tools)
        return fixed + sum(self.message_raw)

    def estimate(self) -> int:
        """Calibrated estimate of the whole request, in provider tokens."""
        return self.calibration.apply(self.raw_tokens)

    @cached_property
    def fixed_tokens(self) -> int:
        """Calibrated estimate of what every request carries whatever the rungs do: the
        system prompt, the tool definitions and the request's overhead."""
        raw = request_tokens((), rule=self.rule, system=self.system, tools=self.tools)
        return self.calibration.apply(raw)

    @property
    def history_budget(self) -> int:
        """The budget's room for the messages: head, tail and the middle's pages or
        summary share it (a harness's fixed part is often most of the budget, and never
        what the rungs may squeeze)."""
        return max(0, self.budget_tokens - self.fixed_tokens)

    def estimate_messages(self, messages: Iterable[Message]) -> int:
        """Calibrated estimate of some messages alone (no request overhead)."""
        return self.calibration.apply(sum(message_tokens(m, rule=self.rule) for m in messages))

    @cached_property
    def violations(self) -> tuple[LimitViolation, ...]:
        return tuple(
            check_limits(
                self.messages,
                self.limits,
                blob_sizes=self.blob_sizes,
                system=self.system,
                tools=self.tools,
            )
        )

    def fits(self) -> bool:
        return self.estimate() <= self.budget_tokens and not self.violations

    # -- structure --

    @cached_property
    def safe(self) -> tuple[bool, ...]:
        """``safe[i]``: the view may be cut before message ``i`` (``i`` in 0..n) without
        separating a tool call from its result. Calls that never get a result in the
        view (an aborted step) do not block cutting."""
        answered = {cid for m in self.messages for cid in _tool_results(m)}
        pending: set[str] = set()
        safe = [True]
        for message in self.messages:
            pending.update(c for c in _tool_calls(message) if c in answered)
            pending.difference_update(_tool_results(message))
            safe.append(not pending)
        return tuple(safe)

    @cached_property
    def turn_starts(self) -> tuple[int, ...]:
        """Index of each turn's first message: 0, then every user message at a safe
        boundary that has something other than system messages before it."""
        starts = [0] if self.messages else []
        seen_non_system = False
        for i, message in enumerate(self.messages):
            if i and message["role"] == "user" and self.safe[i] and seen_non_system:
                starts.append(i)
            seen_non_system = seen_non_system or message["role"] != "system"
        return tuple(starts)

    def turns(self) -> list[tuple[int, int]]:
        """``(start, end)`` index ranges of the turns, oldest first."""
        ends = [*self.turn_starts[1:], len(self.messages)]
        return list(zip(self.turn_starts, ends, strict=True))

    @cached_property
    def step_starts(self) -> tuple[int, ...]:
        """Index of each model step's first message: every turn start, and every
        assistant message at a safe boundary (a step = an assistant message and the
        tool results it waits for)."""
        turn_starts = set(self.turn_starts)
        return tuple(
            i
            for i, m in enumerate(self.messages)
            if i in turn_starts or (m["role"] == "assistant" and self.safe[i])
        )

    def recent_start(self, k_turns: int) -> int:
        """Index of the first message of the "last K turns": the last ``k_turns`` turns,
        but no more than the last ``STEPS_PER_TURN * k_turns`` model steps, so that one
        long agent turn (a user message followed by a hundred tool calls) does not keep
        all of its old tool results and images."""
        if k_turns <= 0:
            return len(self.messages)
        turns, steps = self.turn_starts, self.step_starts
        by_turn = turns[-k_turns] if len(turns) > k_turns else 0
        k_steps = STEPS_PER_TURN * k_turns
        by_step = steps[-k_steps] if len(steps) > k_steps else 0
        return max(by_turn, by_step)

    @cached_property
    def turn_of(self) -> tuple[int, ...]:
        """The turn number of each message."""
        out: list[int] = []
        starts = self.turn_starts
        turn = 0
        for i in range(len(self.messages)):
            while turn + 1 < len(starts) and i >= starts[turn + 1]:
                turn += 1
            out.append(turn)
        return tuple(out)

    @cached_property
    def source_by_id(self) -> dict[str, Message]:
        return {m["id"]: m for m in self.source}

    def with_messages(self, messages: Iterable[Message]) -> ContextView:
        return replace(self, messages=tuple(messages))

    def reset(self) -> ContextView:
        """The view of the original messages, before any rung."""
        return replace(self, messages=self.source)


def estimate_view(view: ContextView) -> int:
    """Calibrated token estimate of a view's request."""
    return view.estimate()


# --- reports -------------------------------------------------------------------------


@dataclass(frozen=True)
class Replacement:
    """One thing a rung replaced: the original message's id, what kind of thing, and the
    placeholder (or page range / summary id) that stands for it now."""

    message_id: str
    kind: str  # "tool_result", "image", "message"
    replaced_with: str


@dataclass(frozen=True)
class RungReport:
    rung: str
    tokens_before: int
    tokens_after: int
    replaced: tuple[Replacement, ...] = ()
    model_calls: int = 0
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def saved(self) -> int:
        return self.tokens_before - self.tokens_after

    @property
    def applied(self) -> bool:
        return bool(self.replaced)


@dataclass(frozen=True)
class LadderResult:
    view: ContextView
    reports: tuple[RungReport, ...]
    fits: bool

    @property
    def model_calls(self) -> int:
        return sum(r.model_calls for r in self.reports)

    @property
    def rungs(self) -> list[str]:
        return [r.rung for r in self.reports]


def _report(
    rung: str,
    before: ContextView,
    after: ContextView,
    replaced: Iterable[Replacement] = (),
    **details: Any,
) -> RungReport:
    calls = int(details.pop("model_calls", 0))
    return RungReport(
        rung=rung,
        tokens_before=before.estimate(),
        tokens_after=after.estimate(),
        replaced=tuple(replaced),
        model_calls=calls,
        details=details,
    )


# --- rung 1: elision ----------------------------------------------------------------------

_WORD_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./@#-]*[A-Za-z0-9_]")
# File names need a known extension: ``entries.length`` or ``Date.now`` are code.
_EXTENSIONS = (
    "c|cc|cfg|cjs|cpp|css|csv|env|go|gz|h|hpp|html|ini|java|jpeg|jpg|js|json|jsonl|jsx|kt|"
    "lock|log|md|mjs|pdf|php|png|py|pyi|rb|rs|scss|sh|sql|svg|swift|toml|ts|tsx|txt|vue|"
    "xml|yaml|yml|zip"
)
_FILE_RE = re.compile(rf"^[A-Za-z0-9_][\w.-]*\.(?:{_EXTENSIONS})$", re.IGNORECASE)
_MIXED_ID_RE = re.compile(r"^(?=[\w.-]*[0-9])(?=[\w.-]*[A-Za-z])[\w.-]{8,}$")
# Code identifiers: camelCase / PascalCase with an inner capital, snake_case, or a name
# mixing letters and digits; plain words ("model", "Error") are not distinctive. They are
# found by ``_identifiers``, which gives what this regex's ``findall`` gives:
#   [A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+           attribute chains (``error.message``)
#   | [A-Za-z_]\w*(?:[a-z0-9][A-Z]|_[A-Za-z0-9])\w*   camelCase, snake_case
#   | [A-Za-z]+[0-9][A-Za-z0-9]*                 letters then digits (``v2beta``)
# (``\w`` meaning ASCII [A-Za-z0-9_]). The regex itself is quadratic: each start inside
# one long run of letters scans to the run's end before failing (a 20,000-letter word took
# a minute), so the scan below judges each run once.
_SEGMENT_RE = re.compile(r"[A-Za-z0-9_]+")
_IDENT_START_RE = re.compile(r"[A-Za-z_]")
_LETTERS_RE = re.compile(r"[A-Za-z]*")
_ALNUM_RE = re.compile(r"[A-Za-z0-9]*")
# The last inner capital or underscore pair of a run (greedy, so one pass and back).
_LAST_PAIR_RE = re.compile(r"[A-Za-z0-9_]*([a-z0-9][A-Z]|_[A-Za-z0-9])")
# Letters then a digit, tried only where a stretch of letters begins: elsewhere in a
# stretch the answer is the same as at its beginning.
_LETTERS_DIGIT_RE = re.compile(r"(?<![A-Za-z])[A-Za-z]+[0-9][A-Za-z0-9]*")
_CHAIN_LINK_RE = re.compile(r"(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
# Versions: ``0.27.5``, ``v2.1.3``.
_VERSION_RE = re.compile(r"(?<![\w.])v?\d+\.\d+(?:\.\d+)+(?![\w])")
# Plain words a later tool call may copy out of a result (an edit's old_string, a grep
# pattern): four letters or more.
_PLAIN_RE = re.compile(r"[A-Za-z0-9_]{4,}")
# Numbers a later message may quote: three digits or more (line numbers, ports, sizes,
# counts), not the tail of a name such as ``text-gray-600``; a result's own line
# numbers (``175: …``, ``src/a.py:42:``) count from two digits.
_NUMBER_RE = re.compile(r"(?<![A-Za-z_.]-)(?<![\w.])\d{3,}(?![\w])")
_LINE_NUMBER_RE = re.compile(r"(?:^[ \t]*|:)(\d{2,})(?=[:\t|])", re.MULTILINE)
_SPOKEN_NUMBER_RE = re.compile(r"(?<![A-Za-z_.]-)(?<![\w.])\d{2,}(?![\w])")


def _words(text: str) -> set[str]:
    return set(_WORD_RE.findall(text))


def _match_end(pattern: re.Pattern[str], text: str, pos: int, end: int) -> int:
    found = pattern.match(text, pos, end)
    return found.end() if found else pos


def _identifiers(text: str) -> Iterator[str]:
    """The code identifiers of ``text`` in order, in time linear in its length.

    In a run of ``[A-Za-z0-9_]`` ending at ``end``, the match starting at ``start`` is:
    an attribute chain when the run is followed by ``.`` and a name (the same for every
    start in the run); else the rest of the run when an inner-capital or underscore pair
    begins after ``start`` (so once that fails it fails for every later start); else
    letters then a digit, which depends only on the stretch of letters ``start`` is in."""
    resume = 0
    for segment in _SEGMENT_RE.finditer(text):
        pos, end = segment.span()
        if pos < resume:  # inside the attribute chain just given
            continue
        pair = _LAST_PAIR_RE.match(text, pos, end)
        last_pair = pair.start(1) if pair else -1
        while pos < end:
            first = _IDENT_START_RE.search(text, pos, end)
            if first is None:
                break
            start = first.start()
            chain = _CHAIN_LINK_RE.match(text, end)
            if chain:
                resume = chain.end()
                yield text[start:resume]
                break
            if last_pair > start:
                yield text[start:end]
                break
            letters = _match_end(_LETTERS_RE, text, start, end)
            if letters > start and letters < end and text[letters].isdigit():
                stop = _match_end(_ALNUM_RE, text, letters, end)
                yield text[start:stop]
                pos = stop
                continue
            # Nothing starts here, and from now on only letters then a digit can.
            found = _LETTERS_DIGIT_RE.search(text, start + 1, end)
            if found is None:
                break
            yield found.group()
            pos = found.end()


def distinctive_tokens(text: str) -> set[str]:
    """What later messages would quote if they relied on this text: paths, file names
    (and the base names of paths), letter+digit ids of 8+ characters, and code
    identifiers of 4+ characters (``TodoItem``, ``max_tokens``, ``v2beta``)."""
    found: set[str] = set()
    for word in _words(text):
        if "/" in word:
            base = word.rstrip("/").rsplit("/", 1)[-1]
            if len(word) >= 4 and any(c.isalpha() for c in word):
                found.add(word)
            if _FILE_RE.match(base) and len(base) >= 4:
                found.add(base)
        elif (_FILE_RE.match(word) and len(word) >= 4) or _MIXED_ID_RE.match(word):
            found.add(word)
    found.update(m for m in _identifiers(text) if len(m) >= 4)
    return found


def plain_words(text: str) -> set[str]:
    return set(_PLAIN_RE.findall(text))


def quoted_numbers(text: str) -> set[str]:
    """Numbers a result holds that a later message could quote: three digits or more,
    and line numbers from two (``175`` in ``175: if (!model)``)."""
    found = set(_NUMBER_RE.findall(text)) | set(_LINE_NUMBER_RE.findall(text))
    return found | set(_VERSION_RE.findall(text))


def spoken_numbers(text: str) -> set[str]:
    """Numbers of two digits or more in narration or tool arguments (``line 175-176``)."""
    return set(_SPOKEN_NUMBER_RE.findall(text)) | set(_VERSION_RE.findall(text))


def _narration(message: Message) -> str:
    if message["role"] not in ("user", "assistant"):
        return ""
    return "\n".join(p.get("text") or "" for p in message["parts"] if p.get("type") == "text")


def _call_arguments(message: Message) -> str:
    return "\n".join(
        compact_json(p.get("arguments")) for p in message["parts"] if p.get("type") == "tool_call"
    )


def _result_text(part: Mapping[str, Any]) -> str:
    return "\n".join(
        p.get("text") or "" for p in part.get("parts") or () if p.get("type") == "text"
    )


def _all_text(message: Message) -> str:
    texts = [_narration(message), _call_arguments(message)]
    texts += [_result_text(p) for p in message["parts"] if p.get("type") == "tool_result"]
    return "\n".join(texts)


def elision_placeholder(message_id: str, chars: int) -> str:
    return f"[elided tool result {message_id}: {chars} chars]"


@dataclass(frozen=True)
class _Candidate:
    """A tool result elision may replace, and what it could be referred to by later."""

    index: int
    part: int
    call_id: str
    revealed: frozenset[str]
    numbers: frozenset[str]
    plain: frozenset[str]


def _asked_words(message: Message) -> dict[str, set[str]]:
    """The words and numbers of each tool call's arguments, by call id: what a call
    asked for is not something its result revealed."""
    asked: dict[str, set[str]] = {}
    for part in message["parts"]:
        if part.get("type") == "tool_call":
            args = compact_json(part.get("arguments"))
            asked[str(part["id"])] = _words(args) | spoken_numbers(args)
    return asked


def _result_candidates(
    index: int,
    message: Message,
    *,
    seen: set[str],
    seen_plain: set[str],
    call_words: Mapping[str, set[str]],
) -> list[_Candidate]:
    """The results of one tool message that may be elided (errors never are), each with
    what it brought that nothing before it said and its own call did not ask for."""
    candidates: list[_Candidate] = []
    for j, part in enumerate(message["parts"]):
        if part.get("type") != "tool_result" or part.get("is_error"):
            continue
        text = _result_text(part)
        call_id = str(part.get("call_id"))
        asked = call_words.get(call_id, set())
        candidates.append(
            _Candidate(
                index,
                j,
                call_id,
                frozenset(distinctive_tokens(text) - seen - asked),
                frozenset(quoted_numbers(text) - asked),
                frozenset(plain_words(text) - seen_plain - asked),
            )
        )
    return candidates


def _elision_candidates(
    messages: Sequence[Message], *, head_end: int, recent: int
) -> list[_Candidate]:
    """Every result between the head and the last K turns that may be elided, in order.
    One walk forwards: ``seen`` holds what the messages before each result said."""
    seen: set[str] = set()
    seen_plain: set[str] = set()
    call_words: dict[str, set[str]] = {}
    candidates: list[_Candidate] = []
    for i, message in enumerate(messages):
        if head_end <= i < recent and message["role"] == "tool":
            candidates += _result_candidates(
                i, message, seen=seen, seen_plain=seen_plain, call_words=call_words
            )
        everything = _all_text(message)
        seen |= distinctive_tokens(everything)
        seen_plain |= plain_words(everything)
        if i < recent:
            call_words.update(_asked_words(message))
    return candidates


@dataclass
class _Later:
    """What the messages after a point say, gathered walking backwards."""

    words: set[str] = field(default_factory=set)  # words of narration and tool arguments
    numbers: set[str] = field(default_factory=set)
    ids: set[str] = field(default_factory=set)  # every word anywhere, tool results included
    args: set[str] = field(default_factory=set)  # plain words of tool calls' arguments

    def refers_to(self, message_id: str, candidate: _Candidate) -> bool:
        """Whether anything later uses the result: its ids, or what it revealed."""
        return bool(
            message_id in self.ids
            or candidate.call_id in self.ids
            or candidate.revealed & self.words
            or candidate.numbers & self.numbers
            or candidate.plain & self.args
        )

    def add(self, message: Message) -> None:
        spoken = _narration(message) + "\n" + _call_arguments(message)
        self.words |= _words(spoken) | distinctive_tokens(spoken)
        self.numbers |= spoken_numbers(spoken)
        self.args |= plain_words(_call_arguments(message))
        # Ids count wherever they are quoted, results included (a recall of this id).
        self.ids |= _words(_all_text(message))


def _eventful(
    messages: Sequence[Message], candidates: Iterable[_Candidate]
) -> set[tuple[int, int]]:
    """``(message index, part index)`` of the candidates something later refers to."""
    by_index: dict[int, list[_Candidate]] = {}
    for candidate in candidates:
        by_index.setdefault(candidate.index, []).append(candidate)
    later = _Later()
    keep: set[tuple[int, int]] = set()
    # Walk backwards so ``later`` holds what every message after ``i`` says.
    for i in range(len(messages) - 1, -1, -1):
        mid = messages[i]["id"]
        keep.update((c.index, c.part) for c in by_index.get(i, ()) if later.refers_to(mid, c))
        later.add(messages[i])
    return keep


def _elide_result(message: Message, index: int) -> tuple[Message, str] | None:
    """``message`` with the text of its part ``index`` (a tool result) collapsed into
    the placeholder, and the placeholder; None when that would not save anything."""
    part = message["parts"][index]
    text = _result_text(part)
    placeholder = elision_placeholder(message["id"], len(text))
    if not text or text_tokens(text) <= text_tokens(placeholder):
        return None
    # Images stay for rung 2; the text parts collapse into one placeholder.
    inner: list[Part] = [{"type": "text", "text": placeholder}]
    inner += [p for p in part.get("parts") or () if p.get("type") != "text"]
    parts = list(message["parts"])
    parts[index] = {**part, "parts": inner}
    return {**message, "parts": parts}, placeholder


def elide(
    view: ContextView, *, k_turns: int = DEFAULT_K_TURNS, head_end: int = 0
) -> tuple[ContextView, RungReport]:
    """Rung 1: replace uneventful old tool results' text with a placeholder.

    Only results between the head (``messages[:head_end]``, kept verbatim) and the last
    K turns are candidates. A result is *eventful*, and kept, when it is an error, or
    when anything later in the path refers to it: its message or call id anywhere
    later; a token it revealed (a path, file name, id or identifier first seen in it,
    not asked for by its own call) or a number it holds, quoted in a later message's
    narration or in a later tool call's arguments (a path listed by ``ls`` and then
    read, a line number the model then cites)."""
    candidates = _elision_candidates(
        view.messages, head_end=head_end, recent=view.recent_start(k_turns)
    )
    keep = _eventful(view.messages, candidates)
    new_messages = list(view.messages)
    replaced: list[Replacement] = []
    for c in sorted(candidates, key=lambda c: (c.index, c.part)):
        if (c.index, c.part) in keep:
            continue
        elided = _elide_result(new_messages[c.index], c.part)
        if elided is None:
            continue
        new_messages[c.index], placeholder = elided
        replaced.append(Replacement(new_messages[c.index]["id"], "tool_result", placeholder))
    after = view.with_messages(new_messages)
    return after, _report("elision", view, after, replaced, k_turns=k_turns)


# --- rung 2: image stripping -----------------------------------------------------------


def image_placeholder(part: Mapping[str, Any], message_id: str = "", why: str = "removed") -> str:
    """The text an image becomes; it names the blob and the message to recall it from."""
    where = f"; message {message_id}" if message_id else ""
    return f"[image {part.get('blob')} {part.get('width')}x{part.get('height')} {why}{where}]"


def is_page(part: Mapping[str, Any]) -> bool:
    """A snapshot page: the compacted text itself, never an image to strip."""
    return part.get("type") == "image" and "snapshot_page" in part


def _map_images(
    parts: Sequence[Part], change: Callable[[Part], Part | None]
) -> tuple[list[Part], bool]:
    """``parts`` with each ordinary image (also inside tool results) passed through
    ``change`` (None keeps it); snapshot pages are never touched."""
    out: list[Part] = []
    changed = False
    for part in parts:
        if part.get("type") == "image" and not is_page(part):
            new = change(part)
            out.append(part if new is None else new)
            changed = changed or new is not None
        elif part.get("type") == "tool_result":
            inner, inner_changed = _map_images(part.get("parts") or (), change)
            out.append({**part, "parts": inner} if inner_changed else part)
            changed = changed or inner_changed
        else:
            out.append(part)
    return out, changed


def _image_replaced(part: Part, mid: str, why: str, replaced: list[Replacement]) -> Part:
    """The text part an image becomes (the placeholder says ``why``), noted in ``replaced``."""
    text = image_placeholder(part, mid, why)
    replaced.append(Replacement(mid, "image", text))
    return {"type": "text", "text": text}


def _has_image(parts: Sequence[Part]) -> bool:
    """Whether ``parts`` hold an ordinary image (also inside a tool result)."""
    return any(not is_page(p) for p in iter_images(parts))


def strip_images(
    view: ContextView, *, k_turns: int = DEFAULT_K_TURNS, head_end: int = 0
) -> tuple[ContextView, RungReport]:
    """Rung 2: replace images between the head and the last K turns with a placeholder.
    Snapshot pages are not images of the conversation: they are never stripped."""
    recent = view.recent_start(k_turns)
    new_messages = list(view.messages)
    replaced: list[Replacement] = []
    for i in range(head_end, recent):
        message = view.messages[i]

        strip = partial(_image_replaced, mid=message["id"], why="removed", replaced=replaced)
        parts, changed = _map_images(message["parts"], strip)
        if changed:
            new_messages[i] = {**message, "parts": parts}
    after = view.with_messages(new_messages)
    return after, _report("image_stripping", view, after, replaced, k_turns=k_turns)


# --- rung 0: what the model can take at all --------------------------------------------------

# Makes an image fit ``max_bytes`` (recompressed, downscaled): a new image part carrying its
# bytes under ``data`` (stored as a Blob before sending, like page PNGs), or None.
ShrinkFn = Callable[[Part, int], Part | None]


@dataclass
class _ImageFitter:
    """Rung 0's decisions, image by image, over ``view``; ``replaced`` lists every
    image changed, in the order it was changed."""

    view: ContextView
    shrink: ShrinkFn | None
    replaced: list[Replacement] = field(default_factory=list)

    def unreadable(self, mid: str, part: Part) -> Part:
        return _image_replaced(part, mid, "not sent: the model cannot read images", self.replaced)

    def oversized(self, cap: int, mid: str, part: Part) -> Part | None:
        """An image over ``cap`` bytes, recompressed when ``shrink`` can (else replaced
        by a placeholder); None keeps an image within the limit (or of unknown size)."""
        size = image_bytes(part, self.view.blob_sizes)
        if size is None or size <= cap:
            return None
        smaller = self.shrink(part, cap) if self.shrink is not None else None
        if smaller is not None:
            self.replaced.append(Replacement(mid, "image", f"recompressed {smaller['blob']}"))
            return smaller
        return _image_replaced(part, mid, f"not sent: {size} bytes, over {cap}", self.replaced)

    def too_many(self, mid: str, part: Part) -> Part:
        return _image_replaced(part, mid, "removed: the request had too many images", self.replaced)

    def per_image(self) -> Callable[[str, Part], Part | None] | None:
        """What each image goes through on its own, before they are counted: none is
        sent to a model without vision; else each must be under the bytes-per-image
        limit, when there is one."""
        if not self.view.model.vision:
            return self.unreadable
        cap = self.view.limits.max_image_bytes
        return None if cap is None else partial(self.oversized, cap)

    def fit(self) -> ContextView:
        messages = list(self.view.messages)
        change = self.per_image()
        if change is not None:
            for i, message in enumerate(messages):
                parts, changed = _map_images(message["parts"], partial(change, message["id"]))
                if changed:
                    messages[i] = {**message, "parts": parts}
        # Unchanged (the common case: a request without images), the view itself is
        # checked, so its limits are computed once for this rung and every later one.
        current = self.view.with_messages(messages) if self.replaced else self.view
        return self.drop_oldest(current)

    def drop_oldest(self, current: ContextView) -> ContextView:
        """Too many images, or too many bytes: the oldest ordinary images go first."""
        messages = list(current.messages)
        while any(v.limit in ("images", "request_bytes") for v in current.violations):
            index = next((i for i, m in enumerate(messages) if _has_image(m["parts"])), None)
            if index is None:
                break
            drop = partial(self.too_many, messages[index]["id"])
            parts, _ = _map_images(messages[index]["parts"], drop)
            messages[index] = {**messages[index], "parts": parts}
            current = self.view.with_messages(messages)
        return current


def fit_images(
    view: ContextView, *, shrink: ShrinkFn | None = None
) -> tuple[ContextView, RungReport]:
    """Rung 0, applied to every request however small: a model without vision gets no
    image parts (each becomes a placeholder naming its blob and message), an image over
    the provider's bytes-per-image limit is recompressed (or replaced when it cannot be),
    and the oldest images go when the request has too many or is too many bytes. This
    is not compaction; it is what makes the request one the provider accepts."""
    fitter = _ImageFitter(view, shrink)
    current = fitter.fit()
    if not fitter.replaced:
        return view, _report("image_limits", view, view)
    # The fitted messages are what every later rung starts from, and what head and tail
    # repeat verbatim.
    after = replace(current, source=current.messages)
    return after, _report("image_limits", view, after, fitter.replaced)


# --- head / middle / tail ----------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """``messages[:head_end]`` head, ``[head_end:tail_start]`` middle, the rest tail."""

    head_end: int
    tail_start: int

    @property
    def middle(self) -> range:
        return range(self.head_end, self.tail_start)


def split_view(
    view: ContextView, *, head_budget: int | None = None, tail_budget: int | None = None
) -> Split:
    """Where the head ends and the tail starts (budgets in calibrated tokens)."""
    n = len(view.messages)
    head_budget = int(view.history_budget * HEAD_SHARE) if head_budget is None else head_budget
    tail_budget = int(view.history_budget * TAIL_SHARE) if tail_budget is None else tail_budget
    cal = view.calibration
    raw = view.message_raw
    safe = view.safe
    starts = view.turn_starts

    # Head: system + first turn; if that is over budget, up to the first user message.
    first_turn_end = starts[1] if len(starts) > 1 else n
    if cal.apply(sum(raw[:first_turn_end])) <= head_budget:
        head_end = first_turn_end
    else:
        users = [i for i, m in enumerate(view.messages) if m["role"] == "user"]
        lead = users[0] + 1 if users else 0
        head_end = next((j for j in range(lead, n + 1) if safe[j]), n)

    suffix = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] + raw[i]

    def fits_tail(i: int) -> bool:
        return cal.apply(suffix[i]) <= tail_budget

    # Tail: the oldest turn start whose suffix still fits; else a safe cut inside the
    # last turn; else the smallest non-empty safe tail.
    candidates = [s for s in starts if s >= head_end and s > 0 and fits_tail(s)]
    if candidates:
        return Split(head_end, min(candidates))
    last_turn = max([head_end, *(s for s in starts if s > 0)])
    inside = [j for j in range(last_turn, n) if safe[j] and fits_tail(j)]
    if inside:
        return Split(head_end, inside[0])
    cuts = [j for j in range(head_end, n) if safe[j]]
    return Split(head_end, cuts[-1] if cuts else head_end)


# --- text of messages, for pages and summaries ---------------------------------------------


def _image_label(part: Mapping[str, Any]) -> str:
    return f"[image {part.get('blob')} {part.get('width')}x{part.get('height')}]"


def part_text(part: Mapping[str, Any]) -> str:
    """A part as plain text: tool calls as compact JSON, images as a placeholder;
    thinking is left out (it is the model's scratchpad, not the conversation)."""
    kind = part.get("type")
    if kind == "text":
        return str(part.get("text") or "")
    if kind == "image":
        return _image_label(part)
    if kind == "tool_call":
        args = compact_json(part.get("arguments"))
        return f"[tool call {part.get('name')} {part.get('id')}] {args}"
    if kind == "tool_result":
        status = " error" if part.get("is_error") else ""
        inner = "\n".join(part_text(p) for p in part.get("parts") or ())
        return f"[tool result {part.get('call_id')}{status}] {inner}"
    return ""


def middle_segments(view: ContextView, indices: Iterable[int]) -> list[Segment]:
    """Segments for messages of the view, built from the archived originals. A tool
    result the elision rung replaced is drawn as its placeholder (the original stays
    reachable by message id); images are always drawn as placeholders."""
    segments: list[Segment] = []
    for i in indices:
        current = view.messages[i]
        original = view.source_by_id.get(current["id"], current)
        texts: list[str] = []
        for j, part in enumerate(original["parts"]):
            if part.get("type") == "tool_result" and j < len(current["parts"]):
                part = _as_elided(current["id"], part, current["parts"][j])
            text = part_text(part)
            if text:
                texts.append(text)
        segments.append(Segment(current["role"], current["id"], "\n".join(texts)))
    return segments


def _as_elided(message_id: str, original: Part, now: Part) -> Part:
    """``original`` with its text replaced by the elision placeholder when ``now`` (the
    same part in the view) carries one."""
    inner = list(original.get("parts") or ())
    placeholder = elision_placeholder(message_id, len(_result_text(original)))
    if now is original or not any(p.get("text") == placeholder for p in now.get("parts") or ()):
        return original
    images = [p for p in inner if p.get("type") == "image"]
    return {**original, "parts": [{"type": "text", "text": placeholder}, *images]}


# A user message longer than this (a pasted log) is left to the pages or the summary; the
# user's own words below it are repeated verbatim next to them.
USER_VERBATIM_MAX_TOKENS = 600


def user_verbatim(view: ContextView, indices: Iterable[int]) -> list[Part]:
    """The text of the user messages among ``indices``, verbatim from the originals, as
    one text part: the task's constraints and the user's corrections survive every rung
    word for word (pages are drawn, summaries are written; neither is the user's text)."""
    blocks: list[str] = []
    for i in indices:
        if view.messages[i]["role"] != "user":
            continue
        mid = view.messages[i]["id"]
        original = view.source_by_id.get(mid, view.messages[i])
        text = "\n".join(
            p.get("text") or "" for p in original["parts"] if p.get("type") == "text"
        ).strip()
        if text and text_tokens(text) <= USER_VERBATIM_MAX_TOKENS:
            blocks.append(f"[user {mid}]\n{text}")
    if not blocks:
        return []
    intro = "[the user's own messages in the part above, verbatim]"
    return [{"type": "text", "text": "\n\n".join([intro, *blocks])}]


# --- rung 3: snapshot ---------------------------------------------------------------------

# Said in a page's or summary's header only where the model has the recall tool.
_FETCHABLE = " The original messages are archived and can be fetched by id."
SNAPSHOT_ID_PREFIX = "snapshot:"
SUMMARY_ID_PREFIX = "summary:"


def page_part(page: PageLike, index: int) -> Part:
    """A snapshot page as an image part. ``blob`` is the sha256 of ``png``, so once the
    Django layer stores the bytes as that Blob (and drops ``png``), the rest is an
    ordinary Arbor image part; ``snapshot_page`` says what it covers."""
    return {
        "type": "image",
        "blob": hashlib.sha256(page.png).hexdigest(),
        "mime": "image/png",
        "width": page.width,
        "height": page.height,
        "png": page.png,
        "snapshot_page": {
            "index": index,
            "first_message_id": page.first_message_id,
            "last_message_id": page.last_message_id,
            "chars": page.chars,
            "billed_tokens": page.billed_tokens,
        },
    }


def page_parts(view: ContextView) -> list[Part]:
    """Every snapshot page part in a view, in order."""
    return [p for m in view.messages for p in m["parts"] if "snapshot_page" in p]


# Where an image part carries bytes not yet in the blob store: ``png`` for a snapshot
# page, ``data`` for an image rung 0 recompressed.
INLINE_KEYS = ("png", "data")


def detach_pages(view: ContextView) -> tuple[ContextView, dict[str, bytes]]:
    """The view with the inline bytes taken out of its image parts (snapshot pages and
    recompressed images), and those bytes by sha256: what the Django layer stores as
    Blobs before the view goes to a provider (which loads images by blob) or out as
    JSON."""
    pngs: dict[str, bytes] = {}

    def detach(parts: Sequence[Part]) -> tuple[list[Part], bool]:
        out: list[Part] = []
        changed = False
        for part in parts:
            key = next((k for k in INLINE_KEYS if k in part), None)
            if key is not None:
                pngs[part["blob"]] = part[key]
                part = {k: v for k, v in part.items() if k != key}
                changed = True
            elif part.get("type") == "tool_result":
                inner, inner_changed = detach(part.get("parts") or ())
                if inner_changed:
                    part, changed = {**part, "parts": inner}, True
            out.append(part)
        return out, changed

    messages: list[Message] = []
    for message in view.messages:
        parts, changed = detach(message["parts"])
        messages.append({**message, "parts": parts} if changed else message)
    return view.with_messages(messages), pngs


def snapshot(
    view: ContextView,
    *,
    render: RenderFn,
    head_budget: int | None = None,
    tail_budget: int | None = None,
    density: str = "default",
) -> tuple[ContextView, RungReport]:
    """Rung 3: the middle of the view as rendered pages of its original text."""
    if not view.model.vision:
        return view, _report("snapshot", view, view, skipped="the model cannot read images")
    # Head and tail are sized and sent as the originals, byte for byte: the rungs only
    # ever change the middle.
    split = split_view(view.reset(), head_budget=head_budget, tail_budget=tail_budget)
    if not split.middle:
        return view, _report("snapshot", view, view, skipped="no middle to snapshot")
    covered = [view.messages[i]["id"] for i in split.middle]
    result = render(middle_segments(view, split.middle), rule=view.rule, density=density)
    pages = list(result.pages)
    if not pages:
        return view, _report("snapshot", view, view, skipped="the renderer made no pages")
    ranges = "; ".join(
        f"page {n}: {p.first_message_id} to {p.last_message_id}" for n, p in enumerate(pages, 1)
    )
    intro = (
        f"[snapshot of messages {covered[0]} to {covered[-1]} ({len(covered)} messages)] "
        f"The {len(pages)} images below are pages of the earlier conversation, rendered "
        "as text: each message starts under a header with its role and id, and a ↵ "
        f"marks a line break.{_FETCHABLE if view.recall else ''} {ranges}."
    )
    message: Message = {
        "id": f"{SNAPSHOT_ID_PREFIX}{covered[0]}..{covered[-1]}",
        "role": "user",
        "parts": [
            {"type": "text", "text": intro},
            *(page_part(p, n) for n, p in enumerate(pages)),
            *user_verbatim(view, split.middle),
        ],
        "metadata": {"compaction": {"rung": "snapshot", "covers": covered}},
    }
    messages = [*view.source[: split.head_end], message, *view.source[split.tail_start :]]
    after = view.with_messages(messages)
    if after.estimate() >= view.estimate():
        return view, _report("snapshot", view, view, skipped="pages would cost more than the text")
    where = f"{message['id']} pages"
    return after, _report(
        "snapshot",
        view,
        after,
        (Replacement(mid, "message", where) for mid in covered),
        pages=len(pages),
        page_tokens=sum(p.billed_tokens for p in pages),
        chars=sum(p.chars for p in pages),
        head_end=split.head_end,
        head_last_id=_head_last_id(view, split),
        tail_start=split.tail_start,
        settings=dict(result.settings),
        missing_glyphs=result.missing_glyphs,
        substituted=result.substituted,
    )


# --- rung 4: summary ------------------------------------------------------------------------

SUMMARY_INSTRUCTIONS = (
    "You compress the middle of a long conversation so that it can continue in a smaller "
    "context window. Summarise the transcript the user sends, in order, for the assistant "
    "who will carry on the work. Keep: decisions made and why; the user's constraints and "
    "preferences; file names, paths, commands and identifiers; errors met and how they "
    "were resolved; open tasks and next steps. Name message ids (shown in the headers) "
    "when you refer to a specific message: the originals can be fetched by id. Do not "
    "invent anything. Stay under {words} words."
)
MERGE_INSTRUCTIONS = (
    "You merge partial summaries of consecutive parts of one conversation into a single "
    "summary, in order. Keep: decisions made and why; the user's constraints and "
    "preferences; file names, paths, commands and identifiers; errors met and how they "
    "were resolved; open tasks and next steps; message ids. Drop repetition. Do not "
    "invent anything. Stay under {words} words."
)


@dataclass
class _Summarizer:
    """Chunked summarisation where every request fits: calibrated estimate of the prompt
    plus the reserved output never exceeds the window less the margin."""

    view: ContextView
    summarize: SummarizeFn
    requests: list[int] = field(default_factory=list)  # calibrated estimate of each
    rejected: list[int] = field(default_factory=list)  # estimates the provider refused
    # What a rejection taught: the provider counts ``scale`` times the calibrated
    # estimate, within a window of ``window`` (at most the model's).
    scale: float = 1.0
    window: int = 0

    def __post_init__(self) -> None:
        self.window = self.window or self.view.model.context_window

    @cached_property
    def output_tokens(self) -> int:
        model = self.view.model
        return max(1, min(SUMMARY_MAX_TOKENS, model.max_output, model.context_window // 8))

    @property
    def capacity(self) -> int:
        """The calibrated size a summary request's prompt may have."""
        return self.window - margin_tokens(self.window) - self.output_tokens

    def _estimate(self, raw: int) -> int:
        return math.ceil(self.view.calibration.apply(raw) * self.scale)

    def _prompt(self, instructions: str, parts: list[Part]) -> list[Message]:
        words = int(self.output_tokens * 0.7)
        return [
            {
                "role": "system",
                "parts": [{"type": "text", "text": instructions.format(words=words)}],
                # The output the request may ask for: its prompt was sized to fit the
                # window with exactly this much room for the answer (invariant 11).
                "metadata": {"max_output": self.output_tokens},
            },
            {"role": "user", "parts": parts},
        ]

    def _fixed_raw(self, instructions: str, header: str) -> int:
        prompt = self._prompt(instructions, [{"type": "text", "text": header}])
        return request_tokens(prompt, rule=self.view.rule)

    def _fits(self, raw: int) -> bool:
        return self._estimate(raw) <= self.capacity

    def _pieces(self, text: str, room_raw: int) -> list[str]:
        """``text`` cut into pieces whose raw estimate is at most ``room_raw``."""
        pieces: list[str] = []
        while text:
            length = len(text)
            # Slices are throwaway strings: count them without filling the cache.
            while length > 1 and (tokens := count_text_tokens(text[:length])) > room_raw:
                length = max(1, int(length * min(0.9, room_raw / tokens)))
            pieces.append(text[:length])
            text = text[length:]
        return pieces

    def _pack(self, instructions: str, header: str, blocks: list[str]) -> list[list[str]]:
        """Greedy batches of blocks, each a request that fits (blocks too large for one
        request are cut into pieces first)."""
        fixed = self._fixed_raw(instructions, header)
        room = int(self.capacity / (self.view.calibration.factor * self.scale)) - fixed - 2
        if room < 64:
            raise CompactionError(
                f"a {self.view.model.context_window}-token window leaves no room to summarise"
            )
        batches: list[list[str]] = [[]]
        used = 0
        for block in blocks:
            for piece in self._pieces(block, room) if text_tokens(block) > room else [block]:
                cost = text_tokens(piece)
                if batches[-1] and not self._fits(fixed + used + cost):
                    batches.append([])
                    used = 0
                batches[-1].append(piece)
                used += cost
        return [b for b in batches if b]

    def _call(self, instructions: str, header: str, batch: list[str]) -> str:
        parts: list[Part] = [{"type": "text", "text": header}]
        parts += [{"type": "text", "text": block} for block in batch]
        prompt = self._prompt(instructions, parts)
        estimate = self._estimate(request_tokens(prompt, rule=self.view.rule))
        if estimate > self.capacity:  # invariant 11; _pack makes this unreachable
            raise CompactionError(f"summary request of {estimate} tokens would not fit")
        self.requests.append(estimate)
        text = self.summarize(prompt).strip()
        return self._clip(text)

    def _summaries(
        self, instructions: str, header: str, blocks: list[str], retries: int = 2
    ) -> list[str]:
        """A summary of each batch of ``blocks`` that fits one request. A request the
        provider rejects as too long teaches the summariser its count (and window), and
        its blocks are packed again, smaller, never resent as they were."""
        out: list[str] = []
        batches = self._pack(instructions, header, blocks)
        for at, batch in enumerate(batches):
            try:
                out.append(self._call(instructions, header, batch))
            except SummaryTooLong as exc:
                sent = self.requests.pop()
                self.rejected.append(sent)
                if retries <= 0:
                    raise CompactionError(f"summary requests keep overflowing: {exc}") from exc
                if exc.limit:
                    self.window = min(self.window, exc.limit)
                learned = exc.measured / max(1, sent) if exc.measured else 1.5
                self.scale *= max(1.1, learned)
                # This batch and every later one, packed again at what was learned.
                rest = [piece for later in batches[at:] for piece in later]
                return out + self._summaries(instructions, header, rest, retries - 1)
        return out

    def _clip(self, text: str) -> str:
        # A summary longer than its reserved output is cut, so merging always converges.
        if count_text_tokens(text) <= self.output_tokens:
            return text
        return self._pieces(text, self.output_tokens)[0] + " […]"

    def run(self, segments: list[Segment]) -> str:
        header = "Transcript to summarise (each message under a header with its role and id):"
        blocks = [f"### {s.role} {s.message_id}\n{s.text}" for s in segments]
        summaries = self._summaries(SUMMARY_INSTRUCTIONS, header, blocks)
        merge_header = "Partial summaries, oldest first:"
        while len(summaries) > 1:
            blocks = [f"## Part {n}\n{s}" for n, s in enumerate(summaries, 1)]
            batches = self._pack(MERGE_INSTRUCTIONS, merge_header, blocks)
            if len(batches) >= len(summaries):
                raise CompactionError("partial summaries are too long to merge in this window")
            summaries = self._summaries(MERGE_INSTRUCTIONS, merge_header, blocks)
        return summaries[0] if summaries else ""


def summarize_middle(
    view: ContextView,
    *,
    summarize: SummarizeFn,
    head_budget: int | None = None,
    tail_budget: int | None = None,
) -> tuple[ContextView, RungReport]:
    """Rung 4: the middle replaced by a model-written summary."""
    summarizer = _Summarizer(view, summarize)
    head_budget = int(view.history_budget * HEAD_SHARE) if head_budget is None else head_budget
    if tail_budget is None:
        tail_budget = int(view.history_budget * TAIL_SHARE)
    # Leave room for the summary itself: the tail gets what head and summary leave.
    original = view.reset()
    head = split_view(original, head_budget=head_budget, tail_budget=0).head_end
    # The user's own words in the middle stay verbatim beside the summary.
    verbatim = user_verbatim(view, range(head, len(view.messages)))
    room = (
        view.budget_tokens
        - view.calibration.apply(
            request_tokens(view.source[:head], rule=view.rule, system=view.system, tools=view.tools)
            + sum(part_tokens(p, rule=view.rule) for p in verbatim)
            + summarizer.output_tokens
            + MESSAGE_OVERHEAD
            + REQUEST_OVERHEAD
        )
        - 64
    )
    split = split_view(
        original, head_budget=head_budget, tail_budget=max(0, min(tail_budget, room))
    )
    if not split.middle:
        return view, _report("summary", view, view, skipped="no middle to summarise")
    covered = [view.messages[i]["id"] for i in split.middle]
    # The summary is written from the originals, not the elided view: an elided result
    # is gone from the request, so the summary is the only place it can survive.
    text = summarizer.run(middle_segments(original, split.middle))
    fetchable = "; the original messages are archived and can be fetched by id" * view.recall
    intro = (
        f"[summary of messages {covered[0]} to {covered[-1]} ({len(covered)} messages){fetchable}]"
    )
    message: Message = {
        "id": f"{SUMMARY_ID_PREFIX}{covered[0]}..{covered[-1]}",
        "role": "user",
        "parts": [
            {"type": "text", "text": f"{intro}\n\n{text}"},
            *user_verbatim(view, split.middle),
        ],
        "metadata": {"compaction": {"rung": "summary", "covers": covered}},
    }
    messages = [*view.source[: split.head_end], message, *view.source[split.tail_start :]]
    after = view.with_messages(messages)
    return after, _report(
        "summary",
        view,
        after,
        (Replacement(mid, "message", message["id"]) for mid in covered),
        model_calls=len(summarizer.requests) + len(summarizer.rejected),
        summary=text,
        request_tokens=list(summarizer.requests),
        rejected_tokens=list(summarizer.rejected),
        request_capacity=summarizer.capacity,
        head_end=split.head_end,
        head_last_id=_head_last_id(view, split),
        tail_start=split.tail_start,
    )


def _head_last_id(view: ContextView, split: Split) -> str | None:
    """The id of the last message kept verbatim at the head, if any."""
    return str(view.messages[split.head_end - 1]["id"]) if split.head_end > 0 else None


# --- the driver -------------------------------------------------------------------------------


def _free_rungs(
    base: ContextView, reports: list[RungReport], *, k_turns: int, head_end: int
) -> ContextView:
    """Elision, then image stripping, on the middle; stops at the first view that fits.
    The reports of the rungs that applied are added to ``reports``."""
    current = base
    for rung in (elide, strip_images):
        current, report = rung(current, k_turns=k_turns, head_end=head_end)
        if report.applied:
            reports.append(report)
        if current.fits():
            break
    return current


def _snapshots(
    base: ContextView,
    free: ContextView,
    *,
    render: RenderFn | None,
    head_budget: int | None,
    tail_budget: int | None,
    head_end: int,
) -> Iterator[tuple[ContextView, RungReport, list[RungReport] | None]]:
    """Snapshots of ``free`` with smaller and smaller tails (pages are cheaper than
    text), one per distinct tail; only those that applied. With each tail, a second
    snapshot whose pages draw every uneventful result of the middle as its elision line
    (``free`` keeps the last turns' results in full, on pages that cost tokens too):
    yielded with the free rungs' reports that replace ``free``'s. None without a renderer
    or for a model that cannot read images. Lazy: the caller stops at the first that
    fits, and no more pages are drawn."""
    if render is None or not base.model.vision:
        return
    tail = int(base.history_budget * TAIL_SHARE) if tail_budget is None else tail_budget
    seen: set[tuple[int, bool]] = set()
    lean: tuple[ContextView, list[RungReport]] | None = None
    for attempt in (tail, tail // 2, tail // 4, 0):
        split = split_view(base, head_budget=head_budget, tail_budget=attempt)
        for all_elided in (False, True):
            if (split.tail_start, all_elided) in seen:
                continue
            seen.add((split.tail_start, all_elided))
            source, lean_reports = free, None
            if all_elided:
                if lean is None:
                    found: list[RungReport] = []
                    lean = (_free_rungs(base, found, k_turns=0, head_end=head_end), found)
                if lean[0].messages == free.messages:
                    continue  # nothing more to elide: the same pages as above
                source, lean_reports = lean
            snap, report = snapshot(
                source, render=render, head_budget=head_budget, tail_budget=attempt
            )
            # Not applied: e.g. pages dearer than a small middle; a smaller tail may pay.
            if report.applied:
                yield snap, report, lean_reports


def _last_resort(
    free: ContextView,
    best: tuple[ContextView, RungReport] | None,
    reports: list[RungReport],
    *,
    summarize: SummarizeFn | None,
    head_budget: int | None,
    tail_budget: int | None,
) -> LadderResult:
    """No rung so far fits: the summary when it applies (or when no snapshot did), else
    the smallest snapshot, else the free rungs' view; none of them may fit."""
    if summarize is not None:
        summary, report = summarize_middle(
            free, summarize=summarize, head_budget=head_budget, tail_budget=tail_budget
        )
        if report.applied or best is None:
            out = (*reports, report) if report.applied else tuple(reports)
            return LadderResult(summary, out, summary.fits())
    if best is not None:
        return LadderResult(best[0], (*reports, best[1]), False)
    return LadderResult(free, tuple(reports), False)


def run_ladder(
    view: ContextView,
    *,
    render: RenderFn | None = None,
    summarize: SummarizeFn | None = None,
    shrink: ShrinkFn | None = None,
    k_turns: int = DEFAULT_K_TURNS,
    tail_budget: int | None = None,
    head_budget: int | None = None,
    ceiling: int | None = None,
) -> LadderResult:
    """What the model sees for ``view``'s originals at ``view``'s budget.

    Always starts from the originals (``view.source``), never from a compacted view.
    First the images are fitted to the model (rung 0: none for a model without vision,
    none over the provider's byte limits); then the rungs run in order on the middle
    only (the head, the system prompt and first turn, and the tail stay verbatim) and
    the first view that fits the budget (tokens and non-token limits) is the answer.
    The snapshot is retried with a smaller tail (pages are cheaper than text) before
    falling back to a summary; the summary runs only when the free rungs are not enough
    or the model cannot read images (or no renderer was given).

    ``ceiling`` (above the view's budget) is the budget a stepped compaction answers
    for: when nothing free fits the step's target, the smallest free or snapshot view
    that fits the ceiling is the answer (its budget the ceiling), before any summary.
    Pages come before summaries at any budget where they fit."""
    base, fitted = fit_images(view.reset(), shrink=shrink)
    reports: list[RungReport] = [fitted] if fitted.applied else []
    if base.fits():
        return LadderResult(base, tuple(reports), True)
    head_end = split_view(base, head_budget=head_budget, tail_budget=0).head_end
    free = _free_rungs(base, reports, k_turns=k_turns, head_end=head_end)
    if free.fits():
        return LadderResult(free, tuple(reports), True)
    best: tuple[ContextView, tuple[RungReport, ...]] | None = None
    snapshots = _snapshots(
        base,
        free,
        render=render,
        head_budget=head_budget,
        tail_budget=tail_budget,
        head_end=head_end,
    )
    for snap, report, lean_reports in snapshots:
        used = (*(reports if lean_reports is None else lean_reports), report)
        if snap.fits():
            return LadderResult(snap, used, True)
        if best is None or snap.estimate() < best[0].estimate():
            best = (snap, used)
    if ceiling is not None and ceiling > view.budget_tokens:
        roomy = _smallest_under(ceiling, [(free, tuple(reports)), *([best] if best else [])])
        if roomy is not None:
            return LadderResult(roomy[0], roomy[1], True)
    return _last_resort(
        free,
        (best[0], best[1][-1]) if best else None,
        reports,
        summarize=summarize,
        head_budget=head_budget,
        tail_budget=tail_budget,
    )


def _smallest_under(
    ceiling: int, views: Sequence[tuple[ContextView, tuple[RungReport, ...]]]
) -> tuple[ContextView, tuple[RungReport, ...]] | None:
    """The smallest of ``views`` that fits ``ceiling``, with that as its budget."""
    fitting = [
        (replace(v, budget_tokens=ceiling), r)
        for v, r in views
        if replace(v, budget_tokens=ceiling).fits()
    ]
    return min(fitting, key=lambda vr: vr[0].estimate()) if fitting else None


def reactive(
    view: ContextView,
    *,
    measured_tokens: int | None,
    limit: int | None,
    render: RenderFn | None = None,
    summarize: SummarizeFn | None = None,
    shrink: ShrinkFn | None = None,
    k_turns: int = DEFAULT_K_TURNS,
    tail_budget: int | None = None,
    head_budget: int | None = None,
) -> LadderResult:
    """Compaction after a provider rejected ``view`` with a
    ContextOverflow(measured_tokens, limit). ``view.messages`` is the request that was
    sent (maybe already compacted), ``view.source`` the originals it was built from:
    the ladder runs again from the originals, never from the rejected view (a snapshot
    page fed back in would be stripped as an image, and the middle lost).

    The calibration learns measured / raw estimate of the rejected request, and the
    ladder compacts to ``limit - max_output - margin`` (or the view's own budget when
    lower), so the next request is below the provider's limit by the margin even in
    the provider's count. Raises CompactionError rather than return a view that does
    not fit or that equals the rejected payload (invariant 11)."""
    window = limit or view.model.context_window
    if not measured_tokens:
        # No numbers: the prompt was at least over the room the window leaves for input.
        measured_tokens = max(view.estimate(), window - view.model.max_output) + 1
    calibration = view.calibration.after_overflow(view.raw_tokens, measured_tokens)
    target = min(view.budget_tokens, window - margin_tokens(window) - view.model.max_output)
    if target <= 0:
        raise CompactionError(f"a {window}-token limit leaves no room for a request")
    retry = replace(view, calibration=calibration, budget_tokens=target)
    result = run_ladder(
        retry,
        render=render,
        summarize=summarize,
        shrink=shrink,
        k_turns=k_turns,
        tail_budget=tail_budget,
        head_budget=head_budget,
    )
    if result.view.messages == view.messages:
        raise CompactionError("compaction left the rejected request unchanged", result=result)
    if not result.fits:
        raise CompactionError(
            f"cannot fit the conversation under {target} tokens (best: {result.view.estimate()})",
            result=result,
        )
    return result


# --- what a view spends its budget on -------------------------------------------------------

# The rungs' names, as their reports (and records) give them, cheapest first.
RUNGS = ("image_limits", "elision", "image_stripping", "snapshot", "summary")
# The sections of a request, in the order they are sent.
SECTIONS = ("head", "summary", "pages", "tail", "images")


def _image_tokens(part: Part, rule: str) -> int:
    """Tokens of the ordinary images in a part (an image, or those inside a result)."""
    if part.get("type") == "image" and "snapshot_page" not in part:
        return part_tokens(part, rule=rule)
    if part.get("type") == "tool_result":
        return sum(_image_tokens(p, rule) for p in part.get("parts") or ())
    return 0


def breakdown(view: ContextView) -> dict[str, int]:
    """The view's calibrated estimate split by section (the numbers of a budget gauge):
    ``head`` (system prompt, request overhead and everything before the first summary or
    snapshot message, or the first turn when there is none), ``summary``, ``pages``
    (snapshot messages: their page images and the text that introduces them), ``tail``
    (the rest) and ``images`` (every other image, wherever it sits). The sections add up
    to ``view.estimate()`` exactly: rounding goes to the largest."""
    rule = view.rule
    first_turn_end = view.turns()[0][1] if view.messages else 0
    head_end = next(
        (
            i
            for i, m in enumerate(view.messages)
            if str(m["id"]).startswith((SNAPSHOT_ID_PREFIX, SUMMARY_ID_PREFIX))
        ),
        first_turn_end,
    )
    raw = dict.fromkeys(SECTIONS, 0)
    raw["head"] = request_tokens((), rule=rule, system=view.system, tools=view.tools)
    for i, message in enumerate(view.messages):
        mid = str(message["id"])
        if mid.startswith(SUMMARY_ID_PREFIX):
            section = "summary"
        elif mid.startswith(SNAPSHOT_ID_PREFIX):
            section = "pages"
        else:
            section = "head" if i < head_end else "tail"
        images = sum(_image_tokens(p, rule) for p in message["parts"])
        raw["images"] += images
        raw[section] += view.message_raw[i] - images
    factor = view.calibration.factor
    out = {name: int(tokens * factor) for name, tokens in raw.items()}
    largest = max(SECTIONS, key=lambda name: out[name])
    out[largest] += view.estimate() - sum(out.values())
    return out
