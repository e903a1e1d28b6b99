"""Telling a call whose deadline passed from one its caller cancelled.

The caller's timer usually fires first and sends a plain cancel; the server started its own clock when it read
the headers, later, so it may still show time left when the cancel arrives (up to seconds later on a busy machine).
A cancel this close to the deadline is the deadline's.
"""

from __future__ import annotations

import time

DEADLINE_SLACK_S = 1.0


def deadline_passed(deadline: float | None) -> bool:
    """Whether a cancellation now is the `deadline`'s (a `time.monotonic()` value, or None for no deadline)."""
    return deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK_S
