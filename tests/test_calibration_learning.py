"""Learning the estimator's calibration from a provider's count: every turn and every
gateway request does it, so it is two queries in the common case (one when the caller
knows the calibration its request was estimated with), and an observation made by
another process between the read and the write is kept."""

from __future__ import annotations

from typing import Any
from unittest import mock

from django.test import TestCase

from compaction import services as compaction
from compaction.estimate import Calibration
from compaction.models import ModelCalibration

MODEL = "openai/calibration-test"


class CalibrationLearningTests(TestCase):
    def test_the_first_observation_makes_the_row_and_later_ones_take_two_queries(self) -> None:
        for _ in range(60):  # until the factor settles (a move over 1% is also an event)
            compaction.calibration_observe(model_id=MODEL, raw_estimate=1000, measured=1300)
        with self.assertNumQueries(2):  # the read, the guarded UPDATE
            learned = compaction.calibration_observe(
                model_id=MODEL, raw_estimate=1000, measured=1300
            )
        expected = Calibration()
        for _ in range(61):
            expected = expected.observe(1000, 1300)
        row = ModelCalibration.objects.get(model=MODEL)
        self.assertEqual((row.samples, learned.samples), (expected.samples, expected.samples))
        self.assertAlmostEqual(row.factor, expected.factor)

    def test_an_observation_made_between_the_read_and_the_write_is_kept(self) -> None:
        compaction.calibration_observe(model_id=MODEL, raw_estimate=1000, measured=1300)
        real = Calibration.observe
        raced: list[bool] = []

        def observe(calibration: Calibration, raw: int, measured: int) -> Any:
            if not raced:  # another process learns after this one read the row
                raced.append(True)
                compaction.calibration_observe(model_id=MODEL, raw_estimate=1000, measured=1500)
            return real(calibration, raw, measured)

        with mock.patch.object(Calibration, "observe", observe):
            compaction.calibration_observe(model_id=MODEL, raw_estimate=1000, measured=1100)
        expected = Calibration().observe(1000, 1300).observe(1000, 1500).observe(1000, 1100)
        row = ModelCalibration.objects.get(model=MODEL)
        self.assertEqual(row.samples, expected.samples)
        self.assertAlmostEqual(row.factor, expected.factor)

    def test_a_known_calibration_saves_the_read_and_a_stale_one_is_not_learned_from(
        self,
    ) -> None:
        current = Calibration()
        for _ in range(60):  # until the factor settles (a move over 1% is also an event)
            compaction.calibration_observe(model_id=MODEL, raw_estimate=1000, measured=1300)
            current = current.observe(1000, 1300)
        stale = current
        with self.assertNumQueries(1):  # the guarded UPDATE only
            compaction.calibration_observe(
                model_id=MODEL, raw_estimate=1000, measured=1200, known=current
            )
        current = current.observe(1000, 1200)
        # A request estimated before another one learned: what it knew is stale, so the
        # UPDATE misses and the row is read again under a lock (no observation is lost).
        compaction.calibration_observe(
            model_id=MODEL, raw_estimate=1000, measured=1100, known=stale
        )
        expected = current.observe(1000, 1100)
        row = ModelCalibration.objects.get(model=MODEL)
        self.assertEqual(row.samples, expected.samples)
        self.assertAlmostEqual(row.factor, expected.factor)
