"""Forms for the compaction screens: input validation lives here, not in the views."""

from __future__ import annotations

from typing import Any

from django import forms

from compaction.ladder import RUNGS
from compaction.models import RecordStatus, Trigger


class AuditFilterForm(forms.Form):
    user = forms.CharField(max_length=150, required=False, label="User")
    conversation = forms.UUIDField(required=False, label="Conversation id")
    status = forms.ChoiceField(choices=[("", "any status"), *RecordStatus.choices], required=False)
    trigger = forms.ChoiceField(choices=[("", "any trigger"), *Trigger.choices], required=False)
    rung = forms.ChoiceField(
        choices=[("", "any rung"), *((r, r.replace("_", " ")) for r in RUNGS)], required=False
    )
    model = forms.CharField(max_length=200, required=False)
    date_from = forms.DateField(
        required=False, label="From", widget=forms.DateInput(attrs={"type": "date"})
    )
    date_to = forms.DateField(
        required=False, label="To", widget=forms.DateInput(attrs={"type": "date"})
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        start, end = data.get("date_from"), data.get("date_to")
        if start and end and start > end:
            self.add_error("date_to", "The end date is before the start date.")
        return data
