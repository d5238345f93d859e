"""A loopback OpenAI Responses API server for the Codex CLI, and the runs that make real
Codex rollout files with it.

``codex exec`` (``@openai/codex`` from the npm registry, installed by ``make harness``)
runs fully offline when ``$HOME/.codex/config.toml`` names a model provider whose
``base_url`` is this server and whose ``wire_api`` is ``responses``. The server answers
``POST /v1/responses`` with the SSE stream the real service sends (``response.created``,
``response.output_item.added``, ``response.output_text.delta``,
``response.output_item.done``, ``response.completed``) and ``GET /v1/models`` with an
empty list. A responder scripts the agent from what the request holds:

- no tool output yet: a reasoning item (a summary and opaque ``encrypted_content``),
  then two ``exec_command`` calls at once (Codex sends ``parallel_tool_calls: true``);
- both outputs in: the final answer;
- the second turn (``codex exec resume --last``, which appends to the same rollout): a
  short answer;
- a compaction request (Codex's summarisation prompt as the last user message, sent
  when the reported usage crosses ``model_auto_compact_token_limit``): a summary.

The rollout files committed under tests/data/codex were made with:

    .venv/bin/python -m tests.codex_server tests/data/codex

The scripted commands are plain ``echo`` commands, so the files hold nothing of the
machine but the temporary home directory's path and the CLI's own instructions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from conversations.gateway import responses

ROOT = Path(__file__).resolve().parents[1]
HARNESS_DIR = Path(os.environ.get("ARBOR_HARNESS_DIR", ROOT / "var" / "harness"))
MODEL = "loopback-codex"
PROMPT = "Check the greek letters alpha and beta, both at once."
WORDS = ("alpha", "beta")
REASONING = "Two independent echo commands: run them in parallel."
FINAL = "Both letters answered."
RESUME_PROMPT = "And once more, briefly."
RESUMED = "Still alpha and beta."
SUMMARY = "Summary so far: the user asked to check alpha and beta; both echo commands ran."
# Codex's own compaction prompt starts like this (codex-rs core/templates/compact).
COMPACT_HINT = "CONTEXT CHECKPOINT COMPACTION"

Event = dict[str, Any]
Item = dict[str, Any]
Responder = Callable[[Mapping[str, Any]], list[Item]]


def binary() -> Path:
    return HARNESS_DIR / "node_modules" / ".bin" / "codex"


# --- the scripted agent ---------------------------------------------------------------


def message_item(text: str, item_id: str) -> Item:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _last_user_text(body: Mapping[str, Any]) -> str:
    for item in reversed(body.get("input") or []):
        if item.get("type") == "message" and item.get("role") == "user":
            return " ".join(
                c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict)
            )
    return ""


def parallel_responder(body: Mapping[str, Any]) -> list[Item]:
    """The next answer for a request, from the tool outputs already in it."""
    items = body.get("input") or []
    last = _last_user_text(body)
    if COMPACT_HINT in last:
        return [message_item(SUMMARY, "msg_summary")]
    if RESUME_PROMPT in last:
        return [message_item(RESUMED, "msg_resumed")]
    answered = sum(1 for i in items if i.get("type") == "function_call_output")
    # After a compaction the calls are gone from the history; the summary says they ran.
    if answered >= len(WORDS) or SUMMARY in json.dumps(items):
        return [message_item(FINAL, "msg_final")]
    reasoning: Item = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": REASONING}],
        # Opaque to Codex; it stores and sends it back as is.
        "encrypted_content": "gAAAAB-loopback-opaque-reasoning",
    }
    calls: list[Item] = [
        {
            "type": "function_call",
            "id": f"fc_{word}",
            "call_id": f"call_{word}",
            "name": "exec_command",
            "arguments": json.dumps({"cmd": f"echo letter {word}"}),
            "status": "completed",
        }
        for word in WORDS
    ]
    return [reasoning, *calls]


def stream_events(response_id: str, items: list[Item], usage: Mapping[str, int]) -> list[Event]:
    """The SSE events of one streamed response that outputs ``items`` (the gateway's own
    Responses stream, conversations/gateway/responses.py)."""
    response = {
        "id": response_id,
        "object": "response",
        "status": "completed",
        "output": items,
        "usage": {
            "input_tokens": usage["input_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["output_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["input_tokens"] + usage["output_tokens"],
        },
    }
    return responses.stream_events(response)


# --- the server -----------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: CodexServer


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log is the record

    def do_GET(self) -> None:
        path = urlsplit(self.path).path.rstrip("/")
        if path.endswith("/models"):
            self._json(200, {"object": "list", "data": [], "models": []})
        else:
            self._json(404, {"error": {"message": f"no route GET {path}"}})

    def do_POST(self) -> None:
        path = urlsplit(self.path).path.rstrip("/")
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            body = None
        if not path.endswith("/responses") or not isinstance(body, dict):
            self._json(404, {"error": {"message": f"no route POST {path}"}})
            return
        events = self.server.owner._answer(path, body)
        data = responses.sse(events)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        # The end of the stream is the end of the connection.
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True
        self.wfile.write(data)
        self.wfile.flush()

    def _json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class CodexServer:
    """``with CodexServer() as server:`` then point Codex at ``server.base_url``.

    ``call_tokens`` is the input usage reported for a response that makes tool calls
    (others report 1,000): above Codex's ``model_auto_compact_token_limit`` it makes
    Codex compact before it sends the results back. After ``max_requests`` requests
    every answer is the final one, so a CLI that keeps asking still ends."""

    def __init__(
        self,
        *,
        responder: Responder = parallel_responder,
        call_tokens: int = 1000,
        max_requests: int = 12,
    ) -> None:
        self.responder = responder
        self.call_tokens = call_tokens
        self.max_requests = max_requests
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> CodexServer:
        server = _Server(("127.0.0.1", 0), _Handler)
        server.owner = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> CodexServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("the server is not running; call start()")
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def _answer(self, path: str, body: dict[str, Any]) -> list[Event]:
        with self._lock:
            self.requests.append({"path": path, "body": body})
            number = len(self.requests)
        if number > self.max_requests:
            items = [message_item(FINAL, f"msg_final_{number}")]
        else:
            items = self.responder(body)
        calls = any(i["type"] == "function_call" for i in items)
        usage = {"input_tokens": self.call_tokens if calls else 1000, "output_tokens": 20}
        return stream_events(f"resp_{number}", items, usage)


# --- running Codex --------------------------------------------------------------------


def write_config(home: Path, base_url: str, *, compact_limit: int | None = None) -> None:
    """``$HOME/.codex/config.toml`` for a loopback provider; nothing else reaches out."""
    lines = [
        f'model = "{MODEL}"',
        'model_provider = "loopback"',
        "check_for_update_on_startup = false",
    ]
    if compact_limit is not None:
        lines.append(f"model_auto_compact_token_limit = {compact_limit}")
    lines += [
        "",
        "[analytics]",
        "enabled = false",
        "",
        # Plugin and app sync would look up github.com and chatgpt.com.
        "[features]",
        "plugins = false",
        "remote_plugin = false",
        "apps = false",
        "",
        "[model_providers.loopback]",
        'name = "loopback"',
        f'base_url = "{base_url}"',
        'wire_api = "responses"',
        'env_key = "LOOPBACK_API_KEY"',
        "",
    ]
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text("\n".join(lines))


def _run(home: Path, arguments: list[str], expected: str) -> None:
    command = [
        str(binary()),
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        *arguments,
    ]
    done = subprocess.run(
        command,
        env={**os.environ, "HOME": str(home), "LOOPBACK_API_KEY": "x"},
        cwd=home / "work",
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0 or expected not in done.stdout:
        raise RuntimeError(
            f"codex failed ({done.returncode}): {done.stdout[-500:]} {done.stderr[-2000:]}"
        )


def codex_session(
    home: Path, base_url: str, *, compact_limit: int | None = None, resume: bool = False
) -> Path:
    """Run ``codex exec`` once in ``home`` (and ``codex exec resume --last`` after it when
    ``resume``); the path of the rollout file it wrote."""
    write_config(home, base_url, compact_limit=compact_limit)
    (home / "work").mkdir(exist_ok=True)
    _run(home, [PROMPT], FINAL)
    if resume:
        _run(home, ["resume", "--last", RESUME_PROMPT], RESUMED)
    (found,) = (home / ".codex" / "sessions").rglob("rollout-*.jsonl")
    return found


def generate(out: Path) -> dict[str, Path]:
    """Write ``codex-parallel.jsonl`` (two turns: the parallel calls, then a resumed
    turn) and ``codex-compacted.jsonl`` (one turn, compacted mid-way) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path] = {}
    # The compacted run reports more tokens than its limit, so Codex compacts after the
    # calls and before it asks for the final answer.
    for name, tokens, limit, resume in (
        ("codex-parallel", 1000, None, True),
        ("codex-compacted", 50_000, 20_000, False),
    ):
        home = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        try:
            with CodexServer(call_tokens=tokens) as server:
                found = codex_session(home, server.base_url, compact_limit=limit, resume=resume)
            made[name] = out / f"{name}.jsonl"
            shutil.copyfile(found, made[name])
        finally:
            shutil.rmtree(home, ignore_errors=True)
    return made


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1])).values():
        print(path)
