"""The tree's invariants (DESIGN.md §1, items 1-4 and 6) under random sequences of real
service calls.

A Hypothesis state machine drives the services over several conversations, originals
and forks alike: turns (with tool call/result pairs), edits, regenerations, tip moves
(some with a stale version or a foreign message), forks of both scopes, checkpoints,
drops and rewinds. It keeps its own model of what every row must look like and, after
every step, compares the model with what the database holds:

- messages are only ever added: every row seen once keeps its conversation, parent,
  role, parts, depth, origin, metadata and created_at for good, and no row appears
  that a successful call did not announce;
- every parent is in its child's conversation, at depth one less; roots are at depth 0;
- every tip is a message of its own conversation, reachable from a root, and the path
  to it is the one the model expects (so a fork never changes its source's path);
- a fork's messages are new rows, copies of the source's path (or subtree);
- checkpoints keep the message they were created with, dropped or not;
- the version goes up by exactly one on each successful tip move, turn or rewind, and
  stays put on every refused one.

Each example runs inside a savepoint that is rolled back at teardown.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import pytest
from django.contrib.auth.models import User
from django.db import transaction
from django.test import TestCase
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from conversations import selectors, services
from conversations.errors import ArborError, Conflict, InvalidInput, NotFound, StaleVersion
from conversations.models import Checkpoint, Conversation, Message

T = TypeVar("T")
Msg = dict[str, Any]

MAX_CONVERSATIONS = 6
MAX_ORIGINALS = 3
LABELS = ("start", "plan", "retry")

# --- strategies ----------------------------------------------------------------------

texts = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
picks = st.integers(min_value=0, max_value=10_000)
tool_names = st.sampled_from(["search", "read_file", "now"])
arguments = st.dictionaries(
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=5),
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), texts),
    max_size=2,
)


def text_part(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


@st.composite
def turns(draw: st.DrawFn, *, start: str = "user") -> list[Msg]:
    """A complete turn, already in the shape the services store: a user prompt (when
    ``start`` is "user"; a user-only turn is valid too), zero or more rounds of an
    assistant's tool calls and their results, and a final assistant answer."""
    messages: list[Msg] = []
    if start == "user":
        messages.append({"role": "user", "parts": [text_part(draw(texts))]})
        if draw(st.integers(min_value=0, max_value=3)) == 0:
            return messages
    for r in range(draw(st.integers(min_value=0, max_value=2))):
        ids = [f"call-{r}-{j}" for j in range(draw(st.integers(min_value=1, max_value=2)))]
        parts: list[dict[str, Any]] = []
        if draw(st.booleans()):
            parts.append({"type": "thinking", "text": draw(texts)})
        parts += [
            {"type": "tool_call", "id": i, "name": draw(tool_names), "arguments": draw(arguments)}
            for i in ids
        ]
        messages.append({"role": "assistant", "parts": parts})
        results = [
            {
                "type": "tool_result",
                "call_id": i,
                "is_error": draw(st.booleans()),
                "parts": [text_part(draw(texts))],
            }
            for i in ids
        ]
        if draw(st.booleans()):
            messages += [{"role": "tool", "parts": [res]} for res in results]
        else:
            messages.append({"role": "tool", "parts": results})
    messages.append({"role": "assistant", "parts": [text_part(draw(texts))]})
    return messages


class Refused:
    """``with Refused(NotFound, "not_found"): …``: the call must raise exactly that error.
    Nothing may change either; the invariants check that against the unchanged model."""

    def __init__(self, error: type[ArborError], code: str) -> None:
        self.error = error
        self.code = code

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        assert exc is not None, f"expected {self.error.__name__}({self.code}); nothing raised"
        assert isinstance(exc, self.error), f"expected {self.error.__name__}, got {exc!r}"
        assert exc.code == self.code, f"expected code {self.code}, got {exc.code}"
        return True


# --- the model -----------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """What a message row must hold, forever."""

    conversation: uuid.UUID
    parent: uuid.UUID | None
    role: str
    parts: list[dict[str, Any]]
    depth: int
    origin: str


@dataclass
class ConvModel:
    id: uuid.UUID
    instance: Conversation  # fetched once and never refreshed: services must not trust it
    tip: uuid.UUID | None = None
    version: int = 0
    forked_from: uuid.UUID | None = None
    # In creation order, so that picking by index replays deterministically.
    messages: list[uuid.UUID] = field(default_factory=list)


@dataclass
class CheckpointModel:
    pk: int
    conversation: uuid.UUID
    label: str
    message: uuid.UUID
    state: str = "live"
    reason: str = ""
    digest: uuid.UUID | None = None

    def as_tuple(self) -> tuple[Any, ...]:
        return (
            self.pk,
            self.conversation,
            self.label,
            self.message,
            self.state,
            self.reason,
            self.digest,
        )


FullRow = tuple[uuid.UUID, uuid.UUID | None, str, Any, int, str, Any, datetime]


def pick(items: Sequence[T], i: int) -> T:
    return items[i % len(items)]


def is_boundary(row: Row) -> bool:
    if row.role == "tool":
        return False
    return not (row.role == "assistant" and any(p["type"] == "tool_call" for p in row.parts))


class TreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._atomic = transaction.atomic()
        self._atomic.__enter__()
        self.user = User.objects.create(username="machine")
        self.convs: list[ConvModel] = []
        self.rows: dict[uuid.UUID, Row] = {}
        # Every column of every row, as first read back from the database.
        self.snapshot: dict[uuid.UUID, FullRow] = {}
        self.checkpoints: list[CheckpointModel] = []
        # The path root→tip of every conversation, as of the end of the previous step,
        # and which conversations the current step was allowed to change.
        self.recorded_paths: dict[uuid.UUID, list[uuid.UUID]] = {}
        self.touched: set[uuid.UUID] = set()
        self._new_conversation()

    def teardown(self) -> None:
        transaction.set_rollback(True)
        self._atomic.__exit__(None, None, None)

    # --- model helpers ----------------------------------------------------------------

    def _new_conversation(self) -> ConvModel:
        conv = services.conversation_create(owner=self.user, title=f"c{len(self.convs)}")
        model = ConvModel(id=conv.pk, instance=conv)
        self.convs.append(model)
        self.touched.add(conv.pk)
        return model

    def model_path(self, tip: uuid.UUID | None) -> list[uuid.UUID]:
        path: list[uuid.UUID] = []
        node = tip
        while node is not None:
            path.append(node)
            node = self.rows[node].parent
        return path[::-1]

    def subtree(self, conv: ConvModel, root: uuid.UUID) -> list[uuid.UUID]:
        """``root``'s descendants, in the model's creation order."""
        below = {root}
        out: list[uuid.UUID] = []
        for mid in conv.messages:  # parents are always created before their children
            if self.rows[mid].parent in below:
                below.add(mid)
                out.append(mid)
        return out

    def nonempty(self) -> list[ConvModel]:
        return [c for c in self.convs if c.messages]

    def having_role(self, role: str, wanted: bool) -> list[ConvModel]:
        """The conversations that have a message with (or without) that role; all
        non-empty ones if there are none."""
        found = [
            c
            for c in self.nonempty()
            if any((self.rows[m].role == role) == wanted for m in c.messages)
        ]
        return found or self.nonempty()

    def with_role(self, conv: ConvModel, role: str, wanted: bool) -> list[uuid.UUID]:
        """The conversation's messages with (or, if not ``wanted``, without) that role;
        all of them if there are none."""
        found = [m for m in conv.messages if (self.rows[m].role == role) == wanted]
        return found or conv.messages

    def live_checkpoints(self, conv: ConvModel, label: str) -> list[CheckpointModel]:
        return [
            cp
            for cp in self.checkpoints
            if cp.conversation == conv.id and cp.label == label and cp.state == "live"
        ]

    def stale_version(self, conv: ConvModel, delta: int) -> int:
        return conv.version - delta if conv.version >= delta else conv.version + delta

    def record_turn(
        self,
        conv: ConvModel,
        parent: uuid.UUID | None,
        messages: list[Msg],
        result: services.TurnResult,
        origin: str,
    ) -> None:
        assert result.version == conv.version + 1
        assert len(result.message_ids) == len(messages)
        assert result.tip == result.message_ids[-1]
        assert len(set(result.message_ids)) == len(messages)
        assert not set(result.message_ids) & self.rows.keys(), "a turn reused a message id"
        depth = self.rows[parent].depth + 1 if parent is not None else 0
        previous = parent
        for i, (mid, message) in enumerate(zip(result.message_ids, messages, strict=True)):
            self.rows[mid] = Row(
                conversation=conv.id,
                parent=previous,
                role=message["role"],
                parts=message["parts"],
                depth=depth + i,
                origin=origin if i == 0 else "turn",
            )
            conv.messages.append(mid)
            previous = mid
        conv.tip = result.tip
        conv.version += 1
        self.touched.add(conv.id)

    # --- turns, edits, regenerations -----------------------------------------------------

    @initialize(turn=turns())
    def first_turn(self, turn: list[Msg]) -> None:
        conv = self.convs[0]
        result = services.turn_append(
            conversation=conv.instance, parent_id=None, expected_version=0, messages=turn
        )
        self.record_turn(conv, None, turn, result, origin="turn")

    @precondition(
        lambda self: (
            len(self.convs) < MAX_CONVERSATIONS
            and sum(c.forked_from is None for c in self.convs) < MAX_ORIGINALS
        )
    )
    @rule()
    def create_conversation(self) -> None:
        self._new_conversation()

    @rule(c=picks, where=st.sampled_from(["tip", "tip", "any", "root"]), m=picks, turn=turns())
    def append_turn(self, c: int, where: str, m: int, turn: list[Msg]) -> None:
        conv = pick(self.convs, c)
        parent = conv.tip
        if where == "any" and conv.messages:
            parent = pick(conv.messages, m)
        elif where == "root":
            parent = None
        result = services.turn_append(
            conversation=conv.instance,
            parent_id=parent,
            expected_version=conv.version,
            messages=turn,
        )
        self.record_turn(conv, parent, turn, result, origin="turn")

    @rule(
        c=picks,
        d=picks,
        m=picks,
        why=st.sampled_from(["stale", "unpaired", "foreign parent"]),
        delta=st.integers(min_value=1, max_value=3),
        turn=turns(),
    )
    def refused_turn(self, c: int, d: int, m: int, why: str, delta: int, turn: list[Msg]) -> None:
        """A turn with a stale version, one that ends on an open tool call, or one below a
        message of another conversation: refused, nothing written."""
        conv = pick(self.convs, c)
        others = [o for o in self.nonempty() if o.id != conv.id]
        if why == "foreign parent" and not others:
            why = "stale"
        if why == "stale":
            with pytest.raises(StaleVersion) as err:
                services.turn_append(
                    conversation=conv.instance,
                    parent_id=conv.tip,
                    expected_version=self.stale_version(conv, delta),
                    messages=turn,
                )
            assert err.value.extra == {
                "tip": str(conv.tip) if conv.tip else None,
                "version": conv.version,
            }
        elif why == "unpaired":
            open_call = {"type": "tool_call", "id": "open", "name": "now", "arguments": {}}
            with Refused(InvalidInput, "unpaired_tool_call"):
                services.turn_append(
                    conversation=conv.instance,
                    parent_id=conv.tip,
                    expected_version=conv.version,
                    messages=[*turn, {"role": "assistant", "parts": [open_call]}],
                )
        else:
            with Refused(InvalidInput, "bad_parent"):
                services.turn_append(
                    conversation=conv.instance,
                    parent_id=pick(pick(others, d).messages, m),
                    expected_version=conv.version,
                    messages=turn,
                )

    @precondition(lambda self: bool(self.nonempty()))
    @rule(c=picks, m=picks, value=texts, right_role=st.sampled_from([True, True, True, False]))
    def edit(self, c: int, m: int, value: str, right_role: bool) -> None:
        conv = pick(self.having_role("user", right_role), c)
        original = pick(self.with_role(conv, "user", right_role), m)
        parts = [text_part(value)]
        if self.rows[original].role != "user":
            with Refused(InvalidInput, "not_editable"):
                services.message_edit(
                    conversation=conv.instance,
                    message_id=original,
                    parts=parts,
                    expected_version=conv.version,
                )
            return
        result = services.message_edit(
            conversation=conv.instance,
            message_id=original,
            parts=parts,
            expected_version=conv.version,
        )
        parent = self.rows[original].parent
        self.record_turn(conv, parent, [{"role": "user", "parts": parts}], result, origin="edit")
        assert self.rows[result.tip].depth == self.rows[original].depth

    @precondition(lambda self: bool(self.nonempty()))
    @rule(
        c=picks,
        m=picks,
        answer=turns(start="assistant"),
        right_role=st.sampled_from([True, True, True, False]),
    )
    def regenerate(self, c: int, m: int, answer: list[Msg], right_role: bool) -> None:
        conv = pick(self.having_role("assistant", right_role), c)
        original = pick(self.with_role(conv, "assistant", right_role), m)
        if self.rows[original].role != "assistant":
            with Refused(InvalidInput, "not_regenerable"):
                services.message_regenerate(
                    conversation=conv.instance,
                    message_id=original,
                    messages=answer,
                    expected_version=conv.version,
                )
            return
        result = services.message_regenerate(
            conversation=conv.instance,
            message_id=original,
            messages=answer,
            expected_version=conv.version,
        )
        parent = self.rows[original].parent
        self.record_turn(conv, parent, answer, result, origin="regenerate")
        assert self.rows[result.message_ids[0]].depth == self.rows[original].depth

    # --- tip moves ---------------------------------------------------------------------

    @precondition(lambda self: bool(self.nonempty()))
    @rule(c=picks, m=picks)
    def move_tip(self, c: int, m: int) -> None:
        conv = pick(self.nonempty(), c)
        target = pick(conv.messages, m)
        state = services.tip_move(
            conversation=conv.instance, message_id=target, expected_version=conv.version
        )
        assert state == services.TipState(tip=target, version=conv.version + 1)
        conv.tip = target
        conv.version += 1
        self.touched.add(conv.id)

    @precondition(lambda self: bool(self.nonempty()))
    @rule(
        c=picks,
        d=picks,
        m=picks,
        why=st.sampled_from(["stale", "foreign message"]),
        delta=st.integers(min_value=1, max_value=3),
    )
    def refused_tip_move(self, c: int, d: int, m: int, why: str, delta: int) -> None:
        """A tip move with a stale version, or to another conversation's message: refused
        with the current state, nothing written."""
        conv = pick(self.nonempty(), c)
        others = [o for o in self.nonempty() if o.id != conv.id]
        if why == "stale" or not others:
            with pytest.raises(StaleVersion) as err:
                services.tip_move(
                    conversation=conv.instance,
                    message_id=pick(conv.messages, m),
                    expected_version=self.stale_version(conv, delta),
                )
            assert err.value.extra == {"tip": str(conv.tip), "version": conv.version}
        else:
            with Refused(NotFound, "not_found"):
                services.tip_move(
                    conversation=conv.instance,
                    message_id=pick(pick(others, d).messages, m),
                    expected_version=conv.version,
                )

    # --- forks -------------------------------------------------------------------------

    @precondition(lambda self: bool(self.nonempty()) and len(self.convs) < MAX_CONVERSATIONS)
    @rule(c=picks, m=picks, scope=st.sampled_from(["path", "subtree"]))
    def fork(self, c: int, m: int, scope: str) -> None:
        source = pick(self.nonempty(), c)
        at = pick(source.messages, m)
        expected = self.model_path(at)
        if scope == "subtree":
            expected += self.subtree(source, at)
        message = selectors.message_get(user=self.user, message_id=at)
        fork = services.conversation_fork(message=message, owner=self.user, scope=scope)

        copies = list(Message.objects.filter(conversation_id=fork.pk))
        assert len(copies) == len(expected)
        id_map = {uuid.UUID(copy.metadata["fork_of"]): copy.id for copy in copies}
        assert sorted(map(str, id_map)) == sorted(map(str, expected)), "wrong messages copied"
        assert not set(id_map.values()) & self.rows.keys(), "a fork shares a message row"
        by_id = {copy.id: copy for copy in copies}
        model = ConvModel(id=fork.pk, instance=fork, version=0, forked_from=at)
        for original in expected:
            row = self.rows[original]
            copy = by_id[id_map[original]]
            assert copy.conversation_id == fork.pk
            assert copy.role == row.role and copy.parts == row.parts and copy.depth == row.depth
            assert copy.parent_id == (id_map[row.parent] if row.parent else None)
            assert copy.origin == "fork"
            source_metadata = self.snapshot[original][6]
            assert copy.metadata == {
                **source_metadata,
                "fork_of": str(original),
                "fork_origin": row.origin,
            }
            self.rows[copy.id] = Row(
                conversation=fork.pk,
                parent=copy.parent_id,
                role=row.role,
                parts=row.parts,
                depth=row.depth,
                origin="fork",
            )
            model.messages.append(copy.id)
        if scope == "subtree" and source.tip in id_map:
            model.tip = id_map[source.tip]
        else:
            model.tip = id_map[at]
        self.convs.append(model)
        self.touched.add(fork.pk)

        # Live checkpoints on the copied messages come along, pointing at the copies.
        wanted = sorted(
            (cp.label, id_map[cp.message], id_map.get(cp.digest) if cp.digest else None)
            for cp in self.checkpoints
            if cp.conversation == source.id and cp.state == "live" and cp.message in id_map
        )
        got = list(Checkpoint.objects.filter(conversation_id=fork.pk).order_by("label"))
        assert [(g.label, g.message_id, g.digest_message_id) for g in got] == wanted
        for g in got:
            assert g.state == "live"
            self.checkpoints.append(
                CheckpointModel(
                    pk=g.pk,
                    conversation=fork.pk,
                    label=g.label,
                    message=g.message_id,
                    digest=g.digest_message_id,
                )
            )

    # --- checkpoints and rewind --------------------------------------------------------

    @precondition(lambda self: bool(self.nonempty()))
    @rule(
        c=picks,
        m=picks,
        label=st.sampled_from(LABELS),
        at=st.sampled_from(["tip", "tip", "message", "mid-turn"]),
    )
    def create_checkpoint(self, c: int, m: int, label: str, at: str) -> None:
        conv = pick(self.nonempty(), c)
        if at == "tip":
            target = conv.tip
        elif at == "message":
            target = pick(conv.messages, m)
        else:
            mid_turn = [mid for mid in conv.messages if not is_boundary(self.rows[mid])]
            target = pick(mid_turn or conv.messages, m)
        message_id = None if at == "tip" else target
        refusals: list[str] = []
        if target is None:
            refusals.append("empty")
        else:
            if not is_boundary(self.rows[target]):
                refusals.append("not_at_boundary")
            if self.live_checkpoints(conv, label):
                refusals.append("label_taken")
        if refusals:
            with pytest.raises(Conflict) as err:
                services.checkpoint_create(
                    conversation=conv.instance, label=label, message_id=message_id
                )
            assert err.value.code in refusals
            return
        assert target is not None
        cp = services.checkpoint_create(
            conversation=conv.instance, label=label, message_id=message_id
        )
        assert cp.message_id == target and cp.conversation_id == conv.id
        self.checkpoints.append(
            CheckpointModel(pk=cp.pk, conversation=conv.id, label=label, message=target)
        )

    @precondition(lambda self: bool(self.checkpoints))
    @rule(i=picks, reason=st.sampled_from(["trimmed on resume", "user dropped it"]))
    def drop_checkpoint(self, i: int, reason: str) -> None:
        cp = pick(self.checkpoints, i)
        services.checkpoint_drop(checkpoint=Checkpoint.objects.get(pk=cp.pk), reason=reason)
        if cp.state == "live":  # dropping a dropped checkpoint changes nothing
            cp.state = "dropped"
            cp.reason = reason
        conv = next(c for c in self.convs if c.id == cp.conversation)
        if not self.live_checkpoints(conv, cp.label):
            # Rewinding to the dropped label is refused; the tip and version stay (the
            # invariants compare them with the model after this step).
            with Refused(Conflict, "checkpoint_dropped"):
                services.checkpoint_rewind(
                    conversation=conv.instance, label=cp.label, expected_version=conv.version
                )

    @precondition(lambda self: any(cp.state == "live" for cp in self.checkpoints))
    @rule(i=picks, version=st.sampled_from(["none", "current"]), digest=st.one_of(st.none(), texts))
    def rewind(self, i: int, version: str, digest: str | None) -> None:
        self._rewind(i, "live", LABELS[0], version, digest)

    @precondition(lambda self: bool(self.checkpoints))
    @rule(
        i=picks,
        which=st.sampled_from(["live", "dropped", "any label"]),
        other_label=st.sampled_from(LABELS),
        version=st.sampled_from(["none", "current", "stale"]),
        digest=st.one_of(st.none(), texts),
    )
    def rewind_maybe_refused(
        self, i: int, which: str, other_label: str, version: str, digest: str | None
    ) -> None:
        """A rewind to a live checkpoint, a dropped one or any label at all (which the
        conversation may not have), with or without a stale version."""
        self._rewind(i, which, other_label, version, digest)

    def _rewind(
        self, i: int, which: str, other_label: str, version: str, digest: str | None
    ) -> None:
        states = {"live": ["live"], "dropped": ["dropped"], "any label": ["live", "dropped"]}
        candidates = [cp for cp in self.checkpoints if cp.state in states[which]]
        chosen = pick(candidates or self.checkpoints, i)
        conv = next(c for c in self.convs if c.id == chosen.conversation)
        label = other_label if which == "any label" else chosen.label
        expected_version = {"none": None, "current": conv.version, "stale": conv.version + 1}[
            version
        ]

        def call() -> services.RewindResult:
            return services.checkpoint_rewind(
                conversation=conv.instance,
                label=label,
                digest=digest,
                expected_version=expected_version,
            )

        live = self.live_checkpoints(conv, label)
        if version == "stale":
            with pytest.raises(StaleVersion):
                call()
            return
        if not live:
            known = any(cp.conversation == conv.id and cp.label == label for cp in self.checkpoints)
            if known:
                with Refused(Conflict, "checkpoint_dropped"):
                    call()
            else:
                with Refused(NotFound, "unknown_checkpoint"):
                    call()
            return

        (checkpoint,) = live
        abandoned = conv.tip
        explored = set(self.model_path(abandoned)) - set(self.model_path(checkpoint.message))
        result = call()
        assert result.version == conv.version + 1
        assert result.tip == result.digest_message
        assert result.abandoned_tip == abandoned
        assert result.checkpoint.pk == checkpoint.pk
        assert result.digest_message not in self.rows
        row = Message.objects.get(pk=result.digest_message)
        body = row.parts[0]["text"]
        assert str(abandoned) in body and f"'{label}'" in body
        if digest is not None and digest.strip():
            assert digest in body
        assert row.metadata["abandoned_tip"] == str(abandoned)
        assert row.metadata["explored_messages"] == len(explored)
        self.rows[row.id] = Row(
            conversation=conv.id,
            parent=checkpoint.message,
            role="user",
            parts=row.parts,
            depth=self.rows[checkpoint.message].depth + 1,
            origin="digest",
        )
        conv.messages.append(row.id)
        conv.tip = row.id
        conv.version += 1
        checkpoint.digest = row.id
        self.touched.add(conv.id)

    # --- the invariants ----------------------------------------------------------------

    @invariant()
    def the_database_matches_the_model(self) -> None:
        self.check_conversations()
        full = self.check_messages()
        self.check_structure(full)
        self.check_tips(full)
        self.check_forks(full)
        self.check_checkpoints(full)

    def check_conversations(self) -> None:
        # Conversations: the same set, each at the tip and version the model expects.
        db_convs = {
            c["id"]: c
            for c in Conversation.objects.values(
                "id", "owner_id", "tip_id", "version", "forked_from_id"
            )
        }
        assert db_convs.keys() == {c.id for c in self.convs}
        for conv in self.convs:
            got = db_convs[conv.id]
            assert (got["tip_id"], got["version"]) == (conv.tip, conv.version), conv.id
            assert got["forked_from_id"] == conv.forked_from
            assert got["owner_id"] == self.user.pk

    def check_messages(self) -> dict[uuid.UUID, FullRow]:
        # Messages: only ever added; none changed, moved or removed.
        full: dict[uuid.UUID, FullRow] = {
            r[0]: r[1:]
            for r in Message.objects.values_list(
                "id",
                "conversation_id",
                "parent_id",
                "role",
                "parts",
                "depth",
                "origin",
                "metadata",
                "created_at",
            )
        }
        missing = self.rows.keys() - full.keys()
        unexpected = full.keys() - self.rows.keys()
        assert not missing, f"messages disappeared: {missing}"
        assert not unexpected, f"messages appeared that no call announced: {unexpected}"
        for mid, values in full.items():
            row = self.rows[mid]
            conversation, parent, role, parts, depth, origin = values[:6]
            assert (conversation, parent, role, parts, depth, origin) == (
                row.conversation,
                row.parent,
                row.role,
                row.parts,
                row.depth,
                row.origin,
            ), f"message {mid} changed"
            first_seen = self.snapshot.setdefault(mid, values)
            assert values == first_seen, f"message {mid} changed"
        return full

    def check_structure(self, full: dict[uuid.UUID, FullRow]) -> None:
        # Structure: every parent in the same conversation, one level up.
        for mid, values in full.items():
            conversation, parent, depth = values[0], values[1], values[4]
            if parent is None:
                assert depth == 0, f"root {mid} at depth {depth}"
            else:
                assert parent in full, f"{mid} has a missing parent"
                assert full[parent][0] == conversation, f"{mid}'s parent is in another conversation"
                assert depth == full[parent][4] + 1, f"{mid} is not one below its parent"

    def check_tips(self, full: dict[uuid.UUID, FullRow]) -> None:
        # Tips: reachable from a root inside their own conversation; paths as expected.
        for conv in self.convs:
            walked: list[uuid.UUID] = []
            node = conv.tip
            while node is not None:
                assert full[node][0] == conv.id, "a path leaves its conversation"
                walked.append(node)
                assert len(walked) <= len(full), "a cycle of parents"
                node = full[node][1]
            walked.reverse()
            if walked:
                assert full[walked[0]][4] == 0
            assert walked == self.model_path(conv.tip)
            read = selectors.message_path(conversation_id=conv.id, tip_id=conv.tip)
            assert [m.id for m in read] == walked
            if conv.id not in self.touched:
                assert walked == self.recorded_paths[conv.id], "a path changed from elsewhere"
            self.recorded_paths[conv.id] = walked
        self.touched = set()

    def check_forks(self, full: dict[uuid.UUID, FullRow]) -> None:
        # Forks hold copies: no message of a fork is a message of its source.
        for conv in self.convs:
            if conv.forked_from is not None and conv.forked_from in full:
                source = full[conv.forked_from][0]
                assert source != conv.id
                assert not {m for m in conv.messages} & {
                    m for m, v in full.items() if v[0] == source
                }

    def check_checkpoints(self, full: dict[uuid.UUID, FullRow]) -> None:
        # Checkpoints: at the message they were created with, dropped or not.
        db_checkpoints = sorted(
            Checkpoint.objects.values_list(
                "pk",
                "conversation_id",
                "label",
                "message_id",
                "state",
                "reason",
                "digest_message_id",
            )
        )
        assert db_checkpoints == sorted(cp.as_tuple() for cp in self.checkpoints)
        for cp in self.checkpoints:
            assert full[cp.message][0] == cp.conversation
            assert is_boundary(self.rows[cp.message])
        for conv in self.convs:
            for label in LABELS:
                assert len(self.live_checkpoints(conv, label)) <= 1


MACHINE_SETTINGS = settings(
    max_examples=50,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class TreeStateMachineTests(TestCase):
    def test_it_keeps_the_tree_invariants_under_random_operations(self) -> None:
        run_state_machine_as_test(TreeMachine, settings=MACHINE_SETTINGS)
