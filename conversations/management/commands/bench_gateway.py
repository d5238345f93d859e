"""``manage.py bench_gateway``: what the gateway costs a harness, and what it saves.

Runs the `make run` server (uvicorn) against the loopback upstream, in one run:

- **latency**: the same request sent straight to the upstream and through the gateway,
  alternately, for a 10-message and a 300-message conversation: total time and time to
  first byte (streaming), p50/p95, and what the gateway adds;
- **billing**: a replayed agent session of ``--requests`` requests (each adds one tool
  round), as a harness sends it (cache breakpoints on the system prompt and on the last
  message, as Claude Code does), billed under Anthropic's cache pricing (uncached 1.0,
  cache write 1.25, cache read 0.1; conversations/gateway/cache_model.py) for: no
  compaction (until the window makes the request fail), naive per-request compaction
  (the oldest tool results trimmed until each request fits, as trimming proxies do), and
  Arbor's cache-stable compaction (the upstream's log of what the gateway sent).

One JSON object on stdout; progress on stderr. The bench user and its data are deleted.
"""

from __future__ import annotations

import copy
import http.client
import json
import statistics
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser

from compaction.models import CompactionRecord
from conversations import services
from conversations.gateway.cache_model import Bill, PromptCache
from conversations.management.liveserver import (
    gateway_env,
    percentile,
    process_cpu_seconds,
    uvicorn_process,
)
from conversations.models import Conversation
from conversations.providers.fake import (
    FakeLLMServer,
    Step,
    _count_anthropic_blocks,
    count_anthropic_request,
    count_text_tokens,
)

BENCH_USERNAME = "__arbor_bench_gateway__"
# The latency pairs are split into this many runs; the goal is judged by their median.
LATENCY_RUNS = 5
# The latency runs use a model with a large window (requests pass through as they are);
# the session uses one whose window it outgrows.
MODEL = "claude-sonnet-4-5"
SESSION_MODEL = "claude-haiku-4-5"
EPHEMERAL = {"type": "ephemeral"}
SYSTEM = "You are a coding agent. Work through the task with the Bash tool. " * 20
TOOLS = [
    {
        "name": "Bash",
        "description": "Run a shell command and return its output. " * 10,
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command"}},
            "required": ["command"],
        },
    }
]


def _output(n: int) -> str:
    return "\n".join(
        f"step {n} line {i}: build/output/module_{n % 17}.o compiled in {n * 7 % 100} ms"
        for i in range(20)
    )


class _Client:
    """One keep-alive HTTP connection to a base URL."""

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        self.host, self.port, self.prefix = parts.hostname or "", parts.port or 80, parts.path
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)

    def post(
        self, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, float, float]:
        started = time.perf_counter()
        self.conn.request("POST", self.prefix + path, body=body, headers=headers)
        response = self.conn.getresponse()
        first = response.read(1)
        ttfb = time.perf_counter() - started
        raw = first + response.read()
        return response.status, raw, time.perf_counter() - started, ttfb


def _conversation(n: int) -> list[dict[str, Any]]:
    """``n`` messages of an agent session: the task, tool rounds, and a user nudge."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing build."}]
    i = 0
    while len(messages) + 2 < n:
        i += 1
        call = f"toolu_bench_{i:05d}"
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Looking at step {i}."},
                    {
                        "type": "tool_use",
                        "id": call,
                        "name": "Bash",
                        "input": {"command": f"make step{i}"},
                    },
                ],
            }
        )
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call, "content": _output(i)[:600]},
                ],
            }
        )
    while len(messages) < n:
        messages.append({"role": "user", "content": "Go on."})
    return messages


def _with_breakpoints(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What Claude Code does: a breakpoint on the last block of the last message."""
    out = copy.deepcopy(messages)
    content = out[-1]["content"]
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    content[-1] = {**content[-1], "cache_control": EPHEMERAL}
    out[-1]["content"] = content
    return out


def _body(
    messages: list[dict[str, Any]], *, stream: bool = False, model: str = MODEL
) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 1024,
        "stream": stream,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}],
        "tools": TOOLS,
        "messages": _with_breakpoints(messages),
    }


def _naive(
    body: dict[str, Any], limit: int, count: Callable[[str], int] = count_text_tokens
) -> dict[str, Any]:
    """Per-request trimming: the oldest tool results emptied until the request fits
    (counted with ``count``, the upstream's tokenizer)."""
    body = copy.deepcopy(body)
    total = count_anthropic_request(body, count_text_tokens=count)
    for message in body["messages"]:
        if total <= limit:
            break
        for block in message["content"] if isinstance(message["content"], list) else []:
            if block.get("type") == "tool_result" and block.get("content") != "[trimmed]":
                before = _count_anthropic_blocks([block], "claude", count)
                block["content"] = "[trimmed]"
                total -= before - _count_anthropic_blocks([block], "claude", count)
    return body


class _HysteresisTrimmer:
    """Trimming as a careful proxy does it: when a request is over the limit, the oldest
    tool results are emptied down to half of it, and those stay emptied, so the prefix
    is byte-identical (cached) until the limit is crossed again."""

    def __init__(self, limit: int, count: Callable[[str], int] = count_text_tokens) -> None:
        self.limit = limit
        self.count = count
        self.trimmed: set[str] = set()

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(body)
        results = [
            block
            for message in body["messages"]
            for block in (message["content"] if isinstance(message["content"], list) else [])
            if block.get("type") == "tool_result"
        ]
        for block in results:
            if block.get("tool_use_id") in self.trimmed:
                block["content"] = "[trimmed]"
        total = count_anthropic_request(body, count_text_tokens=self.count)
        if total > self.limit:
            for block in results:
                if total <= self.limit // 2:
                    break
                if block.get("content") != "[trimmed]":
                    before = _count_anthropic_blocks([block], "claude", self.count)
                    block["content"] = "[trimmed]"
                    self.trimmed.add(str(block.get("tool_use_id")))
                    total -= before - _count_anthropic_blocks([block], "claude", self.count)
        return body


def _bill_dict(bill: Bill) -> dict[str, Any]:
    return {
        "billed_input": round(bill.billed),
        "uncached": bill.uncached,
        "cache_write": bill.written,
        "cache_read": bill.read,
    }


class Command(BaseCommand):
    help = "Gateway latency against the upstream, and cache-priced billing of a session."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--iterations", type=int, default=40)
        parser.add_argument("--requests", type=int, default=300)
        parser.add_argument("--window", type=int, default=40_000)

    def handle(self, *args: Any, **options: Any) -> None:
        user_model = get_user_model()
        user_model.objects.filter(username=BENCH_USERNAME).delete()
        user = user_model.objects.create_user(BENCH_USERNAME)
        _, token = services.api_token_create(user=user, name="bench")
        fake = FakeLLMServer(context_window=10**7).start()
        # The latency legs go to an upstream that does no work per request (no token
        # count of a 137 KB body), so what the gateway adds is Arbor's, not noise.
        trivial = FakeLLMServer(context_window=10**9, tokenizer="none").start()
        env = gateway_env(
            {
                f"anthropic/{MODEL}": {
                    "base_url": trivial.anthropic_base_url,
                    "context_window": 1_000_000,
                    "max_output": 1024,
                },
                f"anthropic/{SESSION_MODEL}": {
                    "base_url": fake.anthropic_base_url,
                    "context_window": options["window"],
                    "max_output": 1024,
                },
            }
        )
        try:
            with uvicorn_process(env) as (port, pid):
                gateway = f"http://127.0.0.1:{port}/gateway/anthropic"
                headers = {
                    "content-type": "application/json",
                    "x-api-key": token,
                    "anthropic-version": "2023-06-01",
                }
                result = {
                    "latency": self._latency(trivial, gateway, headers, options["iterations"], pid),
                    "session": self._session(fake, gateway, headers, options),
                }
        finally:
            fake.stop()
            trivial.stop()
            for conversation in Conversation.objects.filter(owner=user):
                services.conversation_delete(conversation=conversation)
            user.delete()
        latency_300 = result["latency"]["300_messages"]
        session = result["session"]
        result["goals"] = {
            # Judged by the median of interleaved runs, and by the server's CPU per
            # request (which noise cannot make small).
            "p50_added_ms_at_300_le_5": 0 <= latency_300["added_p50_ms"] <= 5.0
            and latency_300["gateway_cpu_ms_per_request"] <= 5.0,
            "arbor_billed_le_half_of_naive": session["arbor_vs_naive"] <= 0.5,
            "arbor_billed_le_naive_with_hysteresis": session["arbor_vs_naive_hysteresis"] <= 1.0,
            "arbor_never_failed": not session["arbor"]["failed"],
        }
        self.stdout.write(json.dumps(result, indent=2))

    def _latency(
        self,
        fake: FakeLLMServer,
        gateway: str,
        headers: dict[str, str],
        iterations: int,
        server: int,
    ) -> dict[str, Any]:
        """Wall times per path, and the gateway server's CPU per request through it (its
        process's, exchange writes behind the answer included)."""
        out: dict[str, Any] = {}
        for size in (10, 300):
            messages = _conversation(size)
            direct, through = _Client(fake.anthropic_base_url), _Client(gateway)
            times: dict[str, list[float]] = {k: [] for k in ("d", "g", "dt", "gt")}
            # Each run's added p50 (the pairs are interleaved within every run).
            runs: list[float] = []
            cpu_from = 0.0
            for i in range(iterations + 3):
                if i > 3 and (i - 3) % max(1, iterations // LATENCY_RUNS) == 0:
                    window = max(1, iterations // LATENCY_RUNS) // 2
                    runs.append(
                        statistics.median(times["g"][-window:])
                        - statistics.median(times["d"][-window:])
                    )
                stream = i % 2 == 1
                body = json.dumps(_body(messages, stream=stream)).encode()
                fake.push(Step.reply("ok"), Step.reply("ok"))
                if i == 3:  # the timed requests begin
                    cpu_from = process_cpu_seconds(server)
                _, _, d_total, d_first = direct.post("/v1/messages", body, headers)
                _, _, g_total, g_first = through.post("/v1/messages", body, headers)
                if i < 3:
                    continue  # warm-up: connections, caches, the first placement
                if stream:
                    times["dt"].append(d_first)
                    times["gt"].append(g_first)
                else:
                    times["d"].append(d_total)
                    times["g"].append(g_total)
            # The last exchange is written behind its answer: let it land, then count
            # the server's CPU over every timed request (the direct ones never reach it).
            time.sleep(0.5)
            cpu = process_cpu_seconds(server) - cpu_from
            ms = 1000.0
            out[f"{size}_messages"] = {
                "request_bytes": len(json.dumps(_body(messages))),
                "direct_p50_ms": round(statistics.median(times["d"]) * ms, 2),
                "gateway_p50_ms": round(statistics.median(times["g"]) * ms, 2),
                "added_p50_ms": round(statistics.median(runs or [0.0]) * ms, 2),
                "added_p50_ms_per_run": [round(r * ms, 2) for r in runs],
                "added_p95_ms": round(
                    (percentile(times["g"], 0.95) - percentile(times["d"], 0.95)) * ms, 2
                ),
                "gateway_cpu_ms_per_request": round(cpu / iterations * ms, 2),
                "ttfb_direct_p50_ms": round(statistics.median(times["dt"]) * ms, 2),
                "ttfb_gateway_p50_ms": round(statistics.median(times["gt"]) * ms, 2),
                "ttfb_added_p50_ms": round(
                    (statistics.median(times["gt"]) - statistics.median(times["dt"])) * ms, 2
                ),
            }
            self.stderr.write(f"latency {size}: {out[f'{size}_messages']}")
        return out

    def _session(
        self, fake: FakeLLMServer, gateway: str, headers: dict[str, str], options: dict[str, Any]
    ) -> dict[str, Any]:
        window, requests = options["window"], options["requests"]
        fake.clear()
        fake.set_window(SESSION_MODEL, window)
        client = _Client(gateway)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing build."}]
        sent: list[dict[str, Any]] = []
        failed_at = None
        for n in range(1, requests + 1):
            fake.push(Step.tools({"name": "Bash", "arguments": {"command": f"make step{n}"}}))
            body = _body(messages, model=SESSION_MODEL)
            sent.append(body)
            status, raw, _, _ = client.post("/v1/messages", json.dumps(body).encode(), headers)
            if status != 200:
                failed_at = n
                self.stderr.write(f"arbor request {n}: {status} {raw[:200]!r}")
                break
            answer = json.loads(raw)
            call = next(b for b in answer["content"] if b["type"] == "tool_use")
            messages.append({"role": "assistant", "content": answer["content"]})
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": call["id"], "content": _output(n)}
                    ],
                }
            )
            if n % 50 == 0:
                self.stderr.write(f"session: {n} requests")
        upstream = [r for r in fake.requests if r.status == 200]
        rejected = [r for r in fake.requests if (r.status or 0) >= 400]
        arbor = PromptCache()
        arbor_bill = Bill()
        for r in upstream:
            _add(arbor_bill, arbor.bill(r.body))
        # The same client requests without Arbor.
        none_cache, none_bill, none_failed = PromptCache(), Bill(), None
        naive_cache, naive_bill = PromptCache(), Bill()
        steady_cache, steady_bill = PromptCache(), Bill()
        limit = int(0.8 * (window - 1024))
        steady = _HysteresisTrimmer(limit)
        for n, body in enumerate(sent, start=1):
            if none_failed is None:
                if count_anthropic_request(body) > window:
                    none_failed = n
                else:
                    _add(none_bill, none_cache.bill(body))
            _add(naive_bill, naive_cache.bill(_naive(body, limit)))
            _add(steady_bill, steady_cache.bill(steady(body)))
        compactions = CompactionRecord.objects.filter(
            conversation__owner__username=BENCH_USERNAME
        ).count()
        return {
            "requests": requests,
            "window": window,
            "none": {
                **_bill_dict(none_bill),
                "failed": none_failed is not None,
                "failed_at_request": none_failed,
            },
            # Trimmed on every request: each one rewrites the cached prefix.
            "naive": {**_bill_dict(naive_bill), "failed": False},
            # Trimmed down to half when over, then kept: the fair baseline.
            "naive_hysteresis": {**_bill_dict(steady_bill), "failed": False},
            "arbor": {
                **_bill_dict(arbor_bill),
                "failed": failed_at is not None,
                "failed_at_request": failed_at,
                "compaction_steps": compactions,
                "upstream_rejections": len(rejected),
                "max_prompt_tokens": max((r.prompt_tokens or 0) for r in upstream),
            },
            "arbor_vs_naive": round(arbor_bill.billed / max(1.0, naive_bill.billed), 3),
            "arbor_vs_naive_hysteresis": round(arbor_bill.billed / max(1.0, steady_bill.billed), 3),
        }


def _add(total: Bill, bill: Bill) -> None:
    total.uncached += bill.uncached
    total.written += bill.written
    total.read += bill.read
