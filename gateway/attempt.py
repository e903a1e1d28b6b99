"""What one attempt at a request came to, as data the gateway's attempt loop acts on: `Done`, `Retry` (nothing was
streamed: another worker may serve it), `Migrate` (tokens were streamed: prompt + tokens so far move to another
decode worker) or `Fail`. A failed worker call is turned into one of these by its failure-table row (`decide`); no
status, retry rule or label is decided here."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from pdserve.failures import Party, Policy, of_rpc
from pdserve.gateway.request import RequestError


@dataclass(frozen=True)
class Done:
    pass


@dataclass(frozen=True)
class Retry:
    error: RequestError
    culprit: str  # the address of the worker that failed it


@dataclass(frozen=True)
class Migrate:
    error: RequestError
    culprit: str
    reason: str  # the failure's label: the migration metric's reason


@dataclass(frozen=True)
class Fail:
    error: RequestError


Outcome = Done | Retry | Migrate | Fail


@dataclass(frozen=True)
class Blame:
    """Which worker an outcome is about, and whether it should leave the rotation."""

    address: str
    mark_down: bool


def decide(
    e: grpc.aio.AioRpcError, decode: str, prefill: str, streamed: bool, generated: bool
) -> tuple[Outcome, Blame]:
    """The outcome of a decode call to `decode` (with `prefill` named, or "") that failed with `e`. `streamed`:
    this call streamed tokens; `generated`: tokens were streamed, on this worker or an earlier one."""
    failure = of_rpc(e)
    row = failure.row
    party = failure.party or "decode"
    address = failure.address or (prefill if party == "prefill" and prefill else decode)
    blame = Blame(address, row.mark_down)
    if row.party is Party.CALLER:
        return Fail(RequestError(row, failure.details, failure.param)), blame
    where = "mid-stream" if streamed else "before the first token"
    error = RequestError(row, f"{party} worker {address} failed {where}: {failure.details}", failure.param)
    if generated:
        if row.after_first_token is Policy.MIGRATE:
            return Migrate(error, address, row.label), blame
        return Fail(error), blame
    if row.before_first_token is Policy.RETRY:
        return Retry(error, address), blame
    return Fail(error), blame
