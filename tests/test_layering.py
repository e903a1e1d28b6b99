"""Imports run one way only (docs/ARCHITECTURE.md): a package never imports one above it, nothing imports tests."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# package -> the project packages it may import (itself included)
ALLOWED = {
    "cli": {"cli", "gateway", "prefill_service", "decode_service", "benchmarks", "pdserve", "engine", "kvtransfer",
            "kernels", "protos"},
    "benchmarks": {"benchmarks", "pdserve", "engine", "kvtransfer", "kernels", "protos"},
    "gateway": {"gateway", "pdserve", "protos", "kernels"},  # kernels: the block hash the workers name blocks by
    "prefill_service": {"prefill_service", "pdserve", "engine", "kvtransfer", "kernels", "protos"},
    "decode_service": {"decode_service", "pdserve", "engine", "kvtransfer", "kernels", "protos"},
    "pdserve": {"pdserve", "engine", "protos"},
    "engine": {"engine", "kernels"},
    "kvtransfer": {"kvtransfer", "kernels"},
    "kernels": {"kernels"},
    "protos": {"protos"},
}
PROJECT = set(ALLOWED) | {"tests"}


def _imports(path: Path) -> set[str]:
    """Top-level project packages a module imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names} & PROJECT
    return found


def test_imports_only_run_downward():
    wrong = []
    for package, allowed in ALLOWED.items():
        files = sorted((ROOT / package).rglob("*.py"))
        assert files, package
        for path in files:
            for imported in _imports(path) - allowed:
                wrong.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_every_package_is_placed():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == set(ALLOWED), packages ^ set(ALLOWED)
