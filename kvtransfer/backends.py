"""Choosing a transport by name, and releasing process-wide transport state at exit."""

from __future__ import annotations

import sys

from pdserve.kvtransfer.tcp_transport import TCPTransport
from pdserve.kvtransfer.transport import Transport
from pdserve.kvtransfer.ucx_transport import UCXTransport

TRANSPORTS = {"ucx": UCXTransport, "tcp": TCPTransport}


def make_transport(name: str) -> Transport:
    """'ucx' (default) or 'tcp'."""
    try:
        return TRANSPORTS[name]()
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r} (have: {', '.join(TRANSPORTS)})") from None


def shutdown_transports() -> None:
    """Release process-wide transport state once this process is done moving KV (UCX: its notifier thread,
    which otherwise keeps the interpreter from exiting)."""
    if "ucxx" in sys.modules:
        from pdserve.kvtransfer.ucx_transport import shutdown

        shutdown()
