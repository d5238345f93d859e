from __future__ import annotations

from django.urls import path

from conversations.views import (
    account,
    chat,
    chat_turns,
    checkpoints,
    compare,
    imports,
    listing,
    tree,
)

app_name = "conversations"
urlpatterns = [
    path("", listing.conversation_list, name="list"),
    path("new/", listing.conversation_new, name="new"),
    path("sidebar/", listing.conversation_sidebar, name="sidebar"),
    path("c/<str:cid>/", chat.conversation_detail, name="detail"),
    path("c/<str:cid>/settings/", chat.conversation_settings, name="conversation_settings"),
    path("c/<str:cid>/delete/", listing.conversation_delete, name="delete"),
    path("c/<str:cid>/send/", chat_turns.message_send, name="send"),
    path("c/<str:cid>/retry/", chat_turns.turn_retry, name="retry"),
    path("c/<str:cid>/stop/", chat_turns.turn_stop, name="stop"),
    path("c/<str:cid>/live/<str:aid>/", chat_turns.turn_live, name="live"),
    path("c/<str:cid>/tip/", tree.tip_set, name="tip"),
    path("c/<str:cid>/m/<str:mid>/edit/", chat_turns.message_edit, name="edit"),
    path("c/<str:cid>/m/<str:mid>/regenerate/", chat_turns.message_regenerate, name="regenerate"),
    path("c/<str:cid>/m/<str:mid>/select/", chat.message_select, name="select"),
    path("c/<str:cid>/m/<str:mid>/fork/", chat.message_fork, name="fork"),
    path("c/<str:cid>/m/<str:mid>/text/", chat.message_text, name="message_text"),
    path("c/<str:cid>/history/", chat.conversation_history, name="history"),
    path("c/<str:cid>/tree/", tree.tree, name="tree"),
    path("c/<str:cid>/compare/", compare.compare, name="compare"),
    path("c/<str:cid>/checkpoints/", checkpoints.checkpoints, name="checkpoints"),
    path("c/<str:cid>/rewind/", checkpoints.rewind, name="rewind"),
    path("import/", imports.import_page, name="import"),
    path("import/<str:job_id>/", imports.import_job, name="import_job"),
    path("import/<str:job_id>/again/", imports.import_again, name="import_again"),
    path("settings/", account.settings_page, name="settings"),
    path("settings/tokens/<int:token_id>/revoke/", account.token_revoke, name="token_revoke"),
]
