from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

from arbor.bodylimit import BodyLimit
from arbor.lifespan import Lifespan

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "arbor.settings")
# Oversized bodies are refused (413) before Django spools them to disk; at startup, jobs
# a killed server left behind are picked up (without a broker).
application = Lifespan(BodyLimit(get_asgi_application()))
