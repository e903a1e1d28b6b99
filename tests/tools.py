"""Finding the command-line tools the tests run."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def executable(name: str) -> str | None:
    """`name` beside this interpreter (a venv's bin/, found even when the venv is not activated), else on PATH."""
    beside = Path(sys.executable).with_name(name)
    if beside.is_file():
        return str(beside)
    return shutil.which(name)
