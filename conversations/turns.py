"""Chat turns: user message → model → tools → model … → final answer.

The whole turn is held in memory and written at its end by ``services.turn_append``, in
one transaction with the tip move, so a process killed anywhere mid-turn leaves the
transcript at the previous turn. What was asked is recorded first in a ``TurnAttempt``
row (committed on its own, see ``services.turn_attempt_start``), so a failed or interrupted
turn can be retried after a restart.

This module is the way in: it checks the input, records the attempt, and hands the
rounds to ``turn_engine.TurnRun``; it also drains a turn for a plain answer and picks
what a retry runs. The engine is a generator of events; the API streams them as
Server-Sent Events or drains them for a plain JSON answer. One engine, two ways to
watch it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models.functions import Now
from django.utils import timezone

from arbor.heartbeat import db_now
from arbor.procs import process_gone
from conversations import selectors, services
from conversations.errors import ArborError, Conflict, InvalidInput, NotFound
from conversations.models import (
    AttemptStatus,
    Conversation,
    Message,
    Origin,
    TurnAttempt,
)
from conversations.parts import clean_messages
from conversations.providers import ModelSpec, make_provider, resolve_model
from conversations.resume import ResumeReport
from conversations.turn_engine import STOPPED, TurnRun

# ``make_provider`` is exported: a turn looks it up in this module when it opens the
# provider, so a bench (or a test) swaps the provider by setting ``turns.make_provider``.
__all__ = [
    "NothingLoaded",
    "NothingRunning",
    "NothingToRetry",
    "TurnFailed",
    "TurnInProgress",
    "TurnOutcome",
    "attempt_is_stale",
    "make_provider",
    "retry_events",
    "retry_target",
    "turn_drain",
    "turn_events",
    "turn_follow",
    "turn_run",
    "turn_running",
    "turn_stop",
]

_AT_TIP: Any = object()
FOLLOW_KEEPALIVE_SECONDS = 5.0


class NothingLoaded(NotFound):
    code = "nothing_loaded"


class NothingToRetry(Conflict):
    code = "nothing_to_retry"


class TurnInProgress(Conflict):
    code = "turn_in_progress"


@dataclass
class TurnOutcome:
    attempt: uuid.UUID
    tip: uuid.UUID
    version: int
    message_ids: list[uuid.UUID]
    resume: ResumeReport = field(default_factory=ResumeReport)
    stopped: bool = False


# --- attempts ------------------------------------------------------------------------


def attempt_is_stale(attempt: TurnAttempt, now: datetime | None = None) -> bool:
    """A running attempt whose process is gone (on this host: its pid free or reused by
    a process started later, see arbor.procs) or that has not shown signs of life for
    ARBOR_ATTEMPT_STALE_SECONDS, by the database's clock, which its heartbeat is written
    with whichever host runs it (``now``: its time, when the caller has read it)."""
    if attempt.status != AttemptStatus.RUNNING:
        return False
    if process_gone(attempt.worker):
        return True
    limit = timedelta(seconds=settings.ARBOR_ATTEMPT_STALE_SECONDS)
    return (now or db_now()) - attempt.heartbeat_at > limit


class NothingRunning(Conflict):
    code = "nothing_running"


def turn_running(*, conversation: Conversation) -> list[TurnAttempt]:
    """The conversation's turns running now, newest first (a stale one is not: its
    process is gone, and retry offers to run it again)."""
    running = (
        TurnAttempt.objects.filter(conversation=conversation, status=AttemptStatus.RUNNING)
        .annotate(db_time=Now())  # the database's time, read with the rows
        .order_by("-created_at")
    )
    return [a for a in running if not attempt_is_stale(a, a.db_time)]


def turn_stop(*, conversation: Conversation, attempt_id: Any = None) -> list[uuid.UUID]:
    """Ask the conversation's running turn (``attempt_id``, else every one) to stop,
    whichever process runs it: the run cuts the model's request and writes what
    streamed as a partial answer marked ``stopped``. Returns the attempts asked;
    NothingRunning when no turn is running (or only one whose process is gone)."""
    candidates = [
        a
        for a in turn_running(conversation=conversation)
        if attempt_id is None or str(a.pk) == str(attempt_id)
    ]
    asked = []
    for attempt in candidates:
        # Only while it still runs: a turn that ended a moment ago is not marked.
        if attempt.stop_requested_at is not None or TurnAttempt.objects.filter(
            pk=attempt.pk, status=AttemptStatus.RUNNING, stop_requested_at__isnull=True
        ).update(stop_requested_at=timezone.now()):
            asked.append(attempt.pk)
    if not asked:
        raise NothingRunning("no turn is running in this conversation")
    return asked


def turn_follow(*, attempt_id: uuid.UUID) -> Iterator[dict[str, Any]]:
    """Follow a running turn from another request (a chat reloaded mid-answer): a
    ``live`` event with what streamed so far, then one with what was added whenever it
    grew (read from the attempt's row every ARBOR_TURN_STOP_POLL_SECONDS, whichever
    process runs the turn); last ``done`` (with ``stopped``) or ``error`` when the
    attempt ended or its process died."""
    # Each poll reads the database's time with the row: no second query to judge it.
    rows = TurnAttempt.objects.filter(pk=attempt_id).annotate(db_time=Now())
    shown: Any = None
    quiet_since = time.monotonic()
    while True:
        attempt = rows.first()
        if attempt is None:  # deleted with its conversation
            yield {"event": "error", "error": "not_found", "detail": "the turn is gone"}
            return
        if attempt.status == AttemptStatus.RUNNING and attempt_is_stale(attempt, attempt.db_time):
            yield {"event": "error", "error": "interrupted", "detail": "the turn's process stopped"}
            return
        if attempt.status == AttemptStatus.COMPLETED:
            # Stop asked as the last round ended leaves a whole answer: only the run
            # says whether it stopped (turn_engine records "stopped").
            stopped = attempt.error_code == STOPPED
            yield {"event": "done", "attempt": str(attempt.pk), "stopped": stopped}
            return
        if attempt.status == AttemptStatus.FAILED:
            text = attempt.error_text or attempt.error_code
            yield {"event": "error", "error": attempt.error_code, "detail": text}
            return
        if attempt.live != shown:
            yield _live_event(shown, attempt.live)
            shown = attempt.live
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > FOLLOW_KEEPALIVE_SECONDS:
            # A model (or a tool) silent for a while: a sign of life, so a client that
            # went away is noticed and this stream ends with it.
            quiet_since = time.monotonic()
            yield {"event": "waiting"}
        time.sleep(settings.ARBOR_TURN_STOP_POLL_SECONDS)


def _live_event(before: Any, now: dict[str, Any]) -> dict[str, Any]:
    """What a follower is sent when the live answer changed: the text it lacks
    (``append``), or the whole text when it does not simply continue what was sent."""
    text, tools = now.get("text", ""), now.get("tools", [])
    # None: nothing sent yet; a live state with no text yet was sent as "".
    sent = before.get("text", "") if before is not None else None
    if sent is not None and text.startswith(sent):
        return {"event": "live", "append": text[len(sent) :], "tools": tools}
    return {"event": "live", "text": text, "tools": tools}


# --- running a turn ------------------------------------------------------------------


def _clean_input(parts: Any, owner_id: Any) -> list[dict[str, Any]]:
    drafts = clean_messages(
        [{"role": "user", "parts": parts}],
        max_messages=1,
        max_chars=settings.ARBOR_MAX_PART_CHARS,
    )
    services._resolve_images(drafts, owner_id=owner_id)
    return drafts[0].parts


def _resolve(model: str) -> ModelSpec:
    """The model a turn may use: one Arbor knows (built in, or declared in ARBOR_MODELS),
    the offline demo, or the configured default; never any id a client makes up (a
    costly model the operator's keys happen to reach)."""
    from conversations.providers.registry import declared_models

    if not model.strip():
        raise InvalidInput(
            "no model: choose one for the conversation, or set ARBOR_DEFAULT_MODEL (with "
            "DEBUG off Arbor never falls back to the offline demo)",
            code="no_model",
        )
    try:
        spec = resolve_model(model)
    except ValueError as exc:
        raise InvalidInput(str(exc), code="bad_model") from None
    known = (
        spec.fake
        or spec.id in declared_models()
        or spec.id == settings.ARBOR_DEFAULT_MODEL
        or not spec.assumed
    )
    if not known:
        raise InvalidInput(
            f"model {spec.id!r} is not configured: declare it in the ARBOR_MODELS file "
            "(or make it ARBOR_DEFAULT_MODEL)",
            code="bad_model",
        )
    return spec


def turn_events(
    *,
    conversation: Conversation,
    parts: Any,
    parent_id: Any = _AT_TIP,
    model: str = "",
    retry_of: TurnAttempt | None = None,
    origin: str = Origin.TURN,
    attempt: TurnAttempt | None = None,
) -> Iterator[dict[str, Any]]:
    """Run one chat turn, yielding events as they happen; the last event is ``done``
    (with the persisted ids) or ``error``. Bad input raises before anything is written.

    ``parts=None`` continues from ``parent_id`` without a new user message: a
    regenerated answer (``origin="regenerate"``), or the retry of a turn that failed
    after the model rewound (its digest is already the last message). ``origin`` marks
    the turn's first message: ``edit`` for an edited prompt, ``regenerate`` for a new
    answer to the same prompt.
    """
    try:
        user_parts = _clean_input(parts, conversation.owner_id) if parts is not None else []
        model_id = selectors.model_id_for(conversation, model)
        spec = _resolve(model_id)
        parent_id = _turn_parent(conversation, parent_id)
    except Exception as exc:
        if attempt is not None:  # a retry's attempt, made under the lock: it failed here
            services.turn_attempt_finish(
                attempt=attempt,
                status=AttemptStatus.FAILED,
                code=getattr(exc, "code", "error"),
                text=str(exc),
            )
        raise

    if attempt is None:
        attempt = services.turn_attempt_start(
            conversation=conversation,
            parent_id=parent_id,
            input_parts=user_parts,
            model=model_id,
            retry_of=retry_of,
        )
    yield {"event": "attempt", "attempt": str(attempt.pk), "model": spec.id, "notice": spec.notice}
    run = TurnRun(
        conversation=conversation,
        spec=spec,
        attempt=attempt,
        parent_id=parent_id,
        user_parts=user_parts,
        origin=origin,
        # ``make_provider`` is read when the run opens it, not now (see __all__).
        open_provider=lambda: make_provider(spec, load_blob=services.blob_read),
    )
    yield from run.events()


def _turn_parent(conversation: Conversation, parent_id: Any) -> Any:
    """The message the turn continues: the tip as it is now, or ``parent_id`` once it is
    known to be a message of this conversation (None: a first message)."""
    if parent_id is _AT_TIP:
        try:
            conversation.refresh_from_db(fields=["tip", "version"])
        except Conversation.DoesNotExist:  # deleted a moment ago
            raise NotFound(f"no such conversation: {conversation.pk}") from None
        return conversation.tip_id
    if (
        parent_id is not None
        and not Message.objects.filter(pk=parent_id, conversation=conversation).exists()
    ):
        raise InvalidInput(f"parent {parent_id} is not a message of this conversation")
    return parent_id


class TurnFailed(ArborError):
    """A turn ended in a provider or engine error (the attempt records it)."""

    status = 502
    code = "provider_error"


def turn_run(**kwargs: Any) -> TurnOutcome:
    """Run a turn to its end without streaming; raise TurnFailed on a failed turn."""
    return turn_drain(turn_events(**kwargs))


def turn_drain(events: Iterator[dict[str, Any]]) -> TurnOutcome:
    outcome: dict[str, Any] = {}
    for event in events:
        if event["event"] == "done":
            outcome = event
        elif event["event"] == "error":
            status = {"rate_limited": 429, "context_overflow": 413}.get(event["error"], 502)
            # Everything the error said beyond its code and text (retry_after, the
            # estimate of an oversized message) reaches the client too.
            extra = {k: v for k, v in event.items() if k not in ("event", "error", "detail")}
            error = TurnFailed(event["detail"], code=event["error"], **extra)
            error.status = status
            raise error
    return TurnOutcome(
        attempt=uuid.UUID(outcome["attempt"]),
        tip=uuid.UUID(outcome["tip"]),
        version=outcome["version"],
        message_ids=[uuid.UUID(m) for m in outcome["message_ids"]],
        stopped=bool(outcome.get("stopped")),
    )


# --- retry ---------------------------------------------------------------------------


def retry_target(
    *, user: Any, conversation_id: Any
) -> tuple[Conversation, TurnAttempt, TurnAttempt]:
    """What ``retry`` would run, in DESIGN.md's order: no such conversation →
    nothing_loaded; the last attempt failed (or was interrupted) → that attempt; no
    attempt and no messages → nothing_loaded; otherwise nothing_to_retry.

    The retry's own attempt row is created under the conversation's row lock, before the
    lock is let go: of concurrent retries exactly one finds the failed attempt last; the
    others find the new running one and get 409."""
    try:
        conversation = selectors.conversation_get(user=user, conversation_id=conversation_id)
    except NotFound:
        raise NothingLoaded("nothing loaded: there is no such conversation") from None
    last, retry = _retry_claim(conversation)
    if last is not None and retry is not None:
        return conversation, last, retry
    raise _nothing_to_retry(conversation, last)


def _retry_claim(conversation: Conversation) -> tuple[TurnAttempt | None, TurnAttempt | None]:
    """Under the conversation's row lock: the last attempt, and the retry's own attempt
    when the last one failed (a stale running one is marked failed first)."""
    with transaction.atomic():
        if not Conversation.objects.select_for_update().filter(pk=conversation.pk).exists():
            raise NothingLoaded("nothing loaded: there is no such conversation")
        last = selectors.turn_attempt_last(conversation=conversation)
        if last is not None and attempt_is_stale(last):
            # Its process died mid-turn; the transcript holds the previous turn.
            last.status = AttemptStatus.FAILED
            services.turn_attempt_finish(
                attempt=last,
                status=AttemptStatus.FAILED,
                code="interrupted",
                text=f"the process running this turn ({last.worker}) stopped",
            )
        if last is None or last.status != AttemptStatus.FAILED:
            return last, None
        retry = services.turn_attempt_start(
            conversation=conversation,
            parent_id=last.parent_id,
            input_parts=last.input_parts,
            model=last.model,
            retry_of=last,
        )
        return last, retry


def _nothing_to_retry(conversation: Conversation, last: TurnAttempt | None) -> ArborError:
    """Why there is nothing to retry when the last attempt did not fail."""
    if last is not None and last.status == AttemptStatus.RUNNING:
        return TurnInProgress("a turn is still running in this conversation")
    if last is None and not Message.objects.filter(conversation=conversation).exists():
        return NothingLoaded("nothing loaded: the conversation has no transcript")
    return NothingToRetry("nothing to retry: the last turn completed")


def retry_events(*, user: Any, conversation_id: Any) -> Iterator[dict[str, Any]]:
    conversation, failed, attempt = retry_target(user=user, conversation_id=conversation_id)
    return turn_events(
        conversation=conversation,
        # Empty input: the failed attempt had already rewound; continue from its digest.
        parts=failed.input_parts or None,
        parent_id=failed.parent_id,
        model=failed.model,
        retry_of=failed,
        attempt=attempt,
    )
