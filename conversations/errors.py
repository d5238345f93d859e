"""Domain errors. The API turns each into a JSON body ``{"error": code, "detail": …}``."""

from __future__ import annotations

from typing import Any


class ArborError(Exception):
    status = 400
    code = "bad_request"

    def __init__(self, detail: str, *, code: str | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        self.extra = extra

    def as_dict(self) -> dict[str, Any]:
        return {"error": self.code, "detail": self.detail, **self.extra}


class NotFound(ArborError):
    status = 404
    code = "not_found"


class TokenExpired(ArborError):
    """A bearer token that exists but is past its ``expires_at``."""

    status = 401
    code = "token_expired"


class InvalidInput(ArborError):
    status = 422
    code = "invalid"


class Conflict(ArborError):
    status = 409
    code = "conflict"


class StaleVersion(Conflict):
    """The expected version no longer matches: someone else moved the tip first."""

    code = "stale_version"

    def __init__(self, *, tip: str | None, version: int) -> None:
        super().__init__(
            f"the conversation is at version {version}; reload and try again",
            tip=tip,
            version=version,
        )


class TooManyRequests(ArborError):
    """A per-user limit on work in flight (open imports)."""

    status = 429
    code = "too_many_requests"


class StorageFull(ArborError):
    """The media store has no room: nothing was stored (507 Insufficient Storage)."""

    status = 507
    code = "storage_full"


class StorageUnavailable(ArborError):
    """The media store cannot be written (read-only, permissions, I/O error)."""

    status = 503
    code = "storage_unavailable"


def storage_error(exc: OSError, what: str) -> ArborError:
    """A clear error for a failed write to the media store."""
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"the media store is full: {what} was not stored; free space and retry")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return StorageUnavailable(f"the media store is read-only: {what} was not stored")
    return StorageUnavailable(
        f"the media store failed ({exc.strerror or exc}): {what} was not stored"
    )
