"""Real session files written by the real harnesses (Claude Code and pi from the npm
registry, installed by `make harness` into var/harness), run in print mode against a
loopback Anthropic-compatible server (conversations.providers.fake) that scripts an
agent making parallel tool calls: two ``tool_use`` blocks in one answer, then three,
then a final answer. Claude Code also runs a PreToolUse and a PostToolUse hook, so its
file has hook records between the records of one answer and its results.

The importer tests run this live (a fresh file from today's CLI) and read the copies
committed under tests/data/sessions, made with:

    SECRET_KEY=x .venv/bin/python -m tests.harness_sessions tests/data/sessions

The scripted calls are plain ``echo`` commands, so the files hold nothing from the
machine but the temporary home directory's path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HARNESS_DIR = Path(os.environ.get("ARBOR_HARNESS_DIR", ROOT / "var" / "harness"))
MODEL = "claude-sonnet-4-5"
PROMPT = "Check the greek letters, two and three at a time."
# The answers, one per request that offers a tool: calls made at once in one answer.
ROUNDS: tuple[tuple[str, ...], ...] = (("alpha", "beta"), ("gamma", "delta", "epsilon"))
FINAL = "All five letters answered."


def binary(name: str) -> Path:
    return HARNESS_DIR / "node_modules" / ".bin" / name


def parallel_responder() -> Any:
    """Round n (counted from the tool results already in the request) answers with the
    calls of ROUNDS[n] at once, then the final answer. Side requests (no tools: titles,
    summaries) get a short reply."""
    from conversations.providers.fake import Step

    def respond(protocol: str, body: Mapping[str, Any]) -> Step | None:
        tools = body.get("tools") or []
        names = [t.get("name") or (t.get("function") or {}).get("name") for t in tools]
        tool = next((n for n in ("Bash", "bash") if n in names), None)
        if tool is None:
            return Step.reply("A short answer for a side request.")
        answered = sum(_results(m) for m in body.get("messages") or [])
        done, index = 0, 0
        while index < len(ROUNDS) and done + len(ROUNDS[index]) <= answered:
            done += len(ROUNDS[index])
            index += 1
        if index >= len(ROUNDS):
            return Step.reply(FINAL)
        calls = []
        for word in ROUNDS[index]:
            arguments: dict[str, Any] = {"command": f"echo letter {word}"}
            if tool == "Bash":
                arguments["description"] = f"print {word}"
            calls.append({"name": tool, "arguments": arguments})
        text = "I'll run these at once." if index == 0 else ""
        return Step.tools(*calls, text=text)

    return respond


SUBAGENT_PROMPT = "SUBTASK: print the letter sub"
SUBAGENT_FINAL = "The sub-agent printed: letter sub."


def subagent_responder() -> Any:
    """The main agent starts a sub-agent (Claude Code's Agent tool); the sub-agent runs
    one Bash call and answers; the main agent then finishes."""
    from conversations.providers.fake import Step

    def respond(protocol: str, body: Mapping[str, Any]) -> Step | None:
        names = [t.get("name") for t in body.get("tools") or []]
        messages = body.get("messages") or []
        if not names or not messages:
            return Step.reply("A short answer for a side request.")
        if SUBAGENT_PROMPT in json.dumps(messages[0]):
            if sum(_results(m) for m in messages):
                return Step.reply(SUBAGENT_FINAL)
            call = {"command": "echo letter sub", "description": "print sub"}
            return Step.tools({"name": "Bash", "arguments": call})
        if SUBAGENT_FINAL in json.dumps(messages):
            return Step.reply(FINAL)
        tool = "Agent" if "Agent" in names else "Task"
        task = {
            "description": "print a letter",
            "prompt": SUBAGENT_PROMPT,
            "subagent_type": "general-purpose",
        }
        return Step.tools({"name": tool, "arguments": task})

    return respond


def claude_subagent_project(home: Path, base_url: str, api_key: str = "x") -> Path:
    """Run Claude Code once with a sub-agent; the project folder it wrote (the session
    file and ``<session>/subagents/agent-<id>.jsonl`` with its meta file)."""
    command = [
        str(binary("claude")), "-p", "Delegate the letter to a sub-agent.",
        "--allowedTools", "Bash,Agent,Task", "--model", MODEL,
    ]  # fmt: skip
    env = {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    _run(command, home, env)
    (project,) = (home / ".claude" / "projects").iterdir()
    return project


def _results(message: Mapping[str, Any]) -> int:
    """Tool results in one wire message (Anthropic blocks or an OpenAI tool message)."""
    if message.get("role") == "tool":
        return 1
    content = message.get("content")
    blocks = content if isinstance(content, list) else []
    return sum(1 for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result")


def _run(command: list[str], home: Path, env: Mapping[str, str]) -> None:
    done = subprocess.run(
        command,
        env={**os.environ, "HOME": str(home), **env},
        cwd=home,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0 or FINAL not in done.stdout:
        raise RuntimeError(
            f"{command[0]} failed ({done.returncode}): {done.stdout[-500:]} {done.stderr[-2000:]}"
        )


def claude_session(home: Path, base_url: str) -> Path:
    """Run Claude Code once with hooks; the path of the session file it wrote."""
    settings = {
        "hooks": {
            event: [{"matcher": "Bash", "hooks": [{"type": "command", "command": f"echo {word}"}]}]
            for event, word in (("PreToolUse", "pre-hook"), ("PostToolUse", "post-hook"))
        }
    }
    (home / ".claude").mkdir(parents=True, exist_ok=True)
    (home / ".claude" / "settings.json").write_text(json.dumps(settings))
    command = [str(binary("claude")), "-p", PROMPT, "--allowedTools", "Bash", "--model", MODEL]
    env = {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "x",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    _run(command, home, env)
    (found,) = (home / ".claude" / "projects").rglob("*.jsonl")
    return found


def pi_session(home: Path, base_url: str) -> Path:
    """Run pi once (Anthropic Messages API); the path of the session file it wrote."""
    agent = home / ".pi" / "agent"
    agent.mkdir(parents=True, exist_ok=True)
    provider = {
        "baseUrl": base_url,
        "api": "anthropic-messages",
        "apiKey": "x",
        "models": [
            {
                "id": MODEL,
                "contextWindow": 200_000,
                "maxTokens": 4096,
                "reasoning": False,
                "input": ["text"],
            }
        ],
    }
    (agent / "models.json").write_text(json.dumps({"providers": {"loopback": provider}}))
    command = [str(binary("pi")), "--provider", "loopback", "--model", MODEL, "-p", PROMPT]
    _run(command, home, {"PI_OFFLINE": "1"})
    (found,) = (agent / "sessions").rglob("*.jsonl")
    return found


def generate(out: Path) -> dict[str, Path]:
    """Write ``claude-code-2.1-parallel.jsonl``, ``pi-parallel.jsonl`` and the project
    folder ``claude-code-2.1-subagent/`` into ``out``."""
    from conversations.providers.fake import FakeLLMServer

    out.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path] = {}
    for name, run in (("claude-code-2.1-parallel", claude_session), ("pi-parallel", pi_session)):
        fake = FakeLLMServer(context_window=200_000, responder=parallel_responder()).start()
        home = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        try:
            found = run(home, fake.anthropic_base_url)
            made[name] = out / f"{name}.jsonl"
            shutil.copyfile(found, made[name])
        finally:
            fake.stop()
            shutil.rmtree(home, ignore_errors=True)
    name = "claude-code-2.1-subagent"
    fake = FakeLLMServer(context_window=200_000, responder=subagent_responder()).start()
    home = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    try:
        project = claude_subagent_project(home, fake.anthropic_base_url)
        made[name] = out / name
        shutil.rmtree(made[name], ignore_errors=True)
        shutil.copytree(project, made[name])
    finally:
        fake.stop()
        shutil.rmtree(home, ignore_errors=True)
    return made


if __name__ == "__main__":
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "arbor.settings")
    django.setup()
    for path in generate(Path(sys.argv[1])).values():
        print(path)
