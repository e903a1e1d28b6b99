"""What a user on plain PyPI gets: the dependency set resolves there (no local wheels, no pip config)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_dependencies_resolve_on_plain_pypi(tmp_path):
    """`--isolated` ignores this machine's pip configuration (which supplies a local CPU torch), so this is the
    resolution a new user gets: torch 2.13.0 from PyPI is the CUDA 13 build, and every CUDA-flavoured dependency
    must agree with it."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--isolated",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "torch==2.13.0",
            "-e",
            f"{ROOT}[test]",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert names["torch"] == "2.13.0"
    assert "ucxx-cu13" in names and not any(n.endswith("-cu12") for n in names), sorted(names)


def test_the_wheel_installs_only_the_pdserve_namespace(tmp_path):
    """site-packages gains `pdserve` and nothing else: no top-level `engine`, `cli`, `gateway`, ... to collide with
    other packages; the folders install as pdserve.<folder>, with the kernels' C sources and the .proto files."""
    import shutil
    import zipfile

    src = tmp_path / "src"  # a copy: setuptools builds in the source tree, and the checkout stays clean
    skip = shutil.ignore_patterns(
        ".git",
        "build",
        "*.egg-info",
        "__pycache__",
        ".make",
        ".venv",
        ".*cache",
        ".hypothesis",
        ".benchmarks",
        "tests",
        "k8s",
        "compose",
        "results",
    )
    shutil.copytree(ROOT, src, symlinks=True, ignore=skip)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"pdserve"}, top
    for path in (
        "pdserve/engine/engine_core.py",
        "pdserve/cli/main.py",
        "pdserve/kernels/cpu_paged_attention.c",
        "pdserve/kernels/cpu_math.h",
        "pdserve/protos/worker.proto",
        "pdserve/benchmarks/load_gen.py",
    ):
        assert path in names, path


@pytest.mark.parametrize("installed", [True, False])
def test_the_kernels_folder_leaves_its_top_level_name_to_the_installed_package(tmp_path, installed):
    """Run from the repository's root, `import kernels` finds this repository's folder first; transformers >= 5.25
    imports Hugging Face's `kernels` at start, and every service failed to start when it got ours instead. The
    folder hands the name to the installed package; without one it stays what it was (transformers 5.24 imports
    the name to read a version, and a package without one counts as absent)."""
    site = tmp_path / "site"
    if installed:
        (site / "kernels").mkdir(parents=True)
        (site / "kernels" / "__init__.py").write_text("CUDAProperties = 'the installed one'\n")
    code = (
        "import sys\n"
        f"sys.path[:0] = [{str(ROOT)!r}]\n"
        f"sys.path.append({str(site)!r})\n"
        "import kernels\n"
        "print(getattr(kernels, 'CUDAProperties', kernels.__file__))\n"
        "import pdserve.kernels\n"
    )
    # -S: no site-packages, where a fresh install has the real package (transformers >= 5.25 depends on it)
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("the installed one" if installed else str(ROOT / "kernels" / "__init__.py"))
