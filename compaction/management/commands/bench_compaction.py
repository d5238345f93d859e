"""``manage.py bench_compaction``: the compaction figures `make bench` prints.

- ``render``: snapshot render speed (chars/s), billed image tokens against estimated
  text tokens per page for English and Korean text, OCR character error rate per
  density setting (compaction.bench_render);
- ``ladder``: per-rung token savings on each real sample transcript with zero model
  calls, and how many elided results a later message refers to
  (compaction.bench_ladder; it reads ../shared/samples in place, so run it from the
  project root, as make does);
- ``calibration``: the estimator's learned factor after a 20-turn tool-using chat on the
  loopback provider, against the provider's true count (compaction.bench_calibration).

One JSON object per line on stdout.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from compaction import bench_calibration, bench_ladder, bench_render


class Command(BaseCommand):
    help = "Benchmark the snapshot renderer and the compaction ladder; print JSON."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--ocr-pages", type=int, default=4, help="pages OCR'd per density (0 skips OCR)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        self.stderr.write("rendering and OCR…")
        self.stdout.write(json.dumps({"render": bench_render.run(ocr_pages=options["ocr_pages"])}))
        self.stderr.write("running the ladder on the samples…")
        ladder = bench_ladder.run(ocr_pages=options["ocr_pages"])
        self.stdout.write(json.dumps({"ladder": ladder}))
        self.stderr.write("a 20-turn tool-using chat on the loopback provider…")
        self.stdout.write(json.dumps({"calibration": bench_calibration.run()}))
