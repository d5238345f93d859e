"""bench_turns runs end to end against the fake provider and cleans up after itself."""

from __future__ import annotations

import io
import json

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import TransactionTestCase

from conversations.models import Conversation, Message, TurnAttempt


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
