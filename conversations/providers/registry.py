"""The model registry: what Arbor knows about a model id.

A model id is ``<provider>/<model>``:

- ``openai/<model>``: any OpenAI-compatible chat-completions server (OpenAI itself, or
  Ollama, vLLM, llama.cpp, OpenRouter… through ``base_url`` / ``OPENAI_BASE_URL``);
- ``anthropic/<model>``: the Anthropic Messages API;
- ``fake/<name>``: the loopback fake provider, an offline demo model that is not an LLM.

Limits come from, in order: the file named by ``ARBOR_MODELS`` (TOML or JSON), a small
built-in table of well-known models, then per-provider defaults marked ``assumed`` so
the UI can say the numbers are a guess::

    [models."openai/gpt-4o-mini"]
    context_window = 128000
    max_output = 16384
    vision = true
    image_billing = "openai-tile"

    [models."openai/llama3"]          # a local Ollama model
    model = "llama3.1:8b"             # the provider's own name, when it differs
    base_url = "http://127.0.0.1:11434/v1"
    api_key_env = "OLLAMA_API_KEY"    # which variable holds its key (optional)
    context_window = 8192
    max_output = 2048

Which of these models users may call on Arbor's keys is the operator's **model
policy** (``model_allowed``), checked here, by ``resolve_model``, for every entry point
(chat turns, the context API, the gateway):

- ``ARBOR_MODEL_POLICY=declared`` (the default with DEBUG off): the models declared in
  the ARBOR_MODELS file, and those the settings name (``ARBOR_DEFAULT_MODEL``);
- ``ARBOR_MODEL_POLICY=builtin`` (the default with DEBUG on, so ``make run`` works
  without a file): the built-in table of well-known models too;
- an undeclared model outside the table is never offered, and ``fake/*`` only when
  ``ARBOR_FAKE_MODELS`` is on (the default with DEBUG on only).

``describe_model`` tells what Arbor knows of any id, without the policy (tests, and
callers that only budget).
"""

from __future__ import annotations

import json
import logging
import os
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from conversations.providers.billing import BILLING_RULES

log = logging.getLogger("arbor.providers")

ProviderKind = Literal["openai", "anthropic"]
PREFIXES = ("openai", "anthropic", "fake")
MODELS_ENV = "ARBOR_MODELS"
FAKE_URL_ENV = "ARBOR_FAKE_BASE_URL"

FAKE_NOTICE = "offline demo model: replies come from Arbor's loopback fake server, not an LLM"
ASSUMED_NOTICE = (
    "unknown model: its context window and output limit are assumed defaults; "
    f"declare it in the {MODELS_ENV} file for exact numbers"
)


@dataclass(frozen=True)
class ModelSpec:
    id: str
    provider: ProviderKind
    model: str
    base_url: str | None
    context_window: int
    max_output: int
    vision: bool
    image_billing: str
    # True when the limits are defaults guessed for a model nobody declared.
    assumed: bool = False
    # True for fake/* models: the loopback fake server answers, speaking the OpenAI protocol.
    fake: bool = False
    # Environment variable holding this model's key, when not the provider's usual one.
    api_key_env: str | None = None
    # "max_tokens" or "max_completion_tokens"; None chooses by server (see client.py).
    max_tokens_param: str | None = None

    @property
    def calibration_key(self) -> str:
        """The estimator's calibration is kept per model *and* deployment: one model id
        served by two endpoints (a local server and a hosted one) may count tokens its
        own way. The endpoint is the base URL the provider client will use."""
        url = (
            self.base_url
            or os.environ.get(_BASE_URL_ENV.get(self.provider, ""), "")
            or _DEFAULT_ENDPOINTS.get(self.provider, "")
        )
        # Host, port and path only: never a user:password@ part (settings shows keys).
        parts = urlsplit(url if "://" in url else f"//{url}")
        host = parts.hostname or ""
        endpoint = f"{host}:{parts.port}" if parts.port else host
        endpoint = (endpoint + parts.path).rstrip("/")
        return f"{self.id} @ {endpoint}"[:200] if endpoint else self.id

    @property
    def notice(self) -> str | None:
        """A line the UI shows next to the model name, or None."""
        if self.fake:
            return FAKE_NOTICE
        if self.assumed:
            return ASSUMED_NOTICE
        return None


# Where a provider's client goes without a declared base URL (as the SDKs do).
_BASE_URL_ENV = {"openai": "OPENAI_BASE_URL", "anthropic": "ANTHROPIC_BASE_URL"}
_DEFAULT_ENDPOINTS = {"openai": "api.openai.com/v1", "anthropic": "api.anthropic.com"}


@dataclass(frozen=True)
class _Limits:
    context_window: int
    max_output: int
    vision: bool
    image_billing: str


_DEFAULTS: dict[str, _Limits] = {
    "openai": _Limits(128_000, 4_096, vision=False, image_billing="openai-tile"),
    "anthropic": _Limits(200_000, 8_192, vision=True, image_billing="claude"),
    "fake": _Limits(16_384, 1_024, vision=True, image_billing="openai-tile"),
}

# Well-known models, matched by name prefix (longest first, so "gpt-4o-mini" beats
# "gpt-4o", and dated snapshots like "claude-sonnet-4-5-20250929" match their family).
_BUILTIN: dict[str, dict[str, _Limits]] = {
    "openai": {
        "gpt-4o-mini": _Limits(128_000, 16_384, vision=True, image_billing="openai-tile"),
        "gpt-4o": _Limits(128_000, 16_384, vision=True, image_billing="openai-tile"),
        "gpt-4.1-mini": _Limits(1_047_576, 32_768, vision=True, image_billing="openai-patch"),
        "gpt-4.1-nano": _Limits(1_047_576, 32_768, vision=True, image_billing="openai-patch"),
        "gpt-4.1": _Limits(1_047_576, 32_768, vision=True, image_billing="openai-tile"),
        "o4-mini": _Limits(200_000, 100_000, vision=True, image_billing="openai-patch"),
        "o3-mini": _Limits(200_000, 100_000, vision=False, image_billing="openai-tile"),
        "o3": _Limits(200_000, 100_000, vision=True, image_billing="openai-tile"),
    },
    "anthropic": {
        "claude-sonnet-4-5": _Limits(200_000, 64_000, vision=True, image_billing="claude"),
        "claude-sonnet-4": _Limits(200_000, 64_000, vision=True, image_billing="claude"),
        "claude-haiku-4-5": _Limits(200_000, 64_000, vision=True, image_billing="claude"),
        "claude-opus-4-1": _Limits(200_000, 32_000, vision=True, image_billing="claude"),
        "claude-opus-4": _Limits(200_000, 32_000, vision=True, image_billing="claude"),
        "claude-3-7-sonnet": _Limits(200_000, 64_000, vision=True, image_billing="claude"),
        "claude-3-5-haiku": _Limits(200_000, 8_192, vision=True, image_billing="claude"),
    },
}

_FIELDS: dict[str, type | tuple[type, ...]] = {
    "model": str,
    "base_url": str,
    "context_window": int,
    "max_output": int,
    "vision": bool,
    "image_billing": str,
    "api_key_env": str,
    "max_tokens_param": str,
}


def split_model_id(model_id: str) -> tuple[str, str]:
    """``"openai/gpt-4o"`` → ``("openai", "gpt-4o")``. The model part may hold slashes
    (``openai/meta-llama/Llama-3-8B``)."""
    prefix, sep, name = (model_id or "").partition("/")
    if not sep or prefix not in PREFIXES:
        raise ValueError(
            f"model id {model_id!r} needs a provider prefix: 'openai/<model>' (any "
            "OpenAI-compatible server), 'anthropic/<model>' or 'fake/<name>' (offline demo)"
        )
    if not name.strip():
        raise ValueError(f"model id {model_id!r} names no model after {prefix + '/'!r}")
    return prefix, name


def _builtin(prefix: str, name: str) -> _Limits | None:
    table = _BUILTIN.get(prefix, {})
    for key in sorted(table, key=len, reverse=True):
        if name == key or name.startswith(key + "-"):
            return table[key]
    return None


def _check_entry(source: str, model_id: str, entry: Any) -> dict[str, Any]:
    where = f"{source}: model {model_id!r}"
    try:
        split_model_id(model_id)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a table/object of settings")
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown settings {unknown}; allowed: {sorted(_FIELDS)}")
    for key, value in entry.items():
        expected = _FIELDS[key]
        # bool is an int in Python; a window of `true` is a mistake, not 1.
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            name = expected.__name__ if isinstance(expected, type) else str(expected)
            raise ValueError(f"{where}: {key} must be a {name}, got {value!r}")
    for key in ("context_window", "max_output"):
        if key in entry and entry[key] <= 0:
            raise ValueError(f"{where}: {key} must be positive, got {entry[key]}")
    if "image_billing" in entry and entry["image_billing"] not in BILLING_RULES:
        raise ValueError(
            f"{where}: image_billing must be one of {list(BILLING_RULES)}, "
            f"got {entry['image_billing']!r}"
        )
    if "max_tokens_param" in entry and entry["max_tokens_param"] not in (
        "max_tokens",
        "max_completion_tokens",
    ):
        raise ValueError(f"{where}: max_tokens_param must be max_tokens or max_completion_tokens")
    return dict(entry)


def parse_models_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read and validate an ARBOR_MODELS file (``.json`` is JSON, anything else TOML).

    Raises ValueError naming the file and the problem.
    """
    path = Path(path)
    source = f"{MODELS_ENV} file {str(path)!r}"
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{source} cannot be read: {exc.strerror or exc}") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(raw.decode("utf-8"))
        else:
            data = tomllib.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
        raise ValueError(f"{source} is not valid {kind}: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"models"}:
        raise ValueError(f"{source} must hold one top-level 'models' table keyed by model id")
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise ValueError(f"{source}: 'models' must be a table keyed by model id")
    return {model_id: _check_entry(source, model_id, entry) for model_id, entry in models.items()}


_cache: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}


def declared_models() -> dict[str, dict[str, Any]]:
    """The models declared in the ARBOR_MODELS file ({} when the variable is unset)."""
    path = os.environ.get(MODELS_ENV, "").strip()
    if not path:
        return {}
    try:
        stat = Path(path).stat()
    except OSError as exc:
        raise ValueError(
            f"{MODELS_ENV} file {path!r} cannot be read: {exc.strerror or exc}"
        ) from None
    # Re-read when the file changes, without a restart.
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key not in _cache:
        _cache.clear()
        _cache[key] = parse_models_file(path)
    return _cache[key]


class ModelNotOffered(ValueError):
    """The operator's model policy does not offer this model to users (see the module
    docstring). Its message names the model, never a path on the server."""


class ModelsFileError(ValueError):
    """The ARBOR_MODELS file cannot be read or is not valid: the server is misconfigured,
    not the request. The message names neither the file's path nor its content (it may
    reach a client); the details go to the server's log."""

    def __init__(self) -> None:
        super().__init__(
            f"the server's model configuration ({MODELS_ENV}) cannot be read; an operator "
            "must fix it (the server's log says what is wrong)"
        )


_reported: set[str] = set()


def _declared_checked() -> dict[str, dict[str, Any]]:
    """``declared_models()`` for a request: a broken file is logged, with its details,
    and raised as a ModelsFileError that names no path."""
    try:
        declared = declared_models()
    except ValueError as exc:
        # Once per problem (until the file reads well again), not once per request.
        if str(exc) not in _reported:
            _reported.add(str(exc))
            log.error("model registry: %s", exc)
        raise ModelsFileError from None
    _reported.clear()
    return declared


def _policy() -> tuple[str, bool, set[str]]:
    """(policy, whether fake/* is offered, the model ids the settings name)."""
    from django.conf import settings

    named = {
        str(getattr(settings, name, "") or "")
        for name in ("ARBOR_DEFAULT_MODEL", "ARBOR_GATEWAY_DEFAULT_MODEL")
    }
    return (
        str(getattr(settings, "ARBOR_MODEL_POLICY", "declared")),
        bool(getattr(settings, "ARBOR_FAKE_MODELS", False)),
        named - {""},
    )


def model_allowed(model_id: str) -> bool:
    """Whether the operator's model policy lets users call ``model_id`` on Arbor's keys:
    ``fake/*`` only when ARBOR_FAKE_MODELS is on; else a model declared in ARBOR_MODELS
    or named by the settings (ARBOR_DEFAULT_MODEL); else, under the ``builtin`` policy
    only, one in the built-in table. Raises ValueError for a malformed id, and
    ModelsFileError when the ARBOR_MODELS file is broken."""
    return _allowed(model_id, _declared_checked())


def _allowed(model_id: str, declared: dict[str, dict[str, Any]]) -> bool:
    prefix, name = split_model_id(model_id)
    policy, fake_offered, named = _policy()
    if prefix == "fake":
        return fake_offered
    if model_id in declared or model_id in named:
        return True
    return policy == "builtin" and _builtin(prefix, name) is not None


def _refusal(model_id: str) -> ModelNotOffered:
    if model_id.startswith("fake/"):
        why = "the offline demo models (fake/*) are offered only on a development server"
    elif _policy()[0] == "builtin":
        why = (
            "not configured: the operator offers the models declared in the "
            f"{MODELS_ENV} file and Arbor's built-in table"
        )
    else:
        why = f"not configured: the operator offers only the models declared in {MODELS_ENV}"
    return ModelNotOffered(f"model {model_id!r} is not offered on this server ({why})")


def resolve_model(model_id: str) -> ModelSpec:
    """Everything Arbor needs to call and budget for ``model_id``, a model the operator's
    policy offers (``model_allowed``): the one check every entry point goes through.

    Raises ModelNotOffered for a model the policy does not offer, ValueError for an id
    without a known provider prefix or inconsistent limits, ModelsFileError (a ValueError
    naming no path) for a broken ARBOR_MODELS file.
    """
    declared = _declared_checked()
    if not _allowed(model_id, declared):
        raise _refusal(model_id)
    return _describe(model_id, declared)


def describe_model(model_id: str) -> ModelSpec:
    """What Arbor knows of ``model_id`` (limits, endpoint), whatever the policy says.

    Raises ValueError for an id without a known provider prefix or a malformed
    ARBOR_MODELS file (naming the file: for the operator, not for a client).
    """
    return _describe(model_id, declared_models())


def _describe(model_id: str, declared_all: dict[str, dict[str, Any]]) -> ModelSpec:
    prefix, name = split_model_id(model_id)
    declared = declared_all.get(model_id)
    builtin = _builtin(prefix, name)
    base = builtin or _DEFAULTS[prefix]
    fake = prefix == "fake"
    # fake/* speaks the OpenAI protocol; its server is started on demand (client.py)
    # unless ARBOR_FAKE_BASE_URL points at a standalone one.
    provider: ProviderKind = "anthropic" if prefix == "anthropic" else "openai"
    spec = ModelSpec(
        id=model_id,
        provider=provider,
        model=name,
        base_url=(os.environ.get(FAKE_URL_ENV) or None) if fake else None,
        context_window=base.context_window,
        max_output=base.max_output,
        vision=base.vision,
        image_billing=base.image_billing,
        assumed=builtin is None and not fake and declared is None,
        fake=fake,
    )
    if declared:
        spec = replace(spec, **declared)
        if not {"context_window", "max_output"} <= set(declared) and builtin is None and not fake:
            # Declared without its limits: the numbers are still guesses.
            spec = replace(spec, assumed=True)
    if spec.max_output >= spec.context_window:
        raise ValueError(
            f"model {model_id!r}: max_output ({spec.max_output}) must be smaller than "
            f"context_window ({spec.context_window})"
        )
    return spec
