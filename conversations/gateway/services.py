"""The gateway's side of the tree: which conversation a request belongs to, how much of
it is stored already, what to forward, and writing the exchange at its boundary.

A request is placed by its chain keys (wire.chain_keys): the longest stored prefix is
found with one indexed query; what follows it is new. Nothing is written until the
upstream's answer is complete; then the new messages and the answer go in one
transaction with the tip move (DESIGN.md invariant 13). A request that leaves the stored
path (the user rewound or edited, or the harness compacted on its own) continues from
the last common message: a new branch, nothing hidden or deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import orjson
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone
from PIL import Image, UnidentifiedImageError

from compaction import services as compaction
from compaction.estimate import Calibration, message_tokens, request_tokens
from compaction.models import Trigger
from conversations import selectors
from conversations import services as tree
from conversations.errors import ArborError, NotFound
from conversations.gateway import wire
from conversations.models import Conversation, Message, Origin
from conversations.providers import ContextOverflow, ModelSpec
from conversations.resume import ResumeReport

# A compaction step, once the threshold is crossed, goes down to this share of the room
# for input; the record it makes is reused until the requests outgrow the threshold.
TARGET = 0.5
CONVERSATION_HEADER = "x-arbor-conversation"
# Where harnesses say which session a request belongs to, besides Claude Code's
# metadata.user_id.
SESSION_HEADERS = ("x-claude-code-session-id", "x-session-id", "session_id", "x-session-affinity")
_SESSION_IN_USER_ID = re.compile(r"session_([0-9a-fA-F-]{16,64})")
# A request without a session id continues a sessionless conversation of the same
# client (token, agent and User-Agent) by content only if that one was active lately.
CONTENT_MATCH_WINDOW = timedelta(minutes=30)
# How a harness's request starts after it compacted its own history (Claude Code, pi).
SELF_COMPACTION_MARKERS = (
    "This session is being continued from a previous conversation",
    "The conversation history before this point was compacted",
)


@dataclass
class Exchange:
    """One request as the gateway reads it."""

    protocol: str  # "anthropic" | "openai"
    body: dict[str, Any]
    # The conversation's wire messages, in order (OpenAI: without leading system ones).
    messages: list[dict[str, Any]]
    system: str
    tools: list[dict[str, Any]]
    digests: list[str]
    keys: list[str]
    drafts: list[list[wire.Draft]]
    session: str
    fingerprint: str
    harness: str

    def fixed_raw(self, rule: str) -> int:
        """The raw count of what every request of the session repeats verbatim: the
        system prompt, the tool definitions and the first message (the task, with
        whatever context the harness injected into it)."""
        fixed = _fixed_tokens(self.system, self.tools, rule)
        if self.digests:
            fixed += _message_raw(self.digests[0], self.drafts[0], rule)
        return fixed

    def raw_tokens(self, rule: str) -> int:
        """The estimator's raw count of the request as the client sent it."""
        fixed = _fixed_tokens(self.system, self.tools, rule)
        pairs = zip(self.digests, self.drafts, strict=True)
        return fixed + sum(_message_raw(digest, drafts, rule) for digest, drafts in pairs)


@dataclass
class Placement:
    conversation: Conversation
    matched: int  # how many of the request's wire messages are stored already
    parent_id: uuid.UUID | None  # the last stored message of that prefix
    created: bool = False
    parent_depth: int = -1


# --- reading a request -------------------------------------------------------------------

# Parsed wire messages by digest (a harness resends the same ones every request).
_DRAFT_CACHE: OrderedDict[str, list[wire.Draft]] = OrderedDict()
_RAW_CACHE: OrderedDict[tuple[str, str], int] = OrderedDict()
_CACHE_SIZE = 20_000


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any) -> Any:
    cache[key] = value
    if len(cache) > _CACHE_SIZE:
        with contextlib.suppress(KeyError):  # emptied by another thread meanwhile
            cache.popitem(last=False)
    return value


def _with_sizes(drafts: list[wire.Draft]) -> list[wire.Draft]:
    """Fill width and height of inline images (the estimator bills them by area)."""

    def fill(parts: list[wire.Part]) -> None:
        for part in parts:
            if part.get("type") == "image" and "data" in part:
                try:
                    with Image.open(io.BytesIO(part["data"])) as image:
                        part["width"], part["height"] = image.size
                except (UnidentifiedImageError, OSError, ValueError):
                    raise wire.WireError("an image in the request is not readable") from None
            elif part.get("type") == "tool_result":
                fill(part["parts"])

    for draft in drafts:
        fill(draft["parts"])
    return drafts


def _message_raw(digest: str, drafts: list[wire.Draft], rule: str) -> int:
    key = (digest, rule)
    cached = _RAW_CACHE.get(key)
    if cached is None:
        cached = _remember(
            _RAW_CACHE, key, sum(message_tokens(_for_estimate(d), rule=rule) for d in drafts)
        )
    return cached


_FIXED_CACHE: OrderedDict[tuple[str, str, str], int] = OrderedDict()
_DIGEST_CACHE: OrderedDict[bytes, str] = OrderedDict()
_DIGEST_KEY_MAX = 32 * 1024


def _fixed_tokens(system: str, tools: Sequence[Mapping[str, Any]], rule: str) -> int:
    """The system prompt and tool definitions, counted once per distinct pair (a
    harness sends the same tens of kilobytes with every request)."""
    key = (system, json.dumps(tools, separators=(",", ":")), rule)
    found = _FIXED_CACHE.get(key)
    if found is None:
        found = _remember(
            _FIXED_CACHE, key, request_tokens((), rule=rule, system=system, tools=tools)
        )
        while len(_FIXED_CACHE) > 64:
            _FIXED_CACHE.popitem(last=False)
    return found


def _digest_of(message: Mapping[str, Any], to_digest: Any) -> str:
    """A wire message's digest, looked up by its exact JSON first (C-fast) and computed
    (the canonical form, in Python) only for a message not seen in that exact form."""
    try:
        exact: bytes = orjson.dumps(message)
    except (TypeError, orjson.JSONEncodeError):  # an integer past 64 bits
        exact = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()
    if len(exact) > _DIGEST_KEY_MAX:  # an image or a huge result: not kept as a key
        return str(to_digest(message))
    found = _DIGEST_CACHE.get(exact)
    if found is None:
        found = _remember(_DIGEST_CACHE, exact, to_digest(message))
    else:
        # Requests are read on several threads: another may have evicted it meanwhile.
        with contextlib.suppress(KeyError):
            _DIGEST_CACHE.move_to_end(exact)
    return found


def _for_estimate(draft: wire.Draft) -> dict[str, Any]:
    return {"id": "", "role": draft["role"], "parts": draft["parts"], "metadata": {}}


def fingerprint(system: str, tools: Sequence[Mapping[str, Any]]) -> str:
    """Which agent of a harness is talking: the start of its system prompt (without
    Claude Code's per-request billing line) and its tool names. The main agent, its
    sub-agents and its side requests (titles, summaries) differ here."""
    lines = [line for line in system.splitlines() if not line.startswith("x-anthropic-billing")]
    names = sorted(str(t.get("name") or (t.get("function") or {}).get("name")) for t in tools)
    text = "\n".join(lines).strip()[:400] + "|" + ",".join(names)
    return hashlib.sha256(text.encode()).hexdigest()


def session_of(headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
    """The harness's own session id, where it sends one."""
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user_id, str) and user_id:
        try:
            parsed = json.loads(user_id)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("session_id"):
            return str(parsed["session_id"])[:200]
        match = _SESSION_IN_USER_ID.search(user_id)
        if match:
            return match.group(1)
    for name in SESSION_HEADERS:
        if headers.get(name):
            return str(headers[name])[:200]
    return ""


def exchange_read(
    *,
    protocol: str,
    body: dict[str, Any],
    wire_messages: list[dict[str, Any]],
    system: str,
    tools: list[dict[str, Any]],
    headers: Mapping[str, str],
) -> Exchange:
    """Parse and hash a request's messages. Raises wire.WireError for a malformed one."""
    to_drafts = wire.anthropic_drafts if protocol == "anthropic" else wire.openai_drafts
    to_digest = wire.anthropic_digest if protocol == "anthropic" else wire.openai_digest
    digests: list[str] = []
    drafts: list[list[wire.Draft]] = []
    for i, message in enumerate(wire_messages):
        if not isinstance(message, dict):
            raise wire.WireError(f"messages.{i}: a message is an object")
        digest = _digest_of(message, to_digest)
        cached = _DRAFT_CACHE.get(digest)
        if cached is None:
            cached = _remember(
                _DRAFT_CACHE, digest, _with_sizes(to_drafts(message, f"messages.{i}"))
            )
        digests.append(digest)
        drafts.append(cached)
    return Exchange(
        protocol=protocol,
        body=body,
        messages=wire_messages,
        system=system,
        tools=tools,
        digests=digests,
        keys=wire.chain_keys(digests),
        drafts=drafts,
        session=session_of(headers, body),
        fingerprint=fingerprint(system, tools),
        harness=str(headers.get("user-agent", ""))[:200],
    )


# --- placing it in the tree ---------------------------------------------------------------


# (conversation id, matched count, message id, its depth): where a request's longest
# stored prefix ends.
Match = tuple[Any, int, uuid.UUID, int]


def _deepest(conversation_ids: Any, keys: Sequence[str]) -> Match | None:
    """(conversation id, matched count, message id, its depth) of the longest stored
    prefix. The newest keys are tried first: a harness's next request usually continues
    right after the answer it got (one lookup of three keys, not of the whole request)."""
    if not keys:
        return None
    index = {key: i for i, key in enumerate(keys)}
    for wanted in (keys[-3:], keys[:-3]):
        if not wanted:
            continue
        # "Not empty" matches the key index's condition, so the planner may use it; the
        # conversations come as a subquery (see placement_find).
        rows = Message.objects.filter(~Q(gateway_key=""), gateway_key__in=wanted)
        if conversation_ids is not None:
            rows = rows.filter(conversation_id__in=conversation_ids)
        best: Match | None = None
        for cid, mid, key, depth in rows.values_list(
            "conversation_id", "id", "gateway_key", "depth"
        ):
            matched = index[key] + 1
            if best is None or matched > best[1]:
                best = (cid, matched, mid, depth)
        if best is not None:
            return best
    return None


def _deepest_in(conversation_id: Any, keys: Sequence[str]) -> Match | None:
    """``_deepest`` within one conversation. The conversation goes in as a subquery, not
    a list of one id: SQLite (without ANALYZE statistics) would otherwise read every
    message of the conversation by its conversation index, instead of the few rows with
    the wanted keys (the cost grew with the session)."""
    return _deepest(Conversation.objects.filter(pk=conversation_id).values("pk"), keys)


def placement_find(*, user: Any, exchange: Exchange, conversation_id: str | None) -> Placement:
    """The conversation a request continues, and how much of it is stored.

    By the ``X-Arbor-Conversation`` header when given (another user's id is refused
    like a missing one); else by the harness's session id together with the agent's
    fingerprint; else by content (the longest stored prefix among the user's gateway
    conversations of the same agent); else a new conversation."""
    placement = _placement_find(user=user, exchange=exchange, conversation_id=conversation_id)
    # Every route above finds only the user's own conversations: spare the query for
    # the owner when images are stored.
    placement.conversation.owner = user
    return placement


def _placement_find(*, user: Any, exchange: Exchange, conversation_id: str | None) -> Placement:
    conversation: Conversation | None = None
    if conversation_id:
        conversation = selectors.conversation_get(user=user, conversation_id=conversation_id)
    elif exchange.session:
        # A session id is the harness's word: a new one is a new conversation, whatever
        # its first message says (two sessions started with the same prompt stay apart).
        conversation = (
            Conversation.objects.filter(
                owner=user,
                gateway_session=exchange.session,
                gateway_fingerprint=exchange.fingerprint,
            )
            .order_by("-updated_at")
            .first()
        )
    else:
        # No session id (pi, the SDKs): by content, among this client's sessionless
        # conversations of the same agent that were active lately.
        mine = Conversation.objects.filter(
            owner=user,
            gateway_fingerprint=exchange.fingerprint,
            gateway_session="",
            harness=exchange.harness,
            updated_at__gte=timezone.now() - CONTENT_MATCH_WINDOW,
        )
        found = _deepest(mine.values("pk"), exchange.keys)
        if found is not None:
            conversation = Conversation.objects.get(pk=found[0])
            return Placement(conversation, found[1], found[2], parent_depth=found[3])
    if conversation is None:
        return Placement(_conversation_new(user, exchange), 0, None, created=True)
    found = _deepest_in(conversation.pk, exchange.keys)
    if found is not None:
        return Placement(conversation, found[1], found[2], parent_depth=found[3])
    if harness_compacted(exchange) and conversation.tip_id is not None:
        # The harness summarised its own history: its new path continues below the
        # message where it compacted, not as a new root.
        depth = Message.objects.only("depth").get(pk=conversation.tip_id).depth
        return Placement(conversation, 0, conversation.tip_id, parent_depth=depth)
    return Placement(conversation, 0, None)


def harness_compacted(exchange: Exchange) -> bool:
    """Whether the request starts with a summary the harness wrote of its own history
    (Claude Code's and pi's compaction say so in their first words)."""
    first = exchange.drafts[0] if exchange.drafts else []
    for draft in first:
        if draft["role"] != "user":
            continue
        for part in draft["parts"]:
            text = str(part.get("text") or "").lstrip()[:400] if part.get("type") == "text" else ""
            if any(marker in text for marker in SELF_COMPACTION_MARKERS):
                return True
    return False


def _title(exchange: Exchange) -> str:
    for drafts in exchange.drafts:
        for draft in drafts:
            if draft["role"] != "user":
                continue
            for part in draft["parts"]:
                text = part.get("text", "") if part.get("type") == "text" else ""
                # Claude Code opens with <system-reminder> blocks; the prompt follows.
                if text.strip() and not text.lstrip().startswith("<system-reminder>"):
                    return " ".join(text.split())[:80]
    return "Gateway session"


SUBAGENT_TOOLS = ("Task", "Agent")


def _spawner(user: Any, exchange: Exchange) -> tuple[Message, str, str] | None:
    """For a new conversation that is a sub-agent's run: the parent's message holding
    the Task/Agent call that started it, the call's id and description. The harness
    says so by its session id (shared with the parent, whose agent fingerprint differs)
    and by the sub-agent's first prompt, which is the call's ``prompt``. The parent's
    answer with the call is stored before the harness starts the sub-agent, so it is
    the parent's tip."""
    if not exchange.session or not exchange.drafts:
        return None
    first = next((d for d in exchange.drafts[0] if d["role"] == "user"), None)
    texts = {
        p["text"].strip()
        for p in (first or {}).get("parts", [])
        if p.get("type") == "text" and p.get("text", "").strip()
    }
    if not texts:
        return None
    parents = (
        Conversation.objects.filter(owner=user, gateway_session=exchange.session)
        .exclude(gateway_fingerprint=exchange.fingerprint)
        .select_related("tip")
        .order_by("-updated_at")[:20]
    )
    for parent in parents:
        tip = parent.tip
        if tip is None or tip.role != "assistant":
            continue
        for part in tip.parts:
            arguments = part.get("arguments")
            if (
                part.get("type") == "tool_call"
                and part.get("name") in SUBAGENT_TOOLS
                and isinstance(arguments, dict)
                and str(arguments.get("prompt", "")).strip() in texts
            ):
                return tip, str(part.get("id", "")), str(arguments.get("description") or "")
    return None


def _conversation_new(user: Any, exchange: Exchange) -> Conversation:
    model = str(exchange.body.get("model", ""))
    spawner = _spawner(user, exchange)
    title = _title(exchange)
    if spawner is not None and spawner[2]:
        title = f"Sub-agent: {spawner[2]}"[:200]
    return Conversation.objects.create(
        owner=user,
        title=title,
        model=f"{exchange.protocol}/{model}" if model else "",
        system_prompt=exchange.system,
        gateway_session=exchange.session,
        gateway_fingerprint=exchange.fingerprint,
        harness=exchange.harness,
        spawned_by=spawner[0] if spawner else None,
        spawned_call=spawner[1][:200] if spawner else "",
    )


# --- writing the exchange -----------------------------------------------------------------


def _store_images(owner: Any, parts: list[wire.Part]) -> list[wire.Part]:
    """Parts with inline image bytes replaced by blob references (validated as every
    upload is: an unreadable or oversized image is refused)."""
    out: list[wire.Part] = []
    for part in parts:
        if part.get("type") == "image" and "data" in part:
            blob = tree.blob_store(owner=owner, data=part["data"])
            out.append(
                {
                    "type": "image",
                    "blob": blob.sha256,
                    "mime": blob.mime,
                    "width": blob.width,
                    "height": blob.height,
                }
            )
        elif part.get("type") == "tool_result":
            out.append({**part, "parts": _store_images(owner, part["parts"])})
        else:
            out.append(part)
    return out


@dataclass
class NewRows:
    rows: list[Message] = field(default_factory=list)

    @property
    def last(self) -> uuid.UUID | None:
        return self.rows[-1].id if self.rows else None


def _rows(
    *,
    conversation: Conversation,
    parent_id: uuid.UUID | None,
    depth: int,
    groups: Sequence[tuple[int, str, list[wire.Draft]]],
    extra_metadata: Mapping[int, dict[str, Any]] | None = None,
) -> NewRows:
    """Message rows for wire messages ``(index, chain key, drafts)``, chained below
    ``parent_id``; the key goes on the last row of each."""
    now = timezone.now()
    out = NewRows()
    previous = parent_id
    for index, key, drafts in groups:
        for member, draft in enumerate(drafts):
            metadata: dict[str, Any] = {"gateway": {"wire": index, "member": member}}
            metadata.update((extra_metadata or {}).get(index, {}))
            row = Message(
                id=uuid.uuid4(),
                conversation_id=conversation.pk,
                parent_id=previous,
                role=draft["role"],
                parts=_store_images(conversation.owner, draft["parts"]),
                depth=depth,
                origin=Origin.TURN,
                metadata=metadata,
                created_at=now + timedelta(microseconds=len(out.rows)),
                gateway_key=key if member == len(drafts) - 1 else "",
            )
            out.rows.append(row)
            previous = row.id
            depth += 1
    return out


def exchange_store(
    *,
    placement: Placement,
    exchange: Exchange,
    answer: Mapping[str, Any] | None,
    answer_metadata: dict[str, Any] | None = None,
) -> uuid.UUID | None:
    """Write the request's new messages and the upstream's complete ``answer`` (a wire
    message) below the stored prefix, and move the tip to the answer: one transaction,
    a turn boundary. Without an answer only the request's messages are written (a valid
    transcript: what the harness sent) and the tip moves to their end. Returns the new
    last message (the tip)."""
    with transaction.atomic():
        # Writes to one conversation take turns (its row locked; SQLite's writers take
        # turns anyway), so the catch-up below sees what the one before committed.
        locked = Conversation.objects.select_for_update().filter(pk=placement.conversation.pk)
        list(locked.values_list("pk", flat=True))
        _catch_up(placement, exchange)
        return _store(placement, exchange, answer, answer_metadata)


def _catch_up(placement: Placement, exchange: Exchange) -> None:
    """More of the request may be stored than when it was placed: the answer to the
    request before is written behind that answer (views: pending), and another server
    process may have served it. Continue below the deepest stored prefix, so nothing is
    written twice. (Even in a conversation this request created: the harness's next
    request, placed there by its session, may have been stored first.)"""
    if placement.matched >= len(exchange.keys):
        return
    found = _deepest_in(placement.conversation.pk, exchange.keys)
    if found is not None and found[1] > placement.matched:
        _, placement.matched, placement.parent_id, placement.parent_depth = found


def _stored_answer(placement: Placement, key: str) -> Match | None:
    """Everything the request carried is stored; is the answer too? Then nothing is
    written. Either the same request was answered the same way before (the tip moves to
    that answer, as to any newest exchange), or this write came late: a later request
    carrying the answer was stored first, below it (the tip stays where that newer
    exchange put it)."""
    stored = _deepest_in(placement.conversation.pk, [key])
    if stored is not None and not Message.objects.filter(parent_id=stored[2]).exists():
        Conversation.objects.filter(pk=placement.conversation.pk).update(
            tip_id=stored[2], version=F("version") + 1, updated_at=timezone.now()
        )
    return stored


def _store(
    placement: Placement,
    exchange: Exchange,
    answer: Mapping[str, Any] | None,
    answer_metadata: dict[str, Any] | None,
) -> uuid.UUID | None:
    start = placement.matched
    groups: list[tuple[int, str, list[wire.Draft]]] = [
        (i, exchange.keys[i], exchange.drafts[i]) for i in range(start, len(exchange.messages))
    ]
    extra: dict[int, dict[str, Any]] = {}
    if answer is not None:
        to_drafts = (
            wire.anthropic_drafts if exchange.protocol == "anthropic" else wire.openai_drafts
        )
        to_digest = (
            wire.anthropic_digest if exchange.protocol == "anthropic" else wire.openai_digest
        )
        previous = exchange.keys[-1] if exchange.keys else wire.CHAIN_SEED
        index = len(exchange.messages)
        key = wire.chain_next(previous, to_digest(answer))
        if start == index:
            stored = _stored_answer(placement, key)
            if stored is not None:
                placement.matched, placement.parent_id, placement.parent_depth = (
                    index + 1,
                    stored[2],
                    stored[3],
                )
                return stored[2]
        groups.append((index, key, to_drafts(answer, "answer")))
        extra[index] = dict(answer_metadata or {})
    if not groups:
        return placement.parent_id
    conversation = placement.conversation
    depth = 0
    if placement.parent_id is not None:
        depth = placement.parent_depth + 1
        if placement.parent_depth < 0:  # pragma: no cover - placements carry it
            depth = Message.objects.only("depth").get(pk=placement.parent_id).depth + 1
    new = _rows(
        conversation=conversation,
        parent_id=placement.parent_id,
        depth=depth,
        groups=groups,
        extra_metadata=extra,
    )
    tree._insert_messages(new.rows)
    # A plain UPDATE, no version check: a harness's request is placed by content, and
    # the tip follows its newest exchange (concurrent ones each keep their own branch;
    # the last to finish holds the tip).
    changes: dict[str, Any] = {"updated_at": timezone.now()}
    if exchange.harness and exchange.harness != conversation.harness:
        changes["harness"] = conversation.harness = exchange.harness
    updated = Conversation.objects.filter(pk=conversation.pk).update(
        tip_id=new.last, version=F("version") + 1, **changes
    )
    if not updated:
        raise NotFound(f"no such conversation: {conversation.pk}")
    placement.matched = len(exchange.messages) + (1 if answer is not None else 0)
    placement.parent_id = new.last
    placement.parent_depth = depth + len(new.rows) - 1
    return new.last


# --- what to forward ----------------------------------------------------------------------


@dataclass
class Forward:
    """What goes upstream for a request: its messages (client wire messages where the
    ladder left them as they were) and the context they were built from."""

    messages: list[dict[str, Any]]
    context: compaction.ContextResult
    prefix_end: int | None  # index of the last message of the compacted prefix


def _archived(placement: Placement) -> compaction.Archived:
    """The stored prefix, as sent (not trimmed: its last message may be a tool call the
    request's next message answers)."""
    if placement.parent_id is None:
        return [], ResumeReport()
    path = selectors.message_path(
        conversation_id=placement.conversation.pk, tip_id=placement.parent_id
    )
    return [
        {"id": str(m.id), "role": m.role, "parts": m.parts, "metadata": m.metadata} for m in path
    ], ResumeReport()


def _prepared(placement: Placement, exchange: Exchange) -> tuple[Any, list[dict[str, Any]]]:
    """The stored prefix and the request's new messages (images stored as blobs, which
    the ladder reads), with each Arbor message's wire position ``(index, member)``."""
    archived = _archived(placement)
    owner = placement.conversation.owner
    pending: list[dict[str, Any]] = []
    for i in range(placement.matched, len(exchange.messages)):
        for member, draft in enumerate(exchange.drafts[i]):
            pending.append(
                {
                    "role": draft["role"],
                    "parts": _store_images(owner, draft["parts"]),
                    "wire": (i, member),
                }
            )
    return archived, pending


def forward_build(
    *,
    placement: Placement,
    exchange: Exchange,
    spec: ModelSpec,
    overflow: ContextOverflow | None = None,
    sent: compaction.ContextResult | None = None,
) -> Forward:
    """The request as the ladder builds it from the stored path plus the request's new
    messages: a reused record until the next step, else a compaction step down to the
    target; after an ``overflow``, reactive compaction from the originals."""
    if placement.parent_id is None:
        # Nothing stored to anchor a record on: the request itself is the transcript.
        exchange_store(placement=placement, exchange=exchange, answer=None)
    archived, pending = _prepared(placement, exchange)
    calibration, reported = compaction.calibration_get(spec.calibration_key)
    budget = request_budget(exchange, spec, calibration, reported)
    target = step_target(exchange, spec, budget, calibration)
    common = dict(
        conversation=placement.conversation,
        spec=spec,
        tip_id=placement.parent_id,
        pending=pending,
        archived=archived,
        tools=exchange.tools,
        system=exchange.system,
        recall=False,  # no recall tool is offered through the gateway
    )
    if overflow is None:
        context = compaction.context_build(
            **common, budget=budget, target=target, trigger=Trigger.PROACTIVE
        )
        if not context.fits:
            context = _fallback(context, common, spec, reported, exchange.protocol)
    else:
        if sent is None:  # the originals went out: their view, without compacting
            sent = compaction.context_build(
                **common, budget=10**9, compact=False, preview_pages=False
            )
        context = compaction.context_after_overflow(
            conversation=placement.conversation,
            spec=spec,
            tip_id=placement.parent_id,
            sent=replace(sent),
            overflow=overflow,
        )
    return _assemble(context, archived[0], pending, exchange)


class CannotFit(ArborError):
    """Nothing Arbor can build from the conversation fits the window: the harness is
    told so in the provider's own words for an overlong prompt (a harness compacts on
    its own when it reads them), with Arbor's reason. The raw request is never sent."""

    status = 400
    code = "context_overflow"


def _fallback(
    failed: compaction.ContextResult,
    common: dict[str, Any],
    spec: ModelSpec,
    reported: int | None,
    protocol: str,
) -> compaction.ContextResult:
    """The step did not fit (a summary that could not be made, or none allowed): the
    free rungs and pages at the window's own ceiling, read-only (no record, pages served
    inline), or CannotFit."""
    ceiling = compaction.window_ceiling(spec, reported)
    context = compaction.context_build(
        **common, budget=ceiling, allow_summary=False, compact=False, preview_pages=True
    )
    if context.fits:
        return context
    why = failed.record.error if failed.record is not None and failed.record.error else ""
    reason = (
        f"Arbor could not compact this conversation below the window{': ' + why if why else ''}"
    )
    if protocol == "anthropic":
        raise CannotFit(
            f"prompt is too long: {context.estimate} tokens > {ceiling} maximum ({reason})"
        )
    raise CannotFit(
        f"This model's maximum context length is {ceiling} tokens. However, your messages "
        f"resulted in {context.estimate} tokens ({reason}).",
        code="context_length_exceeded",
    )


def request_budget(
    exchange: Exchange, spec: ModelSpec, calibration: Calibration, reported: int | None
) -> int:
    """The compaction threshold for this request, by parts: the harness's fixed part
    (system prompt, tools, the first message) is counted and kept, and the threshold
    works on the room the history has beside it."""
    fixed = calibration.apply(exchange.fixed_raw(spec.image_billing))
    return compaction.budget_by_parts(spec, reported, fixed)


def step_target(exchange: Exchange, spec: ModelSpec, budget: int, calibration: Calibration) -> int:
    """How far a compaction step goes: the fixed part of every request (the harness's
    system prompt, tool definitions and first message, often tens of thousands of
    tokens) plus ``TARGET`` of the room the history has under the threshold."""
    fixed = calibration.apply(exchange.fixed_raw(spec.image_billing))
    return max(1, min(budget, int(fixed + TARGET * max(0, budget - fixed))))


def _assemble(
    context: compaction.ContextResult,
    archived: list[dict[str, Any]],
    pending: list[dict[str, Any]],
    exchange: Exchange,
) -> Forward:
    """Wire messages for what the ladder chose: a client message whose Arbor messages
    all came through unchanged goes out as the client sent it (its bytes, breakpoints
    and thinking signatures); anything the ladder made or changed is converted."""
    position: dict[str, tuple[int, int]] = {}
    original: dict[str, list[Any]] = {}
    sizes = [len(d) for d in exchange.drafts]
    for m in archived:
        gateway = (m.get("metadata") or {}).get("gateway") or {}
        if "wire" in gateway:
            position[m["id"]] = (int(gateway["wire"]), int(gateway.get("member", 0)))
            original[m["id"]] = m["parts"]
    for i, m in enumerate(pending):
        position[f"{compaction.PENDING}{i}"] = m["wire"]
        original[f"{compaction.PENDING}{i}"] = m["parts"]
    record_ids = {str(m["id"]) for m in (context.record.view if context.record else [])}
    convert = (
        wire.to_anthropic_messages if exchange.protocol == "anthropic" else wire.to_openai_messages
    )
    out: list[dict[str, Any]] = []
    prefix_end: int | None = None
    buffer: list[dict[str, Any]] = []
    buffer_prefix = False

    def flush() -> None:
        nonlocal buffer, buffer_prefix, prefix_end
        if buffer:
            out.extend(convert(buffer, context.load_blob))
            if buffer_prefix:
                prefix_end = len(out) - 1
        buffer, buffer_prefix = [], False

    messages = context.messages
    i = 0
    while i < len(messages):
        m = messages[i]
        at = position.get(str(m["id"]))
        if at is not None and at[1] == 0 and at[0] < len(exchange.messages):
            n = sizes[at[0]]
            group = messages[i : i + n]
            if len(group) == n and all(
                position.get(str(g["id"])) == (at[0], j) and g["parts"] == original[str(g["id"])]
                for j, g in enumerate(group)
            ):
                flush()
                out.append(exchange.messages[at[0]])
                if any(str(g["id"]) in record_ids for g in group):
                    prefix_end = len(out) - 1
                i += n
                continue
        buffer.append(m)
        buffer_prefix = buffer_prefix or str(m["id"]) in record_ids
        i += 1
    flush()
    return Forward(out, context, prefix_end if context.record is not None else None)


def usage_learn(*, spec: ModelSpec, raw_estimate: int, input_tokens: int | None) -> None:
    """The upstream's count of a request whose raw estimate we know."""
    if input_tokens:
        compaction.calibration_observe(
            model_id=spec.calibration_key, raw_estimate=raw_estimate, measured=input_tokens
        )


def record_measured(forward: Forward | None, input_tokens: int | None) -> None:
    if forward is not None and forward.context.record is not None and input_tokens:
        compaction.record_measured(record=forward.context.record, input_tokens=input_tokens)
