"""``manage.py bench_harness``: real harnesses under pressure, through Arbor and alone.

Claude Code and pi (from npm, installed by ``make harness`` into var/harness) run a
scripted agent's rounds of ~3.4 KB shell output against a loopback upstream that counts
pessimistically (UTF-8 bytes / 3, tool definitions included), rejects what is over its
window with the provider's real error body, and answers summary requests with a short
summary. Each run is made twice:

- **through Arbor**: the harness's base URL is the gateway (the harness is told of a
  large window, so compaction is Arbor's);
- **alone**: the harness talks to the upstream directly and is told the real window
  (Claude Code: ``CLAUDE_CODE_AUTO_COMPACT_WINDOW``; pi: its models.json), so it
  compacts on its own.

A recording proxy in front of each sees what the harness sent and what it got back. Per
run it prints: rounds completed, errors the harness saw, Arbor's requests over the
window, summary calls (requests without tools), snapshot pages per forwarded request,
the fraction of consecutive forwarded requests whose earlier one is a byte-identical
prefix, and billed input under Anthropic's cache pricing
(conversations/gateway/cache_model.py) for Arbor, the harness alone, and naive trimming
of the harness's own requests (per request, and with hysteresis). One JSON object on
stdout; progress on stderr.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from conversations import services
from conversations.gateway.cache_model import Bill, PromptCache
from conversations.management.commands.bench_gateway import (
    _add,
    _bill_dict,
    _HysteresisTrimmer,
    _naive,
)
from conversations.management.liveserver import gateway_env, uvicorn
from conversations.models import Conversation
from conversations.providers.fake import (
    ROUND_MARK,
    FakeLLMServer,
    count_bytes_tokens,
    scripted_agent,
)

BENCH_USERNAME = "__arbor_bench_harness__"
MODEL = "claude-sonnet-4-5"
PROMPT = "Run the rounds the tool asks for."
MAX_OUTPUT = 4096
HARNESS_DIR = Path(os.environ.get("ARBOR_HARNESS_DIR", settings.BASE_DIR / "var" / "harness"))


# --- a recording proxy ------------------------------------------------------------------


@dataclass
class Exchange:
    path: str
    body: Any
    status: int


@dataclass
class Recorder:
    """A loopback HTTP proxy to ``target`` that keeps every request body and status."""

    target: str
    log: list[Exchange] = field(default_factory=list)
    port: int = 0

    @contextmanager
    def running(self) -> Iterator[Recorder]:
        recorder = self
        parts = urlsplit(self.target)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("host", "content-length", "connection", "accept-encoding")
                }
                conn = http.client.HTTPConnection(
                    parts.hostname or "127.0.0.1", parts.port, timeout=600
                )
                conn.request(self.command, self.path, body=raw or None, headers=headers)
                response = conn.getresponse()
                data = response.read()  # relayed whole: the harness parses SSE just the same
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                recorder.log.append(Exchange(self.path, body, response.status))
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(key, value)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = _forward

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = server.server_address[1]
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# --- one run ------------------------------------------------------------------------------


def _binary(name: str) -> str:
    path = HARNESS_DIR / "node_modules" / ".bin" / name
    if not path.exists():
        raise CommandError(f"{path} is missing: `make harness` installs it")
    return str(path)


def _claude(tools: str) -> list[str]:
    extra = ["--tools", tools] if tools else []
    return [
        _binary("claude"),
        "-p",
        PROMPT,
        "--allowedTools",
        "Bash",
        *extra,
        "--model",
        MODEL,
    ]


def _pi_home(home: Path, base: str, key: str, window: int) -> None:
    agent = home / ".pi" / "agent"
    agent.mkdir(parents=True, exist_ok=True)
    provider = {
        "baseUrl": base,
        "api": "anthropic-messages",
        "apiKey": key,
        "models": [
            {
                "id": MODEL,
                "contextWindow": window,
                "maxTokens": MAX_OUTPUT,
                "reasoning": False,
                "input": ["text", "image"],
            }
        ],
    }
    (agent / "models.json").write_text(json.dumps({"providers": {"arbor": provider}}))


def _harness(
    name: str, base: str, key: str, *, told_window: int, alone: bool, tools: str
) -> subprocess.CompletedProcess[str]:
    home = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    env = dict(os.environ, HOME=str(home), PI_OFFLINE="1")
    if name == "claude":
        env.update(
            ANTHROPIC_BASE_URL=base,
            ANTHROPIC_API_KEY=key,
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        )
        if alone:  # Claude Code compacts on its own at the window it is told
            env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(told_window)
        command = _claude(tools)
    else:
        _pi_home(home, base, key, told_window if alone else 1_000_000)
        command = [_binary("pi"), "--provider", "arbor", "--model", MODEL, "-p", PROMPT]
    return subprocess.run(command, env=env, cwd=home, capture_output=True, text=True, timeout=3600)


def _pages(body: Any) -> int:
    return json.dumps(body).count('"type": "image"') if body else 0


def _stable(bodies: list[dict[str, Any]]) -> float:
    """Share of consecutive forwarded requests whose earlier one is, but for its last
    message, a byte-identical prefix of the later one."""
    pairs = list(itertools.pairwise(bodies))
    if not pairs:
        return 1.0
    same = sum(
        1
        for a, b in pairs
        if json.dumps(b["messages"][: len(a["messages"]) - 1]) == json.dumps(a["messages"][:-1])
        and a.get("system") == b.get("system")
    )
    return round(same / len(pairs), 3)


def _billed(bodies: list[dict[str, Any]]) -> Bill:
    cache, total = PromptCache(), Bill()
    for body in bodies:
        _add(total, cache.bill(body))
    return total


class Command(BaseCommand):
    help = "Claude Code and pi under pressure, through Arbor's gateway and alone."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--harness", default="claude,pi", help="claude, pi or both")
        parser.add_argument("--windows", default="24000,60000")
        parser.add_argument("--rounds", default="40", help="e.g. 40,120")

    def handle(self, *args: Any, **options: Any) -> None:
        runs: list[dict[str, Any]] = []
        for name in options["harness"].split(","):
            for window in (int(w) for w in options["windows"].split(",")):
                for rounds in (int(r) for r in options["rounds"].split(",")):
                    # Claude Code's full default tool set is ~29k tokens counted this
                    # way: at small windows it runs with Bash alone, as a user would.
                    tools = "Bash" if name == "claude" and window < 40_000 else ""
                    run = self._compare(name, window, rounds, tools)
                    self.stderr.write(json.dumps(run))
                    runs.append(run)
        goals = {
            "no_overflow_reaches_the_harness": all(r["arbor"]["errors_seen"] == 0 for r in runs),
            "no_arbor_request_over_the_window": all(r["arbor"]["over_window"] == 0 for r in runs),
            "billed_le_0_7_of_the_harness_alone": all(
                r["arbor_vs_alone"] is not None and r["arbor_vs_alone"] <= 0.7 for r in runs
            ),
            "billed_le_naive_with_hysteresis": all(
                r["arbor_vs_naive_hysteresis"] <= 1.0 for r in runs
            ),
            "summary_calls_le_1_per_40_rounds_at_24k": all(
                r["arbor"]["summary_calls"] * 40 <= r["rounds"]
                for r in runs
                if r["window"] <= 24_000
            ),
            "every_run_completes": all(r["arbor"]["rounds_done"] == r["rounds"] for r in runs),
        }
        self.stdout.write(json.dumps({"runs": runs, "goals": goals}, indent=2))

    def _compare(self, name: str, window: int, rounds: int, tools: str) -> dict[str, Any]:
        arbor = self._through_arbor(name, window, rounds, tools)
        alone = self._alone(name, window, rounds, tools)
        client = arbor.pop("client_bodies")
        # The baselines trim to the budget Arbor starts from, counted as the upstream
        # counts (bytes / 3).
        limit = int(0.8 * (window - MAX_OUTPUT))
        naive = _billed([_naive(b, limit, count_bytes_tokens) for b in client])
        steady_trim = _HysteresisTrimmer(limit, count_bytes_tokens)
        steady = _billed([steady_trim(b) for b in client])
        return {
            "harness": name,
            "window": window,
            "rounds": rounds,
            "tools": tools or "default",
            "arbor": arbor,
            "alone": alone,
            "naive": _bill_dict(naive),
            "naive_hysteresis": _bill_dict(steady),
            "arbor_vs_alone": (
                round(arbor["billed_input"] / alone["billed_input"], 3)
                if alone["billed_input"]
                else None
            ),
            "arbor_vs_naive": round(arbor["billed_input"] / max(1.0, naive.billed), 3),
            "arbor_vs_naive_hysteresis": round(arbor["billed_input"] / max(1.0, steady.billed), 3),
        }

    def _through_arbor(self, name: str, window: int, rounds: int, tools: str) -> dict[str, Any]:
        user_model = get_user_model()
        user_model.objects.filter(username=BENCH_USERNAME).delete()
        user = user_model.objects.create_user(BENCH_USERNAME)
        _, token = services.api_token_create(user=user, name="bench")
        fake = FakeLLMServer(
            context_window=window, responder=scripted_agent(rounds), tokenizer="bytes"
        ).start()
        entry = {"base_url": fake.anthropic_base_url, "context_window": window}
        env = gateway_env({f"anthropic/{MODEL}": {**entry, "max_output": MAX_OUTPUT}})
        started = time.monotonic()
        try:
            with uvicorn(env) as port:
                recorder = Recorder(f"http://127.0.0.1:{port}")
                with recorder.running():
                    done = _harness(
                        name,
                        f"{recorder.url}/gateway/anthropic",
                        token,
                        told_window=window,
                        alone=False,
                        tools=tools,
                    )
            upstream = fake.requests
        finally:
            fake.stop()
            for conversation in Conversation.objects.filter(owner=user):
                services.conversation_delete(conversation=conversation)
            user.delete()
        forwarded = [r.body for r in upstream if r.status == 200 and r.body.get("tools")]
        bill = _billed([r.body for r in upstream if r.status == 200])
        client = [e.body for e in recorder.log if isinstance(e.body, dict) and e.body.get("tools")]
        return {
            "exit": done.returncode,
            "seconds": round(time.monotonic() - started, 1),
            "rounds_done": _rounds_done(done.stdout, [r.body for r in upstream]),
            "errors_seen": sum(1 for e in recorder.log if e.status >= 400),
            "over_window": sum(1 for r in upstream if (r.prompt_tokens or 0) > window),
            "summary_calls": sum(1 for r in upstream if not r.body.get("tools")),
            "requests": len(forwarded),
            "pages_per_request": round(
                sum(_pages(b) for b in forwarded) / max(1, len(forwarded)), 2
            ),
            "prefix_stable": _stable(forwarded),
            "max_prompt_tokens": max((r.prompt_tokens or 0) for r in upstream) if upstream else 0,
            # Each forwarded request's size as the upstream counted it, and its pages.
            "trace": [
                (r.prompt_tokens, _pages(r.body), len(r.body.get("messages") or []))
                for r in upstream
                if r.status == 200
            ],
            **_bill_dict(bill),
            "client_bodies": client,
        }

    def _alone(self, name: str, window: int, rounds: int, tools: str) -> dict[str, Any]:
        fake = FakeLLMServer(
            context_window=window, responder=scripted_agent(rounds), tokenizer="bytes"
        ).start()
        started = time.monotonic()
        try:
            recorder = Recorder(fake.url)
            with recorder.running():
                done = _harness(
                    name, recorder.url, "sk-ant-bench", told_window=window, alone=True, tools=tools
                )
            upstream = fake.requests
        finally:
            fake.stop()
        bill = _billed([r.body for r in upstream if r.status == 200])
        forwarded = [r.body for r in upstream if r.status == 200 and r.body.get("tools")]
        return {
            "exit": done.returncode,
            "seconds": round(time.monotonic() - started, 1),
            "rounds_done": _rounds_done(done.stdout, [r.body for r in upstream]),
            "errors_seen": sum(1 for e in recorder.log if e.status >= 400),
            "summary_calls": sum(1 for r in upstream if not r.body.get("tools")),
            "requests": len(forwarded),
            "prefix_stable": _stable(forwarded),
            **_bill_dict(bill),
        }


def _rounds_done(stdout: str, bodies: list[Any]) -> int:
    """The last round whose output the model was sent."""
    seen = [int(n) for body in bodies for n in ROUND_MARK.findall(json.dumps(body))]
    return max(seen, default=0)
