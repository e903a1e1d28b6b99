"""The engine's failures a caller can be told about, in a module that loads no torch: the services' failure table
(`pdserve.failures`) names them, and the gateway, which never runs a model, imports that table."""

from __future__ import annotations


class InvalidParameter(ValueError):
    """A request parameter is out of range; `param` names it (the API reports it to the caller)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class PoolExhausted(RuntimeError):
    """No KV blocks to reserve now, and the queue of reservations waiting for them is full."""


class EngineStopped(RuntimeError):
    """The engine loop is not running (it died, or the worker is stopping)."""


class SamplingError(ValueError):
    """This row's distribution could not be sampled (non-finite logits)."""
