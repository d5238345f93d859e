"""Root pytest configuration: test runs need a SECRET_KEY but never a real one."""

from __future__ import annotations

import os

os.environ.setdefault("SECRET_KEY", "test-only-secret-key-not-for-production")
os.environ.setdefault("SECURE_COOKIES", "0")
