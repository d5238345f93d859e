from __future__ import annotations

import os
from typing import Any

from django.core.asgi import get_asgi_application

from arbor.bodylimit import BodyLimit, Receive, Scope, Send
from arbor.lifespan import Lifespan

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "arbor.settings")
site = get_asgi_application()  # sets Django up: import what needs apps after it

from arbor.gateway_asgi import GatewayHandler  # noqa: E402

gateway = GatewayHandler()


async def route(scope: Scope, receive: Receive, send: Send) -> Any:
    """The gateway's paths to their own lean handler; everything else to the site."""
    handler = site
    if scope["type"] == "http" and scope.get("path", "").startswith("/gateway/"):
        handler = gateway
    return await handler(scope, receive, send)  # type: ignore[arg-type]


# Oversized bodies are refused (413) before Django spools them to disk; at startup, jobs
# a killed server left behind are picked up (without a broker).
application = Lifespan(BodyLimit(route))
