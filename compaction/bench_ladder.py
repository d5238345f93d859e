"""Bench: what each free rung of the ladder saves on the real sample sessions.

``run()`` returns a JSON-able dict; ``manage.py bench_compaction`` prints it (``python -m
compaction.bench_ladder`` too). No database. For every large-enough sample it builds a
view whose budget is a quarter of the original estimate (a Claude-billed vision model)
and runs the ladder with no summarizer, so the numbers are what elision, image stripping
and snapshot pages (drawn by compaction.render) save with zero model calls.

It also reports how the estimator compares with the usage Claude measured on the
samples (before any compaction by the recording tool).

The samples are read with Arbor's own importers (compaction.bench_samples): they read
``../shared/samples`` in place, so this must run from the project root.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import re
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from compaction.estimate import usage_pairs
from compaction.ladder import ContextView, ModelInfo, RenderFn, page_parts, run_ladder
from compaction.render import render_pages

BUDGET_SHARE = 0.25
MODEL = ModelInfo(context_window=200_000, max_output=8_192, vision=True, image_billing="claude")


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


# An independent reading of "referenced later" (its own patterns, not the ladder's).
_TOKEN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]*[A-Za-z0-9_]")
_PIECE = re.compile(r"[A-Za-z0-9_]+")
_NUMBER = re.compile(r"(?<![\w.-])\d{3,}(?![\w])|^\s*(\d{2,})[:|\t]", re.MULTILINE)


def _is_distinctive(token: str) -> bool:
    """Paths, dotted names, code identifiers and ids: what a later message quotes."""
    if len(token) < 4 or not any(c.isalpha() for c in token):
        return False
    if "/" in token or "_" in token or "." in token.strip("."):
        return True
    inner_capital = any(a.islower() and b.isupper() for a, b in itertools.pairwise(token))
    return inner_capital or (any(c.isdigit() for c in token) and len(token) >= 6)


def _tokens(text: str) -> set[str]:
    """Every token and every alphanumeric piece of it (``a/b.py`` gives ``a``, ``b``,
    ``py`` and ``a/b.py``), so a name seen inside a longer one counts as seen."""
    out = set(_TOKEN.findall(text))
    out |= {p for t in list(out) for p in _PIECE.findall(t)}
    for token in list(out):
        if "/" in token:
            out.add(token.rstrip("/").rsplit("/", 1)[-1])
    return out


def _numbers(text: str) -> set[str]:
    return {m.group(1) or m.group(0) for m in _NUMBER.finditer(text)}


def _text(part: dict[str, Any]) -> str:
    if part.get("type") == "text":
        return str(part.get("text") or "")
    if part.get("type") == "tool_call":
        return json.dumps(part.get("arguments"), ensure_ascii=False)
    if part.get("type") == "tool_result":
        return "\n".join(_text(p) for p in part.get("parts") or ())
    return ""


def elision_check(messages: list[dict[str, Any]], elided: list[str]) -> dict[str, Any]:
    """An independent check of the elision rung: an elided result counts as *referenced
    later* when a later message quotes its message or call id; when later narration or
    tool arguments use a path, file name, identifier or id it was the first to show (not
    asked for by its own call), or a number it holds (3+ digits, or a line number); or
    when a later tool call's arguments reuse any word of 4+ characters it was the first
    to show. The goal is at most 2% of the elided results."""
    index = {m["id"]: i for i, m in enumerate(messages)}
    texts = ["\n".join(_text(p) for p in m["parts"]) for m in messages]
    seen_before: list[set[str]] = []
    seen: set[str] = set()
    for text in texts:
        seen_before.append(set(seen))
        seen |= _tokens(text)
    later_said: list[set[str]] = [set() for _ in messages]
    later_args: list[set[str]] = [set() for _ in messages]
    said: set[str] = set()
    args: set[str] = set()
    for i in range(len(messages) - 1, -1, -1):
        later_said[i], later_args[i] = set(said), set(args)
        message = messages[i]
        if message["role"] == "tool":
            continue
        for part in message["parts"]:
            text = _text(part)
            if part.get("type") == "tool_call":
                args |= _tokens(text)
            if part.get("type") in ("text", "tool_call"):
                said |= _tokens(text) | _numbers(text)
    calls = {
        str(p.get("id")): _tokens(_text(p)) | _numbers(_text(p))
        for m in messages
        for p in m["parts"]
        if p.get("type") == "tool_call"
    }
    referenced: list[dict[str, Any]] = []
    for mid in dict.fromkeys(elided):
        i = index[mid]
        later_text = "\n".join(texts[i + 1 :])
        for part in messages[i]["parts"]:
            if part.get("type") != "tool_result":
                continue
            text = _text(part)
            call_id = str(part.get("call_id"))
            asked = calls.get(call_id, set())
            revealed = _tokens(text) - seen_before[i] - asked
            hits = {t for t in revealed if _is_distinctive(t)} & later_said[i]
            hits |= (_numbers(text) - asked) & later_said[i]
            hits |= {t for t in revealed if len(t) >= 4} & later_args[i]
            quoted = mid in later_text or call_id in later_text
            if hits or quoted:
                referenced.append({"message": mid, "words": sorted(hits)[:5], "id_quoted": quoted})
    count = len(dict.fromkeys(elided))
    share = 100 * len(referenced) / count if count else 0.0
    return {
        "elided": count,
        "referenced_later": len(referenced),
        "referenced_pct": round(share, 2),
        "goal_pct": 2.0,
        "met": share <= 2.0,
        "examples": referenced[:3],
    }


# Exact tokens a model must copy back (a recall id, a path to open, a call to answer).
TOKEN_KINDS = {
    "numbers": re.compile(r"(?<![\w.])\d{2,}(?![\w])"),
    "paths": re.compile(r"(?:[\w.-]+/)+[\w.-]+"),
    "hex": re.compile(
        r"(?<![\w-])(?=[0-9a-f-]*\d)(?=[0-9a-f-]*[a-f])[0-9a-f]{8,}(?:-[0-9a-f]{4,})*(?![\w-])"
    ),
    "call_ids": re.compile(r"\b(?:toolu|call)_[A-Za-z0-9]{6,}\b"),
}
EXACT_GOAL_PCT = 98.0
CER_GOAL_PCT = 2.0


# The instrument's own ceiling: the same tokens, a line each, in a large clean TrueType
# monospace (Debian's fonts-dejavu-core), read by the same tesseract. Below the goal
# there, no glyph design on a snapshot page can reach it as tesseract measures it.
CONTROL_FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf")
CONTROL_PX = 28
CONTROL_TOKENS = 120


def _control(tokens: dict[str, set[str]]) -> dict[str, Any] | None:
    """Tesseract's exact reading of each kind's tokens drawn at CONTROL_PX in
    CONTROL_FONT (at most CONTROL_TOKENS of each); None without the font."""
    from PIL import Image, ImageDraw, ImageFont

    from compaction.render.ocr import ocr_image

    if not CONTROL_FONT.is_file():
        return None
    font = ImageFont.truetype(str(CONTROL_FONT), CONTROL_PX)
    line = CONTROL_PX + 10
    out: dict[str, Any] = {"font": CONTROL_FONT.name, "px": CONTROL_PX}
    for kind, found in tokens.items():
        chosen = sorted(found)[:CONTROL_TOKENS]
        if not chosen:
            continue
        width = int(max(font.getlength(t) for t in chosen)) + 40
        image = Image.new("L", (width, line * len(chosen) + 40), 255)
        pen = ImageDraw.Draw(image)
        for i, token in enumerate(chosen):
            pen.text((20, 20 + i * line), token, fill=0, font=font)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        # Read as the pages are: whitespace dropped, each token looked for in the rest.
        read = re.sub(r"\s+", "", ocr_image(buffer.getvalue(), scale=1) or "")
        hit = sum(token in read for token in chosen)
        out[kind] = {"tokens": len(chosen), "exact_pct": round(100 * hit / len(chosen), 1)}
    return out


def _ocr_one(page: Any) -> str:
    from compaction.render.ocr import ocr_image

    return ocr_image(page.png, row_boxes=page.row_boxes) or ""


def legibility(pages: list[Any]) -> dict[str, Any] | None:
    """Tesseract's reading of snapshot pages the ladder made: the share of each kind of
    exact token on them that comes back character for character (rows joined, so a
    token wrapped across rows still counts), and the character error rate. None
    without tesseract."""
    from concurrent.futures import ThreadPoolExecutor

    from compaction.render import tesseract_available
    from compaction.render.ocr import cer, reference_text

    if not pages or not tesseract_available("eng"):
        return None
    with ThreadPoolExecutor(2) as pool:  # tesseract runs as a subprocess
        readings = list(pool.map(_ocr_one, pages))
    found = {kind: [0, 0] for kind in TOKEN_KINDS}
    seen: dict[str, set[str]] = {kind: set() for kind in TOKEN_KINDS}
    errors = []
    for page, reading in zip(pages, readings, strict=True):
        reference = reference_text(page)
        errors.append(cer(reference, reading))
        drawn, read = reference.replace("\n", ""), re.sub(r"\s+", "", reading)
        for kind, pattern in TOKEN_KINDS.items():
            for token in set(pattern.findall(drawn)):
                seen[kind].add(token)
                found[kind][1] += 1
                found[kind][0] += token in read
    exact = {
        kind: {
            "tokens": total,
            "exact_pct": round(100 * hit / total, 1) if total else None,
            "met": (100 * hit / total >= EXACT_GOAL_PCT) if total else None,
        }
        for kind, (hit, total) in found.items()
    }
    mean = 100 * statistics.mean(errors)
    return {
        "pages": len(pages),
        "exact": exact,
        "exact_goal_pct": EXACT_GOAL_PCT,
        "tesseract_control": _control(seen),
        "cer_mean_pct": round(mean, 2),
        "cer_max_pct": round(100 * max(errors), 2),
        "cer_goal_pct": CER_GOAL_PCT,
        "cer_met": mean <= CER_GOAL_PCT,
    }


def _capturing(render: RenderFn, drawn: dict[str, Any]) -> RenderFn:
    def capture(segments: Any, **options: Any) -> Any:
        result = render(segments, **options)
        for page in result.pages:
            drawn[hashlib.sha256(page.png).hexdigest()] = page
        return result

    return capture


def run(
    *, budget_share: float = BUDGET_SHARE, min_messages: int = 20, ocr_pages: int = 4
) -> dict[str, Any]:
    # Imported here: the importers need Django's settings, set up by then (see __main__).
    from compaction.bench_samples import load_samples

    render: RenderFn = render_pages
    out: dict[str, Any] = {
        "renderer": "compaction.render",
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
        drawn: dict[str, Any] = {}
        result = run_ladder(view, render=_capturing(render, drawn))
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
        pages = [drawn[p["blob"]] for p in page_parts(result.view) if p["blob"] in drawn]
        sampled = pages[:: max(1, len(pages) // ocr_pages)][:ocr_pages] if ocr_pages else []
        elision = next((r for r in result.reports if r.rung == "elision"), None)
        elided = [r.message_id for r in elision.replaced] if elision else []
        out["samples"][sample.name] = {
            "elision": {
                "tokens_saved": elision.saved if elision else 0,
                **elision_check(list(view.source), elided),
            },
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
            "legibility": legibility(sampled),
            "model_calls": result.model_calls,
            "seconds": round(seconds, 3),
        }
    return out


if __name__ == "__main__":
    import os

    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "arbor.settings")
    django.setup()
    print(json.dumps(run(), indent=2))
