"""Operator commands: create_api_token, seed_demo and bench_tree."""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from io import StringIO
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db.models import Count
from django.test import TestCase, TransactionTestCase, override_settings

from compaction.models import CompactionRecord
from conversations import selectors
from conversations.management.commands.bench_tree import BENCH_USERNAME
from conversations.management.commands.seed_demo import DEMO_TITLE, LONG_MODEL, LONG_TITLE
from conversations.models import ApiToken, Checkpoint, Conversation, Message
from conversations.providers import resolve_model
from tests.builders import make_user, new_conversation
from tests.sample_loaders import requires_samples


def run(*args: Any, **options: Any) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err, **options)
    return out.getvalue(), err.getvalue()


def texts(message: Message) -> str:
    return " ".join(p.get("text", "") for p in message.parts)


class CreateApiTokenTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")
        new_conversation(cls.user, "a>b", title="alice's notes")

    def test_the_printed_secret_authenticates_against_the_api(self) -> None:
        out, _ = run("create_api_token", "alice", "--name", "laptop")
        secret = out.splitlines()[1]
        assert secret.startswith("arb_")
        assert f'curl -H "Authorization: Bearer {secret}"' in out
        assert "http://127.0.0.1:8000/api/conversations" in out
        token = ApiToken.objects.get(user=self.user)
        assert token.name == "laptop"
        assert secret not in (token.token_hash, token.prefix)  # only a hash is stored

        response = self.client.get("/api/conversations", HTTP_AUTHORIZATION=f"Bearer {secret}")
        assert response.status_code == 200
        assert [c["title"] for c in response.json()["items"]] == ["alice's notes"]
        assert self.client.get("/api/conversations").status_code == 401

    def test_each_run_creates_a_new_token(self) -> None:
        first, _ = run("create_api_token", "alice")
        second, _ = run("create_api_token", "alice")
        assert first.splitlines()[1] != second.splitlines()[1]
        assert ApiToken.objects.filter(user=self.user, name="cli").count() == 2

    def test_an_unknown_user_is_a_clear_error(self) -> None:
        with pytest.raises(CommandError, match="no user named 'nobody'"):
            run("create_api_token", "nobody")
        assert not ApiToken.objects.exists()

    def test_an_inactive_user_gets_no_token(self) -> None:
        make_user("bob")
        get_user_model().objects.filter(username="bob").update(is_active=False)
        with pytest.raises(CommandError, match="inactive"):
            run("create_api_token", "bob")
        assert not ApiToken.objects.exists()


@override_settings(DEBUG=True)
class SeedDemoTests(TestCase):
    def counts(self) -> dict[str, int]:
        return {
            "users": get_user_model().objects.count(),
            "conversations": Conversation.objects.count(),
            "messages": Message.objects.count(),
            "checkpoints": Checkpoint.objects.count(),
        }

    def test_it_creates_the_admin_and_says_how_to_log_in(self) -> None:
        out, _ = run("seed_demo")
        admin = get_user_model().objects.get(username="admin")
        assert admin.is_superuser and admin.is_staff and admin.check_password("admin")
        assert "http://127.0.0.1:8000/admin/" in out
        assert "http://127.0.0.1:8000/" in out
        assert "password: admin" in out
        assert "local use only" in out

    @requires_samples
    def test_it_imports_the_real_sample_transcripts_once(self) -> None:
        run("seed_demo")
        admin = get_user_model().objects.get(username="admin")
        formats = {
            m.metadata["source"]["format"]
            for m in Message.objects.filter(conversation__owner=admin, origin="import")
        }
        assert formats == {"chatgpt", "openwebui", "claude-code", "pi"}
        count = Conversation.objects.filter(owner=admin).count()
        run("seed_demo")
        assert Conversation.objects.filter(owner=admin).count() == count

    def test_without_the_samples_it_says_so_and_builds_the_rest(self) -> None:
        with tempfile.TemporaryDirectory() as empty:
            nowhere = str(Path(empty) / "samples")
            with mock.patch.dict(os.environ, {"ARBOR_SAMPLES": nowhere}):
                out, _ = run("seed_demo")
        assert f"No sample transcripts at {nowhere}; none imported." in out
        admin = get_user_model().objects.get(username="admin")
        assert not Message.objects.filter(conversation__owner=admin, origin="import").exists()
        titles = set(Conversation.objects.filter(owner=admin).values_list("title", flat=True))
        assert {DEMO_TITLE, LONG_TITLE} <= titles

    def test_it_builds_a_long_session_compacted_with_the_free_rungs(self) -> None:
        out, _ = run("seed_demo")
        admin = get_user_model().objects.get(username="admin")
        long = Conversation.objects.get(owner=admin, title=LONG_TITLE)
        record = CompactionRecord.objects.get(conversation=long)
        # Larger than the demo model's window, brought under its budget by pages alone.
        assert record.status == "ready" and record.anchor_id == long.tip_id
        assert record.tokens_before > resolve_model(LONG_MODEL).context_window
        assert record.tokens_after <= record.budget_tokens
        assert record.model_calls == 0 and record.rungs[-1]["rung"] == "snapshot"
        assert record.pages.count() >= 2
        assert f'"{LONG_TITLE}"' in out and "after compaction (snapshot)" in out

    def test_it_builds_the_demo_tree(self) -> None:
        run("seed_demo")
        admin = get_user_model().objects.get(username="admin")
        demo = Conversation.objects.get(owner=admin, title=DEMO_TITLE)
        messages = list(Message.objects.filter(conversation=demo))
        by_id = {m.id: m for m in messages}

        # Edit and regenerate each left a pair of siblings.
        crowded = (
            Message.objects.filter(conversation=demo)
            .values("parent_id")
            .annotate(n=Count("id"))
            .filter(n__gte=2)
        )
        assert len(crowded) >= 2
        for origin in ("edit", "regenerate"):
            m = next(m for m in messages if m.origin == origin)
            siblings = selectors.message_siblings(message=m)
            assert len(siblings.ids) == 2 and siblings.index == 1

        # A tool call answered by its result, right below it.
        call = next(m for m in messages if any(p["type"] == "tool_call" for p in m.parts))
        result = next(m for m in messages if m.role == "tool")
        assert result.parent_id == call.id
        assert result.parts[0]["call_id"] == call.parts[0]["id"]

        # A checkpoint and a rewind: the digest hangs below the checkpoint's message and
        # names the tip of the abandoned branch.
        checkpoint = Checkpoint.objects.get(conversation=demo, label="before-budget")
        assert checkpoint.state == "live"
        assert checkpoint.digest_message_id is not None
        digest = by_id[checkpoint.digest_message_id]
        assert digest.origin == "digest" and digest.parent_id == checkpoint.message_id
        abandoned = by_id[uuid.UUID(digest.metadata["abandoned_tip"])]
        assert str(abandoned.id) in texts(digest)
        assert abandoned.depth > by_id[checkpoint.message_id].depth
        path = selectors.message_path(conversation_id=demo.pk, tip_id=demo.tip_id)
        assert digest in path and abandoned not in path

        # A fork of one of its messages, with a turn of its own.
        fork = Conversation.objects.get(forked_from__conversation=demo)
        assert fork.owner == admin
        assert fork.forked_from_id is not None
        forked_from = by_id[fork.forked_from_id]
        fork_path = selectors.message_path(conversation_id=fork.pk, tip_id=fork.tip_id)
        assert len(fork_path) == forked_from.depth + 1 + 2
        assert all(m.conversation_id == fork.pk for m in fork_path)
        assert fork_path[forked_from.depth].metadata["fork_of"] == str(forked_from.id)
        assert fork_path[-1].origin == "turn"

        # A little Korean, intact in the source and in the fork's copy.
        assert any("감사합니다" in texts(m) for m in messages)
        assert any("감사합니다" in texts(m) for m in fork_path)

    def test_a_second_run_creates_nothing(self) -> None:
        run("seed_demo")
        before = self.counts()
        out, _ = run("seed_demo")
        assert self.counts() == before
        assert "exists" in out
        assert "password: admin (unless you changed it)" in out

    def test_an_existing_admin_is_left_alone(self) -> None:
        admin = make_user("admin", password="s3cret-local")
        run("seed_demo")
        admin.refresh_from_db()
        assert admin.check_password("s3cret-local") and not admin.is_superuser
        assert Conversation.objects.filter(owner=admin, title=DEMO_TITLE).exists()

    @override_settings(DEBUG=False)
    def test_it_refuses_without_debug_unless_forced(self) -> None:
        with pytest.raises(CommandError, match="DEBUG=1"):
            run("seed_demo")
        assert not get_user_model().objects.exists()
        run("seed_demo", "--force")
        assert get_user_model().objects.filter(username="admin").exists()


class BenchTreeTests(TestCase):
    def test_small_run_prints_one_json_object_and_cleans_up(self) -> None:
        owner = make_user("carol")
        keep, _ = new_conversation(owner, "a>b>c")
        out, err = run("bench_tree", "--depth", "200", "--nodes", "2000", "--repeat", "1")

        report = json.loads(out)
        assert set(report) >= {
            "database",
            "sizes",
            "path",
            "pk_fetch",
            "path_over_pk",
            "tip_move",
            "fork",
            "targets",
            "all_targets_met",
        }
        assert report["sizes"]["depth"] == 200 and report["sizes"]["nodes"] == 2000
        assert report["path"]["rows"] == report["pk_fetch"]["rows"] == 200
        assert report["path"]["queries"] == 1
        assert report["pk_fetch"]["queries"] >= 1
        for figure in (
            report["path"],
            report["pk_fetch"],
            *report["tip_move"].values(),
            *report["fork"].values(),
        ):
            assert figure["seconds"] > 0 and len(figure["runs"]) == 1
            assert 0 < figure["cpu_seconds"] <= figure["seconds"] * 1.5 + 0.02
        assert report["tip_move"]["large"]["nodes"] == 2000
        assert report["fork"]["large"]["messages"] == 200
        assert set(report["targets"]) == {
            "path_at_most_2x_pk_fetch",
            "tip_move_constant_queries",
            "fork_constant_queries",
            "fork_at_most_1s_on_postgresql",
        }
        for target in report["targets"].values():
            assert isinstance(target["met"], bool) and isinstance(target["applies"], bool)
        assert report["targets"]["tip_move_constant_queries"]["met"]
        assert report["targets"]["fork_constant_queries"]["met"]
        assert "measuring" in err

        # Nothing of the bench is left; other data is untouched.
        assert not get_user_model().objects.filter(username=BENCH_USERNAME).exists()
        assert list(Conversation.objects.all()) == [keep]
        assert Message.objects.count() == 3

    def test_a_failing_run_still_cleans_up(self) -> None:
        with (
            mock.patch("conversations.services.tip_move", side_effect=RuntimeError("boom")),
            pytest.raises(RuntimeError),
        ):
            run("bench_tree", "--depth", "20", "--nodes", "50", "--repeat", "1")
        assert not Conversation.objects.exists()
        assert not Message.objects.exists()
        assert not get_user_model().objects.exists()

    def test_sizes_are_checked(self) -> None:
        with pytest.raises(CommandError):
            run("bench_tree", "--repeat", "0")
        with pytest.raises(CommandError):
            run("bench_tree", "--depth", "3")


class BenchImportTests(TransactionTestCase):
    def test_it_imports_a_generated_session_and_reports_peak_memory(self) -> None:
        out = StringIO()
        call_command("bench_import", "--mb", "1", stdout=out, stderr=StringIO())
        figures = json.loads(out.getvalue())["import"]
        assert figures["file_mb"] >= 1 and figures["conversations"] == 1
        assert figures["imported"] and figures["messages"] > 200 and figures["messages"] % 4 == 0
        assert figures["peak_rss_mb"] > 0 and figures["within_limit"] is True
        # The child's CPU, not counting children waited for before it.
        assert 0 < figures["cpu_seconds"] < figures["wall_seconds"] + 1
        assert not Conversation.objects.exists()
        assert not get_user_model().objects.filter(username__startswith="__arbor").exists()


def test_a_process_cpu_time_is_read_from_proc() -> None:
    import os
    import time

    from conversations.management.liveserver import process_cpu_seconds

    before = process_cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.1
    while time.process_time() < deadline:
        pass  # 0.1 s of this process's CPU
    spent = process_cpu_seconds(os.getpid()) - before
    assert 0.05 <= spent <= 1.0  # /proc counts in ticks (1/100 s here)
