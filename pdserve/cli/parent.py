"""A child of `pdserve up` ends when `up` does, however `up` ends (even SIGKILL).

The child asks the kernel for this itself, first thing, rather than `up` asking in a `preexec_fn`: a `preexec_fn`
makes Python fork a full copy of `up` and run its fork handlers, and `up` already runs gRPC by the time it starts
the gateway. gRPC's handler restarts its poller in that copy, where the poller can meet an epoll fd that is already
closed and abort the child before its exec (seen once: status -6). Without one, Python starts the child with
vfork and runs no fork handler at all.
"""

from __future__ import annotations

import ctypes
import os
import signal

PARENT_PID = "PDSERVE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str] | None) -> dict[str, str]:
    """`env` (or this process's environment) with the request that the child end with this process."""
    return {**(os.environ if env is None else env), PARENT_PID: str(os.getpid())}


def die_with_parent() -> None:
    """Honour `child_env`'s request; a no-op in a process started any other way. Not passed on to grandchildren."""
    pid = os.environ.pop(PARENT_PID, None)
    if pid is None:
        return
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(pid):  # the parent ended before the request above took hold
        os.kill(os.getpid(), signal.SIGTERM)
