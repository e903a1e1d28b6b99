"""The KV protocol's messages, as types, and the one codec between them and the JSON headers on the wire.

A sender opens a connection with `Hello` (its layout) and the receiver answers `HelloOk` or `HelloErr`. Then, per
transfer: `Begin` (the transfer id the receiver made, its secret, how many blocks the sender holds for it),
`Layer` messages (each followed by 2 * len(layers) payloads of `blocks` pages: K then V of each layer), and the
receiver's `Done` or `Error`; `Abort` from the sender gives up on one transfer, `Bye` ends the connection.
Which blocks the bytes land in is never on the wire: the receiver writes where it reserved.

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


@dataclass(frozen=True)
class Hello:
    kind: ClassVar[str] = "hello"
    layout: dict[str, Any]


@dataclass(frozen=True)
class HelloOk:
    kind: ClassVar[str] = "hello_ok"
    layout: dict[str, Any]


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
    if name == "layout":
        if not isinstance(value, dict):
            raise ProtocolError("field 'layout' must be an object")
        return value
    if name == "trace":  # trace context: a few short strings, kept only as far as they are sane
        if not isinstance(value, dict):
            raise ProtocolError("field 'trace' must be an object")
        return {str(k)[:64]: str(v)[:256] for k, v in list(value.items())[:8]}
    raise ProtocolError(f"unknown field {name!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
