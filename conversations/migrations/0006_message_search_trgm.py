"""PostgreSQL only: a trigram index so the message search's case-insensitive substring
match (``search_text__icontains`` → ``UPPER(search_text) LIKE UPPER('%…%')``) does not
scan every message. On SQLite both operations do nothing.

The index lives outside the model's Meta: SQLite cannot build a GIN index, and Django
re-creates Meta indexes whenever it rebuilds a SQLite table in a later migration.
"""

from django.contrib.postgres.operations import TrigramExtension
from django.db import migrations

INDEX = "msg_search_text_trgm"


def create_index(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    table = schema_editor.quote_name(apps.get_model("conversations", "Message")._meta.db_table)
    schema_editor.execute(
        f"CREATE INDEX IF NOT EXISTS {INDEX} ON {table} USING gin (UPPER(search_text) gin_trgm_ops)"
    )


def drop_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX IF EXISTS {INDEX}")


class Migration(migrations.Migration):

    dependencies = [
        ("conversations", "0005_message_search_text"),
    ]

    operations = [
        # CREATE EXTENSION pg_trgm: a no-op off PostgreSQL. pg_trgm is a trusted extension
        # (PostgreSQL 13+), so the database owner may create it without superuser rights.
        TrigramExtension(),
        migrations.RunPython(create_index, drop_index),
    ]
