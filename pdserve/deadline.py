"""Telling a call whose deadline passed from one its caller cancelled.

The caller's timer usually fires first and sends a plain cancel; the server started its own clock when it read
the headers, later, so it may still show time left when the cancel arrives (up to seconds later on a busy machine).
A cancel this close to the deadline is the deadline's.
"""

from __future__ import annotations

import time
from typing import Any

import grpc

DEADLINE_SLACK_S = 1.0


def deadline_passed(deadline: float | None) -> bool:
    """Whether a cancellation now is the `deadline`'s (a `time.monotonic()` value, or None for no deadline)."""
    return deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK_S


def mark_ended_from_outside(context: Any) -> None:
    """Set the code of a server call that ended from outside (the client cancelled, its deadline passed, a write
    failed because the client had gone): DEADLINE_EXCEEDED when it had no time left, CANCELLED otherwise. The
    context is a `grpc.aio.ServicerContext` or a wrapper of one (OpenTelemetry's records the code on its span)."""
    remaining = context.time_remaining()
    passed = remaining is not None and remaining <= DEADLINE_SLACK_S
    try:
        context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED if passed else grpc.StatusCode.CANCELLED)
    except Exception:  # noqa: BLE001 - the call is gone; the code is only read by its span and logs
        pass
