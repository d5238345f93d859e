"""Concurrent writers on one conversation: the compare-and-set on ``version`` lets exactly
one of two racing writers through, and the other learns it was late with nothing written.

PostgreSQL only: SQLite serialises every writer on one database lock, so there is no race
to observe. Each thread uses its own connection (Django's are per thread) and closes it
when done; a Barrier releases both writers at the same moment.
"""

from __future__ import annotations

import threading
import time
import unittest
from collections.abc import Callable
from functools import partial
from typing import Any
from unittest import mock

import pytest
from django.db import connection, connections, transaction
from django.test import TransactionTestCase, override_settings

from conversations import selectors, services
from conversations.errors import Conflict, NotFound, StaleVersion
from conversations.models import Checkpoint, Conversation, Message
from tests.builders import make_user, new_conversation, text

ROUNDS = 20


def race(*calls: Callable[[], Any]) -> list[Any]:
    """Run each call in its own thread, all released together; return each call's result
    or the exception it raised, in order."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            # Connect first, so that connecting does not stagger the writers.
            connection.ensure_connection()
            barrier.wait(timeout=30)
            results[i] = call()
        except BaseException as exc:
            results[i] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a writer is stuck (deadlock?)"
    return results


def split(results: list[Any], loser: type[BaseException]) -> tuple[list[int], list[Any]]:
    """Indexes of the winners, and the losers' exceptions; anything else fails the test."""
    winners = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
    losers = [r for r in results if isinstance(r, BaseException)]
    for exc in losers:
        if not isinstance(exc, loser):
            raise AssertionError(f"unexpected failure in a writer: {exc!r}") from exc
    return winners, losers


@pytest.mark.postgres
@unittest.skipUnless(
    connection.vendor == "postgresql",
    "needs PostgreSQL: SQLite serialises writers, so there is no race to test",
)
class ConcurrentWriterTests(TransactionTestCase):
    def setUp(self) -> None:
        self.user = make_user("alice")

    def test_it_lets_exactly_one_of_two_tip_moves_through(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c, b>d")
        messages = Message.objects.count()
        targets = [n["c"].id, n["a"].id]
        for round_no in range(ROUNDS):
            conv.refresh_from_db()
            version = conv.version
            results = race(
                *(
                    partial(
                        services.tip_move,
                        conversation=conv,
                        message_id=target,
                        expected_version=version,
                    )
                    for target in targets
                )
            )
            winners, losers = split(results, StaleVersion)
            assert len(winners) == 1 and len(losers) == 1, (round_no, results)
            (winner,) = winners
            conv.refresh_from_db()
            assert conv.version == version + 1, round_no
            assert conv.tip_id == targets[winner] == results[winner].tip
            assert results[winner].version == version + 1
            # The loser is told the state that beat it.
            assert losers[0].extra == {"tip": str(targets[winner]), "version": version + 1}
        assert Message.objects.count() == messages
        assert conv.version == 4 + ROUNDS

    def test_it_writes_exactly_one_of_two_turns_with_the_same_version(self) -> None:
        conv, _ = new_conversation(self.user, "a>b")
        for round_no in range(ROUNDS):
            conv.refresh_from_db()
            version, tip, count = conv.version, conv.tip_id, Message.objects.count()
            results = race(
                *(
                    partial(
                        services.turn_append,
                        conversation=conv,
                        parent_id=tip,
                        expected_version=version,
                        messages=[
                            {"role": "user", "parts": text(f"q{round_no}-{who}")},
                            {"role": "assistant", "parts": text(f"a{round_no}-{who}")},
                        ],
                    )
                    for who in ("x", "y")
                )
            )
            winners, losers = split(results, StaleVersion)
            assert len(winners) == 1 and len(losers) == 1, (round_no, results)
            won = results[winners[0]]
            lost = "xy"[1 - winners[0]]
            conv.refresh_from_db()
            assert conv.version == version + 1 and conv.tip_id == won.tip
            assert Message.objects.count() == count + 2
            parents = Message.objects.filter(pk__in=won.message_ids).values_list(
                "parent_id", flat=True
            )
            assert set(parents) == {tip, won.message_ids[0]}
            texts = {m.parts[0]["text"] for m in Message.objects.filter(depth__gte=2)}
            assert f"q{round_no}-{lost}" not in texts and f"a{round_no}-{lost}" not in texts
            assert losers[0].extra["version"] == version + 1
        # No turn was lost: the path from the tip holds every winning turn in order.
        path = selectors.message_path(conversation_id=conv.pk, tip_id=conv.tip_id)
        assert len(path) == 2 + 2 * ROUNDS
        assert [m.depth for m in path] == list(range(2 + 2 * ROUNDS))
        assert Message.objects.count() == 2 + 2 * ROUNDS

    def test_it_gives_a_label_to_exactly_one_of_two_checkpoints(self) -> None:
        conv, _ = new_conversation(self.user, "a>b")
        version = conv.version
        for round_no in range(ROUNDS):
            label = f"cp{round_no}"
            results = race(
                *(
                    partial(services.checkpoint_create, conversation=conv, label=label)
                    for _ in range(2)
                )
            )
            winners, losers = split(results, Conflict)
            assert len(winners) == 1 and len(losers) == 1, (round_no, results)
            assert losers[0].code == "label_taken"
            live = Checkpoint.objects.filter(conversation=conv, label=label, state="live")
            assert list(live.values_list("pk", flat=True)) == [results[winners[0]].pk]
        assert Checkpoint.objects.count() == ROUNDS
        conv.refresh_from_db()
        assert conv.version == version

    def test_a_turn_and_a_tip_move_on_the_same_version_do_not_both_land(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c")
        for round_no in range(ROUNDS):
            conv.refresh_from_db()
            version, tip, count = conv.version, conv.tip_id, Message.objects.count()
            results = race(
                partial(
                    services.turn_append,
                    conversation=conv,
                    parent_id=tip,
                    expected_version=version,
                    messages=[
                        {
                            "role": "user" if round_no % 2 else "assistant",
                            "parts": text(f"t{round_no}"),
                        }
                    ],
                ),
                partial(
                    services.tip_move,
                    conversation=conv,
                    message_id=n["a"].id,
                    expected_version=version,
                ),
            )
            winners, _ = split(results, StaleVersion)
            assert len(winners) == 1, (round_no, results)
            conv.refresh_from_db()
            assert conv.version == version + 1
            if winners == [0]:
                assert conv.tip_id == results[0].tip
                assert Message.objects.count() == count + 1
            else:
                assert conv.tip_id == n["a"].id
                assert Message.objects.count() == count
            # Put the tip back on a leaf for the next round.
            leaf = Message.objects.filter(conversation=conv).order_by("-depth", "-created_at")[0]
            services.tip_move(conversation=conv, message_id=leaf.id, expected_version=conv.version)

    def test_two_rewinds_on_the_same_version_leave_one_digest(self) -> None:
        conv, n = new_conversation(self.user, "a>b")
        services.checkpoint_create(conversation=conv, label="cp")
        for round_no in range(ROUNDS):
            conv.refresh_from_db()
            version, count = conv.version, Message.objects.count()
            results = race(
                *(
                    partial(
                        services.checkpoint_rewind,
                        conversation=conv,
                        label="cp",
                        expected_version=version,
                    )
                    for _ in range(2)
                )
            )
            winners, _ = split(results, StaleVersion)
            assert len(winners) == 1, (round_no, results)
            conv.refresh_from_db()
            assert conv.version == version + 1
            assert conv.tip_id == results[winners[0]].digest_message
            assert Message.objects.count() == count + 1
            assert Message.objects.filter(origin="digest", parent=n["b"]).count() == round_no + 1
        assert Conversation.objects.get(pk=conv.pk).version == 2 + ROUNDS

    def test_a_write_that_waited_on_a_delete_finds_nothing(self) -> None:
        """A writer queued behind a delete of its conversation hears "not found" (404),
        never a crash, and leaves no orphan rows behind."""
        writers: dict[str, Callable[..., Any]] = {
            "turn_append": lambda conv, n: services.turn_append(
                conversation=conv,
                parent_id=n["b"].id,
                expected_version=conv.version,
                messages=[{"role": "user", "parts": text("late")}],
            ),
            "tip_move": lambda conv, n: services.tip_move(
                conversation=conv, message_id=n["a"].id, expected_version=conv.version
            ),
            "checkpoint_create": lambda conv, n: services.checkpoint_create(
                conversation=conv, label="new"
            ),
            "rewind": lambda conv, n: services.checkpoint_rewind(conversation=conv, label="cp"),
        }
        for name, write in writers.items():
            conv, n = new_conversation(self.user, "a>b")
            services.checkpoint_create(conversation=conv, label="cp")
            conv.refresh_from_db()
            locked = threading.Event()

            def delete(conv: Conversation = conv, locked: threading.Event = locked) -> None:
                with transaction.atomic():
                    # Hold the row so that the writer queues behind the delete.
                    Conversation.objects.select_for_update().get(pk=conv.pk)
                    locked.set()
                    time.sleep(0.3)
                    services.conversation_delete(conversation=conv)

            def late_write(
                conv: Conversation = conv,
                n: dict[str, Message] = n,
                write: Callable[..., Any] = write,
                locked: threading.Event = locked,
            ) -> Any:
                assert locked.wait(timeout=30)
                return write(conv, n)

            deleted, written = race(delete, late_write)
            with self.subTest(name):
                assert deleted is None, deleted
                assert isinstance(written, NotFound), (name, repr(written))
                assert not Conversation.objects.filter(pk=conv.pk).exists()
                assert not Message.objects.filter(conversation_id=conv.pk).exists()
                assert not Checkpoint.objects.filter(conversation_id=conv.pk).exists()


@pytest.mark.postgres
@unittest.skipUnless(
    connection.vendor == "postgresql",
    "needs PostgreSQL: SQLite serialises writers, so there is no race to test",
)
class ConcurrentRetryTests(TransactionTestCase):
    """Five retries at once after a failed turn: exactly one runs it; the others are
    told a turn is running (or, if it already finished, that nothing is left to retry),
    and the prompt and its answer are written once."""

    def test_exactly_one_of_five_concurrent_retries_runs_the_turn(self) -> None:
        from conversations import turns
        from conversations.models import AttemptStatus, TurnAttempt

        user = make_user("retrier")
        for round_no in range(5):
            conv, n = new_conversation(user, "a>b")
            TurnAttempt.objects.create(
                conversation=conv,
                parent=n["b"],
                input_parts=text(f"the prompt {round_no}"),
                model="fake/demo",
                status=AttemptStatus.FAILED,
                error_code="interrupted",
            )
            before = Message.objects.filter(conversation=conv).count()

            def retry(conv: Conversation = conv) -> Any:
                return list(turns.retry_events(user=user, conversation_id=conv.pk))

            results = race(*(retry for _ in range(5)))
            winners, _ = split(results, Conflict)
            assert len(winners) == 1, (round_no, results)
            assert results[winners[0]][-1]["event"] == "done", results[winners[0]][-1]
            assert Message.objects.filter(conversation=conv).count() == before + 2
            prompts = Message.objects.filter(conversation=conv, role="user").count()
            assert prompts == 2, prompts  # a's prompt and the retried one, once
            attempts = TurnAttempt.objects.filter(conversation=conv)
            assert attempts.filter(status=AttemptStatus.COMPLETED).count() == 1
            assert not attempts.filter(status=AttemptStatus.RUNNING).exists()


@pytest.mark.postgres
@unittest.skipUnless(
    connection.vendor == "postgresql",
    "needs PostgreSQL: SQLite serialises writers, so there is no race to test",
)
class DeleteRaceTests(TransactionTestCase):
    """Delete racing a fork, a chat turn and a tip move: each ends as it would alone or
    with a clear 404/409, never an integrity error or a half-made fork."""

    def test_delete_against_fork_chat_and_tip_move(self) -> None:
        from conversations import turns
        from conversations.errors import ArborError

        user = make_user("racer")
        for round_no in range(10):
            conv, n = new_conversation(user, "a>b>c, b>d")
            conv.model = "fake/demo"
            conv.save()

            def fork(conv: Conversation = conv, n: Any = n) -> Any:
                return services.conversation_fork(message=n["c"], owner=user)

            def chat(conv: Conversation = conv) -> Any:
                events = list(turns.turn_events(conversation=conv, parts=text("hi")))
                return events[-1]

            def move(conv: Conversation = conv, n: Any = n) -> Any:
                return services.tip_move(
                    conversation=conv, message_id=n["d"].id, expected_version=conv.version
                )

            def delete(conv: Conversation = conv) -> Any:
                return services.conversation_delete(conversation=conv)

            results = race(fork, chat, move, delete)
            for result in results:
                if isinstance(result, BaseException):
                    assert isinstance(result, ArborError), (round_no, repr(result))
                    assert result.status in (404, 409), (round_no, result.status)
            assert not Conversation.objects.filter(pk=conv.pk).exists()
            assert not Message.objects.filter(conversation_id=conv.pk).exists()
            made = results[0]
            if not isinstance(made, BaseException):
                # A fork that was made is whole, and no longer linked to the deleted one.
                made.refresh_from_db()
                assert made.forked_from_id is None
                assert Message.objects.filter(conversation=made).count() == 3


@pytest.mark.postgres
@unittest.skipUnless(
    connection.vendor == "postgresql",
    "needs PostgreSQL: SQLite serialises writers, so there is no race to test",
)
class JobLimitRaceTests(TransactionTestCase):
    """Compactions queued at the same moment: a user's limit of open jobs holds, and one
    anchor still gets one job (the second asker finds it), never an integrity error."""

    def enqueue(self, conv: Conversation, trigger: str = "manual") -> Callable[[], Any]:
        from compaction import services as compaction

        assert conv.tip_id is not None
        return partial(
            compaction.job_enqueue,
            conversation=conv,
            anchor_id=conv.tip_id,
            model_id="openai/test",
            trigger=trigger,
        )

    @override_settings(ARBOR_COMPACTION_MAX_OPEN=2)
    def test_six_at_once_leave_the_users_limit_open_and_refuse_the_rest(self) -> None:
        from compaction.models import CompactionJob
        from conversations.errors import TooManyRequests

        for round_no in range(5):
            user = make_user(f"busy{round_no}")
            convs = [new_conversation(user, "a>b")[0] for _ in range(6)]
            with mock.patch("arbor.jobs.job_dispatch"):  # the jobs stay queued
                results = race(*(self.enqueue(c) for c in convs))
            winners, refused = split(results, TooManyRequests)
            assert len(winners) == 2 and len(refused) == 4, results
            assert CompactionJob.objects.filter(conversation__owner=user).count() == 2

    def test_two_at_once_on_one_anchor_make_one_job(self) -> None:
        from compaction.models import CompactionJob

        user = make_user("twice")
        for _ in range(5):
            conv, _ = new_conversation(user, "a>b")
            with mock.patch("arbor.jobs.job_dispatch"):
                results = race(self.enqueue(conv), self.enqueue(conv, "proactive"))
            assert not any(isinstance(r, BaseException) for r in results), results
            assert sorted(r is None for r in results) == [False, True]
            assert CompactionJob.objects.filter(conversation=conv).count() == 1
            CompactionJob.objects.filter(conversation=conv).delete()
