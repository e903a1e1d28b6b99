"""Imports run one way only (docs/ARCHITECTURE.md): a layer never imports one above it, modules import each other in
no cycle, project code is imported only as `pdserve.*`, and nothing imports tests."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# layer -> the layers it may import (itself included). "core" is the pdserve package's own modules (client, wire,
# tracing, grpc_server, ...): what every service and client shares.
ALLOWED = {
    "cli": {
        "cli",
        "gateway",
        "prefill_service",
        "decode_service",
        "benchmarks",
        "planner",
        "core",
        "engine",
        "kvtransfer",
        "kernels",
        "protos",
    },
    "benchmarks": {"benchmarks", "planner", "core", "engine", "kvtransfer", "kernels", "protos"},
    "planner": {"planner"},
    "gateway": {"gateway", "core", "protos", "kernels"},  # kernels: the block hash the workers name blocks by
    "prefill_service": {"prefill_service", "core", "engine", "kvtransfer", "kernels", "protos"},
    "decode_service": {"decode_service", "core", "engine", "kvtransfer", "kernels", "protos"},
    "core": {"core", "engine", "kvtransfer", "kernels", "protos"},
    "engine": {"engine", "kernels"},
    "kvtransfer": {"kvtransfer", "kernels"},
    "kernels": {"kernels"},
    "protos": {"protos"},
}
# single modules a layer may import from a layer it otherwise may not: the gateway checks sampling parameters by the
# engine's own rules, checks an output constraint compiles with the workers' own code (llguidance, no torch) and names
# the engine's failures (plain classes; importing them loads no model code), and the speculation limit (plain Python)
EXCEPTIONS = {
    "gateway": {
        "pdserve.engine.sampling_params",
        "pdserve.engine.errors",
        "pdserve.engine.grammar",
        "pdserve.engine.speculation",
    }
}
SUBPACKAGES = set(ALLOWED) - {"core"}
# where each layer's sources are: the folders at the top of the repository, the CLI inside pdserve/
FOLDERS = {layer: ROOT / layer for layer in SUBPACKAGES - {"cli"}} | {"cli": ROOT / "pdserve" / "cli"}
TOP_LEVEL_NAMES = SUBPACKAGES | {"tests"}


def _sources() -> dict[str, Path]:
    """Every project module by its import name."""
    out = {f"pdserve.{p.stem}" if p.stem != "__init__" else "pdserve": p for p in (ROOT / "pdserve").glob("*.py")}
    for layer, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join(("pdserve", layer, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGES else "core"


def _imports(path: Path, module_level_only: bool) -> set[str]:
    """The modules a file imports (at module level, or anywhere)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_imports_only_run_downward() -> None:
    sources = _sources()
    wrong = []
    for module, path in sorted(sources.items()):
        layer = _layer(module)
        for imported in _imports(path, module_level_only=False):
            top = imported.split(".")[0]
            if top in TOP_LEVEL_NAMES:
                wrong.append(f"{path.relative_to(ROOT)} imports {imported} (project code is pdserve.*)")
            elif (
                top == "pdserve"
                and _layer(imported) not in ALLOWED[layer]
                and not any(imported == e or imported.startswith(e + ".") for e in EXCEPTIONS.get(layer, ()))
            ):
                wrong.append(f"{path.relative_to(ROOT)} ({layer}) imports {imported} ({_layer(imported)})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle() -> None:
    """Among module-level imports (what runs at import time): a cycle makes import order matter."""
    sources = _sources()
    graph = {m: {i for i in _imports(p, module_level_only=True) if i in sources and i != m} for m, p in sources.items()}
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycles.append(
                    " -> ".join(stack[stack.index(dep) :] + [module, dep]) if dep in stack else f"{module} -> {dep}"
                )
            elif dep not in state:
                visit(dep, [*stack, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "\n".join(cycles)


def test_every_package_is_placed() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "pdserve"}
    assert packages == SUBPACKAGES - {"cli"}, packages ^ (SUBPACKAGES - {"cli"})
    for layer in SUBPACKAGES - {"cli"}:
        link = ROOT / "pdserve" / layer
        assert link.is_symlink() and link.resolve() == (ROOT / layer).resolve(), f"pdserve/{layer} -> ../{layer}"


def test_the_gateway_loads_no_torch() -> None:
    """The gateway only tokenizes and routes: its server, both front doors and the failure table import no torch
    (nor transformers, which imports it), so its process starts fast and stays small."""
    code = (
        "import sys\n"
        "import pdserve.gateway.server, pdserve.gateway.openai_api, pdserve.failures, pdserve.cli.main\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


SERVICES = ("gateway", "decode_service", "prefill_service", "kvtransfer", "pdserve")  # pdserve: core and the CLI


def test_the_services_layer_reads_in_pieces() -> None:
    """No module of the services layer over 400 lines, no function over 60 (generated stubs aside)."""
    long = []
    for folder in SERVICES:
        paths = (ROOT / folder).rglob("*.py") if folder != "pdserve" else [*(ROOT / "pdserve").glob("*.py")]
        paths = [*paths, *((ROOT / "pdserve" / "cli").glob("*.py") if folder == "pdserve" else [])]
        for path in paths:
            if path.is_symlink() or "_pb2" in path.name:
                continue
            text = path.read_text()
            if text.count("\n") > 400:
                long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
                    size = node.end_lineno - node.lineno + 1
                    if size > 60:
                        long.append(f"{path.relative_to(ROOT)}: {node.name} is {size} lines")
    assert not long, "\n".join(long)
