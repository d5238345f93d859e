"""The chat turn engine: user message → model → tools → model … → final answer.

The whole turn is held in memory and written at its end by ``services.turn_append``, in
one transaction with the tip move, so a process killed anywhere mid-turn leaves the
transcript at the previous turn. What was asked is recorded first in a ``TurnAttempt``
row (committed on its own), so a failed or interrupted turn can be retried after a
restart.

The engine is a generator of events; the API streams them as Server-Sent Events or
drains them for a plain JSON answer. One engine, two ways to watch it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from arbor.heartbeat import Heartbeat
from arbor.procs import process_gone, process_identity
from compaction import services as compaction
from compaction.models import Trigger
from conversations import selectors, services
from conversations.errors import ArborError, Conflict, InvalidInput, NotFound
from conversations.models import (
    AttemptStatus,
    Checkpoint,
    CheckpointSource,
    CheckpointState,
    Conversation,
    Message,
    Origin,
    TurnAttempt,
)
from conversations.parts import DraftMessage, clean_messages
from conversations.providers import (
    ContextOverflow,
    Done,
    ModelSpec,
    ProviderError,
    Request,
    TextDelta,
    ThinkingDelta,
    ToolCallStarted,
    make_provider,
    resolve_model,
)
from conversations.resume import ResumeReport
from conversations.tools import ToolContext, run_tool, tools_for

_AT_TIP: Any = object()


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


# --- attempts ------------------------------------------------------------------------


def _worker_name() -> str:
    return process_identity()


def attempt_is_stale(attempt: TurnAttempt) -> bool:
    """A running attempt whose process is gone (on this host: its pid free or reused by
    a process started later, see arbor.procs) or that has not shown signs of life for
    ARBOR_ATTEMPT_STALE_SECONDS."""
    if attempt.status != AttemptStatus.RUNNING:
        return False
    if process_gone(attempt.worker):
        return True
    limit = timedelta(seconds=settings.ARBOR_ATTEMPT_STALE_SECONDS)
    return timezone.now() - attempt.heartbeat_at > limit


def _attempt_finish(
    attempt: TurnAttempt,
    *,
    status: str,
    code: str = "",
    text: str = "",
    tip: uuid.UUID | None = None,
) -> None:
    TurnAttempt.objects.filter(pk=attempt.pk).update(
        status=status,
        error_code=code[:64],
        error_text=text,
        result_tip_id=tip,
        finished_at=timezone.now(),
    )


def _drafts(messages: list[dict[str, Any]]) -> list[DraftMessage]:
    """The turn in memory as the drafts turn_append writes."""
    return [
        DraftMessage(role=m["role"], parts=m["parts"], metadata=m.get("metadata", {}))
        for m in messages
    ]


def _lease(attempt: TurnAttempt) -> Heartbeat:
    """Keeps a running attempt's heartbeat fresh on a timer, whatever the model is doing:
    a model silent for minutes is still a turn in progress (retry refuses it), and a
    process that died stops renewing, so its attempt goes stale."""
    running = TurnAttempt.objects.filter(pk=attempt.pk, status=AttemptStatus.RUNNING)
    return Heartbeat(
        lambda: running.update(heartbeat_at=timezone.now()),
        settings.ARBOR_ATTEMPT_STALE_SECONDS / 4,
        name="arbor-turn-lease",
    )


def _heartbeat(attempt: TurnAttempt) -> None:
    now = timezone.now()
    # At most one write every few seconds, however fast the tokens arrive.
    if now - attempt.heartbeat_at > timedelta(seconds=5):
        attempt.heartbeat_at = now
        TurnAttempt.objects.filter(pk=attempt.pk).update(heartbeat_at=now)


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
        if parent_id is _AT_TIP:
            try:
                conversation.refresh_from_db(fields=["tip", "version"])
            except Conversation.DoesNotExist:  # deleted a moment ago
                raise NotFound(f"no such conversation: {conversation.pk}") from None
            parent_id = conversation.tip_id
        elif (
            parent_id is not None
            and not Message.objects.filter(pk=parent_id, conversation=conversation).exists()
        ):
            raise InvalidInput(f"parent {parent_id} is not a message of this conversation")
    except Exception as exc:
        if attempt is not None:  # a retry's attempt, made under the lock: it failed here
            _attempt_finish(
                attempt,
                status=AttemptStatus.FAILED,
                code=getattr(exc, "code", "error"),
                text=str(exc),
            )
        raise

    if attempt is None:
        try:
            with transaction.atomic():
                attempt = TurnAttempt.objects.create(
                    conversation=conversation,
                    parent_id=parent_id,
                    input_parts=user_parts,
                    model=model_id,
                    worker=_worker_name(),
                    retry_of=retry_of,
                )
        except IntegrityError:  # the conversation was deleted a moment ago
            raise NotFound(f"no such conversation: {conversation.pk}") from None
    yield {"event": "attempt", "attempt": str(attempt.pk), "model": spec.id, "notice": spec.notice}
    finished = False
    lease = _lease(attempt).__enter__()
    try:
        turn: list[dict[str, Any]] = [{"role": "user", "parts": user_parts}] if user_parts else []
        tool_specs = tools_for(conversation)
        tool_context = ToolContext(conversation=conversation)
        persisted: list[str] = []
        reported_resume = False
        told_record: Any = None
        # The archived path below the turn, loaded once (again only after a rewind
        # moves the turn's parent): every round adds only the turn in memory to it.
        archived: tuple[uuid.UUID | None, Any] = (None, None)
        with make_provider(spec, load_blob=services.blob_read) as provider:
            for round_number in range(settings.ARBOR_MAX_TOOL_ROUNDS + 1):
                # Every request goes through the one entry point into compaction: the
                # archived path plus the turn so far, at the model's budget, with the
                # tool definitions it is sent with.
                if archived[1] is None or archived[0] != parent_id:
                    archived = (
                        parent_id,
                        services.transcript_for_model(conversation=conversation, tip_id=parent_id),
                    )
                context = compaction.context_build(
                    conversation=conversation,
                    spec=spec,
                    tip_id=parent_id,
                    pending=turn,
                    archived=archived[1],
                    tools=tool_specs,
                    trigger=Trigger.PROACTIVE,
                )
                sent_len = len(turn)  # the turn messages this request carries
                report = context.resume
                if report.changed and not reported_resume:
                    reported_resume = True
                    yield {
                        "event": "resume",
                        "trimmed": report.trimmed,
                        "repaired": report.repaired,
                    }
                if context.record is not None and context.record.pk != told_record:
                    told_record = context.record.pk
                    yield _context_event(context)
                # The last round keeps the tool definitions (a history with tool calls
                # needs them) but lets the model call none, so the turn ends on an answer.
                last_round = round_number == settings.ARBOR_MAX_TOOL_ROUNDS
                reply = None
                for retry in (False, True):
                    request = Request(
                        messages=context.messages,
                        system=conversation.system_prompt,
                        tools=tool_specs,
                        tool_choice="none" if last_round else None,
                    )
                    try:
                        for event in provider.stream(request):
                            _heartbeat(attempt)
                            if isinstance(event, TextDelta):
                                yield {"event": "delta", "text": event.text}
                            elif isinstance(event, ThinkingDelta):
                                yield {"event": "thinking", "text": event.text}
                            elif isinstance(event, ToolCallStarted):
                                yield {"event": "tool_call", "id": event.id, "name": event.name}
                            elif isinstance(event, Done):
                                reply = event.reply
                        break
                    except ContextOverflow as overflow:
                        if retry:
                            raise  # compacted once already: fail the turn, say why
                        # Reactive compaction: the provider counted more than we did.
                        # Recalibrate, compact again from the originals below its limit,
                        # and retry once; the rejected payload is never sent again.
                        context = compaction.context_after_overflow(
                            conversation=conversation,
                            spec=spec,
                            tip_id=parent_id,
                            sent=context,
                            overflow=overflow,
                        )
                        yield {"event": "compacted", "trigger": "reactive"}
                assert reply is not None  # stream() raises rather than end without Done
                compaction.usage_observe(spec=spec, context=context, usage=reply.usage)
                message = reply.message()
                if not message["parts"]:
                    message["parts"] = [{"type": "text", "text": ""}]
                turn.append(message)
                if not reply.tool_calls:
                    break
                results = []
                rewind_call: dict[str, Any] | None = None
                for call in reply.tool_calls:
                    arguments = call.get("arguments") or {}
                    if call["name"] == "rewind" and conversation.checkpoint_tools:
                        if rewind_call is None:
                            rewind_call = call  # answered below, after the others
                            continue
                        text, is_error = "only one rewind per step", True
                    elif call["name"] == "checkpoint" and conversation.checkpoint_tools:
                        text, is_error = _model_checkpoint(conversation, parent_id, arguments)
                    else:
                        text, is_error = run_tool(call["name"], arguments, tool_context)
                    results.append(_result(call, text, is_error))
                    yield _result_event(call, is_error)
                if rewind_call is not None:
                    outcome = _model_rewind(
                        conversation, parent_id, turn, results, rewind_call, attempt
                    )
                    yield _result_event(rewind_call, outcome.is_error)
                    if outcome.digest_id is None:
                        results.append(_result(rewind_call, outcome.text, True))
                    else:
                        # The exploration is persisted on the abandoned branch; the
                        # model continues from the checkpoint and its digest.
                        persisted += outcome.persisted
                        parent_id = outcome.digest_id
                        turn = []
                        yield {
                            "event": "rewind",
                            "label": rewind_call["arguments"].get("label"),
                            "digest_message": str(parent_id),
                            "abandoned_tip": outcome.persisted[-1],
                        }
                        continue
                turn.append({"role": "tool", "parts": results})
        # The turn and its attempt's "completed" commit together: a process killed
        # between the two would leave a whole turn whose attempt looks interrupted, and
        # retry would run it again.
        with transaction.atomic():
            result = services.turn_append(
                conversation=conversation,
                parent_id=parent_id,
                expected_version=None,
                messages=_drafts(turn),
                # After a rewind the turn continues below the digest: an ordinary turn.
                origin=Origin.TURN if persisted else origin,
            )
            _attempt_finish(attempt, status=AttemptStatus.COMPLETED, tip=result.tip)
        finished = True
        compaction.compaction_enqueue_if_due(
            conversation=conversation,
            spec=spec,
            tip_id=result.tip,
            tools=tool_specs,
            last=context,
            appended=turn[sent_len:],
        )
        yield {
            "event": "done",
            "attempt": str(attempt.pk),
            "tip": str(result.tip),
            "version": result.version,
            "message_ids": persisted + [str(mid) for mid in result.message_ids],
        }
    except (ProviderError, ArborError) as exc:
        body = exc.as_dict()
        _attempt_finish(
            attempt, status=AttemptStatus.FAILED, code=body["error"], text=body["detail"]
        )
        finished = True
        yield {"event": "error", "attempt": str(attempt.pk), **body}
    except Exception as exc:
        _attempt_finish(
            attempt, status=AttemptStatus.FAILED, code="internal", text=type(exc).__name__
        )
        finished = True
        raise
    finally:
        lease.__exit__()
        if not finished:
            # The consumer went away mid-turn (a closed stream): nothing was written to
            # the transcript; the attempt stays retryable.
            _attempt_finish(
                attempt, status=AttemptStatus.FAILED, code="interrupted", text="stream closed"
            )


def _context_event(context: compaction.ContextResult) -> dict[str, Any]:
    record = context.record
    return {
        "event": "context",
        "record": str(record.pk) if record else None,
        "reused": context.reused,
        "estimate": context.estimate,
        "budget": context.budget,
        "rungs": [r["rung"] for r in (record.rungs if record else [])],
    }


def _result(call: dict[str, Any], text: str, is_error: bool) -> dict[str, Any]:
    return {
        "type": "tool_result",
        "call_id": call["id"],
        "is_error": is_error,
        "parts": [{"type": "text", "text": text}],
    }


def _result_event(call: dict[str, Any], is_error: bool) -> dict[str, Any]:
    return {
        "event": "tool_result",
        "call_id": call["id"],
        "name": call["name"],
        "is_error": is_error,
    }


# --- the model's own checkpoint and rewind (DESIGN.md invariant 6) ---------------------


def _model_checkpoint(
    conversation: Conversation, turn_start: uuid.UUID | None, arguments: dict[str, Any]
) -> tuple[str, bool]:
    """Label the boundary where the current turn started: the last persisted tip. It is
    committed at once, so the label survives a crash later in the turn."""
    if turn_start is None:
        return "nothing to label yet: the conversation has no earlier turn", True
    try:
        checkpoint = services.checkpoint_create(
            conversation=conversation,
            label=arguments.get("label"),  # type: ignore[arg-type]
            message_id=turn_start,
            source=CheckpointSource.MODEL,
        )
    except ArborError as exc:
        return f"{exc.code}: {exc.detail}", True
    return f"checkpoint {checkpoint.label!r} labels message {checkpoint.message_id}", False


@dataclass
class _RewindOutcome:
    text: str
    is_error: bool
    digest_id: uuid.UUID | None = None
    persisted: list[str] = field(default_factory=list)


def _model_rewind(
    conversation: Conversation,
    turn_start: uuid.UUID | None,
    turn: list[dict[str, Any]],
    results: list[dict[str, Any]],
    call: dict[str, Any],
    attempt: TurnAttempt,
) -> _RewindOutcome:
    """Persist the turn so far on the branch being abandoned, then rewind to the label
    and append the digest — one transaction. An unknown or dropped label is a tool
    error naming the reason, and nothing moves."""
    arguments = call.get("arguments") or {}
    label, digest = arguments.get("label"), arguments.get("digest")
    checkpoint = (
        Checkpoint.objects.filter(conversation=conversation, label=label)
        .order_by("-created_at")
        .first()
        if isinstance(label, str)
        else None
    )
    if checkpoint is None:
        return _RewindOutcome(f"unknown_checkpoint: no checkpoint labelled {label!r}", True)
    live = Checkpoint.objects.filter(
        conversation=conversation, label=label, state=CheckpointState.LIVE
    ).exists()
    if not live:
        return _RewindOutcome(
            f"checkpoint_dropped: checkpoint {label!r} was dropped: {checkpoint.reason}", True
        )
    if not isinstance(digest, str) or not digest.strip():
        return _RewindOutcome("bad_digest: give a digest of what you learned", True)
    answered = [*results, _result(call, f"rewound to checkpoint {label!r}", False)]
    abandoned = [*turn, {"role": "tool", "parts": answered}]
    try:
        with transaction.atomic():
            written = services.turn_append(
                conversation=conversation,
                parent_id=turn_start,
                expected_version=None,
                messages=_drafts(abandoned),
                ends_in_rewind=True,
            )
            rewound = services.rewind(conversation=conversation, label=str(label), digest=digest)
    except ArborError as exc:
        return _RewindOutcome(f"{exc.code}: {exc.detail}", True)
    # A retry of a failure after this point continues from the digest, not from scratch.
    TurnAttempt.objects.filter(pk=attempt.pk).update(
        parent_id=rewound.digest_message, input_parts=[]
    )
    return _RewindOutcome(
        "rewound",
        False,
        digest_id=rewound.digest_message,
        persisted=[str(mid) for mid in written.message_ids],
    )


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
    with transaction.atomic():
        if not Conversation.objects.select_for_update().filter(pk=conversation.pk).exists():
            raise NothingLoaded("nothing loaded: there is no such conversation")
        last = TurnAttempt.objects.filter(conversation=conversation).order_by("-created_at").first()
        if last is not None and attempt_is_stale(last):
            # Its process died mid-turn; the transcript holds the previous turn.
            last.status = AttemptStatus.FAILED
            _attempt_finish(
                last,
                status=AttemptStatus.FAILED,
                code="interrupted",
                text=f"the process running this turn ({last.worker}) stopped",
            )
        if last is not None and last.status == AttemptStatus.FAILED:
            retry = TurnAttempt.objects.create(
                conversation=conversation,
                parent_id=last.parent_id,
                input_parts=last.input_parts,
                model=last.model,
                worker=_worker_name(),
                retry_of=last,
            )
            return conversation, last, retry
    if last is not None and last.status == AttemptStatus.RUNNING:
        raise TurnInProgress("a turn is still running in this conversation")
    if last is None and not Message.objects.filter(conversation=conversation).exists():
        raise NothingLoaded("nothing loaded: the conversation has no transcript")
    raise NothingToRetry("nothing to retry: the last turn completed")


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
