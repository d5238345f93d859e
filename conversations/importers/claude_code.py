"""Claude Code session files (``~/.claude/projects/<project>/<session>.jsonl``): one record
per line, linked by ``uuid``/``parentUuid``.

- One API message is often written as several ``assistant`` records (one content block
  each) sharing ``message.id``: they are merged into one message (the record ids are
  kept in ``metadata.source.records``). Records that are not messages (hook
  ``progress``, ``attachment``, …) may sit between them and are looked through.
- A ``user`` record holding ``tool_result`` blocks becomes a ``tool`` message (text in the
  same record follows as a user message). Claude Code ≥ 2.1 hangs each result below the
  record of its own ``tool_use``; the results of one message are chained in file order
  (every call is answered on one line), and what follows the results continues below
  the last of them.
- Records without a ``parentUuid`` field (files other tools write) follow the record
  before them; a file where no record has a parent is read in file order.
- ``system``/``compact_boundary`` becomes a compaction marker (a system message with
  ``metadata.compaction_marker``) attached to its ``logicalParentUuid``; the summary
  record after it (``isCompactSummary``) stays a user message flagged ``compact_summary``.
- Sidechains (``isSidechain``: Task sub-agents) are their own conversations, one per
  sidechain root, titled after the Task call that started them; a sub-agent never saw
  the main conversation, so a branch of it would misstate what the model saw. Each is
  linked to the call that started it (``Conversation.spawned_by``) when that call is in
  the same import: in the same file (≤ 2.0), or, for 2.1's ``subagents/agent-<id>.jsonl``
  files, through the ``agentId`` the call's result names (a project folder imported as
  a zip).
- There is no current node: the tip is the newest leaf (the leaf written last).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conversations.importers.base import (
    ConversationReport,
    FileIssues,
    ImportReport,
    Limits,
    Node,
    Part,
    SourceConversation,
    as_dict,
    as_str,
    block_parts,
    first_text,
    json_text,
    nonempty_text,
    parse_time,
    preview_text,
    text_part,
    thinking_part,
    tool_call_part,
    tool_result_part,
)
from conversations.importers.media import b64_image, url_image
from conversations.importers.reading import iter_jsonl

FORMAT = "claude-code"
TASK_TOOLS = ("Task", "Agent")


def _source(uid: str, **extra: Any) -> dict[str, Any]:
    return {"format": FORMAT, "id": uid, **extra}


def parse(path: Path, *, report: ImportReport, limits: Limits) -> Iterator[SourceConversation]:
    reader = _Reader(report)
    for lineno, record in iter_jsonl(path, issues=FileIssues(report), limits=limits):
        reader.add(lineno, record)
    yield from reader.conversations()


class _Reader:
    def __init__(self, report: ImportReport) -> None:
        self.report = report
        self.nodes: list[Node] = []
        self.by_key: dict[str, Node] = {}
        self.sidechain: dict[str, bool] = {}
        self.aliases: dict[str, str] = {}
        self.summaries: dict[str, str] = {}
        self.group_of: dict[str, Node] = {}  # assistant record uuid → its merged message
        # Records that are not messages → their parent: looked through when linking.
        self.through: dict[str, str | None] = {}
        # Tool results, per assistant message: the calls answered so far, the record
        # the next result hangs below, and each result record's assistant message.
        self.answered: dict[str, set[str]] = {}
        self.results_end: dict[str, str] = {}
        self.results_of: dict[str, str] = {}
        self.previous: str | None = None  # the last message record, for file order
        self.agent_ids: dict[str, str] = {}  # sidechain record → its agentId (2.1 files)
        self.ignored: Counter[str] = Counter()
        self.session_id: str | None = None
        self.order = 0

    def _append(self, node: Node, side: bool) -> None:
        self.nodes.append(node)
        self.by_key[node.key] = node
        self.sidechain[node.key] = side

    def add(self, lineno: int, record: dict[str, Any]) -> None:
        self.order += 1
        kind = as_str(record.get("type"))
        if kind == "summary":
            self.summaries[as_str(record.get("leafUuid"))] = as_str(record.get("summary"))
            return
        uid = record.get("uuid")
        if not isinstance(uid, str) or not uid:
            self.ignored[kind or "untyped"] += 1
            return
        if uid in self.by_key or uid in self.aliases:
            self.report.skipped.add(
                "duplicate_id", f"line {lineno}", f"record {uid} appears again: skipped"
            )
            return
        self.session_id = self.session_id or as_str(record.get("sessionId")) or None
        if "parentUuid" in record:
            parent = record.get("parentUuid")
            parent_key = parent if isinstance(parent, str) and parent else None
        else:
            parent_key = self.previous
        if kind in ("assistant", "user") or (
            kind == "system" and record.get("subtype") == "compact_boundary"
        ):
            self.previous = uid
        side = bool(record.get("isSidechain"))
        if side and isinstance(record.get("agentId"), str):
            self.agent_ids.setdefault(uid, record["agentId"])
        created = parse_time(record.get("timestamp"))
        message = as_dict(record.get("message"))
        if kind == "assistant":
            self._assistant(uid, parent_key, side, created, message, record)
        elif kind == "user":
            self._user(uid, parent_key, side, created, message, record)
        elif kind == "system" and record.get("subtype") == "compact_boundary":
            self._boundary(uid, parent_key, side, created, record)
        else:
            what = kind + (
                f"/{record['subtype']}" if isinstance(record.get("subtype"), str) else ""
            )
            node = Node(uid, parent_key, "system", [], order=self.order, created_at=created)
            node.skip = f"a {what} record (not a message)"
            self.through[uid] = parent_key
            self._append(node, side)

    # -- linking --

    def _look_through(self, key: str | None) -> str | None:
        """The message record a parent id stands for: non-message records are looked
        through, merged records stand for their message."""
        seen = 0
        while key is not None and key in self.through and seen < 10_000:
            key = self.through[key]
            seen += 1
        return self.aliases.get(key, key) if key is not None else None

    def _continue_below(self, key: str | None) -> str | None:
        """Where a message continuing from ``key`` hangs: below the last result of the
        assistant message when ``key`` is one of its results."""
        key = self._look_through(key)
        owner = self.results_of.get(key) if key is not None else None
        return self.results_end[owner] if owner is not None else key

    # -- record kinds --

    def _assistant(
        self,
        uid: str,
        parent: str | None,
        side: bool,
        created: Any,
        message: dict[str, Any],
        record: dict[str, Any],
    ) -> None:
        message_id = as_str(message.get("id"))
        through = self._look_through(parent)
        group = self.group_of.get(through) if through else None
        if group is not None and message_id and group.metadata.get("message_id") == message_id:
            # Another block of the same API message: merge into it (a block written
            # twice is kept once).
            have = {p["id"] for p in group.parts if p.get("type") == "tool_call"}
            parts = _assistant_parts(message.get("content"), group, uid)
            group.parts.extend(
                p for p in parts if not (p.get("type") == "tool_call" and p["id"] in have)
            )
            group.metadata["source"]["records"].append(uid)
            for key, field in (("stop_reason", "stop_reason"), ("usage", "usage")):
                if message.get(field) is not None:
                    group.metadata[key] = message[field]
            self.aliases[uid] = group.key
            self.group_of[uid] = group
            return
        node = Node(
            uid, self._continue_below(parent), "assistant", [], order=self.order, created_at=created
        )
        node.parts = _assistant_parts(message.get("content"), node, uid)
        node.metadata = {"source": _source(uid, records=[uid])}
        if message_id:
            node.metadata["message_id"] = message_id
        for key, value in (
            ("model", message.get("model")),
            ("stop_reason", message.get("stop_reason")),
            ("usage", message.get("usage")),
            ("request_id", record.get("requestId")),
        ):
            if value is not None:
                node.metadata[key] = value
        if record.get("isApiErrorMessage"):
            node.metadata["api_error"] = True
        self.group_of[uid] = node
        self._append(node, side)

    def _user(
        self,
        uid: str,
        parent: str | None,
        side: bool,
        created: Any,
        message: dict[str, Any],
        record: dict[str, Any],
    ) -> None:
        content = message.get("content")
        blocks: list[Any] = (
            [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        )
        if not isinstance(blocks, list):
            blocks = [{"type": "text", "text": json_text(blocks)}]
        results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
        others = [b for b in blocks if not (isinstance(b, dict) and b.get("type") == "tool_result")]
        meta: dict[str, Any] = {"source": _source(uid)}
        if record.get("isMeta"):
            meta["meta"] = True
        if record.get("isCompactSummary"):
            meta["compact_summary"] = True
        # The last message made from a record keeps the record's id, so that children
        # naming it attach below everything the record became.
        chain: list[Node] = []
        parent = (
            self._link_results(uid, parent, results) if results else self._continue_below(parent)
        )
        if results:
            key = f"{uid}#results" if others else uid
            tool = Node(key, parent, "tool", [], order=self.order, created_at=created)
            tool.metadata = {"source": _source(uid)}
            agent = as_dict(record.get("toolUseResult")).get("agentId")
            if isinstance(agent, str) and agent:
                # A Task/Agent call's result: the sub-agent's own file is agent-<id>.jsonl.
                tool.metadata["agent_id"] = agent
            tool.parts = [_tool_result(b, tool) for b in results]
            chain.append(tool)
        if others or not results:
            node = Node(
                uid,
                chain[-1].key if chain else parent,
                "user",
                [],
                order=self.order,
                created_at=created,
            )
            node.metadata = meta
            node.parts = _user_parts(others, node)
            chain.append(node)
        for node in chain:
            self._append(node, side)

    def _boundary(
        self, uid: str, parent: str | None, side: bool, created: Any, record: dict[str, Any]
    ) -> None:
        logical = as_str(record.get("logicalParentUuid")) or None
        meta = as_dict(record.get("compactMetadata"))
        trigger = as_str(meta.get("trigger")) or "unknown"
        tokens = meta.get("preTokens")
        marker = {
            "format": FORMAT,
            "trigger": trigger,
            "tokens_before": tokens if isinstance(tokens, int) else None,
            "logical_parent": logical,
            "summary_follows": True,
        }
        detail = f"{trigger}, {tokens} tokens before" if tokens is not None else trigger
        node = Node(
            uid,
            self._continue_below(parent or logical),
            "system",
            [text_part(f"[Conversation compacted here ({detail}); the summary follows.]")],
            metadata={"source": _source(uid), "compaction_marker": marker},
            order=self.order,
            created_at=created,
        )
        self._append(node, side)

    def _link_results(self, uid: str, parent: str | None, results: list[Any]) -> str | None:
        """The parent of a record of tool results. Results answering calls of the
        assistant message above (new calls, not answered yet) join that message's
        chain of results; anything else (a result run again, one for a call not made
        there) stays where the file put it."""
        through = self._look_through(parent)
        owner_key = self.results_of.get(through, through) if through is not None else None
        owner = self.by_key.get(owner_key) if owner_key is not None else None
        if owner is None or owner.role != "assistant":
            return through
        calls = {p["id"] for p in owner.parts if p.get("type") == "tool_call"}
        ids = {as_str(b.get("tool_use_id")) for b in results}
        answered = self.answered.setdefault(owner.key, set())
        if not ids <= calls or ids & answered:
            return through
        answered |= ids
        below = self.results_end.get(owner.key, owner.key)
        self.results_end[owner.key] = uid
        self.results_of[uid] = owner.key
        return below

    # -- grouping --

    def _root_of(self, key: str, memo: dict[str, str]) -> str:
        """The sidechain root a sidechain node belongs to."""
        path: list[str] = []
        current = key
        while current not in memo:
            path.append(current)
            parent = self.by_key[current].parent
            parent = self.aliases.get(parent, parent) if parent else None
            if (
                parent is None
                or parent not in self.by_key
                or not self.sidechain.get(parent)
                or parent in path
            ):
                memo[current] = current
                break
            current = parent
        root = memo[current]
        for k in path:
            memo[k] = root
        return root

    def conversations(self) -> Iterator[SourceConversation]:
        if self.ignored:
            listed = ", ".join(
                f"{k} \N{MULTIPLICATION SIGN}{n}" for k, n in sorted(self.ignored.items())
            )
            self.report.skipped.add("not_a_message", "file", f"records without a uuid: {listed}")
        main = [n for n in self.nodes if not self.sidechain[n.key]]
        self._chain_in_file_order(main)
        side = self._sidechains()
        title = self._title(main)
        tasks = _task_calls(main)
        if main:
            report = ConversationReport(source_id=self.session_id)
            yield SourceConversation(
                source_id=self.session_id,
                title=title or preview_text(first_text(main)) or "Claude Code session",
                nodes=main,
                report=report,
                aliases=self.aliases,
                created_at=min((n.created_at for n in main if n.created_at), default=None),
            )
        for root_key, nodes in side.items():
            yield self._sub_agent(root_key, nodes, tasks)

    def _chain_in_file_order(self, main: list[Node]) -> None:
        """A file where no message names its parent (written by another tool) is one
        line of history, in file order."""
        messages = [n for n in main if n.skip is None]
        if len(messages) > 1 and all(n.parent is None for n in messages):
            for before, node in itertools.pairwise(messages):
                node.parent = before.key
            self.report.repaired.add(
                "file_order",
                "file",
                f"no record names its parent: the {len(messages)} messages are read in file order",
            )

    def _sidechains(self) -> dict[str, list[Node]]:
        """The sidechain nodes, grouped by the sidechain root each belongs to."""
        side: dict[str, list[Node]] = {}
        memo: dict[str, str] = {}
        for node in self.nodes:
            if self.sidechain[node.key]:
                side.setdefault(self._root_of(node.key, memo), []).append(node)
        return side

    def _title(self, main: list[Node]) -> str:
        """The first summary naming a message of the main conversation; summaries that
        name a message of another session (files copied from one another) are reported."""
        main_keys = {n.key for n in main} | {a for a, t in self.aliases.items() if t in self.by_key}
        used_summaries: set[str] = set()
        title = ""
        for leaf, summary in self.summaries.items():
            if leaf in main_keys and summary:
                title = title or summary
                used_summaries.add(leaf)
        # In file order, so a report reads the same every time (a set's order does not).
        for leaf in [k for k in self.summaries if k not in used_summaries]:
            self.report.skipped.add(
                "summary",
                f"summary for {leaf}",
                "it names a message that is not in this file (from another session): not used",
            )
        return title

    def _sub_agent(
        self, root_key: str, nodes: list[Node], tasks: dict[str, tuple[str, str]]
    ) -> SourceConversation:
        """One sidechain as its own conversation, titled after (and linked to) the Task
        call that started it when the main conversation holds it."""
        root = self.by_key[root_key]
        if root.parent is not None:
            root.metadata["branched_from"] = root.parent
            root.parent = None
        prompt = first_text([root]) if root.role == "user" else ""
        call = tasks.get(prompt.strip())
        spawned_by = None
        agent = self.agent_ids.get(root_key)
        if agent:
            # Claude Code ≥ 2.1: the main session's result of the call names it.
            spawned_by = f"agent:{agent}"
        if call is not None:
            root.metadata["sidechain"] = {"parent_tool_call": call[0]}
            title = f"Sub-agent: {call[1]}"
            spawned_by = call[0]
        else:
            title = f"Sub-agent: {preview_text(first_text(nodes))}"
        source_id = f"{self.session_id}:{root_key}" if self.session_id else root_key
        report = ConversationReport(source_id=source_id, sidechain_of=self.session_id)
        return SourceConversation(
            source_id=source_id,
            title=title,
            nodes=nodes,
            report=report,
            aliases=self.aliases,
            created_at=min((n.created_at for n in nodes if n.created_at), default=None),
            spawned_by_call=spawned_by,
        )


def _task_calls(nodes: list[Node]) -> dict[str, tuple[str, str]]:
    """Sub-agent prompts of the main conversation → (tool call id, description)."""
    out: dict[str, tuple[str, str]] = {}
    for node in nodes:
        for part in node.parts:
            if part.get("type") == "tool_call" and part.get("name") in TASK_TOOLS:
                args = part.get("arguments", {})
                prompt = as_str(args.get("prompt")).strip()
                if prompt:
                    description = as_str(args.get("description")) or preview_text(prompt)
                    out.setdefault(prompt, (part["id"], description))
    return out


def _assistant_parts(content: Any, node: Node, uid: str) -> list[Part]:
    def left_out(block: dict[str, Any]) -> None:
        kind = block.get("type")
        what = "redacted thinking" if kind == "redacted_thinking" else f"a {kind} block"
        node.note("content_dropped", f"record {uid}: {what} left out")

    return block_parts(
        content,
        {
            "text": nonempty_text,
            "thinking": lambda b: thinking_part(as_str(b.get("thinking")), b.get("signature")),
            "tool_use": lambda b: tool_call_part(b.get("id"), b.get("name"), b.get("input")),
        },
        left_out,
    )


def _user_parts(blocks: list[Any], node: Node) -> list[Part]:
    def left_out(block: dict[str, Any]) -> None:
        node.note("content_dropped", f"a {block.get('type')} block left out")

    return block_parts(
        blocks, {"text": nonempty_text, "image": lambda b: _image(b, node)}, left_out
    )


def _image(block: dict[str, Any], node: Node) -> Part:
    source = as_dict(block.get("source"))
    if source.get("type") == "base64":
        return b64_image(source.get("data"), source.get("media_type"), node, "image block")
    return url_image(source.get("url"), node, "image block")


def _tool_result(block: dict[str, Any], node: Node) -> Part:
    content = block.get("content")
    inner: list[Part] = []
    if isinstance(content, str):
        inner = [text_part(content)] if content else []
    elif isinstance(content, list):
        for item in content:
            if isinstance(item, dict) and item.get("type") == "text":
                inner.append(text_part(as_str(item.get("text"))))
            elif isinstance(item, dict) and item.get("type") == "image":
                inner.append(_image(item, node))
            elif item is not None:
                inner.append(text_part(json_text(item)))
    elif content is not None:
        inner = [text_part(json_text(content))]
    return tool_result_part(block.get("tool_use_id"), inner, is_error=block.get("is_error") is True)
