"""The content-block readers the Claude Code and pi importers share (importers.base
block_parts): each format's dialect, what is kept, what is left out and noted."""

from __future__ import annotations

from conversations.importers import claude_code, pi
from conversations.importers.base import Node


def node() -> Node:
    return Node(key="k", parent=None, role="assistant", parts=[])


def test_claude_code_assistant_blocks() -> None:
    n = node()
    parts = claude_code._assistant_parts(
        [
            {"type": "text", "text": ""},
            {"type": "text", "text": "Let me look."},
            {"type": "thinking", "thinking": "hmm", "signature": "sig"},
            {"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "a.py"}},
            {"type": "redacted_thinking", "data": "xx"},
            {"type": "server_tool_use"},
            "not a block",
        ],
        n,
        "u1",
    )
    assert [p["type"] for p in parts] == ["text", "thinking", "tool_call"]
    assert parts[1]["signature"] == "sig" and parts[2]["arguments"] == {"path": "a.py"}
    assert [detail for _, _, detail in n.notes] == [
        "record u1: redacted thinking left out",
        "record u1: a server_tool_use block left out",
    ]
    assert claude_code._assistant_parts("plain", node(), "u") == [{"type": "text", "text": "plain"}]
    assert claude_code._assistant_parts("", node(), "u") == []


def test_pi_user_blocks_keep_empty_text_and_unknown_blocks_as_json() -> None:
    n = node()
    parts = pi._user_content([{"type": "text", "text": ""}, {"type": "audio", "x": 1}], n)
    assert parts[0] == {"type": "text", "text": ""}
    assert parts[1]["type"] == "text" and '"audio"' in parts[1]["text"]
    assert n.notes == []


def test_pi_assistant_blocks() -> None:
    n = node()
    parts = pi._assistant_content(
        [
            {"type": "text", "text": "ok"},
            {"type": "thinking", "thinking": "t", "thinkingSignature": ""},
            {"type": "toolCall", "id": "c", "name": "bash", "arguments": {"cmd": "ls"}},
            {"type": "image", "data": "", "mimeType": "image/png"},
        ],
        n,
    )
    assert [p["type"] for p in parts] == ["text", "thinking", "tool_call"]
    assert "signature" not in parts[1]
    assert [detail for _, _, detail in n.notes] == ["a image block left out"]
