"""bench_turns runs end to end against the fake provider and cleans up after itself."""

from __future__ import annotations

import io
import json

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection, transaction
from django.test import TransactionTestCase

from conversations import services
from conversations.management.benchdb import vacuum
from conversations.models import Conversation, Message, TurnAttempt


@pytest.mark.slow  # a bench run (minutes on a busy machine)
class BenchTurnsTests(TransactionTestCase):
    def test_it_prints_json_figures_and_leaves_nothing_behind(self) -> None:
        out = io.StringIO()
        call_command(
            "bench_turns", "--turns", "3", "--concurrency", "3", stdout=out, stderr=io.StringIO()
        )
        figures = json.loads(out.getvalue())
        assert figures["overhead"]["turns"] == 3
        assert figures["overhead"]["transcript_writes"] == 1
        assert figures["overhead"]["median_ms"] > 0
        assert figures["concurrent"]["completed"] == 3, figures["concurrent"]["errors"]
        rewind = figures["rewind"]
        assert rewind["tokens_saved"] > 0
        assert rewind["tokens_saved"] == (
            rewind["without_rewind"]["next_request_tokens"]
            - rewind["with_rewind"]["next_request_tokens"]
        )
        assert set(figures["targets"]) == {
            "overhead_at_most_10ms",
            "one_transcript_transaction_per_turn",
        }
        assert not Conversation.objects.exists()
        assert not Message.objects.exists()
        assert not TurnAttempt.objects.exists()
        assert not get_user_model().objects.exists()


class BenchVacuumTests(TransactionTestCase):
    """A bench that deleted what it wrote leaves PostgreSQL without its dead rows (this
    cluster runs without autovacuum: bench_turns measured 15-24 ms a turn on top of the
    last run's dead rows, 16 ms after a vacuum, A/B in one session)."""

    def test_it_reclaims_the_dead_rows_of_the_tables_named(self) -> None:
        from tests.builders import grow, make_user

        conv = services.conversation_create(owner=make_user("dead"), title="d")
        grow(conv, 40)
        services.conversation_delete(conversation=conv)
        vacuum(Message, Conversation)  # SQLite: nothing to do, and no error
        if connection.vendor != "postgresql":
            return
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT n_dead_tup, last_vacuum IS NOT NULL FROM pg_stat_user_tables"
                " WHERE relname = %s",
                [Message._meta.db_table],
            )
            dead, vacuumed = cursor.fetchone()
        assert vacuumed and dead == 0

    def test_inside_a_transaction_it_does_nothing(self) -> None:
        with transaction.atomic():
            vacuum(Message)  # VACUUM cannot run here: not tried
            assert not Message.objects.exists()
