"""The shapes shared by the provider layer: requests, replies, usage and stream events.

Messages are Arbor's own ``{"role", "parts"}`` dicts (see conversations/parts.py); the
provider layer converts them to each protocol and back, so nothing above it sees a
provider's wire format.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

Part = dict[str, Any]
# Returns the bytes of the image blob with this sha256 (conversations.Blob storage).
LoadBlob = Callable[[str], bytes]

# Normalised finish reasons; the provider's own word is kept in Reply.raw_finish_reason.
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter", "other")


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call: a name, what it does, and a JSON schema for arguments."""

    name: str
    description: str
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )

    @classmethod
    def coerce(cls, value: ToolSpec | Mapping[str, Any]) -> ToolSpec:
        if isinstance(value, ToolSpec):
            return value
        return cls(
            name=str(value["name"]),
            description=str(value.get("description", "")),
            parameters=value.get("parameters") or {"type": "object", "properties": {}},
        )


@dataclass
class Usage:
    """Tokens the provider measured. ``input_tokens`` is the whole prompt, including any
    part served from a prompt cache (so it is comparable with an estimate of the prompt).
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        out = {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}
        if self.cache_read_tokens:
            out["cache_read_tokens"] = self.cache_read_tokens
        if self.cache_write_tokens:
            out["cache_write_tokens"] = self.cache_write_tokens
        return out


@dataclass
class Reply:
    """One assistant message from the model, as Arbor parts."""

    parts: list[Part]
    usage: Usage | None = None
    finish_reason: str = "stop"
    raw_finish_reason: str | None = None
    model: str | None = None
    response_id: str | None = None

    @property
    def text(self) -> str:
        return "".join(p["text"] for p in self.parts if p["type"] == "text")

    @property
    def tool_calls(self) -> list[Part]:
        return [p for p in self.parts if p["type"] == "tool_call"]

    def metadata(self) -> dict[str, Any]:
        """What DESIGN §2 keeps in Message.metadata: model, measured usage, finish reason."""
        out: dict[str, Any] = {"finish_reason": self.finish_reason}
        if self.model:
            out["model"] = self.model
        if self.usage is not None:
            out["usage"] = self.usage.as_dict()
        return out

    def message(self) -> dict[str, Any]:
        """The reply as an Arbor message dict, ready for turn_append."""
        return {"role": "assistant", "parts": self.parts, "metadata": self.metadata()}


@dataclass
class Request:
    """A model request in Arbor terms; the provider converts it to its protocol."""

    messages: Sequence[Mapping[str, Any]]
    system: str = ""
    tools: Sequence[ToolSpec | Mapping[str, Any]] = ()
    # Defaults to the model's max_output from the registry.
    max_output: int | None = None
    temperature: float | None = None
    # "none": the tools are defined (the history may hold calls) but none may be called.
    tool_choice: str | None = None


# --- stream events --------------------------------------------------------------------


@dataclass(frozen=True)
class TextDelta:
    type: ClassVar[str] = "text_delta"
    text: str


@dataclass(frozen=True)
class ThinkingDelta:
    type: ClassVar[str] = "thinking_delta"
    text: str


@dataclass(frozen=True)
class ToolCallStarted:
    """The model began a tool call; its arguments are still arriving."""

    type: ClassVar[str] = "tool_call_started"
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallFinished:
    """A tool call is complete; ``part`` is the Arbor tool_call part."""

    type: ClassVar[str] = "tool_call_finished"
    index: int
    part: Part


@dataclass(frozen=True)
class Done:
    """The last event of every successful stream: the whole reply, with usage."""

    type: ClassVar[str] = "done"
    reply: Reply


StreamEvent = TextDelta | ThinkingDelta | ToolCallStarted | ToolCallFinished | Done
