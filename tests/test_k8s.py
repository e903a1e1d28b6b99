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


def render(overlay: str, root: Path = K8S) -> list[dict]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(root / "overlays" / overlay)],
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
        if o["kind"] != "Namespace":  # every namespaced object names it: a generated one without lands elsewhere
            assert o["metadata"].get("namespace") == "pdserve", (o["kind"], o["metadata"]["name"])


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


EXTERNAL_SECRETS = {"pdserve-tls", "pdserve-api-key"}  # the operator creates these (README, the components)


def _references(pod: dict) -> dict[str, set[str]]:
    """kind -> names a pod template refers to: ConfigMaps, Secrets, PersistentVolumeClaims."""
    refs: dict[str, set[str]] = {"ConfigMap": set(), "Secret": set(), "PersistentVolumeClaim": set()}
    for c in pod["spec"]["containers"]:
        for e in c.get("envFrom", []):
            for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                if key in e:
                    refs[kind].add(e[key]["name"])
        for e in c.get("env", []):
            source = e.get("valueFrom", {})
            for key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                if key in source:
                    refs[kind].add(source[key]["name"])
    for v in pod["spec"].get("volumes", []):
        for key, kind, name in (
            ("configMap", "ConfigMap", "name"),
            ("secret", "Secret", "secretName"),
            ("persistentVolumeClaim", "PersistentVolumeClaim", "claimName"),
        ):
            if key in v:
                refs[kind].add(v[key][name])
    return refs


def _overlay(tmp_path: Path, name: str, body: str) -> Path:
    """A copy of k8s/ with an overlay of a user's own on top of `cpu` (`body`: the rest of its kustomization)."""
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    mine = root / "overlays" / name
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: pdserve\n"
        "resources: [../cpu]\n" + body
    )
    return root


def _custom_overlay(tmp_path: Path) -> Path:
    """A user's own overlay: their model on a PVC, NetworkPolicies."""
    return _overlay(
        tmp_path,
        "mine",
        "components: [../../components/model-pvc, ../../components/networkpolicy]\n"
        "configMapGenerator:\n  - {name: pdserve-model, behavior: replace, literals: [model=/models/Llama-3.2-1B]}\n",
    )


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "secure", "mine"])
def test_every_reference_resolves_in_the_pods_namespace(overlay, tmp_path):
    """What a cluster reports only as CreateContainerConfigError: each ConfigMap, Secret and claim a pod names
    exists (or is one the operator creates) in the pod's own namespace; each Service a role dials exists."""
    objs = render(overlay, _custom_overlay(tmp_path) if overlay == "mine" else K8S)
    have = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs}
    for d in by_kind(objs, "Deployment").values():
        ns = d["metadata"]["namespace"]
        for kind, names in _references(d["spec"]["template"]).items():
            for name in names:
                external = kind == "Secret" and name in EXTERNAL_SECRETS
                assert external or (kind, ns, name) in have, f"{d['metadata']['name']} needs {kind} {ns}/{name}"
        args = cli_args(container(d))
        for dialled in (getattr(args, "prefill", ""), getattr(args, "decode", "")):
            for target in filter(None, (dialled or "").split(",")):
                assert ("Service", ns, target.rsplit(":", 1)[0]) in have, target
    if overlay == "mine":
        configmaps = by_kind(objs, "ConfigMap")
        models = {_model_of(d, configmaps) for d in by_kind(objs, "Deployment").values()}
        assert models == {"/models/Llama-3.2-1B"}, "one setting names the model for every role"
        for d in by_kind(objs, "Deployment").values():
            (volume,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
            assert volume == {
                "name": "models",
                "persistentVolumeClaim": {"claimName": "pdserve-models", "readOnly": True},
            }


def _model_of(d: dict, configmaps: dict[str, dict]) -> str:
    env = {e["name"]: e for e in container(d)["env"]}
    ref = env["PDSERVE_MODEL"]["valueFrom"]["configMapKeyRef"]
    return configmaps[ref["name"]]["data"][ref["key"]]


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "secure"])
def test_operations_defaults(overlay):
    """What a first deployment trips on: the CPU-agnostic dtype, one model setting for every role, probe timeouts
    above the 1 s default, side-loaded images, a preStop pause, spreading over nodes, budgets that protect."""
    objs = render(overlay)
    for name, d in by_kind(objs, "Deployment").items():
        c, spec = container(d), d["spec"]["template"]["spec"]
        args = cli_args(c)
        if args.command != "gateway":
            assert args.dtype == "auto", f"{name}: a pinned half precision crash-loops or crawls on AVX2-only CPUs"
        assert "PDSERVE_MODEL" in {e["name"] for e in c["env"]}
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert c["imagePullPolicy"] == "IfNotPresent"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[kind].get("timeoutSeconds", 1) >= 5, f"{name} {kind}"
        assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        term = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert matches(
            term["podAffinityTerm"]["labelSelector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"]
        )
    for budget in by_kind(objs, "PodDisruptionBudget").values():
        assert budget["spec"].get("minAvailable") == 1 and "maxUnavailable" not in budget["spec"]


def _allowed(policy: dict, from_component: str | None, port: int) -> bool:
    for rule in policy["spec"].get("ingress", []):
        sources = rule.get("from")
        if sources is not None and not any(
            s.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == from_component
            for s in sources
        ):
            continue
        for p in rule.get("ports", []):
            if p["port"] <= port <= p.get("endPort", p["port"]):
                return True
    return False


def test_network_policies_let_through_exactly_what_pdserve_dials():
    objs = render("secure")
    policies = {
        p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p
        for p in by_kind(objs, "NetworkPolicy").values()
    }
    assert set(policies) == set(ROLES)
    deployments = by_kind(objs, "Deployment")
    gateway, prefill, decode = (cli_args(container(deployments[f"pdserve-{r}"])) for r in ROLES)
    low, high = (int(x) for x in decode.kv_data_ports.split("-"))
    assert prefill.kv_data_ports == decode.kv_data_ports
    assert _allowed(policies["gateway"], None, gateway.port) and _allowed(policies["gateway"], None, gateway.http_port)
    assert _allowed(policies["prefill"], "gateway", prefill.port) and _allowed(
        policies["prefill"], "decode", prefill.port
    )
    assert _allowed(policies["decode"], "gateway", decode.port)
    assert _allowed(policies["decode"], "prefill", decode.kv_port)
    for port in (low, high):  # UCX's data paths, both ways
        assert _allowed(policies["decode"], "prefill", port) and _allowed(policies["prefill"], "decode", port)
    assert not _allowed(policies["decode"], "gateway", decode.kv_port), "only prefill pods reach the KV door"
    assert not _allowed(policies["prefill"], None, prefill.port), "strangers do not reach the workers"
    for role in ROLES:
        assert _allowed(policies[role], None, 9400)


def test_autoscaling_scales_each_role_on_a_metric_its_workers_export(tmp_path):
    """The autoscaling component: valid HPAs on the prefill and decode Deployments, each on a per-pod metric that
    the role's own /metrics has and that the Prometheus adapter's rules serve; decode scales down slowly."""
    import kubernetes_validate

    from pdserve.decode_service.metrics import DecodeMetrics
    from pdserve.prefill_service.metrics import PrefillMetrics

    objs = render("autoscaled", _overlay(tmp_path, "autoscaled", "components: [../../components/autoscaling]\n"))
    for o in objs:
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
    deployments, hpas = by_kind(objs, "Deployment"), by_kind(objs, "HorizontalPodAutoscaler")
    rules = yaml.safe_load(by_kind(objs, "ConfigMap")["pdserve-prometheus-adapter-rules"]["data"]["config.yaml"])
    served = {r["name"]["as"] for r in rules["rules"]}
    exported = {
        "prefill": {m.name for m in PrefillMetrics().registry.collect()},
        "decode": {m.name for m in DecodeMetrics().registry.collect()},
    }
    assert set(hpas) == {"pdserve-prefill", "pdserve-decode"}
    for name, hpa in hpas.items():
        role = name.removeprefix("pdserve-")
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        for metric in hpa["spec"]["metrics"]:
            metric_name = metric["pods"]["metric"]["name"]
            assert metric_name in exported[role] and metric_name in served, metric_name
    decode_down = hpas["pdserve-decode"]["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
    assert decode_down >= hpas["pdserve-prefill"]["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
