"""A discrete-event simulation of one deployment serving a workload, step by step, as pdserve's engines run.

Every worker is an engine that takes one step at a time, each lasting what the profile's step cost says for what
it computes. The gateway routes as the real one does: a decode worker by load, a prefill worker by queued prompt
tokens, and (conditional disaggregation) a short prompt to the decode worker itself while its own backlog is short.
A decode worker reserves a request's KV before its prompt runs (queueing, in arrival order, when its pool is full);
a prefill worker batches waiting prompts up to the token budget, chunking long ones, and its KV lands on the decode
worker one transfer later, which is when the first token streams; a colocated worker mixes prompt chunks into its
decode batch under the same budget, as `engine/scheduler.py` does.

A running batch is held as a count, a sum of contexts and a heap of the step at which each row finishes, never as a
list walked every step: a step costs O(log n) however large the batch. A stretch of decode-only steps, where the
batch cannot change before its next row finishes, is one event (cut short, at the step in progress, when new work
arrives), so the events follow the requests rather than the steps.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.planner.profile import Profile
from pdserve.planner.workload import Request

MAX_SCAN = 32  # more workers than this: route by two random choices instead of scanning them all


@dataclass(frozen=True)
class Deployment:
    """`prefill` workers and `decode` workers; no prefill workers means `decode` colocated workers."""

    prefill: int
    decode: int
    local_prefill_max_tokens: int = 0  # disaggregated: prompts up to this are prefilled by the decode worker

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    @property
    def label(self) -> str:
        if self.colocated:
            return f"colocated x{self.decode}"
        local = f" (local <= {self.local_prefill_max_tokens})" if self.local_prefill_max_tokens else ""
        return f"{self.prefill}P{self.decode}D{local}"


@dataclass
class Outcome:
    request: Request
    first_token: float
    finish: float

    @property
    def ttft(self) -> float:
        return self.first_token - self.request.arrival

    @property
    def tpot(self) -> float:
        """Mean gap between output tokens after the first (0 for a one-token output)."""
        n = self.request.output - 1
        return (self.finish - self.first_token) / n if n > 0 else 0.0


class _Prefill:
    """A prompt being computed: where it is, and how far."""

    __slots__ = ("index", "remaining", "done", "decode")

    def __init__(self, index: int, tokens: int, decode: _Engine) -> None:
        self.index, self.remaining, self.done, self.decode = index, tokens, 0, decode


class _Engine:
    """One worker's engine: prompts to compute (a FIFO, chunked under the budget) and, unless it only
    prefills, a running decode batch."""

    def __init__(self, sim: Simulation, prefill_only: bool) -> None:
        self.sim = sim
        self.prefill_only = prefill_only
        self.prompts: deque[_Prefill] = deque()
        self.queued_tokens = 0
        self.step_index = 0
        self.busy = False
        # the decode batch
        self.rows = 0
        self.context = 0
        self.finishing: list[tuple[int, int, int]] = []  # (finish step, request index, context at join - join step)
        self.ready: deque[int] = deque()  # landed or prefilled, waiting for a batch slot
        # KV reservations (decode side)
        self.free_tokens = sim.profile.kv_capacity_tokens
        self.reserving: deque[tuple[int, _Engine | None]] = deque()
        self.assigned = 0  # requests routed here and not finished: the router's load figure
        # decode-only stretches run as one event up to the next finish (`_start`); `gen` outdates a cut one's end
        self.macro: tuple[float, float, float, int] | None = None  # (start, first step's cost, growth, steps)
        self.gen = 0

    # ---- admission -------------------------------------------------------------------------------------------

    def reserve(self, index: int, prefill: _Engine | None) -> None:
        """Hold KV for request `index` (queued in arrival order when the pool is full), then have `prefill` (None:
        this engine) compute its prompt."""
        self.assigned += 1
        self.reserving.append((index, prefill))
        self._grant()

    def _grant(self) -> None:
        sim = self.sim
        while self.reserving:
            index, prefill = self.reserving[0]
            req = sim.requests[index]
            need = req.prompt + req.output
            if need > self.free_tokens and self.free_tokens < sim.profile.kv_capacity_tokens:
                return
            self.reserving.popleft()
            self.free_tokens -= need
            (prefill or self).add_prompt(_Prefill(index, req.prompt, self))

    def add_prompt(self, job: _Prefill) -> None:
        self.prompts.append(job)
        self.queued_tokens += job.remaining
        self.kick()

    def land(self, index: int) -> None:
        """The KV of request `index` arrived: its first token streams now; it decodes from the next step."""
        self.sim.first_token[index] = self.sim.now
        self._joined(index)
        self.kick()

    def _joined(self, index: int) -> None:
        if self.sim.requests[index].output <= 1:
            self._finished(index)
        else:
            self.ready.append(index)

    def _finished(self, index: int) -> None:
        sim = self.sim
        req = sim.requests[index]
        sim.finish[index] = sim.now
        self.free_tokens += req.prompt + req.output
        self.assigned -= 1
        self._grant()

    # ---- steps -------------------------------------------------------------------------------------------------

    def kick(self) -> None:
        if not self.busy:
            if self.prompts or self.rows or self.ready:
                self._start()
        elif self.macro is not None:
            self._cut()

    def _cut(self) -> None:
        """New work arrived during a run of decode-only steps: end the run with the step in progress, as a
        step-by-step engine would take the work in at its next step."""
        assert self.macro is not None
        start, first, growth, steps = self.macro
        now = self.sim.now

        def end(j: int) -> float:  # when step j (from 0) of the run ends
            return start + (j + 1) * first + growth * j * (j + 1) / 2

        lo, hi = 0, steps - 1  # the first step that has not ended before now
        while lo < hi:
            mid = (lo + hi) // 2
            if end(mid) < now:
                lo = mid + 1
            else:
                hi = mid
        self.macro = None
        if lo + 1 < steps:
            self.gen += 1
            self.sim.schedule(end(lo), self, ([], first, lo + 1, self.gen))

    def _start(self) -> None:
        sim, prof = self.sim, self.sim.profile
        while self.ready and self.rows < prof.max_num_seqs:
            index = self.ready.popleft()
            req = sim.requests[index]
            self.rows += 1
            join = req.prompt + 1
            self.context += join
            heapq.heappush(self.finishing, (self.step_index + req.output - 1, index, join - self.step_index))
        budget = prof.max_num_batched_tokens - self.rows
        seqs = self.rows
        chunks: list[tuple[_Prefill, int]] = []
        tokens = pairs = 0.0
        for job in self.prompts:
            if budget <= 0 or seqs >= prof.max_num_seqs:
                break
            n = min(job.remaining, budget)
            chunks.append((job, n))
            tokens += n
            pairs += n * (job.done + (n + 1) / 2)
            budget -= n
            seqs += 1
        step = prof.step
        total = int(tokens) + self.rows
        base = sim.tokens_s[total] if total < len(sim.tokens_s) else step.tokens_s(total)
        seconds = base + step.seq_s * seqs + step.context_s * self.context + step.pair_s * pairs
        self.busy = True
        steps = 1
        if sim.macro_steps and not chunks and not self.ready and self.finishing:
            # nothing changes the batch until its next row finishes, unless new work comes (`_cut`): the steps
            # until then cost `seconds` plus context_s * rows more each, as one event
            steps = self.finishing[0][0] - self.step_index
            growth = step.context_s * self.rows
            if steps > 1:
                self.macro = (sim.now, seconds, growth, steps)
            seconds = steps * seconds + growth * steps * (steps - 1) / 2
        sim.schedule(sim.now + seconds, self, (chunks, seconds, steps, self.gen))

    def end_step(self, chunks: list[tuple[_Prefill, int]], seconds: float, steps: int, gen: int) -> None:
        if gen != self.gen:
            return  # a run of steps that was cut short: its end is the one `_cut` scheduled
        sim = self.sim
        self.macro = None
        self.step_index += steps
        self.context += self.rows * steps
        while self.finishing and self.finishing[0][0] <= self.step_index:
            _, index, offset = heapq.heappop(self.finishing)
            self.rows -= 1
            self.context -= offset + self.step_index
            self._finished(index)
        for job, n in chunks:
            job.remaining -= n
            job.done += n
            self.queued_tokens -= n
            if job.remaining == 0:
                self.prompts.popleft()  # chunks are taken from the front, so a finished one is first
                if self.prefill_only:
                    sim.schedule(sim.now + sim.transfer_tail(job.done, seconds), job.decode, job.index)
                else:
                    sim.first_token[job.index] = sim.now
                    self._joined(job.index)
        self.busy = False
        self.kick()


class Simulation:
    def __init__(
        self, profile: Profile, deployment: Deployment, requests: list[Request], macro_steps: bool = True
    ) -> None:
        """`macro_steps` False simulates every decode step as its own event (the reference the test compares
        the runs of steps against)."""
        if deployment.decode < 1 or deployment.prefill < 0:
            raise ValueError("a deployment needs at least one decode (or colocated) worker")
        self.profile = profile
        self.deployment = deployment
        self.requests = requests
        self.macro_steps = macro_steps
        self.now = 0.0
        self.first_token = [0.0] * len(requests)
        self.finish = [-1.0] * len(requests)
        self.decode = [_Engine(self, prefill_only=False) for _ in range(deployment.decode)]
        self.prefill = [_Engine(self, prefill_only=True) for _ in range(deployment.prefill)]
        self._events: list[tuple[float, int, _Engine, object]] = []
        self._seq = 0
        self._rng = random.Random(0)
        # the token-dependent part of a step's cost, by tokens in the forward: looked up, not interpolated, per step
        most = profile.max_num_batched_tokens + profile.max_num_seqs
        self.tokens_s = [profile.step.tokens_s(t) for t in range(most + 1)]

    def schedule(self, at: float, engine: _Engine, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, engine, payload))

    def transfer_tail(self, tokens: int, last_step_s: float) -> float:
        """What the transfer adds after the prompt's last step: layers are pushed as they are computed, so all but
        the last layer's share overlaps that step, as far as the wire keeps up."""
        p = self.profile
        wire = tokens * p.kv_bytes_per_token / p.transfer_bytes_per_s
        layers = max(p.num_layers, 1)
        return p.transfer_latency_s + wire / layers + max(0.0, wire - last_step_s) * (layers - 1) / layers

    def _least(self, engines: Sequence[_Engine], load) -> _Engine:
        """The least loaded engine, as the router picks; among many, the better of two at random (the power of
        two choices), so routing stays O(1) per request."""
        if len(engines) > MAX_SCAN:
            engines = self._rng.sample(engines, 2)
        return min(engines, key=load)

    def _route(self, index: int) -> None:
        req = self.requests[index]
        decode = self._least(self.decode, lambda e: e.assigned)
        dep = self.deployment
        if dep.colocated:
            decode.reserve(index, None)
            return
        limit = dep.local_prefill_max_tokens
        remote = min(w.queued_tokens for w in self.prefill) if limit else 0
        if 0 < req.prompt <= limit and decode.queued_tokens < max(4 * limit, remote):
            decode.reserve(index, None)
            return
        decode.reserve(index, self._least(self.prefill, lambda e: e.queued_tokens))

    def run(self) -> list[Outcome]:
        order = sorted(range(len(self.requests)), key=lambda i: self.requests[i].arrival)
        events = self._events
        next_arrival = 0
        while next_arrival < len(order) or events:
            if next_arrival < len(order) and (not events or self.requests[order[next_arrival]].arrival <= events[0][0]):
                index = order[next_arrival]
                next_arrival += 1
                self.now = self.requests[index].arrival
                self._route(index)
                continue
            at, _, engine, payload = heapq.heappop(events)
            self.now = at
            if isinstance(payload, int):
                engine.land(payload)
            else:
                engine.end_step(*payload)  # type: ignore[misc]
        unfinished = [i for i, f in enumerate(self.finish) if f < 0]
        if unfinished:
            raise RuntimeError(f"{len(unfinished)} requests never finished (a request larger than a KV pool?)")
        return [Outcome(r, self.first_token[i], self.finish[i]) for i, r in enumerate(self.requests)]
