"""Why a transfer failed. Each failure names the request so both sides can free exactly what it held."""

from __future__ import annotations


class ListenFailed(OSError):
    """The KV listener cannot take its port (in use, or not this machine's)."""


class TransferError(RuntimeError):
    """A transfer for one request did not complete."""


class TransferTimeout(TransferError):
    """No progress within the transfer deadline."""


class PeerDisconnected(TransferError):
    """The other side went away mid-transfer."""


class TransferCancelled(TransferError):
    """The request was cancelled; late data for it is discarded."""


class ProtocolError(TransferError):
    """The peer sent something the protocol does not allow; the connection is closed."""
