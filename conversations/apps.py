from __future__ import annotations

from typing import Any

from django.apps import AppConfig


class ConversationsConfig(AppConfig):
    name = "conversations"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_delete

        from conversations.models import ImportJob

        post_delete.connect(_drop_import_upload, sender=ImportJob, dispatch_uid="import_upload")


def _drop_import_upload(sender: Any, instance: Any, **kwargs: Any) -> None:
    """An import job deleted (its user was) takes the file it kept along, once the
    deletion commits."""
    from django.db import transaction

    from conversations.services import _import_upload_drop

    if instance.upload:
        transaction.on_commit(lambda: _import_upload_drop(instance))
