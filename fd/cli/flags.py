"""Command-line flags made from the nodes' config dataclasses: a field that is a flag says so
in its metadata (``flag``: its name; ``help``, ``metavar``, ``choices``, ``nargs``, ``action``
as argparse takes them; ``type`` when the annotation does not say it; ``negate``: a field true
by default whose flag ``--no-...`` turns it off), and the flag's default is the field's. So a
default and its help are written once, where the setting is declared (fd/engine/node/node_config.py's
``EngineConfig`` and its ``SchedulerSettings``, fd/api/config.py's ``ApiConfig``), and the
parsed flags go back to those fields by :func:`field_values`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from typing import Any

from fd.cli.vllm_table import dtype, human_int, human_int_or_auto


def seconds(text: str) -> int:
    """A flag's whole number of seconds, at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1 second")
    return n


def timeout_s(text: str) -> float:
    """A timeout flag's seconds (fractions too); 0 turns it off."""
    try:
        s = float(text)
    except ValueError:
        s = math.nan
    if not (math.isfinite(s) and s >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return s


def endpoint_list(text: str) -> tuple[str, ...]:
    """vLLM's ``--disable-access-log-for-endpoints``: paths, comma-separated."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


#: what a field's annotation (a string: the modules use postponed annotations) parses with
_TYPES: dict[str, Callable[[str], Any]] = {
    "int": int,
    "float": float,
    "int | None": int,
    "float | None": float,
}


#: the parsers a field's metadata may name as its ``type`` (the nodes do not import the CLI);
#: human_int: vLLM's human-readable int (32k), for the fields whose flags are vLLM's, and
#: human_int_or_auto one that may also be ``auto`` (None: the model's)
NAMED_TYPES: dict[str, Callable[[str], Any]] = {
    "seconds": seconds,
    "timeout_s": timeout_s,
    "endpoint_list": endpoint_list,
    "human_int": human_int,
    "human_int_or_auto": human_int_or_auto,
    "dtype": dtype,
}


def _field(cls: type, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def dest(f: dataclasses.Field) -> str:
    """The ``argparse`` attribute of a field's flag."""
    return f.metadata["flag"].lstrip("-").replace("-", "_")


def add_field_flags(p: argparse.ArgumentParser, cls: type, *names: str, **defaults: Any) -> None:
    """The flags of ``cls``'s fields ``names``, in that order; ``defaults``: a command's own
    default for a field (``fd serve``'s port, say), where it differs from the field's.

    The command records which fields it made flags of (its namespace's ``field_flags``:
    class -> field names), so :func:`field_values` reads exactly those."""
    made = dict(p.get_default("field_flags") or {})
    made[cls] = (*made.get(cls, ()), *names)
    p.set_defaults(field_flags=made)
    for name in names:
        f = _field(cls, name)
        meta = dict(f.metadata)
        flag = meta.pop("flag")
        aliases = meta.pop("aliases", ())
        kw: dict[str, Any] = {k: v for k, v in meta.items() if k != "negate"}
        if meta.get("negate"):
            kw.setdefault("action", "store_true")
        else:
            default = defaults.get(name, f.default)
            if default is dataclasses.MISSING:
                default = f.default_factory()  # type: ignore[misc]
            if kw.get("action") != "store_true":
                kw["default"] = default
                parse = kw.get("type")
                if isinstance(parse, str):
                    kw["type"] = NAMED_TYPES[parse]
                elif parse is None and kw.get("action") is None and f.type in _TYPES:
                    kw["type"] = _TYPES[f.type]  # type: ignore[index]
        p.add_argument(flag, *aliases, **kw)


def field_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values ``args`` gives ``cls``'s fields: those its command made flags of
    (:func:`add_field_flags` recorded them), by field name."""
    out: dict[str, Any] = {}
    for name in args.field_flags.get(cls, ()):
        f = _field(cls, name)
        v = getattr(args, dest(f))  # (the flag's: its command added it)
        out[name] = (not v) if f.metadata.get("negate") else v
    return out


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` that shows every flag's default: argparse's ``(default: ...)``, unless the
    help says it already; a switch's as on or off, a flag that is None as not given."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text.lower()
            or action.default is argparse.SUPPRESS
            or not action.option_strings
            and action.nargs not in ("?", "*")
        ):
            return text
        if action.nargs == 0:
            return text + (" (default: on)" if action.default else " (default: off)")
        if action.default is None or action.default == []:
            return text + " (default: not given)"
        return text + " (default: %(default)s)"
