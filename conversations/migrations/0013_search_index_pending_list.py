"""PostgreSQL only: a 1 MB pending list for the trigram search index (the default is
4 MB, ``gin_pending_list_limit``).

New rows go to the GIN index's pending list and are merged into the index in batches;
the list's pages stay allocated for the next batch, so the index carries up to the
limit on top of its contents: 5.0 MB instead of 1.1 MB for the 1.1 MB of text in the
real samples (``manage.py bench_storage``). At 1 MB a fork of 10,000 messages takes as
long as at 4 MB (bench_tree); at 256 kB it was 20% slower. On SQLite this does nothing.
"""

from django.db import migrations

INDEX = "msg_search_text_trgm"


def bound(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER INDEX {INDEX} SET (gin_pending_list_limit = 1024)")


def unbound(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER INDEX {INDEX} RESET (gin_pending_list_limit)")


class Migration(migrations.Migration):
    dependencies = [
        ("conversations", "0012_import_source_key"),
    ]

    operations = [migrations.RunPython(bound, unbound)]
