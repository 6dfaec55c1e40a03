"""The ``deltarl`` command's dispatch table names a real module and function for every
subcommand it parses (checked without importing the heavy ones)."""

from __future__ import annotations

import ast
import importlib.util

from deltarl import cli


def _functions(module: str) -> set[str]:
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    assert spec.origin is not None
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_every_command_has_an_entry_point() -> None:
    commands = {
        "ctl", "up", "chaos", "keys", "model", "plan", "doctor", "drill", "trainer-restore",
        "export-dry-run", "layout", "trainer --synthetic", *cli.DAEMONS,
        *(f"bench {b}" for b in cli.BENCHES),
    }  # fmt: skip
    assert set(cli.ENTRY_POINTS) == commands
    for command, (module, function) in cli.ENTRY_POINTS.items():
        assert function in _functions(module), f"{command}: {module}.{function}"
