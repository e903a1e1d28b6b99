"""The KV protocol's messages, as types, and the one codec between them and the JSON headers on the wire.

A sender opens a connection with `Hello` (its layout and, when its cache is registered, the cache's descriptor) and
the receiver answers `HelloOk` (naming the plane: one-sided when it will read from that cache, else staged) or
`HelloErr`. Then, per transfer: `Begin` (the transfer id the receiver made, its secret, how many blocks the sender
holds for it and, for a one-sided transfer, which of its blocks as runs), `Layer` messages (staged: each followed by
2 * len(layers) payloads of `blocks` pages, K then V of each layer; one-sided: no payload, the receiver reads those
layers), and the receiver's `Done` or `Error`; `Abort` from the sender gives up on one transfer, `Bye` ends the
connection. Which blocks the bytes land in is never on the wire: the receiver writes where it reserved.

`decode` trusts nothing: a header that is not one of these messages with fields of the right types and sizes is
a ProtocolError, and the connection that sent it is closed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pdserve.kvtransfer.errors import ProtocolError

MAX_TRANSFER_ID = 128
MAX_SECRET = 256
MAX_ERROR = 200  # what a receiver keeps of a peer's error text
_MAX_STRING = {"req": MAX_TRANSFER_ID, "secret": MAX_SECRET, "error": 1 << 12}
MAX_LAYERS_PER_MESSAGE = 4096
MAX_SRC = 4096  # numbers in a Begin's source runs (a transfer whose blocks need more goes staged)
PLANE_NAMES = ("staged", "one-sided")


@dataclass(frozen=True)
class Hello:
    kind: ClassVar[str] = "hello"
    layout: dict[str, Any]
    memory: dict[str, Any] = field(default_factory=dict)  # the sender's registered cache (registered.py)


@dataclass(frozen=True)
class HelloOk:
    kind: ClassVar[str] = "hello_ok"
    layout: dict[str, Any]
    plane: str = "staged"


@dataclass(frozen=True)
class HelloErr:
    kind: ClassVar[str] = "hello_err"
    error: str


@dataclass(frozen=True)
class Begin:
    kind: ClassVar[str] = "begin"
    req: str
    blocks: int
    secret: str
    trace: dict[str, str] = field(default_factory=dict)
    src: list[int] = field(default_factory=list)  # one-sided: the sender's blocks as (start, count) pairs, flat


@dataclass(frozen=True)
class Layer:
    kind: ClassVar[str] = "layer"
    req: str
    layers: list[int]
    blocks: int


@dataclass(frozen=True)
class Done:
    kind: ClassVar[str] = "done"
    req: str


@dataclass(frozen=True)
class Error:
    kind: ClassVar[str] = "error"
    req: str
    error: str


@dataclass(frozen=True)
class Abort:
    kind: ClassVar[str] = "abort"
    req: str
    error: str


@dataclass(frozen=True)
class Bye:
    kind: ClassVar[str] = "bye"


Message = Hello | HelloOk | HelloErr | Begin | Layer | Done | Error | Abort | Bye
KINDS: dict[str, type[Message]] = {m.kind: m for m in (Hello, HelloOk, HelloErr, Begin, Layer, Done, Error, Abort, Bye)}


def encode(msg: Message) -> dict[str, Any]:
    """The header a message travels as."""
    return {"type": msg.kind, **dataclasses.asdict(msg)}


def decode(header: dict[str, Any]) -> Message:
    """The message a header holds; ProtocolError for anything else."""
    kind = KINDS.get(str(header.get("type")))
    if kind is None:
        raise ProtocolError(f"unknown message type {header.get('type')!r}")
    values = {}
    for f in dataclasses.fields(kind):
        if f.name in header:
            values[f.name] = _checked(f.name, header[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{kind.kind} message without {f.name!r}")
    return kind(**values)


def _checked(name: str, value: Any) -> Any:
    """A field's value if it has the type and size the protocol allows."""
    limit = _MAX_STRING.get(name)
    if limit is not None:
        if not isinstance(value, str) or len(value) > limit:
            raise ProtocolError(f"field {name!r} must be a string of at most {limit} characters")
        return value
    if name == "blocks":
        if not _is_int(value) or value < 0:
            raise ProtocolError("field 'blocks' must be a non-negative integer")
        return value
    if name == "layers":
        if (
            not isinstance(value, list)
            or not value
            or len(value) > MAX_LAYERS_PER_MESSAGE
            or not all(_is_int(v) and v >= 0 for v in value)
        ):
            raise ProtocolError("field 'layers' must be a non-empty list of layer indices")
        return value
    if name in ("layout", "memory"):
        if not isinstance(value, dict):
            raise ProtocolError(f"field {name!r} must be an object")
        return value
    if name == "plane":
        if value not in PLANE_NAMES:
            raise ProtocolError(f"field 'plane' must be one of {PLANE_NAMES}")
        return value
    if name == "src":
        if (
            not isinstance(value, list)
            or len(value) % 2
            or len(value) > MAX_SRC
            or not all(_is_int(v) and v >= 0 for v in value)
            or not all(value[i] > 0 for i in range(1, len(value), 2))
        ):
            raise ProtocolError("field 'src' must be a list of (start, count > 0) pairs of block numbers")
        return value
    if name == "trace":  # trace context: a few short strings, kept only as far as they are sane
        if not isinstance(value, dict):
            raise ProtocolError("field 'trace' must be an object")
        return {str(k)[:64]: str(v)[:256] for k, v in list(value.items())[:8]}
    raise ProtocolError(f"unknown field {name!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def runs_of(blocks: list[int]) -> list[int]:
    """Block numbers as flat (start, count) pairs: [5, 6, 7, 9] -> [5, 3, 9, 1]."""
    out: list[int] = []
    for b in blocks:
        if out and b == out[-2] + out[-1]:
            out[-1] += 1
        else:
            out += [b, 1]
    return out


def blocks_of(runs: list[int]) -> list[int]:
    return [b for i in range(0, len(runs), 2) for b in range(runs[i], runs[i] + runs[i + 1])]
