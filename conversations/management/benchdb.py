"""The database as a benchmark leaves it and finds it."""

from __future__ import annotations

from django.db import connection, models


def vacuum(*tables: type[models.Model]) -> None:
    """On PostgreSQL, reclaim the dead rows of these models' tables and refresh the
    planner's figures, as autovacuum would (a cluster may run without it): a bench that
    deleted what it wrote must not leave the next one planning against dead rows, nor
    measure on top of what the last one left. Not inside a transaction, where VACUUM
    cannot run (the benches' own tests); nothing to do on SQLite."""
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return
    names = ", ".join(connection.ops.quote_name(m._meta.db_table) for m in tables)
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM ANALYZE {names}")
