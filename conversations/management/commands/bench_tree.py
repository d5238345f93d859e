"""``manage.py bench_tree``: time the tree's hot paths on the configured database.

Builds, for a throwaway user, a chain of ``--depth`` messages, a bushy tree of
``--nodes`` messages (each node's parent drawn at random among the nodes before it) and
a 10-node conversation, then measures:

- path load (``selectors.message_path``) root→tip of the chain, against fetching the
  same rows by primary key (``Message.objects.filter(pk__in=ids)``): the ratio of the
  two is the figure that matters;
- tip move (``services.tip_move``) on the 10-node and on the bushy conversation;
- fork (``services.conversation_fork``) of a 10-message and of a ``--depth``-message
  path.

Each figure is the median over ``--repeat`` runs after one warm-up, with the garbage
collector paused inside a timed run (as timeit does). Timings are taken with query
logging off (as in production: logging the 10,000 parameters of an IN list is
not free); query counts come from a separate run under CaptureQueriesContext. One JSON
object goes to stdout, progress to stderr. Everything built is deleted at the end (and
leftovers of an interrupted run at the start).
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext, override_settings
from django.utils import timezone

from conversations import selectors, services
from conversations.management.benchdb import vacuum
from conversations.models import Conversation, Message, Origin, Role
from conversations.parts import searchable_text

BENCH_USERNAME = "__arbor_bench__"
SMALL_NODES = 10
INSERT_CHUNK = 10_000
# Some ordinary chat text, so rows are not unrealistically thin.
FILLER = (
    "Benchmark message {i}: a paragraph of ordinary chat text, long enough that the row "
    "is not unrealistically thin, but short enough that transfer does not dominate."
)

T = TypeVar("T")


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 6)


@contextmanager
def _no_query_logging() -> Iterator[None]:
    """Time as production runs: no SQL logging (DEBUG=1 would otherwise log every query,
    and SQLite formats each IN-list parameter for the log)."""
    forced = connection.force_debug_cursor
    connection.force_debug_cursor = False
    try:
        with override_settings(DEBUG=False):
            yield
    finally:
        connection.force_debug_cursor = forced


class Command(BaseCommand):
    help = (
        "Benchmark path load, tip move and fork on the configured database (SQLite by "
        "default, PostgreSQL when DATABASE_URL says so) and print one JSON object with "
        "each figure and whether its target is met. Builds throwaway data for a "
        f"dedicated user ({BENCH_USERNAME}) and deletes it afterwards."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--depth", type=int, default=10_000, help="length of the chain (default %(default)s)"
        )
        parser.add_argument(
            "--nodes",
            type=int,
            default=100_000,
            help="messages in the bushy tree (default %(default)s)",
        )
        parser.add_argument(
            "--repeat", type=int, default=5, help="timed runs per figure (default %(default)s)"
        )
        parser.add_argument(
            "--seed", type=int, default=1, help="random seed for the bushy tree's shape"
        )

    # --- output ----------------------------------------------------------------------

    def _progress(self, message: str) -> None:
        self.stderr.write(message, style_func=str)

    # --- entry point -----------------------------------------------------------------

    def handle(self, *args: Any, **options: Any) -> None:
        depth: int = options["depth"]
        nodes: int = options["nodes"]
        repeat: int = options["repeat"]
        if depth < SMALL_NODES or nodes < SMALL_NODES:
            raise CommandError(f"--depth and --nodes must be at least {SMALL_NODES}")
        if repeat < 1:
            raise CommandError("--repeat must be at least 1")
        self.rng = random.Random(options["seed"])
        self.now = timezone.now()

        self._cleanup()  # leftovers of an interrupted run
        user = get_user_model().objects.create_user(username=BENCH_USERNAME)
        user.set_unusable_password()
        user.save(update_fields=["password"])
        try:
            report = self._run(user, depth=depth, nodes=nodes, repeat=repeat)
        finally:
            self._progress("cleaning up")
            self._cleanup()
        self.stdout.write(json.dumps(report, indent=2, ensure_ascii=False))

    def _cleanup(self) -> None:
        user = get_user_model().objects.filter(username=BENCH_USERNAME).first()
        if user is None:
            return
        for conv in Conversation.objects.filter(owner=user):
            services.conversation_delete(conversation=conv)
        user.delete()
        vacuum(Message)  # 110,000 rows just deleted

    # --- setup -----------------------------------------------------------------------

    def _row(self, conv: Conversation, i: int, parent: uuid.UUID | None, depth: int) -> Message:
        parts = [{"type": "text", "text": FILLER.format(i=i)}]
        return Message(
            id=uuid.uuid4(),
            conversation_id=conv.pk,
            parent_id=parent,
            role=Role.USER if depth % 2 == 0 else Role.ASSISTANT,
            parts=parts,
            # bulk_create skips Message.save(), which fills the search text otherwise.
            search_text=searchable_text(parts),
            depth=depth,
            origin=Origin.TURN,
            metadata={},
            created_at=self.now + timedelta(microseconds=i),
        )

    def _build(self, conv: Conversation, parents: list[int | None], what: str) -> list[Message]:
        """Insert messages whose parents are given by index (parents before children),
        in bulk, and leave the tip on the last one."""
        rows: list[Message] = []
        depths: list[int] = []
        for i, p in enumerate(parents):
            d = 0 if p is None else depths[p] + 1
            depths.append(d)
            rows.append(self._row(conv, i, None if p is None else rows[p].id, d))
        with transaction.atomic():
            for start in range(0, len(rows), INSERT_CHUNK):
                Message.objects.bulk_create(rows[start : start + INSERT_CHUNK], batch_size=2000)
                done = min(start + INSERT_CHUNK, len(rows))
                self._progress(f"  {what}: {done:,}/{len(rows):,} messages")
            Conversation.objects.filter(pk=conv.pk).update(tip_id=rows[-1].id, version=1)
        conv.refresh_from_db()
        return rows

    # --- measuring -------------------------------------------------------------------

    def _measure(
        self,
        label: str,
        fn: Callable[[], T],
        *,
        repeat: int,
        after: Callable[[T], None] | None = None,
    ) -> dict[str, Any]:
        """One run under CaptureQueriesContext for the query count (it doubles as the
        warm-up), then ``repeat`` timed runs without query logging. ``after`` undoes
        what a run wrote, outside the timing."""
        self._progress(f"measuring {label} ({repeat} runs)")
        with CaptureQueriesContext(connection) as captured:
            result = fn()
        queries = len(captured.captured_queries)
        if after is not None:
            after(result)
        times: list[float] = []
        cpu: list[float] = []
        for _ in range(repeat):
            # As timeit does: no garbage collection pause lands inside a timed run.
            gc.collect()
            gc.disable()
            try:
                with _no_query_logging():
                    start, cpu_start = time.perf_counter(), time.process_time()
                    result = fn()
                    times.append(time.perf_counter() - start)
                    cpu.append(time.process_time() - cpu_start)
            finally:
                gc.enable()
            if after is not None:
                after(result)
        return {
            "seconds": _median(times),
            # This process's CPU (not the database server's, on PostgreSQL).
            "cpu_seconds": _median(cpu),
            "queries": queries,
            "runs": [round(t, 6) for t in times],
        }

    def _in_list_chunk(self) -> int | None:
        """How many ids one IN list may hold on this backend (None: no limit)."""
        limit = connection.ops.max_in_list_size()
        if limit:
            return int(limit)
        if connection.vendor == "sqlite":
            import sqlite3

            connection.ensure_connection()
            raw = connection.connection
            if raw is not None and hasattr(raw, "getlimit"):
                return int(raw.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
            return connection.features.max_query_params
        return None

    def _run(self, user: Any, *, depth: int, nodes: int, repeat: int) -> dict[str, Any]:
        setup_start = time.perf_counter()
        self._progress(f"building a chain of {depth:,} messages")
        chain = services.conversation_create(owner=user, title="bench chain")
        chain_rows = self._build(chain, [None, *range(depth - 1)], "chain")

        self._progress(f"building a bushy tree of {nodes:,} messages")
        bushy = services.conversation_create(owner=user, title="bench bushy tree")
        bushy_parents: list[int | None] = [None]
        bushy_parents += [self.rng.randrange(i) for i in range(1, nodes)]
        bushy_rows = self._build(bushy, bushy_parents, "bushy tree")

        small = services.conversation_create(owner=user, title="bench small")
        small_parents: list[int | None] = [None, 0, 1, 2, 2, 4, 5, 1, 7, 8][:SMALL_NODES]
        small_rows = self._build(small, small_parents, "small tree")

        if connection.vendor == "postgresql" and not connection.in_atomic_block:
            # Fresh bulk-loaded rows: give the planner the statistics autovacuum would.
            with connection.cursor() as cursor:
                cursor.execute(f"ANALYZE {connection.ops.quote_name(Message._meta.db_table)}")
        setup_seconds = time.perf_counter() - setup_start

        # Path load against fetching the same rows by primary key.
        tip_id = chain_rows[-1].id
        ids = [m.id for m in chain_rows]
        path_rows: list[int] = []

        def load_path() -> None:
            path = selectors.message_path(conversation_id=chain.pk, tip_id=tip_id)
            path_rows.append(len(path))

        chunk = self._in_list_chunk() or len(ids)
        pk_rows: list[int] = []

        def fetch_by_pk() -> None:
            got = 0
            for start in range(0, len(ids), chunk):
                got += len(list(Message.objects.filter(pk__in=ids[start : start + chunk])))
            pk_rows.append(got)

        path = self._measure(f"path load at depth {depth:,}", load_path, repeat=repeat)
        path["rows"] = path_rows[-1]
        pk = self._measure(f"primary-key fetch of {depth:,} rows", fetch_by_pk, repeat=repeat)
        pk["rows"] = pk_rows[-1]
        pk["in_list_chunk"] = chunk
        if path["rows"] != depth or pk["rows"] != depth:
            raise CommandError(
                f"expected {depth} rows, the path gave {path['rows']} and the pk fetch {pk['rows']}"
            )
        ratio = round(path["seconds"] / pk["seconds"], 3) if pk["seconds"] else None

        # Tip moves: to random messages, each with the version the last move left.
        def tip_mover(conv: Conversation, rows: list[Message]) -> Callable[[], None]:
            state = {"version": Conversation.objects.get(pk=conv.pk).version}

            def move() -> None:
                target = rows[self.rng.randrange(len(rows))].id
                result = services.tip_move(
                    conversation=conv, message_id=target, expected_version=state["version"]
                )
                state["version"] = result.version

            return move

        tip_small = self._measure(
            f"tip move on {SMALL_NODES} nodes", tip_mover(small, small_rows), repeat=repeat
        )
        tip_small["nodes"] = SMALL_NODES
        tip_large = self._measure(
            f"tip move on {nodes:,} nodes", tip_mover(bushy, bushy_rows), repeat=repeat
        )
        tip_large["nodes"] = nodes

        # Forks: of a short and of the full path; each copy is deleted outside the timing.
        def forker(message_id: uuid.UUID) -> Callable[[], Conversation]:
            message = Message.objects.select_related("conversation").get(pk=message_id)
            return lambda: services.conversation_fork(message=message, owner=user)

        def drop(fork: Conversation) -> None:
            services.conversation_delete(conversation=fork)

        fork_small = self._measure(
            f"fork of a {SMALL_NODES}-message path",
            forker(chain_rows[SMALL_NODES - 1].id),
            repeat=repeat,
            after=drop,
        )
        fork_small["messages"] = SMALL_NODES
        fork_large = self._measure(
            f"fork of a {depth:,}-message path", forker(tip_id), repeat=repeat, after=drop
        )
        fork_large["messages"] = depth

        postgres = connection.vendor == "postgresql"
        targets: dict[str, dict[str, Any]] = {
            "path_at_most_2x_pk_fetch": {
                "description": f"path load of {depth:,} messages ≤ 2 × fetching them by pk",
                "value": ratio,
                "limit": 2.0,
                "met": ratio is not None and ratio <= 2.0,
                "applies": True,
            },
            "tip_move_constant_queries": {
                "description": f"tip move: same query count on {SMALL_NODES} and {nodes:,} nodes",
                "value": [tip_small["queries"], tip_large["queries"]],
                "met": tip_small["queries"] == tip_large["queries"],
                "applies": True,
            },
            "fork_constant_queries": {
                "description": f"fork: same query count for a {SMALL_NODES}- and a "
                f"{depth:,}-message path",
                "value": [fork_small["queries"], fork_large["queries"]],
                "met": fork_small["queries"] == fork_large["queries"],
                "applies": True,
            },
            "fork_at_most_1s_on_postgresql": {
                "description": f"fork of a {depth:,}-message path ≤ 1 s (target on PostgreSQL)",
                "value": fork_large["seconds"],
                "limit": 1.0,
                "met": fork_large["seconds"] <= 1.0,
                "applies": postgres,
            },
        }
        return {
            "database": {
                "vendor": connection.vendor,
                "version": ".".join(str(v) for v in connection.get_database_version()),
            },
            "sizes": {
                "depth": depth,
                "nodes": nodes,
                "small_nodes": SMALL_NODES,
                "repeat": repeat,
                "bushy_tree_height": max(m.depth for m in bushy_rows),
            },
            "setup_seconds": round(setup_seconds, 3),
            "path": path,
            "pk_fetch": pk,
            "path_over_pk": ratio,
            "tip_move": {"small": tip_small, "large": tip_large},
            "fork": {"small": fork_small, "large": fork_large},
            "targets": targets,
            "all_targets_met": all(t["met"] for t in targets.values() if t["applies"]),
        }
