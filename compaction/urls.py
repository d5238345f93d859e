from __future__ import annotations

from django.urls import path

from compaction import views

app_name = "compaction"
urlpatterns = [
    path("audit/", views.audit_list, name="audit"),
    path("audit/<str:rid>/", views.audit_detail, name="audit_detail"),
    path("audit/<str:rid>/blobs/<str:sha256>/", views.audit_blob, name="audit_blob"),
    path("c/<str:cid>/context/", views.context_panel, name="context"),
    path("c/<str:cid>/compact/", views.compact, name="compact"),
    path("c/<str:cid>/compactions/jobs/<str:job_id>/", views.job_progress, name="job"),
    path("c/<str:cid>/compactions/jobs/<str:job_id>/run/", views.job_run_now, name="job_run_now"),
    path("c/<str:cid>/compactions/<str:rid>/", views.record_detail, name="record"),
    path(
        "c/<str:cid>/compactions/<str:rid>/blobs/<str:sha256>/",
        views.record_blob,
        name="record_blob",
    ),
]
