"""One chat turn's rounds, held in memory: model → tool calls → tool results → model …

``conversations.turns`` checks the input and records the attempt; a ``TurnRun`` then
runs the rounds (build the context, stream a round, dispatch the tools it called) and
persists the turn at its end, in one transaction with the attempt's ``completed``, so a
process killed anywhere mid-turn leaves the transcript at the previous turn.

The run is a generator of events, in the order the API streams them: ``resume`` and
``context`` before a request, ``delta``/``thinking``/``tool_call`` while it streams,
``compacted`` after an overflow, ``tool_result`` and ``rewind`` after it, and last
``done`` or ``error``.

Stop (``turns.turn_stop``, from any process) is seen by the turn's lease thread, which
cuts the model's request at once; the run then writes the turn so far with what streamed of the
answer, marked ``stopped`` — a clean boundary: a tool call the model had not finished
is dropped, never left unanswered. While it runs, what streamed is recorded on the
attempt (``live``) every ARBOR_TURN_LIVE_SECONDS, so a reloaded chat can follow it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import transaction

from compaction import services as compaction
from compaction.models import Trigger
from conversations import services
from conversations.errors import ArborError
from conversations.models import (
    AttemptStatus,
    Checkpoint,
    CheckpointSource,
    CheckpointState,
    Conversation,
    Origin,
    TurnAttempt,
)
from conversations.parts import DraftMessage
from conversations.providers import (
    CallCancelled,
    ContextOverflow,
    Done,
    ModelSpec,
    Provider,
    ProviderError,
    Reply,
    Request,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallStarted,
)
from conversations.tools import ToolContext, run_tool, tools_for

Event = dict[str, Any]


class _Stopped(Exception):
    """Someone asked the turn to stop: it ends with what it has."""


# The code a completed attempt records when it was stopped (its answer is partial).
STOPPED = "stopped"


class TurnRun:
    """The state of one turn while it runs: where it will be written (a rewind moves
    that), the messages so far, and what the client was already told."""

    def __init__(
        self,
        *,
        conversation: Conversation,
        spec: ModelSpec,
        attempt: TurnAttempt,
        parent_id: uuid.UUID | None,
        user_parts: list[dict[str, Any]],
        origin: str,
        open_provider: Callable[[], Provider],
    ) -> None:
        self.conversation = conversation
        self.spec = spec
        self.attempt = attempt
        self.parent_id = parent_id
        self.origin = origin
        self.open_provider = open_provider
        self.turn: list[dict[str, Any]] = (
            [{"role": "user", "parts": user_parts}] if user_parts else []
        )
        # Ids written on abandoned branches by the model's rewinds, reported with `done`.
        self.persisted: list[str] = []
        # Set once the attempt's end is recorded: otherwise the stream was closed.
        self.finished = False
        # The last request's context and how many turn messages it carried: proactive
        # compaction after the turn starts from them.
        self.context: compaction.ContextResult | None = None
        self.sent_len = 0
        # The last reply's usage, not yet learned from (see ``_learn``).
        self._usage: tuple[compaction.ContextResult, Any] | None = None
        self.tool_specs: list[Any] = []
        self.tool_context = ToolContext(conversation=conversation)
        self._reported_resume = False
        self._told_record: Any = None
        # The archived path below the turn, loaded once (again only after a rewind
        # moves the turn's parent): every round adds only the turn in memory to it.
        self._archived: compaction.Archived | None = None
        self._archived_at: uuid.UUID | None = None
        # Stop: set by the lease thread, which also cuts the provider's request.
        self.stopping = threading.Event()
        self.provider: Provider | None = None
        # What the client saw stream (every round's text, the tools called), and where
        # the current round's text begins in it: a stop keeps that as the partial answer.
        self.live_text: list[str] = []
        self.live_tools: list[str] = []
        self.round_from = 0
        # A turn that ends within ARBOR_TURN_LIVE_SECONDS never writes it (most do).
        self._live_at = time.monotonic()

    # --- the attempt's lifecycle ----------------------------------------------------

    def events(self) -> Iterator[Event]:
        """Everything after the ``attempt`` event, ending with ``done`` or ``error``; the
        attempt ends with the run however it ends, its lease renewed until then."""
        with services.turn_attempt_lease(attempt=self.attempt, on_stop=self._on_stop):
            try:
                yield from self._run()
            except (ProviderError, ArborError) as exc:
                body = exc.as_dict()
                self._fail(code=body["error"], text=body["detail"])
                yield {"event": "error", "attempt": str(self.attempt.pk), **body}
            except Exception as exc:
                self._fail(code="internal", text=type(exc).__name__)
                raise
            finally:
                if not self.finished:
                    # The consumer went away mid-turn (a closed stream): nothing was
                    # written to the transcript; the attempt stays retryable.
                    self._fail(code="interrupted", text="stream closed")

    def _on_stop(self) -> None:
        """Stop was asked (on the lease thread): cut the request in flight."""
        self.stopping.set()
        if self.provider is not None:
            self.provider.cancel()

    def _fail(self, *, code: str, text: str) -> None:
        services.turn_attempt_finish(
            attempt=self.attempt, status=AttemptStatus.FAILED, code=code, text=text
        )
        self.finished = True
        self._learn()  # a reply that came before the failure still counted tokens

    def _learn(self) -> None:
        """Teach the estimator the provider's count of the last request. Held until the
        next request is estimated, or the turn's transcript commits (then in its
        transaction: a turn commits twice, its attempt and its transcript, not three
        times)."""
        if self._usage is not None:
            context, usage = self._usage
            self._usage = None
            compaction.usage_observe(spec=self.spec, context=context, usage=usage)

    def _complete(self, tip: uuid.UUID, code: str) -> None:
        """Inside the transcript's transaction: the attempt is done, and what its last
        reply taught the estimator is kept with it."""
        services.turn_attempt_finish(
            attempt=self.attempt, status=AttemptStatus.COMPLETED, code=code, tip=tip
        )
        self._learn()

    def _run(self) -> Iterator[Event]:
        self.tool_specs = tools_for(self.conversation)
        stopped = False
        try:
            with self.open_provider() as provider:
                self.provider = provider
                if self.stopping.is_set():  # asked before the provider was open
                    provider.cancel()
                yield from self._rounds(provider)
        except _Stopped:
            stopped = True
            self.turn.append(self._stopped_answer())
        result = self._persist(code=STOPPED if stopped else "")
        compaction.compaction_enqueue_if_due(
            conversation=self.conversation,
            spec=self.spec,
            tip_id=result.tip,
            tools=self.tool_specs,
            last=self.context,
            appended=self.turn[self.sent_len :],
        )
        yield {
            "event": "done",
            "attempt": str(self.attempt.pk),
            "tip": str(result.tip),
            "version": result.version,
            "message_ids": self.persisted + [str(mid) for mid in result.message_ids],
            "stopped": stopped,
        }

    def _stopped_answer(self) -> dict[str, Any]:
        """The answer as far as it streamed, marked as stopped. Only its text: a tool
        call cut short is not kept (it would be a call without a result), nor a thinking
        block without its signature."""
        return {
            "role": "assistant",
            "parts": [{"type": "text", "text": "".join(self.live_text[self.round_from :])}],
            "metadata": {"stopped": True},
        }

    def _persist(self, *, code: str = "") -> services.TurnResult:
        # The turn and its attempt's "completed" commit together: a process killed
        # between the two would leave a whole turn whose attempt looks interrupted, and
        # retry would run it again.
        result = services.turn_append(
            conversation=self.conversation,
            parent_id=self.parent_id,
            expected_version=None,
            messages=_drafts(self.turn),
            # After a rewind the turn continues below the digest: an ordinary turn.
            origin=Origin.TURN if self.persisted else self.origin,
            also=lambda tip: self._complete(tip, code),
        )
        self.finished = True
        return result

    # --- rounds -----------------------------------------------------------------------

    def _rounds(self, provider: Provider) -> Iterator[Event]:
        """Ask the model until it answers without tool calls, or the rounds run out."""
        for round_number in range(settings.ARBOR_MAX_TOOL_ROUNDS + 1):
            if self.stopping.is_set():
                self.round_from = len(self.live_text)  # between rounds: no new answer yet
                raise _Stopped
            # The last round keeps the tool definitions (a history with tool calls needs
            # them) but lets the model call none, so the turn ends on an answer.
            last_round = round_number == settings.ARBOR_MAX_TOOL_ROUNDS
            reply = yield from self._ask(provider, last_round=last_round)
            if not reply.tool_calls:
                return
            yield from self._answer_tools(reply.tool_calls)

    def _ask(self, provider: Provider, *, last_round: bool) -> Generator[Event, None, Reply]:
        """One request and its streamed reply, which joins the turn in memory."""
        self._learn()  # the previous round's count, before this request is estimated
        context = yield from self._context()
        self.sent_len = len(self.turn)  # the turn messages this request carries
        reply, context = yield from self._stream(provider, context, last_round=last_round)
        self.context = context
        self._usage = (context, reply.usage)
        message = reply.message()
        if not message["parts"]:
            message["parts"] = [{"type": "text", "text": ""}]
        self.turn.append(message)
        return reply

    def _context(self) -> Generator[Event, None, compaction.ContextResult]:
        """Every request goes through the one entry point into compaction: the archived
        path plus the turn so far, at the model's budget, with the tool definitions it
        is sent with."""
        if self._archived is None or self._archived_at != self.parent_id:
            self._archived_at = self.parent_id
            self._archived = services.transcript_resume(
                conversation=self.conversation, tip_id=self.parent_id
            )
        context = compaction.context_build(
            conversation=self.conversation,
            spec=self.spec,
            tip_id=self.parent_id,
            pending=self.turn,
            archived=self._archived,
            tools=self.tool_specs,
            trigger=Trigger.PROACTIVE,
        )
        report = context.resume
        if report.changed and not self._reported_resume:
            self._reported_resume = True
            yield {"event": "resume", "trimmed": report.trimmed, "repaired": report.repaired}
        if context.record is not None and context.record.pk != self._told_record:
            self._told_record = context.record.pk
            yield _context_event(context)
        return context

    def _stream(
        self, provider: Provider, context: compaction.ContextResult, *, last_round: bool
    ) -> Generator[Event, None, tuple[Reply, compaction.ContextResult]]:
        """Stream the request; after an overflow, compact and send it once more."""
        try:
            reply = yield from self._stream_once(provider, context, last_round=last_round)
            return reply, context
        except ContextOverflow as overflow:
            # Reactive compaction: the provider counted more than we did. Recalibrate,
            # compact again from the originals below its limit, and retry once; the
            # rejected payload is never sent again.
            context = compaction.context_after_overflow(
                conversation=self.conversation,
                spec=self.spec,
                tip_id=self.parent_id,
                sent=context,
                overflow=overflow,
            )
            yield {"event": "compacted", "trigger": "reactive"}
        # Compacted once already: a second overflow fails the turn, saying why.
        reply = yield from self._stream_once(provider, context, last_round=last_round)
        return reply, context

    def _stream_once(
        self, provider: Provider, context: compaction.ContextResult, *, last_round: bool
    ) -> Generator[Event, None, Reply]:
        request = Request(
            messages=context.messages,
            system=self.conversation.system_prompt,
            tools=self.tool_specs,
            tool_choice="none" if last_round else None,
        )
        reply: Reply | None = None
        self.round_from = len(self.live_text)
        try:
            for event in provider.stream(request):
                services.turn_attempt_heartbeat(attempt=self.attempt)
                if self.stopping.is_set():
                    raise _Stopped
                if isinstance(event, Done):
                    reply = event.reply
                elif (shown := _stream_event(event)) is not None:
                    self._watched(event)
                    yield shown
        except CallCancelled:  # the lease thread cut the request before it answered
            raise _Stopped from None
        except ProviderError:
            if self.stopping.is_set():  # the lease thread cut the request
                raise _Stopped from None
            raise
        assert reply is not None  # stream() raises rather than end without Done
        return reply

    def _watched(self, event: StreamEvent) -> None:
        """Keep what the client saw stream; record it on the attempt now and then."""
        if isinstance(event, TextDelta):
            self.live_text.append(event.text)
        elif isinstance(event, ToolCallStarted):
            self.live_tools.append(event.name)
        now = time.monotonic()
        if now - self._live_at >= settings.ARBOR_TURN_LIVE_SECONDS:
            self._live_at = now
            live = {"text": "".join(self.live_text), "tools": list(self.live_tools)}
            services.turn_attempt_live(attempt=self.attempt, live=live)

    # --- tools --------------------------------------------------------------------------

    def _answer_tools(self, calls: list[dict[str, Any]]) -> Iterator[Event]:
        """Run the round's tool calls in order; their results join the turn, unless the
        model rewound (the turn then starts again below the digest)."""
        results: list[dict[str, Any]] = []
        rewind_call: dict[str, Any] | None = None
        for call in calls:
            if rewind_call is None and self._is_rewind(call):
                rewind_call = call  # answered below, after the others
                continue
            text, is_error = self._run_tool(call)
            results.append(_result(call, text, is_error))
            yield _result_event(call, is_error)
        if rewind_call is not None:
            rewound = yield from self._rewind(rewind_call, results)
            if rewound:
                return
        self.turn.append({"role": "tool", "parts": results})

    def _is_rewind(self, call: dict[str, Any]) -> bool:
        return bool(call["name"] == "rewind" and self.conversation.checkpoint_tools)

    def _run_tool(self, call: dict[str, Any]) -> tuple[str, bool]:
        """One tool call other than the round's (first) rewind: (text, is_error)."""
        arguments = call.get("arguments") or {}
        if self._is_rewind(call):
            return "only one rewind per step", True
        if call["name"] == "checkpoint" and self.conversation.checkpoint_tools:
            return _model_checkpoint(self.conversation, self.parent_id, arguments)
        return run_tool(call["name"], arguments, self.tool_context)

    def _rewind(
        self, call: dict[str, Any], results: list[dict[str, Any]]
    ) -> Generator[Event, None, bool]:
        """Answer the model's rewind; True when it rewound (a failed one is a tool error
        among ``results``)."""
        outcome = _model_rewind(
            self.conversation, self.parent_id, self.turn, results, call, self.attempt
        )
        yield _result_event(call, outcome.is_error)
        if outcome.digest_id is None:
            results.append(_result(call, outcome.text, True))
            return False
        # The exploration is persisted on the abandoned branch; the model continues from
        # the checkpoint and its digest.
        self.persisted += outcome.persisted
        self.parent_id = outcome.digest_id
        self.turn = []
        yield {
            "event": "rewind",
            "label": call["arguments"].get("label"),
            "digest_message": str(self.parent_id),
            "abandoned_tip": outcome.persisted[-1],
        }
        return True


# --- events and messages -------------------------------------------------------------


def _stream_event(event: StreamEvent) -> Event | None:
    """What the client sees of a provider's stream event (None: nothing)."""
    if isinstance(event, TextDelta):
        return {"event": "delta", "text": event.text}
    if isinstance(event, ThinkingDelta):
        return {"event": "thinking", "text": event.text}
    if isinstance(event, ToolCallStarted):
        return {"event": "tool_call", "id": event.id, "name": event.name}
    return None


def _context_event(context: compaction.ContextResult) -> Event:
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


def _result_event(call: dict[str, Any], is_error: bool) -> Event:
    return {
        "event": "tool_result",
        "call_id": call["id"],
        "name": call["name"],
        "is_error": is_error,
    }


def _drafts(messages: list[dict[str, Any]]) -> list[DraftMessage]:
    """The turn in memory as the drafts turn_append writes."""
    return [
        DraftMessage(role=m["role"], parts=m["parts"], metadata=m.get("metadata", {}))
        for m in messages
    ]


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
            rewound = services.checkpoint_rewind(
                conversation=conversation, label=str(label), digest=digest
            )
    except ArborError as exc:
        return _RewindOutcome(f"{exc.code}: {exc.detail}", True)
    # A retry of a failure after this point continues from the digest, not from scratch.
    services.turn_attempt_rebase(attempt=attempt, parent_id=rewound.digest_message)
    return _RewindOutcome(
        "rewound",
        False,
        digest_id=rewound.digest_message,
        persisted=[str(mid) for mid in written.message_ids],
    )
