"""``manage.py seed_demo``: a local admin account and a small demo tree (``make run``).

Idempotent: ``make run`` calls it on every start. The ``admin`` account is created only
when no user of that name exists (an existing one, and its password, are left alone),
and the demo tree only when the admin has no conversation with the demo title. The tree
is written through the real services, in one transaction: a failed run leaves nothing
half-built and the next run tries again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from conversations import selectors, services
from conversations.importers import transcript_import
from conversations.models import Checkpoint, Conversation, Message

ADMIN_USERNAME = "admin"
ADMIN_PASSWORD = "admin"
DEMO_TITLE = "Demo: planning a trip to Jeju"
# Real transcripts imported for the demo, from ../shared/samples (see its SOURCES.md).
SAMPLE_FILES = [
    ("chatgpt/librechat__chatgpt-tree.json", "chatgpt"),
    ("openwebui/openwebui-importer__webui-json.json", "openwebui"),
    ("claude-code/claude-code-log__dag_compact_after_rewind.jsonl", "claude-code"),
    ("pi/pi-mono__compact.jsonl", "pi"),
]
FORK_TITLE = "Demo fork: a Jeju food day"
LONG_TITLE = "Demo: a long agent session (compacted)"
LONG_MODEL = "fake/demo"  # a 16k-token window with vision: the session is far larger


def _text(value: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": value}]


_CURRENCIES = ("EUR", "JPY", "KRW", "USD")


def _failing_run(step: int) -> str:
    """A made-up pytest failure log for the long demo session (about 3,500 characters)."""
    lines = [f"$ pytest -q tests/test_invoices_{step % 6}.py -vv", ""]
    for case in range(40):
        amount = 1000 + step * 37 + case * 13
        verdict = "FAILED" if (case + step) % 4 == 0 else "PASSED"
        lines.append(
            f"tests/test_invoices_{step % 6}.py::test_round_{_CURRENCIES[case % 4].lower()}"
            f"_{case:02d}[{amount}.{case:02d}] {verdict}"
        )
    lines += [
        "",
        "=" * 30 + " FAILURES " + "=" * 30,
        f"_____ test_round_eur_{step % 40:02d} _____",
        "    def test_round(amount, expected):",
        ">       assert round_amount(amount, 'EUR') == expected",
        f"E       AssertionError: assert Decimal('{step}.005') == Decimal('{step}.01')",
        "E        +  where Decimal('0.005') = round_amount(Decimal('0.005'), 'EUR')",
        "",
        "billing/money.py:42: in round_amount",
        "    return amount.quantize(EXPONENTS[currency], rounding=ROUND_HALF_EVEN)",
        f"{3 + step % 3} failed, {15 - step % 3} passed in 0.{40 + step}s",
    ]
    return "\n".join(lines)


def _user(value: str) -> dict[str, Any]:
    return {"role": "user", "parts": _text(value)}


def _assistant(value: str) -> dict[str, Any]:
    return {"role": "assistant", "parts": _text(value)}


class Command(BaseCommand):
    help = (
        "For local development only: create the admin account (user admin, password "
        "admin) if it does not exist, and a small demo conversation tree (edit, "
        "regenerate, tool call, checkpoint and rewind, fork) if the admin has none. "
        "Safe to run repeatedly; refuses to run unless DEBUG=1 (or --force)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--force",
            action="store_true",
            help="run even though DEBUG is off (the admin password is 'admin': never on a "
            "server others can reach)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not settings.DEBUG and not options["force"]:
            raise CommandError(
                "seed_demo creates an account with the password 'admin' and is meant for "
                "local development: run it with DEBUG=1 (as `make run` does), or pass "
                "--force if you really mean it"
            )
        admin = self._ensure_admin()
        demo = Conversation.objects.filter(owner=admin, title=DEMO_TITLE).first()
        if demo is None:
            demo = self._build_demo(admin)
            self.stdout.write(f'Created the demo conversation "{DEMO_TITLE}".')
            self._build_long_session(admin)
            # With the demo, once: a second run finds the demo and imports nothing.
            self._import_samples(admin)
        else:
            self.stdout.write(f'The demo conversation "{DEMO_TITLE}" exists; left as it is.')
        self._summary(admin, demo)

    # --- real transcripts ------------------------------------------------------------

    def _import_samples(self, admin: Any) -> None:
        """Import the real sample transcripts beside the project (../shared/samples, or
        ARBOR_SAMPLES as for the benches), when they are there: a fresh clone has none."""
        default = Path(settings.BASE_DIR).parent / "shared" / "samples"
        samples = Path(os.environ.get("ARBOR_SAMPLES") or default)
        if not samples.is_dir():
            self.stdout.write(f"No sample transcripts at {samples}; none imported.")
            return
        for name, kind in SAMPLE_FILES:
            path = samples / name
            if path.exists():
                report = transcript_import(owner_id=admin.pk, path=path, format=kind, filename=name)
                count = len(report.conversation_ids)
                self.stdout.write(f"Imported {name}: {count} conversation(s).")

    # --- the admin account -----------------------------------------------------------

    def _ensure_admin(self) -> Any:
        user_model = get_user_model()
        admin = user_model._default_manager.filter(username=ADMIN_USERNAME).first()
        if admin is None:
            admin = user_model.objects.create_superuser(
                username=ADMIN_USERNAME, email="", password=ADMIN_PASSWORD
            )
            self.stdout.write(f"Created the local admin account {ADMIN_USERNAME!r}.")
            password = ADMIN_PASSWORD
        else:
            self.stdout.write(f"The account {ADMIN_USERNAME!r} exists; its password is unchanged.")
            password = f"{ADMIN_PASSWORD} (unless you changed it)"
        self.stdout.write(
            "Log in at http://127.0.0.1:8000/admin/ then open http://127.0.0.1:8000/\n"
            f"  user: {ADMIN_USERNAME}\n"
            f"  password: {password}\n"
            "  This account is for local use only: never expose this server to others."
        )
        return admin

    # --- the demo tree ---------------------------------------------------------------

    @transaction.atomic
    def _build_demo(self, admin: Any) -> Conversation:
        conv = services.conversation_create(
            owner=admin,
            title=DEMO_TITLE,
            system_prompt="You are a friendly, practical travel planner.",
        )
        t1 = services.turn_append(
            conversation=conv,
            parent_id=None,
            expected_version=conv.version,
            messages=[
                _user("I'd like to spend four days on Jeju Island in October. Where do I start?"),
                _assistant(
                    "October is a lovely time for Jeju: dry, mild and the silver grass is out. "
                    "Most visitors split the island in two: the east (Seongsan Ilchulbong, "
                    "Udo island) and the west (Hyeopjae beach, the tea fields). Do you lean "
                    "towards hiking or towards beaches and food?"
                ),
            ],
        )
        t2 = services.turn_append(
            conversation=conv,
            parent_id=t1.tip,
            expected_version=t1.version,
            messages=[
                _user("Mostly hiking."),
                _assistant(
                    "Then plan Hallasan for day 2: the Seongpanak trail to the summit takes "
                    "about 9 hours return, and you must book the trail online in advance."
                ),
            ],
        )
        hiking_prompt = t2.message_ids[0]
        # Edit the second prompt: a sibling of the original, which stays in the tree.
        edit = services.message_edit(
            conversation=conv,
            message_id=hiking_prompt,
            parts=_text("Mostly beaches and cafés, with one easy hike."),
            expected_version=t2.version,
        )
        answer = services.turn_append(
            conversation=conv,
            parent_id=edit.tip,
            expected_version=edit.version,
            messages=[
                _assistant(
                    "Then stay near Hamdeok beach: cafés on the sand, and Saebyeol Oreum, an "
                    "easy 30-minute climb with a view over the west coast."
                )
            ],
        )
        # Regenerate that answer: another sibling, and the tip moves to it.
        regen = services.message_regenerate(
            conversation=conv,
            message_id=answer.tip,
            messages=[
                _assistant(
                    "A relaxed plan: day 1 Hamdeok beach, day 2 Udo island by ferry, day 3 "
                    "Osulloc tea fields and Hyeopjae beach, day 4 Seongsan Ilchulbong at "
                    "sunrise (a 25-minute climb)."
                )
            ],
            expected_version=answer.version,
        )
        # A turn with a tool call and its result, and a little Korean.
        weather = services.turn_append(
            conversation=conv,
            parent_id=regen.tip,
            expected_version=regen.version,
            messages=[
                _user("What weather should I pack for? And how do I thank people in Korean?"),
                {
                    "role": "assistant",
                    "parts": [
                        {
                            "type": "tool_call",
                            "id": "call_weather_1",
                            "name": "get_climate",
                            "arguments": {"place": "Jeju", "month": "October"},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "parts": [
                        {
                            "type": "tool_result",
                            "call_id": "call_weather_1",
                            "is_error": False,
                            "parts": _text(
                                '{"mean_high_c": 22, "mean_low_c": 15, "rain_days": 6, '
                                '"wind": "often strong on the coast"}'
                            ),
                        }
                    ],
                },
                _assistant(
                    "Expect 15-22 °C with a few rainy days and a lot of wind: bring layers "
                    "and a windproof jacket. To thank people, say 감사합니다 (gamsahamnida); "
                    "in a café, 잘 먹었습니다 (jal meogeosseumnida) after the meal is a nice "
                    "touch."
                ),
            ],
        )
        services.checkpoint_create(conversation=conv, label="before-budget")
        budget = services.turn_append(
            conversation=conv,
            parent_id=weather.tip,
            expected_version=weather.version,
            messages=[
                _user("Let's work out a budget with a rental car and a sea-view hotel."),
                _assistant(
                    "Roughly: flights Seoul-Jeju ₩60,000-₩120,000 each way, a small rental "
                    "car ₩40,000 a day plus fuel, a sea-view hotel ₩150,000-₩250,000 a night. "
                    "Four days come to about ₩1,100,000 per person."
                ),
            ],
        )
        # Abandon the budget branch: back to the checkpoint, with a digest of what was seen.
        rewound = services.checkpoint_rewind(
            conversation=conv,
            label="before-budget",
            digest="We priced a rental car and a sea-view hotel (about ₩1.1M each for four "
            "days) and decided that was too much; plan around buses instead.",
            expected_version=budget.version,
        )
        services.turn_append(
            conversation=conv,
            parent_id=rewound.tip,
            expected_version=rewound.version,
            messages=[
                _assistant(
                    "Understood: no car. Jeju's express buses (151 and 181) link the airport, "
                    "the east and the west coast; a T-money card works on all of them."
                )
            ],
        )
        # Fork the weather answer into its own conversation and carry on there.
        fork_point = Message.objects.select_related("conversation").get(pk=weather.tip)
        fork = services.conversation_fork(message=fork_point, owner=admin, title=FORK_TITLE)
        services.turn_append(
            conversation=fork,
            parent_id=fork.tip_id,
            expected_version=fork.version,
            messages=[
                _user("Just food for one day: where do I try Jeju black pork (흑돼지)?"),
                _assistant(
                    "Go to Black Pork Street (흑돼지 거리) in Jeju City for dinner, have "
                    "hairtail soup or abalone porridge at Dongmun market for lunch, and a "
                    "hallabong orange juice wherever you see one."
                ),
            ],
        )
        conv.refresh_from_db()
        return conv

    # --- a compacted agent session -----------------------------------------------------

    @transaction.atomic
    def _build_long_session(self, admin: Any) -> None:
        """An agent session about 1.5x the demo model's window whose tool results all
        failed (so elision cannot help), compacted once with the free rungs: the context
        panel and the staff audit have snapshot pages to show. OCR is not measured here
        (tens of seconds); "Compact now" on the panel measures it."""
        from compaction.services import context_build
        from conversations.providers import resolve_model

        conv = services.conversation_create(
            owner=admin,
            title=LONG_TITLE,
            model=LONG_MODEL,
            system_prompt="You are a coding agent. Run the tests after every change.",
        )
        version, tip = conv.version, None
        first = _user(
            "The nightly build of the billing service fails. Find out why and fix it "
            "without changing the public API; keep every currency rounding rule as it is."
        )
        for step in range(24):
            call = {
                "type": "tool_call",
                "id": f"call_{step}",
                "name": "run_tests",
                "arguments": {"path": f"tests/test_invoices_{step % 6}.py", "verbose": True},
            }
            result = {
                "type": "tool_result",
                "call_id": f"call_{step}",
                "is_error": True,
                "parts": _text(_failing_run(step)),
            }
            turn = services.turn_append(
                conversation=conv,
                parent_id=tip,
                expected_version=version,
                messages=[
                    first if step == 0 else _user(f"Go on with step {step + 1}."),
                    {"role": "assistant", "parts": [call]},
                    {"role": "tool", "parts": [result]},
                    _assistant(
                        f"Step {step + 1}: invoice {1000 + step} still rounds "
                        f"{step % 3 + 1} cent(s) off in half-even mode; next I check "
                        f"`round_amount()` in billing/money.py for the {_CURRENCIES[step % 4]} "
                        "case."
                    ),
                ],
            )
            version, tip = turn.version, turn.tip
        conv.refresh_from_db()
        built = context_build(
            conversation=conv,
            spec=resolve_model(LONG_MODEL),
            tip_id=conv.tip_id,
            trigger="manual",
            allow_summary=False,
        )
        record = built.record
        rungs = [r["rung"] for r in record.rungs] if record is not None else []
        self.stdout.write(
            f'Created "{LONG_TITLE}": {built.estimate} of {built.budget} tokens after '
            f"compaction ({', '.join(rungs) or 'none'})."
        )

    def _summary(self, admin: Any, demo: Conversation) -> None:
        conversations = Conversation.objects.filter(owner=admin).count()
        messages = selectors.message_count(conversation=demo)
        path = selectors.message_path(conversation_id=demo.pk, tip_id=demo.tip_id)
        checkpoints = [cp.label for cp in Checkpoint.objects.filter(conversation=demo)]
        forks = list(selectors.conversation_forks(conversation=demo))
        lines = [
            f"{ADMIN_USERNAME} has {conversations} conversation(s). "
            f'"{demo.title}": {messages} messages, {len(path)} on the current branch, '
            f"checkpoints: {', '.join(checkpoints) or 'none'}.",
        ]
        lines += [
            f'  fork "{f.title}": {selectors.message_count(conversation=f)} messages' for f in forks
        ]
        self.stdout.write("\n".join(lines))
