"""A ``vllm serve MODEL ...`` line from a manifest, run by ``fd serve``: the flags of
:data:`~fd.cli.vllm_table.TABLE` that fd does not declare itself (:func:`add_vllm_args`), what a
parsed command line's come to (:func:`vllm_compat`: applied, named as ignored, or refused in one
line), vLLM's ways of writing a command line (:func:`expand_argv`: ``--config FILE.yaml``,
underscores, ``-O3``), and the page docs/vllm-flags.md (:func:`markdown`).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fd.cli.vllm_table import (  # noqa: F401 (human_int, dtype: what the flags parse with)
    APPLY,
    BY_NAME,
    DTYPES,
    IGNORE,
    REFUSE,
    TABLE,
    VLLM_VERSION,
    Rule,
    VllmFlag,
    dtype,
    human_int,
    human_int_or_auto,
)


@dataclass(frozen=True)
class CommandFlags:
    """Which of :data:`TABLE`'s flags a command has, and where the parsed values are, as
    :func:`add_vllm_args` found them (the command's namespace holds it as ``vllm_flags``):
    :func:`vllm_compat` reads exactly these."""

    #: the table's flags added for vLLM's sake (fd's own flags are not among them)
    added: frozenset[str] = frozenset()
    #: every table flag the command has, fd's or added -> the namespace attribute of its value
    dests: Mapping[str, str] = field(default_factory=dict)
    #: a ``--X`` added beside fd's own ``--no-X`` -> the attribute of ``--no-X``'s value
    negations: Mapping[str, str] = field(default_factory=dict)


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    """The flags of :data:`TABLE` that ``p`` lacks, in a group of their own: each parses its
    value as vLLM's does (so ``--swap-space 4`` takes the 4) and is ``None`` when not given; a
    ``bool`` flag's ``--no-`` form is added beside an fd flag that has only the other."""
    have = p._option_string_actions
    added: list[str] = []
    dests: dict[str, str] = {}
    negations: dict[str, str] = {}
    group = p.add_argument_group(
        "vLLM compatibility",
        "vLLM's flags that fd serve takes so a `vllm serve` line runs here: each is applied, "
        "ignored (named once at start) or refused (see docs/vllm-flags.md)",
    )
    for f in TABLE:
        present = [n for n in f.names if n in have]
        if present:
            # fd's own flag: the names vLLM has besides (an alias, the other half of --x/--no-x)
            action = have[present[0]]
            dests[f.flag] = action.dest
            if isinstance(action, argparse._StoreTrueAction) and f.negation and f.negation not in have:
                group.add_argument(
                    f.negation,
                    dest=action.dest,
                    action="store_false",
                    default=argparse.SUPPRESS,
                    help=f"vLLM's: turns {f.flag} off (default: not given)",
                )
            continue
        if f.fd and f.negation in have:
            # fd's --no-X alone: --X asks for fd's default (and not with --no-X: vllm_compat)
            group.add_argument(
                f.flag,
                dest=f.dest,
                action="store_const",
                const=True,
                default=None,
                help=f"vLLM's: fd's default, which {f.negation} turns off",
            )
            dests[f.flag] = f.dest
            negations[f.flag] = have[f.negation].dest
            continue
        if f.fd:
            continue  # (a flag of another fd command: fd api's --host, say)
        added.append(f.flag)
        dests[f.flag] = f.dest
        kw: dict[str, Any] = {"dest": f.dest, "default": None, "help": f.rule.help()}
        if f.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif f.kind == "store_true":
            kw["action"] = "store_const"
            kw["const"] = True
        else:
            kw.update(type=f.type, nargs=f.nargs, choices=f.choices)
            if f.nargs == "?":
                kw["const"] = ""  # (the flag alone)
            elif f.choices is None:
                kw["metavar"] = f.dest.upper().split("_")[-1]
        group.add_argument(*f.names, **kw)
    p.set_defaults(vllm_flags=CommandFlags(frozenset(added), dests, negations))


def _show(f: VllmFlag, value: Any) -> str:
    if value is False:
        return f.negation or f.flag
    if f.kind != "value" or value is None or value is True or value == "" or f.secret:
        return f.flag
    if isinstance(value, list):
        value = " ".join(map(str, value))
    return f"{f.flag} {value}"


def vllm_compat(args: argparse.Namespace) -> list[str]:
    """What a vLLM command line's flags come to here: raises SystemExit (one line, naming the
    flag) for one fd cannot honour, applies those fd has (setting fd's own flags), and returns
    a note for each it takes and ignores (fd logs them once at start)."""
    tag = args.model_tag
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise SystemExit(f"error: the model is given twice: {tag} and --model {args.model}")
        args.model = tag
    notes: list[str] = []
    here: CommandFlags = args.vllm_flags
    for f in TABLE:
        if f.flag not in here.dests:
            continue  # (none of this command's: fd api's --host on fd engine, say)
        if f.flag in _SPECIAL:
            note = _SPECIAL[f.flag](args)
            if note:
                notes.append(note)
            continue
        # None: not given (a flag fd declares holds fd's default, which may be a value)
        value = getattr(args, here.dests[f.flag])
        negation = here.negations.get(f.flag)
        if negation is not None and value and getattr(args, negation):
            raise SystemExit(f"error: {f.flag} and {f.negation} together")
        if value is None or f.flag not in here.added and f.rule.kind == APPLY:
            continue
        verdict = f.rule.verdict(value)
        if verdict == REFUSE:
            raise SystemExit(f"error: {_show(f, value)} is not supported: {f.rule.why}")
        if verdict == IGNORE:
            notes.append(f"{_show(f, value)} ({f.rule.why})")
        elif f.rule.act is not None:
            f.rule.act(args, value)
    return notes


def _gpu_memory(args: argparse.Namespace) -> str | None:
    if args.gpu_memory_utilization is None:
        return None
    if args.device != "cpu":
        raise SystemExit(
            "error: --gpu-memory-utilization is not supported: size the KV cache with --kv-cache-mb"
        )
    return "--gpu-memory-utilization (a CPU: the KV cache is --kv-cache-mb)"


def _tokenizer(args: argparse.Namespace) -> None:
    tok = args.tokenizer
    if tok is None or args.model is not None and _same_path(tok, args.model):
        return
    raise SystemExit(
        f"error: --tokenizer {tok} is not supported: fd reads the tokenizer of the model it "
        "serves (put the tokenizer's files in the model dir)"
    )


def _same_path(a: str, b: str) -> bool:
    return a == b or Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


#: the flags whose rule reads more of the command line than their own value
_SPECIAL: dict[str, Callable[[argparse.Namespace], str | None]] = {
    "--gpu-memory-utilization": _gpu_memory,
    "--tokenizer": _tokenizer,  # type: ignore[dict-item]
}


def expand_argv(argv: list[str]) -> list[str]:
    """A ``vllm serve`` command line as vLLM's parser reads it, for fd's: ``--max_model_len``
    is ``--max-model-len``, ``-O3`` is ``--optimization-level 3``, and ``--config FILE`` (a
    YAML mapping of flags to values) puts its flags before the command line's, which win."""
    out: list[str] = []
    config: str | None = None
    it = iter(argv)
    for a in it:
        if a.startswith("--") and not a.startswith("---"):
            name, eq, value = a.partition("=")
            a = name.replace("_", "-") + eq + value
        if re.fullmatch(r"-O\d", a):
            out += ["--optimization-level", a[2:]]
        elif a == "--config":
            config = next(it, None)
            if config is None:
                raise SystemExit("error: --config needs a file")
        elif a.startswith("--config="):
            config = a.partition("=")[2]
        else:
            out.append(a)
    if config is None:
        return out
    # after the command and its model, if given first (a list-valued flag would take it)
    at = 2 if len(out) > 1 and not out[1].startswith("-") else 1
    return out[:at] + config_argv(config) + out[at:]


def config_argv(path: str) -> list[str]:
    """vLLM's ``--config`` file as flags: ``key: value`` is ``--key value``, ``key: true``
    ``--key``, ``key: false`` ``--no-key``, a list its items, a mapping its JSON."""
    import orjson
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SystemExit(f"error: --config {path}: {e}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise SystemExit(f"error: --config {path}: not a mapping of flags to values")
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            out += [flag, orjson.dumps(value).decode()]
        elif value is not None:
            out += [flag, str(value)]
    return out


def markdown() -> str:
    """docs/vllm-flags.md: each flag and what fd does with it."""
    counts = {k: sum(f.rule.kind == k for f in TABLE) for k in (APPLY, IGNORE, REFUSE)}
    lines = [
        f"# vLLM {VLLM_VERSION}'s `vllm serve` flags in `fd serve`",
        "",
        "`fd serve` takes every flag of `vllm serve` (and a few of earlier releases that "
        "manifests still carry), so a `vllm serve MODEL ...` line runs with `vllm serve` "
        "replaced by `fd serve`. Each flag is",
        "",
        "- **apply**: fd does what it asks (most are fd's own flags, see `fd serve --help`);",
        "- **ignore**: it asks for nothing fd's answers depend on; fd names it, once, in a log "
        "line at start (`vLLM flags taken and ignored: ...`);",
        "- **refuse**: ignoring it would silently change the outputs, or it cannot work here: "
        "fd exits at once with a one-line message that names the flag. Where a value is listed "
        "(`refuse unless 1`), that value asks for what fd does and is taken.",
        "",
        "A `--no-X` form of a flag asks for nothing fd has, and is taken. vLLM's `--config FILE`"
        " (YAML), `--flag_with_underscores` and `-O3` are read as vLLM reads them.",
        "",
        f"{len(TABLE)} flags: {counts[APPLY]} apply, {counts[IGNORE]} ignore, {counts[REFUSE]} "
        "refuse. This file is written by `python -c 'import fd.cli.vllm_flags as v; "
        'print(v.markdown(), end="")\' > docs/vllm-flags.md` from fd/cli/vllm_flags.py; '
        "tests/integration/test_vllm_flags.py checks it is up to date, and that every flag of "
        "vLLM's own parser (tests/data/vllm_serve_flags_0.32.json) is here.",
        "",
        "| flag | fd | why |",
        "|---|---|---|",
    ]
    for f in sorted(TABLE, key=lambda f: f.flag):
        names = ", ".join(f"`{n}`" for n in (*f.names, *([f.negation] if f.negation else [])))
        kind = f.rule.kind
        if f.rule.ok and kind == REFUSE:
            kind += " unless " + " or ".join(f"`{v}`" for v in f.rule.ok if v is not None) or kind
        why = f.rule.why or "fd's own flag"
        lines.append(f"| {names} | {kind} | {why} |")
    return "\n".join(lines) + "\n"
