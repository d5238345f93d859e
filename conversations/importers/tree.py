"""From a parser's flat node list to a valid Arbor tree. Pure: no database.

Repairs, each reported: a duplicate id keeps its first occurrence; a dangling parent makes
the node a new root; a cycle is broken at its earliest node (which becomes a root); a
node that is not a message is left out and its children move up to its parent. Then the
messages are ordered depth-first, siblings by (timestamp, file position), with depths
computed from the parents, parts validated with ``conversations.parts`` and the tip
chosen.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from conversations.errors import InvalidInput
from conversations.importers.base import (
    NEWEST_LEAF,
    ConversationReport,
    Limits,
    Node,
    Sanitiser,
    SourceCheckpoint,
    SourceConversation,
)
from conversations.parts import clean_messages

_PLACEHOLDER_SHA = "0" * 64


@dataclass
class BuiltMessage:
    key: str
    parent: str | None
    depth: int
    node: Node


@dataclass
class BuiltConversation:
    source: SourceConversation
    messages: list[BuiltMessage]  # depth-first, parents before children
    tip: str | None
    checkpoints: list[SourceCheckpoint] = field(default_factory=list)
    created_at: datetime | None = None


class SkipConversation(Exception):
    """The conversation cannot be imported; the message says why."""


def _resolve(aliases: dict[str, str], key: str | None) -> str | None:
    seen = 0
    while key is not None and key in aliases and seen < 100:
        key = aliases[key]
        seen += 1
    return key


def build(conv: SourceConversation, limits: Limits) -> BuiltConversation:
    """Repair and order one conversation. Raises SkipConversation when nothing usable is
    left or a limit is exceeded."""
    report = conv.report
    _sanitise_header(conv)
    nodes = _unique_nodes(conv)
    if not nodes:
        raise SkipConversation("it holds no messages")
    parent = _parents(conv, nodes)
    _break_cycles(nodes, parent, report)
    kept_ancestor = _KeptAncestor(nodes, parent)
    kept = _kept_messages(nodes, report, limits)
    final_parent = {n.key: kept_ancestor(parent[n.key]) for n in kept}
    children: dict[str | None, list[Node]] = {}
    for node in kept:
        children.setdefault(final_parent[node.key], []).append(node)
    _inherit_times(children, conv.created_at or datetime.now(UTC))
    ordered = _depth_first(children, final_parent)

    _sanitise_and_validate(conv, ordered, limits)

    tip = _choose_tip(conv, nodes, kept_ancestor, children, ordered)
    checkpoints = _checkpoints(conv, {m.key for m in ordered}, nodes, kept_ancestor)
    built = BuiltConversation(
        source=conv,
        messages=ordered,
        tip=tip,
        checkpoints=checkpoints,
        created_at=conv.created_at or (ordered[0].node.created_at if ordered else None),
    )
    _count(built)
    return built


def _sanitise_header(conv: SourceConversation) -> None:
    """The conversation's own text fields, made storable (see ``Sanitiser``)."""
    sanitiser = Sanitiser()
    conv.title = sanitiser.text(conv.title)
    conv.system_prompt = sanitiser.text(conv.system_prompt)
    conv.model = sanitiser.text(conv.model)
    if sanitiser.changed():
        conv.report.repaired.add("nul_bytes", "conversation", sanitiser.describe())


def _unique_nodes(conv: SourceConversation) -> dict[str, Node]:
    """The nodes by key, the first of each id kept; each node's parser notes go to the
    report as they come, in file order."""
    report = conv.report
    nodes: dict[str, Node] = {}
    for node in conv.nodes:
        for bucket, kind, detail in node.notes:
            getattr(report, bucket).add(kind, f"node {node.key}", detail)
        if node.key in nodes:
            report.skipped.add(
                "duplicate_id", f"node {node.key}", "a second record with the same id: skipped"
            )
            continue
        nodes[node.key] = node
    return nodes


def _parents(conv: SourceConversation, nodes: dict[str, Node]) -> dict[str, str | None]:
    """Each node's parent through the aliases; a dangling parent or a self-loop makes
    the node a root."""
    report = conv.report
    parent: dict[str, str | None] = {}
    for key, node in nodes.items():
        target = _resolve(conv.aliases, node.parent)
        if target is not None and target not in nodes:
            report.repaired.add(
                "dangling_parent",
                f"node {key}",
                f"parent {target} is not in the file: kept as a new root",
            )
            target = None
        elif target == key:
            report.repaired.add("cycle", f"node {key}", "its own parent: kept as a root")
            target = None
        parent[key] = target
    return parent


KeptAncestor = Callable[[str | None], str | None]


class _KeptAncestor:
    """The nearest ancestor of a key (the key itself included) that is kept as a
    message: the children of a left-out node move up to it. Each answer is remembered
    for every left-out node on the way, so long chains of them are walked once."""

    def __init__(self, nodes: dict[str, Node], parent: dict[str, str | None]) -> None:
        self.nodes = nodes
        self.parent = parent
        self.memo: dict[str, str | None] = {}

    def __call__(self, key: str | None) -> str | None:
        chain: list[str] = []
        while key is not None and self.nodes[key].skip is not None:
            if key in self.memo:
                key = self.memo[key]
                break
            chain.append(key)
            key = self.parent[key]
        for k in chain:
            self.memo[k] = key
        return key


def _kept_messages(
    nodes: dict[str, Node], report: ConversationReport, limits: Limits
) -> list[Node]:
    """The nodes kept as messages (not left out by the parser, not empty), reporting
    the others. Raises SkipConversation when none is left or there are too many."""
    for key, node in nodes.items():
        if node.skip is None and not node.parts:
            node.skip = f"an empty {node.role} message: left out"
        if node.skip is not None:
            report.skipped.add("not_a_message", f"node {key}", node.skip)
    kept = [n for n in nodes.values() if n.skip is None]
    if not kept:
        raise SkipConversation("it holds no messages")
    if len(kept) > limits.max_messages:
        raise SkipConversation(f"it has {len(kept)} messages; the limit is {limits.max_messages}")
    return kept


def _inherit_times(children: dict[str | None, list[Node]], fallback: datetime) -> None:
    """A node without a timestamp takes its parent's (a root, the conversation's)."""
    stack: list[tuple[Node, datetime]] = [(n, fallback) for n in children.get(None, [])]
    while stack:
        node, inherited = stack.pop()
        if node.created_at is None:
            node.created_at = inherited
        stack.extend((c, node.created_at) for c in children.get(node.key, []))


def _sibling_order(node: Node) -> tuple[datetime, int]:
    assert node.created_at is not None  # set by _inherit_times
    return (node.created_at, node.order)


def _depth_first(
    children: dict[str | None, list[Node]], final_parent: dict[str, str | None]
) -> list[BuiltMessage]:
    """The messages depth-first (parents before children), siblings by (timestamp, file
    position), with their depths."""
    ordered: list[BuiltMessage] = []
    roots = sorted(children.get(None, []), key=_sibling_order, reverse=True)
    walk = [(n, 0) for n in roots]
    while walk:
        node, depth = walk.pop()
        ordered.append(BuiltMessage(node.key, final_parent[node.key], depth, node))
        below = sorted(children.get(node.key, []), key=_sibling_order, reverse=True)
        walk.extend((c, depth + 1) for c in below)
    return ordered


def _break_cycles(
    nodes: dict[str, Node], parent: dict[str, str | None], report: ConversationReport
) -> None:
    """Every node must reach a root. Walk up from each node; a walk that comes back to a
    node of its own path has found a cycle, broken at the cycle's earliest node."""
    state: dict[str, int] = {}  # 1 on the current path, 2 known to reach a root
    for start in nodes:
        if state.get(start) == 2:
            continue
        path: list[str] = []
        key: str | None = start
        while key is not None and key not in state:
            state[key] = 1
            path.append(key)
            key = parent[key]
        if key is not None and state.get(key) == 1:
            cycle = path[path.index(key) :]
            first = min(cycle, key=lambda k: nodes[k].order)
            parent[first] = None
            report.repaired.add(
                "cycle",
                f"node {first}",
                f"a cycle of {len(cycle)} node(s): broken here, kept as a new root",
            )
        for k in path:
            state[k] = 2


def _sanitise_and_validate(
    conv: SourceConversation, ordered: list[BuiltMessage], limits: Limits
) -> None:
    report = conv.report
    for message in ordered:
        node = message.node
        sanitiser = Sanitiser()
        node.parts = sanitiser.value(node.parts)
        node.metadata = sanitiser.value(node.metadata)
        if sanitiser.changed():
            report.repaired.add("nul_bytes", f"message {node.key}", sanitiser.describe())
        _truncate_texts(node.parts, limits.max_part_chars, report, node.key)
        try:
            size = len(json.dumps(node.metadata, ensure_ascii=False))
        except (TypeError, ValueError):
            size = limits.max_metadata_bytes + 1
        if size > limits.max_metadata_bytes:
            keep = {k: node.metadata[k] for k in ("source",) if k in node.metadata}
            node.metadata = {**keep, "metadata_dropped_bytes": size}
            report.repaired.add(
                "metadata_too_large",
                f"message {node.key}",
                f"{size} bytes of metadata dropped (limit {limits.max_metadata_bytes})",
            )
        probe = [_validation_copy(p) for p in node.parts]
        try:
            clean_messages(
                [{"role": node.role, "parts": probe, "metadata": {}}],
                max_messages=1,
                max_chars=limits.max_part_chars,
            )
        except InvalidInput as exc:
            problems = "; ".join(e["msg"] for e in exc.extra.get("errors", [])) or exc.detail
            raise SkipConversation(f"message {node.key} is not valid: {problems}") from None


def _validation_copy(part: Any) -> Any:
    """Parts with pending images (bytes the writer will store) validate as image refs."""
    if not isinstance(part, dict):
        return part
    if part.get("type") == "image":
        return {"type": "image", "blob": _PLACEHOLDER_SHA}
    if part.get("type") == "tool_result" and isinstance(part.get("parts"), list):
        return {**part, "parts": [_validation_copy(p) for p in part["parts"]]}
    return part


def _truncate_texts(parts: list[Any], limit: int, report: ConversationReport, key: str) -> None:
    for part in parts:
        if not isinstance(part, dict):
            continue
        for field_name in ("text",):
            value = part.get(field_name)
            if isinstance(value, str) and len(value) > limit:
                part[field_name] = value[:limit]
                report.repaired.add(
                    "text_truncated",
                    f"message {key}",
                    f"a {part.get('type')} part of {len(value)} characters cut to {limit}",
                )
        if part.get("type") == "tool_result" and isinstance(part.get("parts"), list):
            _truncate_texts(part["parts"], limit, report, key)


def _choose_tip(
    conv: SourceConversation,
    nodes: dict[str, Node],
    kept_ancestor: KeptAncestor,
    children: dict[str | None, list[Node]],
    ordered: list[BuiltMessage],
) -> str | None:
    report = conv.report
    if conv.tip is not None:
        key = _resolve(conv.aliases, conv.tip)
        if key in nodes:
            resolved = kept_ancestor(key) if nodes[key].skip is not None else key
            if resolved != key:
                report.repaired.add(
                    "tip_moved",
                    f"node {key}",
                    f"the current node is not a message: tip set to {resolved}",
                )
            if resolved is not None:
                report.tip_rule = conv.tip_rule
                return str(resolved)
        else:
            report.repaired.add(
                "tip_missing",
                f"node {conv.tip}",
                "the current node is not in the file: tip set to the newest leaf",
            )
    leaves = [m.node for m in ordered if not children.get(m.key)]
    report.tip_rule = NEWEST_LEAF
    if not leaves:  # pragma: no cover - a finite tree always has a leaf
        return None
    return max(leaves, key=lambda n: n.order).key


def _checkpoints(
    conv: SourceConversation,
    present: set[str],
    nodes: dict[str, Node],
    kept_ancestor: KeptAncestor,
) -> list[SourceCheckpoint]:
    out: list[SourceCheckpoint] = []
    live_labels: set[str] = set()
    for cp in conv.checkpoints:
        label = cp.label.strip()[:100] if isinstance(cp.label, str) else ""
        if not label:
            conv.report.skipped.add("checkpoint", "checkpoint", "an empty label: skipped")
            continue
        key = _resolve(conv.aliases, cp.message)
        if key not in present:
            conv.report.skipped.add(
                "checkpoint",
                f"checkpoint {label!r}",
                f"its message {cp.message} was not imported: skipped (never re-pointed)",
            )
            continue
        node = nodes[str(key)]
        if cp.state == "live" and not _is_boundary(node):
            conv.report.skipped.add(
                "checkpoint",
                f"checkpoint {label!r}",
                "its message is not at a clean turn boundary: skipped",
            )
            continue
        if cp.state == "live" and label in live_labels:
            conv.report.skipped.add(
                "checkpoint", f"checkpoint {label!r}", "a live checkpoint with this label exists"
            )
            continue
        if cp.state == "live":
            live_labels.add(label)
        digest = _resolve(conv.aliases, cp.digest_message)
        out.append(
            SourceCheckpoint(
                label=label,
                message=str(key),
                state=cp.state,
                reason=cp.reason,
                source=cp.source,
                digest_message=str(digest) if digest in present else None,
            )
        )
    return out


def _is_boundary(node: Node) -> bool:
    if node.role == "tool":
        return False
    return not (node.role == "assistant" and any(p.get("type") == "tool_call" for p in node.parts))


def _count(built: BuiltConversation) -> None:
    """Fill the report's counts and flag tool traffic that does not pair up, as
    conversations.resume reads it: a call is answered by a result in the run of tool
    messages directly below its assistant message, on the same line of history. A
    result on a sibling branch answers nothing on this one. ``tool_pairs`` counts the
    pairs on the path to the tip; pairs on other branches are ``tool_pairs_elsewhere``."""
    report = built.source.report
    pairs = _ToolPairs(built)
    report.messages = len(built.messages)
    report.roots = sum(1 for m in built.messages if m.parent is None)
    report.leaves = sum(1 for m in built.messages if m.key not in pairs.children)
    report.checkpoints = len(built.checkpoints)
    # Messages come parents first: each tool message finds its run's pairs above it.
    for message in built.messages:
        _count_parts(report, message.node)
        if message.node.role == "tool":
            pairs.pair_results(message)
    for message in built.messages:
        if message.node.role == "assistant":
            pairs.flag_unanswered(message)


def _count_parts(report: ConversationReport, node: Node) -> None:
    if "compaction_marker" in node.metadata:
        report.compaction_markers += 1
    report.images += _count_images(node.parts)
    for part in node.parts:
        if part.get("type") == "tool_call":
            report.tool_calls += 1
        elif part.get("type") == "tool_result":
            report.tool_results += 1


class _ToolPairs:
    """Tool calls and results of one built conversation, paired line by line (see
    ``_count``) and counted on its report."""

    def __init__(self, built: BuiltConversation) -> None:
        self.built = built
        self.report = built.source.report
        self.by_key = {m.key: m for m in built.messages}
        self.children: dict[str, list[str]] = {}
        for m in built.messages:
            if m.parent is not None:
                self.children.setdefault(m.parent, []).append(m.key)
        self.on_path: set[str] = set()
        key = built.tip
        while key is not None and key not in self.on_path:
            self.on_path.add(key)
            key = self.by_key[key].parent
        # Per tool message: its assistant message, and the calls answered from that
        # message down to it.
        self.owner_of: dict[str, str | None] = {}
        self.answered: dict[str, set[str]] = {}

    def pair_results(self, message: BuiltMessage) -> None:
        """Pair the results of a tool message with the calls of its assistant message
        not answered higher up its run; flag the results that answer nothing."""
        node = message.node
        above = message.parent
        if above is not None and self.by_key[above].node.role == "tool":
            owner, done = self.owner_of[above], set(self.answered[above])
        else:
            owner, done = above, set()
        calls = self._calls_of(owner)
        for part in node.parts:
            if part.get("type") != "tool_result":
                continue
            call_id = str(part.get("call_id"))
            if call_id in calls and call_id not in done:
                done.add(call_id)
                if message.key in self.on_path:
                    self.report.tool_pairs += 1
                else:
                    self.report.tool_pairs_elsewhere += 1
            else:
                self.report.flagged.add(
                    "unpaired_tool_result",
                    f"message {node.key}",
                    f"result for {call_id!r} has no call just above it: kept; resume leaves it out",
                )
        self.owner_of[message.key], self.answered[message.key] = owner, done

    def _calls_of(self, owner: str | None) -> set[Any]:
        owner_node = self.by_key[owner].node if owner is not None else None
        if owner_node is None or owner_node.role != "assistant":
            return set()
        return {p["id"] for p in owner_node.parts if p.get("type") == "tool_call"}

    def flag_unanswered(self, message: BuiltMessage) -> None:
        """Flag (and, unless the file is Arbor's own, note in the metadata) each call of
        an assistant message that some line of history below it leaves unanswered."""
        node = message.node
        made = [str(p["id"]) for p in node.parts if p.get("type") == "tool_call"]
        if not made:
            return
        missing = self._missing(message, made)
        if not missing:
            return
        if not self.built.source.verbatim:
            node.metadata["unpaired_tool_calls"] = list(missing)
        for call_id, path in missing.items():
            where = "resume trims it" if path else "on a branch off the current path"
            self.report.flagged.add(
                "unpaired_tool_call",
                f"message {node.key}",
                f"tool call {call_id!r} has no result: kept; {where}",
            )

    def _missing(self, message: BuiltMessage, made: list[str]) -> dict[str, bool]:
        """The calls some line below the message leaves unanswered → whether one such
        line is the path to the tip."""
        # Every line of history below the message: the calls its run of results left
        # unanswered (a line without results answers none).
        below = self.children.get(message.key, [])
        lines = [
            (self.answered[end], self._continues_on_path(end))
            for end in _run_ends(message.key, self.by_key, self.children)
        ]
        direct = [c for c in below if self.by_key[c].node.role != "tool"]
        if direct or not below:
            on_path = message.key == self.built.tip or any(c in self.on_path for c in direct)
            lines.append((set(), on_path))
        missing: dict[str, bool] = {}
        for have, path in lines:
            for call_id in made:
                if call_id not in have:
                    missing[call_id] = missing.get(call_id, False) or path
        return missing

    def _continues_on_path(self, end: str) -> bool:
        """Whether the path to the tip runs through this line's last tool message and on
        from it."""
        if end not in self.on_path:
            return False
        return end == self.built.tip or any(
            c in self.on_path and self.by_key[c].node.role != "tool"
            for c in self.children.get(end, [])
        )


def _run_ends(
    key: str, by_key: dict[str, BuiltMessage], children: dict[str, list[str]]
) -> list[str]:
    """The last tool message of each line of tool messages below ``key`` (a tool message
    ends a line where anything but a tool message, or nothing, follows it); empty when
    no child is a tool message."""
    ends: list[str] = []
    stack = [c for c in children.get(key, []) if by_key[c].node.role == "tool"]
    while stack:
        current = stack.pop()
        below = children.get(current, [])
        tools = [c for c in below if by_key[c].node.role == "tool"]
        if len(tools) < len(below) or not below:
            ends.append(current)
        stack.extend(tools)
    return ends


def _count_images(parts: list[Any]) -> int:
    total = 0
    for part in parts:
        if part.get("type") == "image":
            total += 1
        elif part.get("type") == "tool_result":
            total += _count_images(part.get("parts", []))
    return total
