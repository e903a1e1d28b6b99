"""k8s/ renders, with `kubectl kustomize`, into objects the Kubernetes schemas accept, wired the way the CLI runs.

No cluster here: the checks are the schemas (kubernetes-validate ships them) and the wiring a cluster would only
reveal by failing: selectors, ports, probes, limits, disruption budgets, security contexts, and container args
that the CLI itself parses.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve.cli.main import build_parser

K8S = Path(__file__).resolve().parent.parent / "k8s"
KUBERNETES_VERSION = "1.32"
ROLES = ("gateway", "prefill", "decode")
pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for kustomize) not installed")


def render(overlay: str) -> list[dict]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def cli_args(c: dict) -> argparse.Namespace:
    """The container's args as the CLI parses them (downward-API variables stand in as a pod IP)."""
    args = list(c["args"])
    for e in c.get("env", []):
        if "fieldRef" in e.get("valueFrom", {}):
            args = [a.replace(f"$({e['name']})", "10.0.0.7") for a in args]
    return build_parser().parse_args(args)


def matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "secure"])
def test_every_object_is_valid_for_the_kubernetes_schema(overlay):
    import kubernetes_validate

    objs = render(overlay)
    assert {o["kind"] for o in objs} >= {"Namespace", "Deployment", "Service", "PodDisruptionBudget", "ConfigMap"}
    for o in objs:
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        assert o["metadata"].get("namespace", "pdserve") == "pdserve"


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "secure"])
def test_roles_are_wired_as_the_cli_runs_them(overlay):
    objs = render(overlay)
    deployments, services = by_kind(objs, "Deployment"), by_kind(objs, "Service")
    budgets = list(by_kind(objs, "PodDisruptionBudget").values())
    configmaps = by_kind(objs, "ConfigMap")
    assert sorted(deployments) == sorted(f"pdserve-{r}" for r in ROLES)
    ports = {}
    for role in ROLES:
        d = deployments[f"pdserve-{role}"]
        pod = d["spec"]["template"]
        assert matches(d["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
        c = container(d)
        args = cli_args(c)
        assert args.command == role and args.host == "0.0.0.0"
        ports[role] = args.port
        assert args.port == build_parser().parse_args([role]).port, "not the CLI's default port"
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert named["grpc"] == args.port and named["metrics"] == args.metrics_port
        # the Service in front of the role selects exactly its pods and reaches the named ports
        svc = services[f"pdserve-{role}"]
        assert matches(svc["spec"]["selector"], pod["metadata"]["labels"])
        assert all(p["targetPort"] in named for p in svc["spec"]["ports"])
        assert (svc["spec"].get("clusterIP") == "None") == (role != "gateway"), "workers: headless, for --discover"
        # probes on the gRPC port (native), or the CLI's health check against it where TLS is on
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            if "grpc" in probe:
                assert probe["grpc"]["port"] == args.port
            elif "exec" in probe:
                health = build_parser().parse_args(probe["exec"]["command"][1:])
                assert probe["exec"]["command"][0] == "pdserve" and health.command == "health"
                assert health.address == f"127.0.0.1:{args.port}" and health.timeout < probe["timeoutSeconds"]
            else:
                assert role == "gateway" and kind == "livenessProbe" and probe["tcpSocket"]["port"] == "grpc"
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 300, "model load needs minutes of start-up"
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and {"cpu", "memory"} <= set(
            c["resources"]["limits"]
        )
        pod_sec, sec = pod["spec"]["securityContext"], c["securityContext"]
        assert pod_sec["runAsNonRoot"] and pod_sec["runAsUser"] != 0
        assert sec["readOnlyRootFilesystem"] and sec["allowPrivilegeEscalation"] is False
        assert sec["capabilities"]["drop"] == ["ALL"]
        assert pod["spec"]["terminationGracePeriodSeconds"] > 30, "above the 30 s drain"
        assert any(matches(b["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"]) for b in budgets)
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(args.metrics_port)
        for ref in c.get("envFrom", []):
            assert ref["configMapRef"]["name"] in configmaps
        if overlay == "gpu" and role != "gateway":
            assert args.device == "cuda" and c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        if overlay == "secure":
            env = {e["name"] for e in c["env"]}
            assert {"PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA", "PDSERVE_TLS_SERVER_NAME"} <= env
            assert ("PDSERVE_API_KEY" in env) == (role == "gateway")

    gateway = cli_args(container(deployments["pdserve-gateway"]))
    assert gateway.discover and gateway.prefill == f"pdserve-prefill:{ports['prefill']}"
    assert gateway.decode == f"pdserve-decode:{ports['decode']}"
    decode_c = container(deployments["pdserve-decode"])
    decode = cli_args(decode_c)
    assert decode.prefill == f"pdserve-prefill:{ports['prefill']}"
    # the KV receiver: a fixed, named port on the pod's own address, which prefill pods dial
    assert decode.kv_port and {"name": "kv", "containerPort": decode.kv_port} in decode_c["ports"]
    assert "$(POD_IP)" in decode_c["args"]
    pod_ip = next(e for e in decode_c["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    gw_ports = {p["name"]: p["port"] for p in services["pdserve-gateway"]["spec"]["ports"]}
    assert gw_ports["grpc"] == gateway.port and gw_ports["http"] == gateway.http_port


def test_manifest_args_are_shell_free():
    """Args go to the CLI as a list: none of them relies on a shell to split or expand it."""
    for d in by_kind(render("cpu"), "Deployment").values():
        for a in container(d)["args"]:
            assert shlex.split(a) == [a]
