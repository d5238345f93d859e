from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path

from arbor.api import api
from conversations.gateway import views as gateway

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", api.urls),
    # The gateway: base URLs http://HOST/gateway/anthropic and http://HOST/gateway/openai/v1
    path("gateway/anthropic", gateway.base),
    path("gateway/openai/v1", gateway.base),
    path("gateway/anthropic/v1/messages", gateway.anthropic_messages),
    path("gateway/anthropic/v1/messages/count_tokens", gateway.anthropic_count_tokens),
    path("gateway/openai/v1/chat/completions", gateway.openai_chat),
    path("gateway/openai/v1/responses", gateway.openai_responses),
    path("gateway/openai/v1/models", gateway.openai_models),
    path("gateway/status", gateway.status),
    # Every other path below /gateway/ answers a JSON 404 in its protocol's shape.
    re_path(r"^gateway/anthropic/(?P<rest>.*)$", gateway.anthropic_unknown),
    re_path(r"^gateway/(?P<rest>.*)$", gateway.openai_unknown),
    path(
        "login/",
        auth_views.LoginView.as_view(redirect_authenticated_user=True),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", include("conversations.urls")),
    path("", include("compaction.urls")),
]
