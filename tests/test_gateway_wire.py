"""The gateway's pure parts: what identifies a wire message, how a request's prefix is
keyed, how the compacted prefix gets its cache breakpoint, and the cache-pricing model
the benchmark bills with."""

from __future__ import annotations

import copy
from typing import Any

from django.test import SimpleTestCase

from conversations.gateway import wire
from conversations.gateway.cache_model import PromptCache, session_bill
from conversations.gateway.views import MAX_BREAKPOINTS, _cache_breakpoint, _count_breakpoints

CALL = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"a": 1, "b": [2, 3]}}


class DigestTests(SimpleTestCase):
    def test_what_does_not_change_meaning_does_not_change_the_digest(self) -> None:
        plain = {"role": "user", "content": "hello"}
        blocks = {
            "role": "user",
            "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}],
        }
        self.assertEqual(wire.anthropic_digest(plain), wire.anthropic_digest(blocks))
        reordered = {**CALL, "input": {"b": [2, 3], "a": 1}}
        thinking = {"type": "thinking", "thinking": "hmm", "signature": "sig"}
        self.assertEqual(
            wire.anthropic_digest({"role": "assistant", "content": [thinking, CALL]}),
            wire.anthropic_digest({"role": "assistant", "content": [reordered]}),
        )

    def test_what_is_said_changes_it(self) -> None:
        base = wire.anthropic_digest({"role": "user", "content": "hello"})
        self.assertNotEqual(base, wire.anthropic_digest({"role": "user", "content": "hello!"}))
        self.assertNotEqual(base, wire.anthropic_digest({"role": "assistant", "content": "hello"}))
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
        failed = {**result, "is_error": True}
        self.assertNotEqual(
            wire.anthropic_digest({"role": "user", "content": [result]}),
            wire.anthropic_digest({"role": "user", "content": [failed]}),
        )

    def test_chain_keys_name_prefixes(self) -> None:
        a, b, c = (wire.anthropic_digest({"role": "user", "content": t}) for t in "abc")
        self.assertEqual(wire.chain_keys([a, b])[:2], wire.chain_keys([a, b, c])[:2])
        self.assertNotEqual(wire.chain_keys([a, b])[1], wire.chain_keys([b, a])[1])
        self.assertNotEqual(wire.chain_keys([a, c])[1], wire.chain_keys([a, b])[1])

    def test_a_user_message_with_results_becomes_a_tool_and_a_user_message(self) -> None:
        drafts = wire.anthropic_drafts(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "out"}],
                    },
                    {"type": "text", "text": "and then?"},
                ],
            }
        )
        self.assertEqual([d["role"] for d in drafts], ["tool", "user"])
        self.assertEqual(drafts[0]["parts"][0]["call_id"], "toolu_1")
        self.assertEqual(drafts[1]["parts"], [{"type": "text", "text": "and then?"}])

    def test_bad_wire_is_refused(self) -> None:
        for message in (
            {"role": "robot", "content": "x"},
            {"role": "user", "content": 5},
            {"role": "user", "content": [{"text": "no type"}]},
            {
                "role": "user",
                "content": [{"type": "image", "source": {"type": "base64", "data": "@@"}}],
            },
        ):
            with self.assertRaises(wire.WireError):
                wire.anthropic_drafts(message)

    def test_openai_messages(self) -> None:
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "f", "arguments": '{"x": 1}'},
        }
        spaced = {**call, "function": {"name": "f", "arguments": '{ "x" : 1 }'}}
        self.assertEqual(
            wire.openai_digest({"role": "assistant", "content": None, "tool_calls": [call]}),
            wire.openai_digest({"role": "assistant", "content": "", "tool_calls": [spaced]}),
        )
        system, rest = wire.openai_split_system(
            [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        )
        self.assertEqual((system, len(rest)), ("S", 1))
        (tool,) = wire.openai_drafts({"role": "tool", "tool_call_id": "call_1", "content": "r"})
        self.assertEqual(tool["parts"][0]["call_id"], "call_1")


def _message(text: str, *, mark: bool = False) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": text}
    if mark:
        block["cache_control"] = {"type": "ephemeral"}
    return {"role": "user", "content": [block]}


class BreakpointTests(SimpleTestCase):
    def test_the_prefix_end_is_marked_within_the_limit_of_four(self) -> None:
        body = {
            "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "t", "cache_control": {"type": "ephemeral"}}],
        }
        messages = [
            _message("head"),
            _message("page"),
            _message("a", mark=True),
            _message("b", mark=True),
            _message("c"),
        ]
        out = _cache_breakpoint(body, messages, 1)
        self.assertIn("cache_control", out[1]["content"][-1])
        total = _count_breakpoints(body["system"]) + _count_breakpoints(body["tools"])
        self.assertLessEqual(total + _count_breakpoints(out), MAX_BREAKPOINTS)
        self.assertEqual(messages[1], _message("page"))  # the caller's list is not changed
        self.assertIn("cache_control", out[3]["content"][-1])  # the newest client mark stays

    def test_nothing_to_mark(self) -> None:
        messages = [_message("a")]
        self.assertEqual(_cache_breakpoint({}, messages, None), messages)


class CacheModelTests(SimpleTestCase):
    def body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        marked = copy.deepcopy(messages)
        marked[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        return {"system": [{"type": "text", "text": "system " * 50}], "messages": marked}

    def test_a_growing_conversation_reads_what_it_wrote(self) -> None:
        cache = PromptCache()
        history = [_message("first " * 100)]
        first = cache.bill(self.body(history))
        self.assertEqual((first.read, first.uncached), (0, 0))
        history.append(_message("second " * 100))
        second = cache.bill(self.body(history))
        self.assertEqual(second.read, first.written)
        self.assertGreater(second.written, 0)

    def test_only_a_prefix_ending_at_a_breakpoint_is_read_back(self) -> None:
        # The same long prefix each time, then a new last message: without a breakpoint
        # of its own the prefix is never a cache entry (entries are made at breakpoints).
        unmarked = [self.body([_message("x " * 400), _message(f"n{i}")]) for i in range(5)]
        marked = [self.body([_message("x " * 400, mark=True), _message(f"n{i}")]) for i in range(5)]
        self.assertEqual(session_bill(unmarked).read, 0)
        self.assertGreater(session_bill(marked).read, 0)
        self.assertLess(session_bill(marked).billed, session_bill(unmarked).billed / 3)
