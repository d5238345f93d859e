from __future__ import annotations

from django.urls import path

from conversations import views

app_name = "conversations"
urlpatterns = [
    path("", views.conversation_list, name="list"),
    path("new/", views.conversation_new, name="new"),
    path("c/<str:cid>/", views.conversation_detail, name="detail"),
    path("c/<str:cid>/settings/", views.conversation_settings, name="conversation_settings"),
    path("c/<str:cid>/delete/", views.conversation_delete, name="delete"),
    path("c/<str:cid>/send/", views.message_send, name="send"),
    path("c/<str:cid>/retry/", views.turn_retry, name="retry"),
    path("c/<str:cid>/tip/", views.tip_set, name="tip"),
    path("c/<str:cid>/m/<str:mid>/edit/", views.message_edit, name="edit"),
    path("c/<str:cid>/m/<str:mid>/regenerate/", views.message_regenerate, name="regenerate"),
    path("c/<str:cid>/m/<str:mid>/select/", views.message_select, name="select"),
    path("c/<str:cid>/m/<str:mid>/fork/", views.message_fork, name="fork"),
    path("c/<str:cid>/m/<str:mid>/text/", views.message_text, name="message_text"),
    path("c/<str:cid>/history/", views.conversation_history, name="history"),
    path("c/<str:cid>/tree/", views.tree, name="tree"),
    path("c/<str:cid>/compare/", views.compare, name="compare"),
    path("c/<str:cid>/checkpoints/", views.checkpoints, name="checkpoints"),
    path("c/<str:cid>/rewind/", views.rewind, name="rewind"),
    path("import/", views.import_page, name="import"),
    path("import/<str:job_id>/", views.import_job, name="import_job"),
    path("settings/", views.settings_page, name="settings"),
    path("settings/tokens/<int:token_id>/revoke/", views.token_revoke, name="token_revoke"),
]
