"""Tools the model may call during a turn. Each takes a context and its JSON arguments
and returns text; an exception becomes an ``is_error`` tool result, never a crash."""

from __future__ import annotations

import ast
import json
import operator
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from conversations.models import Conversation, Message
from conversations.providers.base import ToolSpec


class ToolFailed(Exception):
    """The tool ran and failed in a way the model should be told about."""


@dataclass(frozen=True)
class ToolContext:
    conversation: Conversation


@dataclass(frozen=True)
class Tool:
    spec: ToolSpec
    run: Callable[[ToolContext, dict[str, Any]], str]


def _now(ctx: ToolContext, args: dict[str, Any]) -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> float | int:
    # A whitelist walk over the expression tree: never eval(), and exponents are capped
    # so "9**9**9" cannot pin a worker.
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        if isinstance(node.value, bool):
            raise ToolFailed("booleans are not numbers here")
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 100 or abs(left) > 1e6):
            raise ToolFailed("exponent too large")
        result: float | int = _BINARY[type(node.op)](left, right)
        return result
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value: float | int = _UNARY[type(node.op)](_evaluate(node.operand))
        return value
    raise ToolFailed(f"unsupported expression element: {type(node).__name__}")


def _calculator(ctx: ToolContext, args: dict[str, Any]) -> str:
    expression = args.get("expression")
    if not isinstance(expression, str) or len(expression) > 500:
        raise ToolFailed("expression must be a string of at most 500 characters")
    try:
        value = _evaluate(ast.parse(expression, mode="eval"))
    except SyntaxError:
        raise ToolFailed(f"not an arithmetic expression: {expression!r}") from None
    except ZeroDivisionError:
        raise ToolFailed("division by zero") from None
    except OverflowError:  # e.g. 999999**100*1.0: an int too large for a float
        raise ToolFailed("the result is too large") from None
    try:
        return str(value)
    except ValueError:  # more digits than Python converts to text
        raise ToolFailed("the result is too large to write out") from None


# A recall id as a snapshot page header shows it: the last 12 hex digits of a message id.
_RECALL_ID = re.compile(r"^[0-9a-f]{12}$")


def _recall(ctx: ToolContext, args: dict[str, Any]) -> str:
    """The full original of a message, e.g. a tool result that compaction elided: by
    its full id, or by the recall id a snapshot page header shows (its last 12 hex
    digits, unique within the conversation)."""
    given = str(args.get("message_id") or "").strip().lower()
    try:
        if _RECALL_ID.match(given):
            message = Message.objects.get(conversation=ctx.conversation, id__endswith=given)
        else:
            message = Message.objects.get(
                pk=uuid.UUID(given), conversation__owner_id=ctx.conversation.owner_id
            )
    except (ValueError, Message.DoesNotExist, Message.MultipleObjectsReturned):
        raise ToolFailed(f"no such message: {args.get('message_id')!r}") from None
    return json.dumps(
        {"id": str(message.id), "role": message.role, "parts": message.parts},
        ensure_ascii=False,
    )


TOOLS: dict[str, Tool] = {
    tool.spec.name: tool
    for tool in (
        Tool(ToolSpec("current_time", "The current date and time in UTC (ISO 8601)."), _now),
        Tool(
            ToolSpec(
                "calculator",
                "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
                {
                    "type": "object",
                    "properties": {"expression": {"type": "string"}},
                    "required": ["expression"],
                },
            ),
            _calculator,
        ),
        Tool(
            ToolSpec(
                "recall",
                "Fetch the full original of an earlier message by its id, for example a "
                "tool result shown as '[elided tool result <id>: N chars]', or by the "
                "12-character id a snapshot page shows in a message's header.",
                {
                    "type": "object",
                    "properties": {"message_id": {"type": "string"}},
                    "required": ["message_id"],
                },
            ),
            _recall,
        ),
    )
}


def run_tool(name: str, arguments: dict[str, Any], ctx: ToolContext) -> tuple[str, bool]:
    """Run a tool; returns (text, is_error). Unknown tools and failures are errors the
    model is told about."""
    tool = TOOLS.get(name)
    if tool is None:
        return f"unknown tool {name!r}; available: {', '.join(sorted(TOOLS))}", True
    try:
        return tool.run(ctx, arguments if isinstance(arguments, dict) else {}), False
    except ToolFailed as exc:
        return str(exc), True


# The model's own checkpoint and rewind (DESIGN.md invariant 6): the turn engine answers
# these itself (they move the tree), so they are specs without a handler here.
CHECKPOINT_SPEC = ToolSpec(
    "checkpoint",
    "Label the clean turn boundary where the current turn started, so you can come back "
    "to it with rewind after exploring. Labels are unique among live checkpoints.",
    {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"]},
)
REWIND_SPEC = ToolSpec(
    "rewind",
    "Return to a checkpoint, leaving a digest of what you learned while exploring. The "
    "exploration stays in the conversation's tree but leaves your context; afterwards you "
    "see everything up to the checkpoint, then your digest.",
    {
        "type": "object",
        "properties": {"label": {"type": "string"}, "digest": {"type": "string"}},
        "required": ["label", "digest"],
    },
)


def tools_for(conversation: Conversation) -> list[ToolSpec]:
    """The tools a conversation's turns offer the model (the context API sends the
    same: a history holding tool calls needs their definitions)."""
    specs = [tool.spec for tool in TOOLS.values()]
    if conversation.checkpoint_tools:
        specs += [CHECKPOINT_SPEC, REWIND_SPEC]
    return specs
