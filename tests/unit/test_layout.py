"""The tests' own layout (issue #45): test modules live in tests/unit (pure, seconds) or
tests/integration, and share helpers only through the tests/kit package, never by importing
another test module; the Redis launcher there stays free of pytest, so bench/ can use it."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, wherever in it (a function's too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _is_test_module(module: str) -> bool:
    """``test_x`` / ``conftest`` (pytest puts the test's folder on sys.path) or ``tests.test_x``,
    ``tests.integration.test_x``, ``tests.conftest``; not a library's ``aiohttp.test_utils``."""
    parts = module.split(".")
    if parts[0] != "tests":
        parts = parts[:1]
    return any(p.startswith("test_") or p == "conftest" for p in parts)


def test_no_test_module_imports_another():
    bad = [
        f"{path.relative_to(TESTS.parent)}:{line}: import {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in _imports(path)
        if _is_test_module(module)
    ]
    assert not bad, "shared helpers belong in tests/kit:\n" + "\n".join(bad)


def test_every_test_module_is_a_unit_or_an_integration_test():
    stray = [
        str(p.relative_to(TESTS.parent))
        for p in TESTS.rglob("test_*.py")
        if p.parent not in (TESTS / "unit", TESTS / "integration")
    ]
    assert not stray, f"test modules go in tests/unit or tests/integration: {stray}"


def test_the_redis_launcher_needs_no_pytest():
    # bench/_common.py starts its redis-server with it, and the benchmarks do not import pytest
    modules = {m.split(".")[0] for _, m in _imports(TESTS / "kit" / "redis.py")}
    modules |= {m.split(".")[0] for _, m in _imports(TESTS / "kit" / "__init__.py")}
    assert "pytest" not in modules and "tests" not in modules, modules
