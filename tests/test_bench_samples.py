"""The real samples as the ladder bench and the compaction tests read them
(compaction/bench_samples.py): through Arbor's own importers, no database, and no
application module reading anything from ``tests/``. The reader is tested on the
sessions the real CLIs wrote for this repository (tests/data/sessions); what only the
third-party samples hold (pi's v1 ids, compactions, images) is tested on them when they
are beside the repository."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from compaction.bench_samples import CLAUDE_CODE_DIR, PI_SAMPLE, load_claude_code, load_pi
from tests.sample_loaders import requires_samples

ROOT = Path(__file__).resolve().parents[1]
APPS = ("arbor", "compaction", "conversations")
SESSIONS = ROOT / "tests" / "data" / "sessions"
PI_FILE = SESSIONS / "pi-parallel.jsonl"
CLAUDE_FILE = SESSIONS / "claude-code-2.1-parallel.jsonl"
PI_FILES = [
    pytest.param(PI_FILE, id="pi-session"),
    pytest.param(PI_SAMPLE, id="pi-sample", marks=requires_samples),
]


def raw_pi_messages(path: Path = PI_SAMPLE) -> list[dict[str, Any]]:
    messages = []
    for line in path.read_text(encoding="utf-8").splitlines():
        decoder, pos = json.JSONDecoder(), 0
        while pos < len(line):  # the last line holds two records
            record, pos = decoder.raw_decode(line, pos)
            if record.get("type") == "message":
                messages.append(record["message"])
    return messages


def test_no_application_module_imports_the_tests() -> None:
    offenders = []
    for app in APPS:
        for path in (ROOT / app).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(n == "tests" or n.startswith("tests.") for n in names):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_it_reads_a_pi_session_as_the_importer_does() -> None:
    sample = load_pi(PI_FILE)
    assert len(sample.messages) == len(raw_pi_messages(PI_FILE)) == 9
    assert {m["role"] for m in sample.messages} == {"user", "assistant", "tool"}
    assert sample.compactions == [] and sample.blob_sizes == {}
    assert sample.messages[0]["parts"][0]["text"].startswith("Check the greek letters")


@requires_samples
def test_it_reads_the_pi_sample_as_the_importer_does() -> None:
    sample = load_pi()
    # The importer's keys (pi v1 has no ids of its own), in file order.
    assert all(m["id"].startswith("entry-") for m in sample.messages)
    assert {m["role"] for m in sample.messages} == {"user", "assistant", "tool"}
    # A command the user ran in pi is a user message, as an import keeps it.
    assert any(
        p.get("text", "").startswith("Ran `open out.html`")
        for m in sample.messages
        if m["role"] == "user"
        for p in m["parts"]
    )
    # pi compacted twice: the markers are taken out, their places kept.
    assert len(sample.compactions) == 2
    assert 0 < sample.compactions[0] < sample.compactions[1] <= len(sample.messages)


@requires_samples
def test_it_keeps_images_as_blob_references_with_their_sizes() -> None:
    sample = load_pi()
    images = [
        inner
        for m in sample.messages
        for p in m["parts"]
        for inner in ([p, *p.get("parts", [])] if p["type"] == "tool_result" else [p])
        if inner["type"] == "image"
    ]
    assert images and set(sample.blob_sizes) == {i["blob"] for i in images}
    for image in images:
        assert set(image) == {"type", "blob", "mime", "width", "height"}
        assert image["width"] > 0 and image["height"] > 0
        assert sample.blob_sizes[image["blob"]] > 0


@pytest.mark.parametrize("path", PI_FILES)
def test_measured_usage_is_the_whole_prompt(path: Path) -> None:
    sample = load_pi(path)
    raw = [m for m in raw_pi_messages(path) if m.get("role") == "assistant" and m.get("usage")]
    measured = [m["metadata"]["usage"] for m in sample.messages if m["role"] == "assistant"]
    first = raw[0]["usage"]
    prompt = first["input"] + first["cacheRead"] + first["cacheWrite"]
    assert measured[0] == {"input_tokens": prompt, "output_tokens": first["output"]}
    assert all(m["metadata"] == {} for m in sample.messages if m["role"] != "assistant")


@pytest.mark.parametrize(
    ("pi_file", "claude_file"),
    [
        pytest.param(PI_FILE, CLAUDE_FILE, id="sessions"),
        pytest.param(
            PI_SAMPLE,
            CLAUDE_CODE_DIR / "claude-code-viewer__fe5e1c67-53e7-4862-81ae-d0e013e3270b.jsonl",
            id="samples",
            marks=requires_samples,
        ),
    ],
)
def test_every_tool_call_of_a_sample_is_answered(pi_file: Path, claude_file: Path) -> None:
    for sample in [load_pi(pi_file), *load_claude_code(claude_file)]:
        calls = {p["id"] for m in sample.messages for p in m["parts"] if p["type"] == "tool_call"}
        results = {
            p["call_id"] for m in sample.messages for p in m["parts"] if p["type"] == "tool_result"
        }
        assert calls == results, sample.name


@requires_samples
def test_a_claude_code_file_gives_its_longest_line_and_each_main_line() -> None:
    path = CLAUDE_CODE_DIR / "claude-code-log__dag_compact_after_rewind.jsonl"
    samples = {s.name: s for s in load_claude_code(path)}
    assert set(samples) == {f"{path.stem}:longest", f"{path.stem}:main0"}
    longest = samples[f"{path.stem}:longest"]
    # Claude Code's compact_boundary is taken out; the summary after it stays.
    assert len(longest.compactions) == 1
    assert longest.messages[longest.compactions[0]]["role"] == "user"
    assert len(longest.messages) > len(samples[f"{path.stem}:main0"].messages)
