"""The settings screen (conversations/settings.html): the user's API tokens, and the
models the operator configured with how each one's token counts were calibrated."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_http_methods, require_POST

from compaction import selectors as compaction_selectors
from conversations import forms, selectors, services
from conversations.errors import NotFound
from conversations.providers import registry
from conversations.providers.registry import ModelSpec
from conversations.views.common import HtmxHttpRequest, signed_in_user


def _configured_models(*, staff: bool) -> tuple[list[ModelSpec], str]:
    """The default model and those the operator declared (the ARBOR_MODELS file), with
    the limits Arbor budgets for. A bad file is an error on the page, not a 500; only
    staff see its details (they name paths on the server)."""
    default = settings.ARBOR_DEFAULT_MODEL
    try:
        declared = registry.declared_models()
    except ValueError as exc:
        declared, error = {}, str(exc)
    else:
        error = ""
    models: list[ModelSpec] = []
    for model_id in [default, *sorted(set(declared) - {default})]:
        try:
            models.append(registry.resolve_model(model_id))
        except ValueError as exc:
            error = f"{error} {exc}".strip()
    if error and not staff:
        error = f"The {registry.MODELS_ENV} file has a problem: ask an operator to check it."
    return models, error


def _token_create(request: HtmxHttpRequest, form: forms.TokenForm) -> str:
    """Make the token the (valid) form asks for; its secret, shown this once."""
    days = form.cleaned_data["expires"]
    _, secret = services.api_token_create(
        user=signed_in_user(request),
        name=form.cleaned_data["name"],
        expires_in=timedelta(days=days) if days else None,
    )
    return secret


def _settings_context(
    request: HtmxHttpRequest, form: forms.TokenForm, secret: str
) -> dict[str, Any]:
    models, models_error = _configured_models(staff=request.user.is_staff)
    return {
        "form": form,
        "secret": secret,
        "tokens": selectors.api_token_list(user=signed_in_user(request)),
        "models": models,
        "models_error": models_error,
        "default_model": settings.ARBOR_DEFAULT_MODEL,
        "calibrations": compaction_selectors.calibration_list(),
        "now": timezone.now(),
    }


@login_required
@require_http_methods(["GET", "POST"])
def settings_page(request: HtmxHttpRequest) -> HttpResponse:
    form = forms.TokenForm(request.POST or None)
    secret, status = "", 200
    if request.method == "POST":
        if form.is_valid():
            secret = _token_create(request, form)
            form = forms.TokenForm()
        else:
            status = 400
    context = _settings_context(request, form, secret)
    response = render(request, "conversations/settings.html", context, status=status)
    add_never_cache_headers(response)  # the secret is shown once: never from a cache
    return response


@login_required
@require_POST
def token_revoke(request: HtmxHttpRequest, token_id: int) -> HttpResponseRedirect:
    try:
        services.api_token_revoke(user=signed_in_user(request), token_id=token_id)
    except NotFound:
        raise Http404("no such token") from None
    flash.success(request, "Token revoked.")
    return redirect("conversations:settings")
