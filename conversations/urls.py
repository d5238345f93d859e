from __future__ import annotations

from django.urls import path

from conversations import views

app_name = "conversations"
urlpatterns = [
    path("", views.conversation_list, name="list"),
    path("c/<str:cid>/", views.conversation_detail, name="detail"),
]
