"""The pure modules stay pure: the ladder, the estimator and the renderer load neither
Django nor the provider SDKs (checked in a fresh interpreter, as a newcomer's script
or a bench would import them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PURE = ["compaction.ladder", "compaction.estimate", "compaction.render", "conversations.resume"]
FORBIDDEN = ("django", "openai", "anthropic", "httpx", "httpx2", "celery", "ninja")


def loaded_after_importing(modules: list[str]) -> set[str]:
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(json.loads(out.stdout))


def test_the_pure_modules_load_no_django_and_no_sdk():
    loaded = loaded_after_importing(PURE)
    roots = {name.split(".")[0] for name in loaded}
    assert not roots & set(FORBIDDEN), sorted(roots & set(FORBIDDEN))


def test_importing_the_provider_package_does_not_load_the_clients():
    loaded = loaded_after_importing(["conversations.providers.billing"])
    assert not {"openai", "anthropic"} & {name.split(".")[0] for name in loaded}
