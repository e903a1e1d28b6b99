"""Flags declared as dataclass fields: `option` makes a field a flag (its help, parser, environment variables), and
from those declarations come the parser (`add_options`, `add_config`), the values a command runs with (`from_args`)
and the argument list that gives a child process the same values (`to_argv`). The declarations are `config.py`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import field
from typing import Any, TypeVar

T = TypeVar("T")


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB', '4096' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    raw = text
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a size (e.g. 512M, 2G)") from None


def parse_count(text: str) -> int:
    """'3' -> 3; a negative number or a non-number is refused by name."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative") from None
    return value


def parse_seconds(text: str) -> float:
    """'5', '0.5' -> seconds; negative or not a number is refused by name."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a non-negative number of seconds") from None
    return value


def parse_port_range(text: str) -> str:
    """'20000-20099' (or one port) -> itself, checked."""
    lo, _, hi = text.strip().partition("-")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        low = high = 0
    if not 1 <= low <= high <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port range LO-HI (1..65535)")
    return f"{low}-{high}"


def format_size(n: int) -> str:
    """536870912 -> '512M': the form parse_size reads."""
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def option(
    default: Any,
    help: str,
    *,
    flag: str = "",
    choices: tuple[str, ...] = (),
    env: tuple[str, ...] = (),
    parse: typing.Callable[[str], Any] | None = None,
    negate: bool = False,
) -> Any:
    """A dataclass field that is also a command-line flag. `env`: variables that override the default (the first
    one set); `negate`: a bool that is True by default and turned off by `flag` (e.g. --no-prefix-caching)."""
    meta = {"help": help, "flag": flag, "choices": choices, "env": env, "parse": parse, "negate": negate}
    return field(default=default, metadata=meta)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _kind(hint: Any) -> type:
    """A field's value type (int, float, str or bool), Optional unwrapped."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_options(parser: argparse.ArgumentParser, cls: type, **defaults: Any) -> None:
    """A flag for every field of `cls` (`defaults` replaces a field's default for this command)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        default = defaults.get(f.name, f.default)
        kind = _kind(hints[f.name])
        raw = next((os.environ[name] for name in meta["env"] if os.environ.get(name)), None)
        if raw is not None:
            default = raw == "1" if kind is bool else (meta["parse"] or kind)(raw)
        help = meta["help"]
        if meta["parse"] is parse_size and isinstance(default, int):
            help += f" (default: {format_size(default)})"
        if kind is bool:
            action = "store_false" if meta["negate"] else "store_true"
            parser.add_argument(_flag(f), dest=f.name, action=action, default=default, help=help)
            continue
        parser.add_argument(
            _flag(f),
            dest=f.name,
            type=meta["parse"] or kind,
            default=default,
            choices=meta["choices"] or None,
            help=help,
        )


def _is_group(hint: Any) -> bool:
    """Whether a configuration's field is a group of options (a dataclass), not an option."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The options (or a whole configuration) of `cls` as the parsed flags give them."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = hints[f.name]
        values[f.name] = (
            from_args(kind, args)
            if isinstance(kind, type) and dataclasses.is_dataclass(kind)
            else getattr(args, f.name)
        )
    return cls(**values)


def add_config(parser: argparse.ArgumentParser, cls: type, **defaults: Any) -> None:
    """The flags of every group of a configuration (`defaults` replaces some fields' defaults, by name)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        add_options(parser, hints[f.name], **defaults)


def leaf_fields(cls: type) -> list[str]:
    """The names of a configuration's options, through its groups: the flags its command must have."""
    hints = typing.get_type_hints(cls)
    names: list[str] = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        names += leaf_fields(kind) if _is_group(kind) else [f.name]
    return names


def to_argv(options: Any, **values: Any) -> list[str]:
    """The flags that give a child process these options (`values` replaces some of them, by field name, at any
    depth of a configuration's groups)."""
    argv: list[str] = []
    for f in dataclasses.fields(options):
        value = values.get(f.name, getattr(options, f.name))
        if dataclasses.is_dataclass(value):
            argv += to_argv(value, **values)
            continue
        if value is None:
            continue
        if isinstance(value, bool):
            if value != f.metadata["negate"]:  # a store_true flag that is set, or a negating flag that is off
                argv.append(_flag(f))
        else:
            argv += [_flag(f), str(value)]
    return argv
