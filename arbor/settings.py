"""Arbor settings. Every value that differs between machines comes from the environment."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import django_stubs_ext
from csp.constants import NONE, SELF

from arbor.env import (
    ImproperlyConfiguredEnv,
    database_from_url,
    env_bool,
    env_float,
    env_int,
    env_list,
    env_str,
)

# Generic Django classes (ModelAdmin[Conversation], QuerySet[Message]) at run time, so
# mypy --strict can check them with their model (django-stubs' documented setup).
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"

DEBUG = env_bool("DEBUG", False)
if DEBUG:
    SECRET_KEY = env_str("SECRET_KEY", "insecure-debug-only-key")
else:
    SECRET_KEY = env_str("SECRET_KEY", "")
    if not SECRET_KEY:
        raise ImproperlyConfiguredEnv("SECRET_KEY must be set unless DEBUG=1")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])
CSRF_FAILURE_VIEW = "arbor.views.csrf_failure"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_htmx",
    "template_partials",
    "ninja",
    "conversations",
    "compaction",
    # Login brute force: a username is locked out from an address after a few failures
    # (/login/ and /admin/login/ alike).
    "axes",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Serves /static/ under uvicorn too (ASGI has no runserver static handler).
    "arbor.middleware.StaticFiles",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "csp.middleware.CSPMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "arbor.middleware.htmx_sign_in",
    "arbor.middleware.api_json_errors",
    "arbor.middleware.private_pages",
    "axes.middleware.AxesMiddleware",
]

AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_int("ARBOR_LOGIN_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("ARBOR_LOGIN_LOCKOUT_MINUTES", 15))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
# Behind a proxy, the client's address comes from the header it sets.
AXES_IPWARE_META_PRECEDENCE_ORDER = (
    ["HTTP_X_FORWARDED_FOR", "REMOTE_ADDR"]
    if env_str("ARBOR_PROXY_SSL_HEADER", "")
    else ["REMOTE_ADDR"]
)

ROOT_URLCONF = "arbor.urls"
WSGI_APPLICATION = "arbor.wsgi.application"
ASGI_APPLICATION = "arbor.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
            # {% partialdef %} / {% partial %} in every template (django-template-partials).
            "builtins": ["template_partials.templatetags.partials"],
        },
    },
]

DATABASES = {
    "default": database_from_url(
        env_str("DATABASE_URL", "sqlite:///var/arbor.sqlite3"), base_dir=BASE_DIR
    )
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
# Set STATIC_ROOT (and run collectstatic) in production; unset, files are served from
# the app and project folders through WhiteNoise's finders.
STATIC_ROOT = env_str("STATIC_ROOT", "") or None
# Without collectstatic (make run), serve straight from the app and project folders.
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG
MEDIA_URL = "media/"
MEDIA_ROOT = Path(env_str("MEDIA_ROOT", str(VAR_DIR / "media")))

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "conversations:list"
LOGOUT_REDIRECT_URL = "login"

# Content-Security-Policy (django-csp): scripts only from our own static files, never
# inline; images only from our own origin, so a remote image in a message is never
# loaded without the user's action (markdown turns it into a link).
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF],
        "style-src": [SELF],
        "img-src": [SELF, "data:"],
        "connect-src": [SELF],
        "font-src": [SELF],
        "object-src": [NONE],
        "base-uri": [NONE],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
    }
}

SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = env_bool("SECURE_COOKIES", not DEBUG)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE

# HTTPS in production (README "Deploying"): off unless set, because `make run` and the
# tests serve plain HTTP on loopback. Behind a TLS-terminating proxy, name the header it
# sets: ARBOR_PROXY_SSL_HEADER=HTTP_X_FORWARDED_PROTO.
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
_proxy_ssl_header = env_str("ARBOR_PROXY_SSL_HEADER", "")
SECURE_PROXY_SSL_HEADER = (_proxy_ssl_header, "https") if _proxy_ssl_header else None
# What pages may use (none of these), sent on every response (arbor.middleware).
ARBOR_PERMISSIONS_POLICY = "camera=(), microphone=(), geolocation=(), payment=(), usb=()"

# Celery: with no broker configured, tasks run in-process (the embedded default).
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "")
CELERY_TASK_ALWAYS_EAGER = not CELERY_BROKER_URL
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 600)
CELERY_TASK_SOFT_TIME_LIMIT = env_int("CELERY_TASK_SOFT_TIME_LIMIT", 540)
# Without a broker, where background jobs (compaction, imports queued from a request)
# run: "thread" (a worker thread of the web process: the request that queued the job is
# answered at once, as with a real worker) or "inline" (inside the request; the test
# suite's default, where every job is done when the call returns).
ARBOR_INPROCESS_JOBS = env_str("ARBOR_INPROCESS_JOBS", "thread")
# Background job lifecycle. A running job renews its lease every quarter of
# ARBOR_JOB_LEASE_SECONDS; a job whose worker died (its lease passed, or its process is
# gone on this host) is taken again, at most ARBOR_JOB_MAX_ATTEMPTS times in all, then
# failed with the reason. A job queued this long with no worker taking it (a lost send,
# a broker restarted without persistence) is sent again by the sweeper (each worker at
# start, then every ARBOR_JOB_SWEEP_SECONDS with beat: `celery -A arbor worker -B`).
ARBOR_JOB_LEASE_SECONDS = env_int("ARBOR_JOB_LEASE_SECONDS", 60)
ARBOR_JOB_MAX_ATTEMPTS = env_int("ARBOR_JOB_MAX_ATTEMPTS", 3)
ARBOR_JOB_REQUEUE_SECONDS = env_int("ARBOR_JOB_REQUEUE_SECONDS", 60)
ARBOR_JOB_SWEEP_SECONDS = env_int("ARBOR_JOB_SWEEP_SECONDS", 60)
CELERY_BEAT_SCHEDULE = {
    "sweep-stale-jobs": {
        "task": "compaction.tasks.sweep_jobs",
        "schedule": float(ARBOR_JOB_SWEEP_SECONDS),
    }
}
if ARBOR_INPROCESS_JOBS not in ("thread", "inline"):
    raise ImproperlyConfiguredEnv("ARBOR_INPROCESS_JOBS must be thread or inline")

# Who may read the API's OpenAPI schema and docs (/api/openapi.json, /api/docs): "public",
# "signed-in" (a browser session or a bearer token; the default with DEBUG off: the
# schema names every route, which an anonymous scanner has no need of, while every
# real API user has an account to make a token with) or "off".
ARBOR_API_DOCS = env_str("ARBOR_API_DOCS", "public" if DEBUG else "signed-in")
if ARBOR_API_DOCS not in ("public", "signed-in", "off"):
    raise ImproperlyConfiguredEnv("ARBOR_API_DOCS must be public, signed-in or off")

# Limits on what a client may send. Bytes, pixels, counts.
ARBOR_MAX_BLOB_BYTES = env_int("ARBOR_MAX_BLOB_BYTES", 10 * 1024 * 1024)
# Browser imports: the largest upload (the ASGI body limit is the same) and how many a
# user may have waiting or running at once.
ARBOR_IMPORT_MAX_UPLOAD_BYTES = env_int("ARBOR_IMPORT_MAX_UPLOAD_BYTES", 512 * 1024 * 1024)
ARBOR_IMPORT_MAX_OPEN = env_int("ARBOR_IMPORT_MAX_OPEN", 3)
# Compaction jobs ("Compact now"; a turn's proactive job is skipped, not refused) a user
# may have waiting or running at once; each can render and OCR many pages or call a
# model. The context API's POST compacts inside its own request instead.
ARBOR_COMPACTION_MAX_OPEN = env_int("ARBOR_COMPACTION_MAX_OPEN", 3)
# A compaction job measures the legibility of its snapshot pages with tesseract (the
# audit's "OCR CER"): several seconds a dense page, so at most this many pages a record,
# spread from the first to the last; the others show "OCR not measured". 0 measures none.
ARBOR_OCR_MAX_PAGES = env_int("ARBOR_OCR_MAX_PAGES", 6)
# Threads the gateway runs its database work on, each keeping its connection open
# between requests (conversations/gateway/dbthreads.py): at most this many connections
# per server process for the gateway, besides the site's.
ARBOR_GATEWAY_DB_THREADS = env_int("ARBOR_GATEWAY_DB_THREADS", 4)
ARBOR_MAX_IMAGE_PIXELS = env_int("ARBOR_MAX_IMAGE_PIXELS", 40_000_000)
ARBOR_MAX_TURN_MESSAGES = env_int("ARBOR_MAX_TURN_MESSAGES", 200)
ARBOR_MAX_PART_CHARS = env_int("ARBOR_MAX_PART_CHARS", 2_000_000)
# A turn may carry long tool results; uploads (images) are limited separately above.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("ARBOR_MAX_REQUEST_BYTES", 16 * 1024 * 1024)

# Chat turns. With DEBUG on (`make run`) the default model is the offline demo (a
# loopback fake, not an LLM), so it works without keys; with DEBUG off there is no
# default unless one is set (e.g. ARBOR_DEFAULT_MODEL=openai/gpt-4o-mini): a production
# chat never answers from the demo by accident.
ARBOR_DEFAULT_MODEL = env_str("ARBOR_DEFAULT_MODEL", "fake/demo" if DEBUG else "")
# Which models users may call on Arbor's keys, in chat turns, the context API and the
# gateway alike (conversations/providers/registry.py, model_allowed): "declared" (the
# ARBOR_MODELS file's models and ARBOR_DEFAULT_MODEL) or "builtin" (Arbor's table of
# well-known models too). Never the built-ins by default in production: the operator
# pays for every token. The offline demo (fake/*) is a development tool, off unless
# DEBUG is on or ARBOR_FAKE_MODELS=1 (the test suite's servers).
ARBOR_MODEL_POLICY = env_str("ARBOR_MODEL_POLICY", "builtin" if DEBUG else "declared")
if ARBOR_MODEL_POLICY not in ("declared", "builtin"):
    raise ImproperlyConfiguredEnv("ARBOR_MODEL_POLICY must be declared or builtin")
ARBOR_FAKE_MODELS = env_bool("ARBOR_FAKE_MODELS", DEBUG)
if env_str("ARBOR_MODELS", "").strip():
    # A missing or broken models file stops the process here, with the file named for
    # the operator, rather than reaching users' requests. (It is read again when it
    # changes: one broken later is logged, and requests are refused without its path.)
    from conversations.providers.registry import declared_models

    try:
        declared_models()
    except ValueError as exc:
        raise ImproperlyConfiguredEnv(str(exc)) from None
ARBOR_MAX_TOOL_ROUNDS = env_int("ARBOR_MAX_TOOL_ROUNDS", 8)
# A "running" attempt whose heartbeat is older than this is treated as interrupted.
ARBOR_ATTEMPT_STALE_SECONDS = env_int("ARBOR_ATTEMPT_STALE_SECONDS", 300)
# How often a running turn looks whether Stop was pressed (a read on its own thread),
# and at most how often it records what it has streamed so far for a reloaded chat.
ARBOR_TURN_STOP_POLL_SECONDS = env_float("ARBOR_TURN_STOP_POLL_SECONDS", 0.3)
ARBOR_TURN_LIVE_SECONDS = env_float("ARBOR_TURN_LIVE_SECONDS", 0.5)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    # The HTTP clients log every request at INFO: a line per model call (and per gateway
    # request) says nothing the access log does not; their warnings still show.
    "loggers": {
        name: {"level": env_str("HTTP_CLIENT_LOG_LEVEL", "WARNING")}
        for name in ("httpx", "httpx2", "httpcore", "httpcore2")
    },
}
