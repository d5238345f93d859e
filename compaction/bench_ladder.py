"""Bench: what each free rung of the ladder saves on the real sample sessions.

``run()`` returns a JSON-able dict; ``python -m compaction.bench_ladder`` prints it. Pure
Python, no database. For every large-enough sample it builds a view whose budget is a
quarter of the original estimate (a Claude-billed vision model) and runs the ladder with
no summarizer, so the numbers are what elision, image stripping and snapshot pages save
with zero model calls. Pages come from compaction.render when it is importable, else
from the density-model fake in tests/sample_loaders.py (same page size and billing).

It also reports how the estimator compares with the usage Claude measured on the
samples (before any compaction by the recording tool).

The samples and their loaders live with the tests (tests/sample_loaders.py): they read
``../shared/samples`` in place, so this must run from the project root.
"""

from __future__ import annotations

import importlib
import json
import statistics
import time
from dataclasses import replace
from typing import Any

from compaction.estimate import usage_pairs
from compaction.ladder import ContextView, ModelInfo, RenderFn, run_ladder

BUDGET_SHARE = 0.25
MODEL = ModelInfo(context_window=200_000, max_output=8_192, vision=True, image_billing="claude")


def _renderer() -> tuple[str, RenderFn]:
    try:
        render = getattr(importlib.import_module("compaction.render"), "render_pages", None)
    except ImportError:
        render = None
    if render is not None:
        return "compaction.render", render
    from tests.sample_loaders import DensityRenderer

    return "density-fake", DensityRenderer()


def _estimator_check(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Measured prompt tokens over our raw estimate, for each request with usage. The
    first request's excess over our estimate is taken as the fixed part the messages do
    not show (system prompt, tool schemas)."""
    pairs = usage_pairs(messages, rule=MODEL.image_billing)
    if len(pairs) < 5:
        return None
    first_raw, first_measured = pairs[0]
    fixed = first_measured - first_raw
    ratios = [(measured - fixed) / raw for raw, measured in pairs[1:] if raw > 1_000]
    if not ratios:
        return None
    return {
        "requests": len(ratios),
        "fixed_tokens": fixed,
        "median_measured_over_estimate": round(statistics.median(ratios), 3),
        "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
    }


def run(*, budget_share: float = BUDGET_SHARE, min_messages: int = 20) -> dict[str, Any]:
    from tests.sample_loaders import load_samples

    renderer_name, render = _renderer()
    out: dict[str, Any] = {
        "renderer": renderer_name,
        "budget_share": budget_share,
        "model": vars(MODEL),
        "samples": {},
        "estimator": {},
    }
    for sample in load_samples():
        path = sample.messages[: sample.compactions[0]] if sample.compactions else sample.messages
        check = _estimator_check(path)
        if check:
            out["estimator"][sample.name] = check
        if len(sample.messages) < min_messages:
            continue
        started = time.perf_counter()
        full = ContextView.build(
            sample.messages, budget_tokens=0, model=MODEL, blob_sizes=sample.blob_sizes
        )
        original = full.estimate()
        view = ContextView.build(
            sample.messages,
            budget_tokens=int(original * budget_share),
            model=MODEL,
            blob_sizes=sample.blob_sizes,
        )
        result = run_ladder(view, render=render)
        seconds = time.perf_counter() - started
        # The most the free rungs can do: a budget nothing fits, so every rung runs and
        # the tail shrinks to its minimum.
        floor = run_ladder(replace(view, budget_tokens=1), render=render).view.estimate()
        final = result.view.estimate()
        rungs = [
            {
                "rung": report.rung,
                "before": report.tokens_before,
                "after": report.tokens_after,
                "saved": report.saved,
                "saved_pct_of_original": round(100 * report.saved / original, 1),
                "replaced": len(report.replaced),
                **{k: v for k, v in report.details.items() if k in ("pages", "page_tokens")},
            }
            for report in result.reports
        ]
        out["samples"][sample.name] = {
            "messages": len(sample.messages),
            "turns": len(view.turn_starts),
            "tool_results": sum(1 for m in sample.messages if m["role"] == "tool"),
            "tokens": original,
            "budget": view.budget_tokens,
            "rungs": rungs,
            "final": final,
            "cut_pct": round(100 * (1 - final / original), 1),
            "max_cut_pct": round(100 * (1 - floor / original), 1),
            "fits": result.fits,
            "model_calls": result.model_calls,
            "seconds": round(seconds, 3),
        }
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
