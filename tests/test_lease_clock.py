"""Leases and heartbeats are written and judged by the database's clock (arbor.heartbeat),
so a host whose own clock is off does not take another host's live work for dead, nor a
dead one's for alive. Each test runs this host's clock minutes off (``timezone.now``
patched) against work "of another host" (a worker identity not of this machine)."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
from django.db.models.functions import Now
from django.test import TestCase
from django.utils import timezone

from arbor.heartbeat import db_now
from compaction import services as compaction
from compaction.models import CompactionJob, JobState
from conversations import services, turns
from conversations.models import AttemptStatus, ImportJob, ImportState, TurnAttempt
from tests.builders import grow, make_user

ELSEWHERE = "another-host.example:4242:123456"  # a live process on another machine
MODEL = "openai/gpt-4o-mini"


@contextmanager
def clock_off(minutes: float) -> Iterator[None]:
    """This host's clock runs ``minutes`` ahead (or behind, when negative)."""
    real = timezone.now
    with mock.patch(
        "django.utils.timezone.now",
        side_effect=lambda: real() + datetime.timedelta(minutes=minutes),
    ):
        yield


def ago(seconds: float) -> object:
    """The database's time ``seconds`` ago, as an expression for a write."""
    return Now() - datetime.timedelta(seconds=seconds)


class LeaseClockTests(TestCase):
    def setUp(self) -> None:
        self.user = make_user("clocks")
        self.conv = services.conversation_create(owner=self.user, title="c", model=MODEL)
        grow(self.conv, 2)
        self.conv.refresh_from_db()

    def test_db_now_is_the_databases_clock_not_this_hosts(self) -> None:
        real = timezone.now()
        with clock_off(60):
            shared = db_now()
            assert timezone.now() - real > datetime.timedelta(minutes=59)
        assert shared.tzinfo is not None
        assert abs(shared - real) < datetime.timedelta(seconds=30)

    def attempt(self, beat_seconds_ago: float) -> TurnAttempt:
        attempt = TurnAttempt.objects.create(
            conversation=self.conv, input_parts=[], model=MODEL, worker=ELSEWHERE
        )
        TurnAttempt.objects.filter(pk=attempt.pk).update(heartbeat_at=ago(beat_seconds_ago))
        attempt.refresh_from_db()
        return attempt

    def test_a_live_turn_elsewhere_is_not_stale_to_a_host_whose_clock_runs_ahead(self) -> None:
        live = self.attempt(beat_seconds_ago=1)
        dead = self.attempt(beat_seconds_ago=600)  # past ARBOR_ATTEMPT_STALE_SECONDS
        with clock_off(+10):
            assert not turns.attempt_is_stale(live)
        with clock_off(-10):
            assert turns.attempt_is_stale(dead)
        # The running list reads the database's time with its rows: one query.
        with clock_off(+10), self.assertNumQueries(1):
            running = turns.turn_running(conversation=self.conv)
        assert [a.pk for a in running] == [live.pk]
        # A follower's poll too: the dead turn is said at the first read, in one query.
        with clock_off(-10), self.assertNumQueries(1):
            first = next(turns.turn_follow(attempt_id=dead.pk))
        assert first["event"] == "error" and first["error"] == "interrupted"

    def test_a_turn_just_started_on_a_host_whose_clock_runs_behind_is_alive(self) -> None:
        with clock_off(-10):  # its own time would make the attempt 10 minutes old
            attempt = services.turn_attempt_start(
                conversation=self.conv, parent_id=self.conv.tip_id, input_parts=[], model=MODEL
            )
        stored = TurnAttempt.objects.get(pk=attempt.pk)
        assert abs(stored.heartbeat_at - db_now()) < datetime.timedelta(seconds=30)
        assert not turns.attempt_is_stale(stored)

    def test_heartbeats_are_written_in_the_databases_time(self) -> None:
        attempt = self.attempt(beat_seconds_ago=600)
        with clock_off(-30):  # far behind: its own time would look dead at once
            attempt.heartbeat_at = timezone.now() - datetime.timedelta(seconds=10)
            services.turn_attempt_heartbeat(attempt=attempt)
        attempt.refresh_from_db()
        assert abs(attempt.heartbeat_at - db_now()) < datetime.timedelta(seconds=30)
        assert not turns.attempt_is_stale(attempt)
        assert attempt.status == AttemptStatus.RUNNING

    def job(self, lease_seconds_left: float) -> CompactionJob:
        assert self.conv.tip_id is not None
        job = CompactionJob.objects.create(
            conversation=self.conv, anchor_id=self.conv.tip_id, model=MODEL,
            trigger="manual", state=JobState.RUNNING, attempts=1, worker=ELSEWHERE,
        )  # fmt: skip
        CompactionJob.objects.filter(pk=job.pk).update(lease_until=ago(-lease_seconds_left))
        return job

    def test_a_leased_job_is_not_taken_by_a_host_whose_clock_runs_ahead(self) -> None:
        job = self.job(lease_seconds_left=60)
        with clock_off(+5), pytest.raises(compaction.JobBusy) as busy:
            compaction.job_claim(job_id=job.pk)
        assert 1 <= busy.value.retry_in <= 62
        job.refresh_from_db()
        assert job.worker == ELSEWHERE and job.attempts == 1

    def test_an_expired_lease_is_taken_over_by_a_host_whose_clock_runs_behind(self) -> None:
        job = self.job(lease_seconds_left=-5)
        with clock_off(-5):
            claimed = compaction.job_claim(job_id=job.pk, lease_seconds=60)
        assert claimed is not None and claimed.attempts == 2 and claimed.worker != ELSEWHERE
        # Its new lease is the database's time plus 60 s, whatever this host's clock said.
        assert claimed.lease_until is not None
        left = claimed.lease_until - db_now()
        assert datetime.timedelta(seconds=50) < left <= datetime.timedelta(seconds=60)

    def test_a_running_jobs_lease_is_renewed_in_the_databases_time(self) -> None:
        job = self.job(lease_seconds_left=1)
        with clock_off(-10):
            renew = compaction._job_lease(job).renew
            renew()
        job.refresh_from_db()
        assert job.lease_until is not None
        assert job.lease_until - db_now() > datetime.timedelta(seconds=30)

    def test_an_import_alive_elsewhere_is_not_ended_by_a_host_whose_clock_runs_ahead(
        self,
    ) -> None:
        job = ImportJob.objects.create(
            owner=self.user, filename="export.json", state=ImportState.RUNNING,
            worker=ELSEWHERE,
        )  # fmt: skip
        ImportJob.objects.filter(pk=job.pk).update(updated_at=ago(1))
        job.refresh_from_db()
        with clock_off(+10):
            assert services.import_job_sweep(job).state == ImportState.RUNNING
        ImportJob.objects.filter(pk=job.pk).update(updated_at=ago(600))
        job.refresh_from_db()
        with clock_off(-10):
            assert services.import_job_sweep(job).state == ImportState.FAILED
