"""CPU hogs: processes that spin on the cores the tests run on, so behaviour is checked on a busy machine too.

They inherit this process's CPU affinity, so they share exactly the cores the services get. Each one exits by itself
after `seconds` even if the test that started it dies; leaving `cpu_hogs` ends them at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@contextmanager
def cpu_hogs(count: int = 2, seconds: float = 900.0) -> Iterator[list[subprocess.Popen]]:
    procs = [
        subprocess.Popen([sys.executable, "-c", _SPIN.format(seconds=seconds)], stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(10)


def hogs_requested() -> int:
    """PDSERVE_TEST_HOGS=N (make test-busy): run every stack test with N hogs beside it."""
    try:
        return max(0, int(os.environ.get("PDSERVE_TEST_HOGS", "0")))
    except ValueError:
        return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads, from /proc."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
