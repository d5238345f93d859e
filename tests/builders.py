"""A tiny tree builder, so a test can say "a>b>c, b>d" in one line."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import uuid
from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.utils import timezone

from conversations import services
from conversations.models import Conversation, Message


def make_user(username: str = "alice", *, staff: bool = False, password: str = "pw") -> Any:
    return get_user_model().objects.create_user(
        username=username, password=password, is_staff=staff
    )


def text(value: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": value}]


def build_tree(
    conversation: Conversation,
    spec: str,
    *,
    tip: str | None = None,
    nodes: dict[str, Message] | None = None,
) -> dict[str, Message]:
    """Build messages from edges like ``"a>b>c, b>d"``: each name becomes a message whose
    text is its name; a name's parent is the name before ``>`` (roots stand first).
    Roles alternate user/assistant by depth. The tip ends on ``tip`` (default: the last
    message created). Pass ``nodes`` from an earlier call to grow the same tree."""
    nodes = dict(nodes or {})
    for chain in spec.split(","):
        names = [n.strip() for n in chain.split(">") if n.strip()]
        parent: str | None = None
        for name in names:
            if name not in nodes:
                conversation.refresh_from_db(fields=["version", "tip"])
                depth = nodes[parent].depth + 1 if parent else 0
                result = services.turn_append(
                    conversation=conversation,
                    parent_id=nodes[parent].id if parent else None,
                    expected_version=conversation.version,
                    messages=[
                        {"role": "user" if depth % 2 == 0 else "assistant", "parts": text(name)}
                    ],
                )
                nodes[name] = Message.objects.get(pk=result.tip)
            parent = name
    if tip is not None:
        conversation.refresh_from_db(fields=["version", "tip"])
        services.tip_move(
            conversation=conversation,
            message_id=nodes[tip].id,
            expected_version=conversation.version,
        )
    conversation.refresh_from_db()
    return nodes


def new_conversation(
    owner: User, spec: str = "", **kwargs: Any
) -> tuple[Conversation, dict[str, Message]]:
    conv = services.conversation_create(owner=owner, title=kwargs.pop("title", "test"))
    nodes = build_tree(conv, spec, **kwargs) if spec else {}
    return conv, nodes


def grow(
    conv: Conversation, turns: int, *, result_chars: int = 720, start: int = 0, error: bool = False
) -> None:
    """Append agent turns that each read a long, uneventful tool result."""
    for i in range(start, start + turns):
        conv.refresh_from_db()
        services.turn_append(
            conversation=conv,
            parent_id=conv.tip_id,
            expected_version=conv.version,
            messages=[
                {"role": "user", "parts": text(f"step {i}: read the log")},
                {
                    "role": "assistant",
                    "parts": [
                        {"type": "tool_call", "id": f"c{i}", "name": "read", "arguments": {}}
                    ],
                },
                {
                    "role": "tool",
                    "parts": [
                        {
                            "type": "tool_result",
                            "call_id": f"c{i}",
                            "is_error": error,
                            "parts": text("log line ok\n" * (result_chars // 12)),
                        }
                    ],
                },
                {"role": "assistant", "parts": text(f"step {i} done")},
            ],
        )
    conv.refresh_from_db()


def tool_turn(
    prompt: str, *, call_id: str = "c1", name: str = "t", result: str = "", answer: str = "done"
) -> list[dict[str, Any]]:
    """One complete agent turn: prompt, a tool call, its result, the final answer."""
    return [
        {"role": "user", "parts": text(prompt)},
        {
            "role": "assistant",
            "parts": [{"type": "tool_call", "id": call_id, "name": name, "arguments": {}}],
        },
        {
            "role": "tool",
            "parts": [
                {
                    "type": "tool_result",
                    "call_id": call_id,
                    "parts": text(result) if result else [],
                }
            ],
        },
        {"role": "assistant", "parts": text(answer)},
    ]


def bulk_tree(owner: User, parents: list[int | None], *, title: str, tip: int = -1) -> Conversation:
    """A conversation whose message i has parent ``parents[i]`` (an earlier index), written
    straight to the table: this is setup, not the code under test."""
    conv = Conversation.objects.create(owner=owner, title=title)
    start = timezone.now() - timedelta(days=1)
    ids = [uuid.uuid4() for _ in parents]
    depth: list[int] = []
    rows: list[Message] = []
    for i, p in enumerate(parents):
        depth.append(0 if p is None else depth[p] + 1)
        rows.append(
            Message(
                id=ids[i],
                conversation=conv,
                parent_id=None if p is None else ids[p],
                role="user" if depth[i] % 2 == 0 else "assistant",
                parts=text(f"message {i} " + "x" * 90),
                depth=depth[i],
                created_at=start + timedelta(microseconds=i),
            )
        )
    Message.objects.bulk_create(rows, batch_size=500)
    Conversation.objects.filter(pk=conv.pk).update(tip_id=ids[tip], version=1)
    conv.refresh_from_db()
    return conv


def comb(size: int) -> list[int | None]:
    """A spine of about size/2 messages, each with a one-message branch beside it."""
    parents: list[int | None] = [None]
    last = 0
    while len(parents) + 2 <= size:
        parents.append(last)  # the branch off the spine, created first
        parents.append(last)
        last = len(parents) - 1
    return parents + [last] * (size - len(parents))


def bushy(size: int, seed: int = 5) -> list[int | None]:
    """A random recursive tree: each message answers a random earlier one."""
    rng = random.Random(seed)
    return [None] + [rng.randrange(i) for i in range(1, size)]


def snapshot_page_blobs(conv: Conversation) -> set[str]:
    """The blobs of every snapshot page in the conversation's compaction records."""
    from compaction.models import CompactionRecord

    return {
        p["blob"]
        for r in CompactionRecord.objects.filter(conversation=conv)
        for m in r.view
        for p in m["parts"]
        if "snapshot_page" in p
    }


def calls_and_answers(path: list[Message]) -> list[tuple[list[str], list[str]]]:
    """For each message of a path that makes tool calls: its call ids, and the ids the
    run of tool messages right below it answers (both sorted). On a transcript a model
    may be sent, the two are equal for every message."""
    out: list[tuple[list[str], list[str]]] = []
    for index, message in enumerate(path):
        made = [p["id"] for p in message.parts if p["type"] == "tool_call"]
        if not made:
            continue
        run: list[str] = []
        for below in path[index + 1 :]:
            if below.role != "tool":
                break
            run.extend(p["call_id"] for p in below.parts if p["type"] == "tool_result")
        out.append((sorted(made), sorted(run)))
    return out


def gone_process() -> str:
    """The identity (arbor.procs) of a process of this host that has exited."""
    done = subprocess.Popen(["true"])
    done.wait()
    return f"{socket.gethostname()}:{done.pid}:1"


def openwebui_chat(turns: int = 6) -> bytes:
    """One Open WebUI chat as its "Export chat (.json)" writes it (a single document,
    shaped after a real export): a message tree keyed by id, the current one named."""
    messages: dict[str, Any] = {}
    parent = None
    for i in range(turns):
        key = f"00000000-0000-4000-8000-{i:012d}"
        role = "user" if i % 2 == 0 else "assistant"
        text = (
            f"Question {i}: what did the ruling say?"
            if role == "user"
            else (f"Answer {i}: the principle is named after a 1964 controversy. " * 8)
        )
        messages[key] = {
            "id": key,
            "parentId": parent,
            "childrenIds": [],
            "role": role,
            "content": text,
            "timestamp": 1744577557 + i,
            "models": ["demo/model"],
        }
        if parent is not None:
            messages[parent]["childrenIds"].append(key)
        parent = key
    chat = {
        "id": "",
        "title": "A made-up chat",
        "models": ["demo/model"],
        "params": {},
        "history": {"messages": messages, "currentId": parent},
        "messages": list(messages.values()),
        "tags": [],
        "timestamp": 1744577557,
        "files": [],
    }
    return json.dumps(chat, indent=4).encode()
