from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from conversations.models import ApiToken, Blob, Checkpoint, Conversation, Message


@admin.register(Conversation)
class ConversationAdmin(admin.ModelAdmin[Conversation]):
    list_display = ("id", "title", "owner", "version", "updated_at")
    search_fields = ("title", "id")
    raw_id_fields = ("tip", "forked_from")
    list_select_related = ("owner",)


@admin.register(Message)
class MessageAdmin(admin.ModelAdmin[Message]):
    list_display = ("id", "conversation", "role", "origin", "depth", "created_at")
    list_filter = ("role", "origin")
    raw_id_fields = ("conversation", "parent")

    # Messages are immutable: the admin may look, never edit or delete one by one.
    def has_change_permission(self, request: HttpRequest, obj: Message | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Message | None = None) -> bool:
        return False


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin[Checkpoint]):
    list_display = ("label", "conversation", "state", "source", "created_at")
    list_filter = ("state", "source")
    raw_id_fields = ("conversation", "message", "digest_message")


@admin.register(Blob)
class BlobAdmin(admin.ModelAdmin[Blob]):
    list_display = ("sha256", "mime", "width", "height", "size", "created_at")


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin[ApiToken]):
    list_display = ("name", "user", "prefix", "created_at", "last_used_at")
    readonly_fields = ("token_hash", "prefix")
