"""No scanner on a request path takes time growing faster than its input (issue 31).

Each test times a scanner on 10 KB and on 100 KB of input built to make a backtracking
regex rescan (one long word of letters, of digits, ``a.`` repeated, unclosed tags...) and
asserts the CPU time grows at most 15 times for 10 times the input: linear work gives
about 10, quadratic about 100. CPU time (``time.process_time``), the best of a few
repeats, each repeat calling the scanner often enough to take a few milliseconds on the
small input, so a shared machine's load and the clock's grain do not decide the ratio.
"""

from __future__ import annotations

import gc
import random
import re
import time
from collections.abc import Callable
from unittest import mock

import pytest
from django.test import SimpleTestCase

from compaction import ladder
from conversations import markdown
from conversations.importers import openwebui
from conversations.parts import strict_json
from conversations.providers.errors import OVERFLOW_SCAN_CHARS, parse_overflow

SMALL = 10_000
LARGE = 100_000
MAX_RATIO = 15.0


def _best_cpu(scan: Callable[[str], object], text: str, calls: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for _ in range(calls):
            scan(text)
        best = min(best, time.process_time() - started)
    return best


def cpu_ratio(
    scan: Callable[[str], object], make: Callable[[int], str], repeats: int = 3, tries: int = 3
) -> float:
    """CPU time of ``scan`` on ``make(LARGE)`` over its time on ``make(SMALL)``, per
    call. The small input is scanned ten times as often, so both sides measure about
    as much CPU time; the lowest of up to ``tries`` measurements counts (a busy machine
    only ever makes one slower, and a quadratic scan stays near 100x however often it
    is measured). The garbage collector is off while it measures: its passes over
    everything alive grow with what a scan allocates (a 10x input took 15.5x the time
    with it, 10.4x without)."""
    small, large = make(SMALL), make(LARGE)
    ratio = float("inf")
    gc.collect()
    gc.disable()
    try:
        calls = 1
        while _best_cpu(scan, large, calls, 1) < 0.005 and calls < 4096:
            calls *= 2
        for _ in range(tries):
            small_cpu = _best_cpu(scan, small, calls * (LARGE // SMALL), repeats)
            large_cpu = _best_cpu(scan, large, calls, repeats)
            ratio = min(ratio, LARGE // SMALL * large_cpu / max(small_cpu, 1e-9))
            if ratio <= MAX_RATIO:
                break
        return ratio
    finally:
        gc.enable()


def repeat(unit: str, tail: str = "") -> Callable[[int], str]:
    return lambda size: unit * (size // len(unit)) + tail


# Inputs that make a backtracking scan restart at each character of one long run.
ADVERSARIAL: dict[str, Callable[[int], str]] = {
    "letters": repeat("x"),
    "letters then a dot": repeat("x", "."),
    "letters then a digit": repeat("x", "1"),
    "underscores": repeat("_"),
    "digits": repeat("1"),
    "digits then a letter": repeat("1", "x"),
    "a. repeated": repeat("a."),
    "1. repeated": repeat("1.", "x"),
    "camel pairs": repeat("aA"),
    "dashes after a letter": lambda size: "a" + "-" * size,
    "colon then digits": lambda size: ":" + "1" * size + "x",
    "spaces then a letter": lambda size: " " * size + "x",
    "words": repeat("lorem_ipsum dolorSit amet.consectetur v2beta 1234 "),
}

# What ``distinctive_tokens`` matched its identifiers with before the linear scan: the
# reference ``ladder._identifiers`` must agree with on ordinary text.
_OLD_IDENT_RE = re.compile(
    r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+"
    r"|[A-Za-z_][A-Za-z0-9_]*(?:[a-z0-9][A-Z]|_[A-Za-z0-9])[A-Za-z0-9_]*|[A-Za-z]+[0-9][A-Za-z0-9]*"
)


class LadderScanTests(SimpleTestCase):
    def assert_linear(self, scan: Callable[[str], object]) -> None:
        for name, make in ADVERSARIAL.items():
            with self.subTest(input=name):
                ratio = cpu_ratio(scan, make)
                assert ratio <= MAX_RATIO, f"{name}: 10x the input took {ratio:.1f}x the CPU"

    def test_it_finds_distinctive_tokens_in_linear_time(self) -> None:
        # A 20,000-letter word took a minute here (one rescan per letter).
        self.assert_linear(ladder.distinctive_tokens)

    def test_it_finds_plain_words_in_linear_time(self) -> None:
        self.assert_linear(ladder.plain_words)

    def test_it_finds_quoted_numbers_in_linear_time(self) -> None:
        self.assert_linear(ladder.quoted_numbers)

    def test_it_finds_spoken_numbers_in_linear_time(self) -> None:
        self.assert_linear(ladder.spoken_numbers)

    def test_it_finds_the_same_identifiers_as_the_old_regex(self) -> None:
        rng = random.Random(31)
        samples = [
            "event.firstKeptIndex error.message TodoItem max_tokens v2beta a.b.1c x_1 _a",
            "3rdParty __init__ foo.__bar__ abc1_dEf a.b. .a _1x9 x9_y Zz9Q_",
        ]
        for alphabet in ("aZ1_.", "ab1_. ", "aB_-", "xQ9_./é"):
            for _ in range(3000):
                samples.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))))
        for text in samples:
            assert list(ladder._identifiers(text)) == _OLD_IDENT_RE.findall(text), text


def _block(kind: str) -> str:
    return f'<details type="{kind}"><summary>Thought</summary>&gt; x</details> text '


# Open WebUI's rendered content: <details> blocks (reasoning, tool calls) among prose.
OPENWEBUI_CONTENT: dict[str, Callable[[int], str]] = {
    "openings without a close": repeat("<details>"),
    "openings without a >": repeat("<details "),
    "reasoning blocks": repeat(_block("reasoning")),
    "blocks of another kind": repeat(_block("other")),
    "closings alone": repeat("</details>"),
    "summaries without a close": lambda size: (
        '<details type="reasoning">' + "<summary>" * (size // 9) + "</details>"
    ),
    "one long attribute word": lambda size: "<details " + "a" * size + ">x</details>",
    "attribute quotes": lambda size: "<details " + 'a="' * (size // 3) + ">x</details>",
}


class OpenWebUIScanTests(SimpleTestCase):
    def test_it_splits_details_blocks_in_linear_time(self) -> None:
        # 16,000 openings in 140 KB took 57 s to import: each rescanned to the end.
        for name, make in OPENWEBUI_CONTENT.items():
            with self.subTest(input=name):
                ratio = cpu_ratio(openwebui._from_content, make)
                assert ratio <= MAX_RATIO, f"{name}: 10x the input took {ratio:.1f}x the CPU"

    def test_it_still_splits_blocks_as_written(self) -> None:
        content = (
            'Let me look. <details type="reasoning" done="true"><summary>Thought</summary>'
            "&gt; the file\n&gt; is short</details>"
            '<DETAILS type="tool_calls" id="c1" name="read" arguments="{&quot;p&quot;: 1}"'
            ' result="ok"></DETAILS>'
            '<details><summary>mine</summary>kept</details> <details type="reasoning">open'
        )
        segments = openwebui._segments(content)
        assert [kind for kind, _, _ in segments] == ["text", "details", "details", "text"]
        assert segments[1][1] == "<summary>Thought</summary>&gt; the file\n&gt; is short"
        assert segments[2][2] == {
            "type": "tool_calls",
            "id": "c1",
            "name": "read",
            "arguments": "{&quot;p&quot;: 1}",
            "result": "ok",
        }
        steps = openwebui._from_content(content)
        assert steps[1] == ("assistant", [{"type": "thinking", "text": "the file\nis short"}])
        assert segments[3][1].startswith("<details><summary>mine</summary>kept</details>")


# An upstream's error message (a hostile or broken upstream's can be megabytes): each
# pattern's ``.*?`` from every repeated head rescans the rest.
UPSTREAM_ERRORS: dict[str, Callable[[int], str]] = {
    "context heads": repeat("maximum context length is 1 tokens "),
    "mistral heads": repeat("prompt contains 1 tokens "),
    "gemini heads": repeat("input token count (1) exceeds the maximum"),
    "requested without a close": repeat("maximum context length is 1 tokens requested 2 tokens ("),
    "digits": repeat("1"),
}


class UpstreamErrorScanTests(SimpleTestCase):
    def test_it_reads_an_overflow_message_in_bounded_time(self) -> None:
        for name, make in UPSTREAM_ERRORS.items():
            with self.subTest(input=name):
                ratio = cpu_ratio(parse_overflow, make)
                assert ratio <= MAX_RATIO, f"{name}: 10x the input took {ratio:.1f}x the CPU"

    def test_an_overflow_is_still_found_at_the_head_of_a_long_message(self) -> None:
        head = "prompt is too long: 208310 tokens > 200000 maximum. "
        assert parse_overflow(head + "x" * 1_000_000) == (208310, 200000)
        assert parse_overflow("x" * OVERFLOW_SCAN_CHARS + head) is None


def _fence(lang: str, unit: str) -> Callable[[int], str]:
    return lambda size: f"```{lang}\n" + unit * (size // len(unit)) + "\n```\n"


# Markdown as a message holds it: markdown-it's own worst cases, and code blocks whose
# language picks a Pygments lexer that is quadratic on that text.
MARKDOWN: dict[str, Callable[[int], str]] = {
    "brackets": repeat("["),
    "emphasis": repeat("*a"),
    "table rows": lambda size: "|a|b|\n|-|-|\n" + "|\n" * (size // 2),
    "python blank lines": _fence("python", " \n"),
    "typescript a.": _fence("typescript", "a."),
    "c# short lines": _fence("csharp", "a\n"),
    # Lexers where one regex call is itself quadratic or cubic, out of the budget's reach.
    "console words": _fence("console", "a"),
    "ocaml digits": _fence("ocaml", "1"),
    "maple quotes": _fence("maple", "'"),
    "many code blocks": lambda size: ("```python\n" + " \n" * 400 + "```\n") * (size // 820),
}


class MarkdownScanTests(SimpleTestCase):
    @pytest.mark.slow  # tens of seconds: each highlighted case runs up to its CPU budget
    def test_it_renders_in_linear_time(self) -> None:
        with mock.patch.object(markdown._CACHE, "max_item", 0):  # render every time
            for name, make in MARKDOWN.items():
                with self.subTest(input=name):
                    ratio = cpu_ratio(markdown.render, make, repeats=2)
                    assert ratio <= MAX_RATIO, f"{name}: 10x the input took {ratio:.1f}x the CPU"

    def test_code_is_still_highlighted(self) -> None:
        with mock.patch.object(markdown._CACHE, "max_item", 0):
            html = markdown.render("```python\ndef f(x):\n    return x  # hi\n```\n")
        assert '<span class="k">def</span>' in html and '<span class="c1"># hi</span>' in html
        with mock.patch.object(markdown._CACHE, "max_item", 0):
            html = markdown.render("```ocaml\nlet x = 1\n```\n")  # short: highlighted
        assert '<span class="k">let</span>' in html

    def test_past_its_budget_a_block_is_shown_plain(self) -> None:
        text = "```csharp\n" + "a\n" * 20_000 + "```\n"
        with mock.patch.object(markdown._CACHE, "max_item", 0):
            started = time.process_time()
            html = markdown.render(text)
            spent = time.process_time() - started
        assert spent < 10 * markdown.HIGHLIGHT_BUDGET_SECONDS  # unbounded: 35 s
        assert '<span class="' not in html and html.count("a\n") == 20_000


def _strict_json(text: str) -> object:
    try:
        return strict_json(text.encode("utf-8", "surrogatepass"))
    except ValueError as exc:  # NotJSON among them: refusing must be linear too
        return exc


# Request bodies (every API and gateway request): the depth, repeated-key and surrogate
# checks added to the parser scan the text, so they get the same treatment.
JSON_BODIES: dict[str, Callable[[int], str]] = {
    "open brackets": repeat("["),
    "open objects": repeat('{"a":'),
    "64 levels, many times": lambda size: (
        "[" + ",".join(["[" * 63 + "]" * 63] * (size // 128)) + "]"
    ),
    "tiny objects": lambda size: "[" + '{"a":1},' * (size // 8) + "{}]",
    "escaped quotes and colons": lambda size: '["' + '\\":' * (size // 3) + '"]',
    "backslashes": lambda size: '{"k": "' + "\\\\" * (size // 2) + '"}',
    "quote then blanks": lambda size: '["' + " " * size + '"]',
    "repeated keys": lambda size: "{" + '"a":1,' * (size // 6) + '"b":2}',
    "lone surrogates": lambda size: '["' + "\\ud83d" * (size // 6) + '"]',
}


class JsonBodyScanTests(SimpleTestCase):
    def test_it_reads_or_refuses_a_body_in_linear_time(self) -> None:
        for name, make in JSON_BODIES.items():
            with self.subTest(input=name):
                ratio = cpu_ratio(_strict_json, make)
                assert ratio <= MAX_RATIO, f"{name}: 10x the input took {ratio:.1f}x the CPU"
