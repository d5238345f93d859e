"""Which process is running something, in a form that survives PID reuse.

A job or turn row records ``host:pid:start`` (the process's start time in clock ticks
since boot, from ``/proc/<pid>/stat``). On the same host, the work is orphaned when that
pid is gone or now belongs to a process started at another time: a server restarted as
PID 1 in a container is not mistaken for the one that died. Another host's work cannot
be checked from here (callers fall back to a heartbeat or lease).
"""

from __future__ import annotations

import os
import socket
from functools import cache


def _start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else None


@cache
def _host() -> str:
    return socket.gethostname()


def process_identity() -> str:
    """This process, as ``host:pid:start`` (``host:pid`` where /proc is missing)."""
    pid = os.getpid()  # re-read: a forked worker must not inherit its parent's identity
    start = _start_ticks(pid)
    return f"{_host()}:{pid}:{start}" if start else f"{_host()}:{pid}"


def process_gone(identity: str) -> bool:
    """True when ``identity`` names a process of this host that no longer runs (its pid
    is free, or taken by a process started at another time). False when it runs, or is
    another host's, or the identity cannot be read."""
    parts = identity.split(":")
    if len(parts) < 2 or parts[0] != _host() or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, someone else's
    if len(parts) >= 3 and parts[2]:
        current = _start_ticks(pid)
        return current is not None and current != parts[2]
    return False
