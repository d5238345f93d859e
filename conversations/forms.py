"""Forms for the browser UI: input validation lives here, not in the views."""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings

from conversations.importers import FORMATS
from conversations.services import ForkScope


def model_choices(current: str = "") -> list[tuple[str, str]]:
    """The models a conversation may use, for a select: the default (empty), the
    configured default and the models the operator declared (ARBOR_MODELS), and the
    conversation's own model if it is none of those (it stays choosable)."""
    from conversations.providers import registry

    default = settings.ARBOR_DEFAULT_MODEL
    try:
        declared = sorted(registry.declared_models())
    except ValueError:  # a bad models file: the settings page says why
        declared = []
    ids = [m for m in dict.fromkeys([default, *declared, current]) if m]
    return [("", f"Default ({default or 'none configured'})"), *((m, m) for m in ids)]


class ConversationForm(forms.Form):
    """A conversation's settings, at creation and after: the model is one of the
    configured ones (a typo such as ``gpt4o`` is refused here, not at every send)."""

    title = forms.CharField(max_length=200, required=False)
    model = forms.ChoiceField(required=False, choices=())
    system_prompt = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 2}), required=False, strip=False
    )

    def clean_system_prompt(self) -> str:
        # Browsers send textarea lines as CRLF: keep the text the model saw.
        return str(self.cleaned_data["system_prompt"]).replace("\r\n", "\n")

    def __init__(self, *args: Any, current_model: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["model"].choices = model_choices(current_model)  # type: ignore[attr-defined]


class MessageForm(forms.Form):
    text = forms.CharField(max_length=200_000, strip=False, widget=forms.Textarea)
    # The tip the user was looking at: the new message continues it.
    parent = forms.UUIDField(required=False)

    def clean_text(self) -> str:
        text: str = self.cleaned_data["text"]
        if not text.strip():
            raise forms.ValidationError("Write something first.")
        if "\x00" in text:
            raise forms.ValidationError("The text contains a NUL character.")
        return text


class EditForm(MessageForm):
    pass


# Images one composer message may carry (each is checked by services.blob_store).
COMPOSER_MAX_IMAGES = 8


class ComposerForm(MessageForm):
    """The chat's composer: text, images (pasted or chosen, the ``images`` files), or
    both. The images come back in ``cleaned_data["images"]``, not yet checked as
    images: ``services.blob_store`` does that."""

    text = forms.CharField(max_length=200_000, strip=False, widget=forms.Textarea, required=False)

    def clean_text(self) -> str:
        text: str = self.cleaned_data["text"]
        if "\x00" in text:
            raise forms.ValidationError("The text contains a NUL character.")
        return text

    def clean(self) -> dict[str, Any]:
        data: dict[str, Any] = super().clean() or {}
        images = self.files.getlist("images") if self.files else []
        if len(images) > COMPOSER_MAX_IMAGES:
            raise forms.ValidationError(
                f"Attach at most {COMPOSER_MAX_IMAGES} images to one message ({len(images)} given)."
            )
        if not (data.get("text") or "").strip() and not images and "text" not in self.errors:
            raise forms.ValidationError("Write something or attach an image first.")
        data["images"] = images
        return data


class VersionForm(forms.Form):
    version = forms.IntegerField(min_value=0)


class TipForm(VersionForm):
    message = forms.UUIDField()


class ForkForm(forms.Form):
    scope = forms.ChoiceField(
        choices=[(ForkScope.PATH, "Path to here"), (ForkScope.SUBTREE, "Everything below too")],
        initial=ForkScope.PATH,
        widget=forms.RadioSelect,
    )
    title = forms.CharField(max_length=200, required=False)


class CheckpointForm(forms.Form):
    label = forms.CharField(max_length=100)


class RewindForm(VersionForm):
    label = forms.CharField(max_length=100)
    digest = forms.CharField(
        max_length=100_000,
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="What was learned on the abandoned branch (optional; Arbor writes one "
        "from the branch when empty)",
    )


class ImportForm(forms.Form):
    file = forms.FileField()
    format = forms.ChoiceField(choices=[("auto", "Detect")] + [(f, f) for f in FORMATS])
    # Unticked: a conversation imported before (same source id) is skipped and listed.
    copies = forms.BooleanField(
        required=False, label="Import conversations imported before again, as copies"
    )

    def clean_file(self) -> Any:
        upload = self.cleaned_data["file"]
        limit = settings.ARBOR_IMPORT_MAX_UPLOAD_BYTES
        if upload.size is not None and upload.size > limit:
            raise forms.ValidationError(
                f"The file is {upload.size:,} bytes; imports are limited to {limit:,} bytes."
            )
        return upload


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100)
    # Days until the token is refused; "" never expires (an operator's script may want it).
    expires = forms.TypedChoiceField(
        choices=[("7", "in 7 days"), ("30", "in 30 days"), ("90", "in 90 days"),
                 ("365", "in a year"), ("", "never")],
        coerce=int,
        empty_value=None,
        required=False,
        initial="90",
    )  # fmt: skip
