"""The one thread that calls a NIXL agent (it is not thread-safe): it runs the calls submitted to it, polls the
reads posted on it until they complete or expire, and progresses UCX while peers are connected."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.kvtransfer.errors import TransferError, TransferTimeout

log = logging.getLogger(__name__)

PROGRESS_S = 1e-3  # UCX progress while peers are connected and nothing is in flight, just after one connected
IDLE_PROGRESS_S = 50e-3  # ... and once the connections are up, just after the last read or announced layer
IDLE_PROGRESS_MAX_S = 1.0  # ... doubling up to this while nothing more happens (an idle worker hardly wakes)
WIRE_UP_S = 2.0  # how long "just after" a connection is
POLL_S = 20e-6  # between polls of operations in flight


@dataclass
class Read:
    handle: Any
    future: concurrent.futures.Future[tuple[float, float]]
    deadline: float
    started: float = field(default_factory=time.perf_counter)
    expired: bool = False


class AgentThread:
    """The one thread that calls the agent: runs submitted calls, polls posted reads, progresses UCX."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.connected = 0  # peers using this agent: progress UCX while any are
        self._wire_up_until = 0.0
        self._idle_wait = IDLE_PROGRESS_S  # the next idle progress wait: doubles while nothing happens
        self._waiting = 0.0  # the idle progress wait the thread is in (0: none)
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._reads: list[Read] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-plane", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Run `fn` on the agent's thread; its result as an asyncio future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                raise TransferError("the KV plane is closed")
            self._calls.append((fn, fut))
            self._idle_wait = IDLE_PROGRESS_S
            self._cond.notify()
        return asyncio.wrap_future(fut)

    def active(self) -> None:
        """A peer is about to read: progress soon and often again (emulated reads need this side's progress)."""
        with self._cond:
            self._idle_wait = IDLE_PROGRESS_S
            if self._waiting > IDLE_PROGRESS_S:  # in a backed-off wait: cut it short (a shorter one ends soon)
                self._cond.notify()

    def connect(self, delta: int) -> None:
        with self._cond:
            self.connected += delta
            if delta > 0:
                self._wire_up_until = time.monotonic() + WIRE_UP_S
            self._idle_wait = IDLE_PROGRESS_S
            self._cond.notify()

    def track(self, read: Read) -> None:
        """(On the agent's thread.) Poll a posted read until it ends."""
        self._reads.append(read)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._calls and not self._reads and not self._stopping:
                    self._cond.wait(self._progress_interval())
                    self._waiting = 0.0
                if self._stopping and not self._calls and not self._reads:
                    return
                calls = list(self._calls)
                self._calls.clear()
            for fn, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
            if self._reads:
                self._poll()
                if self._reads:
                    time.sleep(POLL_S)
            elif self.connected:
                self.agent.get_new_notifs()  # progresses UCX: wire-up and software-emulated gets need the peer's

    def _progress_interval(self) -> float | None:
        """(Holding the lock.) How long to wait for a call before the next progress: none without peers."""
        if not self.connected:
            return None
        if time.monotonic() < self._wire_up_until:
            return PROGRESS_S
        wait = self._waiting = self._idle_wait
        self._idle_wait = min(2 * wait, IDLE_PROGRESS_MAX_S)
        return wait

    def _poll(self) -> None:
        now = time.perf_counter()
        still: list[Read] = []
        for r in self._reads:
            state = "ERR" if r.expired else self.agent.check_xfer_state(r.handle)
            if state == "PROC" and now > r.deadline:
                r.expired, state = True, "ERR"
            if state == "PROC":
                still.append(r)
                continue
            try:
                self.agent.release_xfer_handle(r.handle)  # cancels one still in flight
            except Exception:  # noqa: BLE001 - UCX could not cancel it yet: it may still write, so keep it a while
                if now < 2 * r.deadline - r.started:
                    still.append(r)
                    continue
                log.error("a KV read could not be cancelled in %.1fs; its handle is left behind", now - r.started)
            if state == "DONE":
                r.future.set_result((r.started, now))
            elif r.expired:
                r.future.set_exception(TransferTimeout(f"a KV read made no progress for {r.deadline - r.started:.1f}s"))
            else:
                r.future.set_exception(TransferError("a KV read failed (the peer's memory is gone or unreachable)"))
        self._reads = still

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(30)
