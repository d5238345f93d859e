"""The provider-ready context: what an agent harness calls to resume a conversation."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Field, Query, Router, Schema

from compaction import services
from compaction.models import RecordStatus
from conversations import selectors
from conversations.errors import ArborError, InvalidInput
from conversations.providers import Request, request_body, resolve_model
from conversations.tools import tools_for

router = Router(tags=["compaction"])


class CompactionFailed(ArborError):
    """The ladder or its summary call failed (e.g. the provider is down)."""

    status = 502
    code = "compaction_failed"


class ContextQuery(Schema):
    model: str = Field("", max_length=200)
    tip: str | None = None
    budget: int | None = Field(None, ge=1, le=10_000_000)
    summary: bool = True


@router.get("/conversations/{cid}/context")
def get_context(request: HttpRequest, cid: str, query: Query[ContextQuery]) -> Any:
    """The request Arbor would send next for the path to ``tip`` (default: the current
    tip), after the compaction ladder, in the provider's own format and ready to send
    (``max_tokens``, the tool definitions, images inline as base64), with a report
    naming each rung applied. ``budget`` defaults to the model's threshold, using any
    smaller window the provider reported in an overflow error.

    A GET only reads: it writes no record and calls no model. A snapshot the next
    request would need is drawn in memory; when only a summary would fit, the answer
    says ``needs_summary`` (POST the same URL to compact)."""
    return _context(request, cid, query, compact=False)


@router.post("/conversations/{cid}/context")
def compact_context(request: HttpRequest, cid: str, query: Query[ContextQuery]) -> Any:
    """Compact now: like the GET, but the ladder's result is kept as a compaction record
    (pages in the blob store) that the next requests reuse, and a summary is made when
    the free rungs are not enough (``summary=false`` forbids it)."""
    return _context(request, cid, query, compact=True)


def _context(request: HttpRequest, cid: str, query: ContextQuery, *, compact: bool) -> Any:
    user = request.auth  # type: ignore[attr-defined]
    conversation = selectors.conversation_get(user=user, conversation_id=cid)
    try:
        spec = resolve_model(selectors.model_id_for(conversation, query.model))
    except ValueError as exc:
        raise InvalidInput(str(exc), code="bad_model") from None
    tip_id = conversation.tip_id
    if query.tip is not None:
        tip_id = selectors.conversation_message(conversation=conversation, message_id=query.tip).pk
    tools = tools_for(conversation)
    context = services.context_build(
        conversation=conversation,
        spec=spec,
        tip_id=tip_id,
        tools=tools,
        budget=query.budget,
        allow_summary=query.summary,
        compact=compact,
    )
    record = context.record
    if record is not None and record.status == RecordStatus.FAILED:
        # Never a 200 that looks like an empty context: say what failed (the failed
        # record stays for the audit).
        raise CompactionFailed(
            f"compaction failed: {record.error}", record=str(record.pk), budget=context.budget
        )
    body = request_body(
        spec,
        Request(messages=context.messages, system=conversation.system_prompt, tools=tools),
        load_blob=context.load_blob,
    )
    return {
        "model": spec.id,
        "provider": spec.provider,
        "notice": spec.notice,
        "tip": str(tip_id) if tip_id else None,
        "budget": context.budget,
        "estimate": context.estimate,
        "fits": context.fits,
        "needs_summary": context.needs_summary,
        "record": str(record.pk) if record else None,
        "record_status": record.status if record else None,
        "reused": context.reused,
        "rungs": context.reports if not context.reused else [],
        "trimmed": context.resume.trimmed,
        "repaired": context.resume.repaired,
        "request": body,
    }
