"""Process identities survive PID reuse: a pid now held by a process started at another
time is not the process that recorded it (a server restarted as PID 1 in a container)."""

from __future__ import annotations

import os
import subprocess
import sys

from django.test import SimpleTestCase

from arbor.procs import process_gone, process_identity


class ProcessIdentityTests(SimpleTestCase):
    def test_this_process_runs(self) -> None:
        self.assertFalse(process_gone(process_identity()))

    def test_a_process_that_exited_is_gone(self) -> None:
        child = subprocess.Popen(
            [sys.executable, "-c", "from arbor.procs import process_identity as p; print(p())"],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
        )  # fmt: skip
        identity = child.communicate(timeout=30)[0].strip()
        self.assertTrue(identity)
        self.assertTrue(process_gone(identity))

    def test_a_reused_pid_is_not_the_same_process(self) -> None:
        host, pid, start = process_identity().split(":")
        self.assertTrue(process_gone(f"{host}:{pid}:{int(start) + 1}"))
        self.assertFalse(process_gone(f"{host}:{pid}"))  # an old-style identity: alive

    def test_another_hosts_process_cannot_be_judged_here(self) -> None:
        self.assertFalse(process_gone("some-other-host:1:1"))
        self.assertFalse(process_gone("garbage"))
