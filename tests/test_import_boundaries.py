"""The pure modules stay pure: the ladder, the estimator, the renderer and the importers'
parsers and tree builder load neither Django nor the provider SDKs (checked in a fresh
interpreter, as a newcomer's script or a bench would import them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import conversations.importers as importers

ROOT = Path(__file__).resolve().parent.parent
PURE = [
    "compaction.ladder",
    "compaction.estimate",
    "compaction.render",
    "conversations.resume",
    "conversations.treemap",
    "conversations.treegraph",
    "conversations.markdown",
]
# Everything of the importers but the Django side (``writer`` and ``services``).
PURE_IMPORTERS = [
    "conversations.importers",
    "conversations.importers.base",
    "conversations.importers.reading",
    "conversations.importers.media",
    "conversations.importers.archive",
    "conversations.importers.tree",
    "conversations.importers.parsers",
    "conversations.importers.arbor",
    "conversations.importers.chatgpt",
    "conversations.importers.claude_code",
    "conversations.importers.claudeai",
    "conversations.importers.codex",
    "conversations.importers.openwebui",
    "conversations.importers.pi",
]
FORBIDDEN = ("django", "openai", "anthropic", "httpx", "httpx2", "aiohttp", "celery", "ninja")
PI_SESSION = ROOT / "tests" / "data" / "sessions" / "pi-parallel.jsonl"


def run_fresh(script: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout


def loaded_after_importing(modules: list[str]) -> set[str]:
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    return set(json.loads(run_fresh(script)))


def forbidden_roots(loaded: set[str]) -> list[str]:
    return sorted({name.split(".")[0] for name in loaded} & set(FORBIDDEN))


def test_the_pure_modules_load_no_django_and_no_sdk():
    loaded = loaded_after_importing(PURE)
    assert not forbidden_roots(loaded), forbidden_roots(loaded)


def test_importing_the_provider_package_does_not_load_the_clients():
    loaded = loaded_after_importing(["conversations.providers.billing"])
    assert not {"openai", "anthropic"} & {name.split(".")[0] for name in loaded}


def test_the_importer_parsers_load_no_django_and_no_sdk():
    loaded = loaded_after_importing(PURE_IMPORTERS)
    assert not forbidden_roots(loaded), forbidden_roots(loaded)
    # The package re-exports the Django side lazily: importing it loads no writer.
    assert "conversations.importers.writer" not in loaded
    assert "conversations.importers.services" not in loaded


def test_a_script_parses_and_builds_a_transcript_without_django():
    script = (
        "import dataclasses, json, sys\n"
        "from conversations.importers.base import ImportReport, Limits\n"
        "from conversations.importers.parsers import PARSERS\n"
        "from conversations.importers.tree import build\n"
        "limits = Limits(**{f.name: 10**9 for f in dataclasses.fields(Limits)})\n"
        "report = ImportReport(file='pi.jsonl', format='pi')\n"
        f"sources = list(PARSERS['pi']({str(PI_SESSION)!r}, report=report, limits=limits))\n"
        "built = [build(s, limits) for s in sources]\n"
        "print(json.dumps({'messages': [len(b.messages) for b in built],\n"
        "                  'modules': sorted(sys.modules)}))\n"
    )
    out = json.loads(run_fresh(script))
    assert len(out["messages"]) == 1 and out["messages"][0] > 0
    assert not forbidden_roots(set(out["modules"])), forbidden_roots(set(out["modules"]))


def test_it_re_exports_the_package_names_lazily():
    # Callers keep writing ``from conversations.importers import transcript_import``.
    for name in importers.__all__:
        assert getattr(importers, name) is not None, name
    from conversations.importers.services import transcript_import

    assert importers.transcript_import is transcript_import
