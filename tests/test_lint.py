"""Lint, format and types are part of the suite: ruff and mypy as configured in pyproject.toml, clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools import executable

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> list[str]:
    """The tool beside this interpreter or on PATH, else run as a module."""
    found = executable(name)
    return [found] if found else [sys.executable, "-m", name]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_lint_is_clean() -> None:
    proc = _run(*_tool("ruff"), "check", "--no-cache", ".")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]


def test_ruff_format_is_clean() -> None:
    proc = _run(*_tool("ruff"), "format", "--check", "--no-cache", ".")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]


@pytest.mark.slow
def test_mypy_is_clean(tmp_path: Path) -> None:
    proc = _run(*_tool("mypy"), "--cache-dir", str(tmp_path / "mypy"))
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
