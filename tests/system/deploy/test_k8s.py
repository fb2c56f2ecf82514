"""deploy/k8s checked without a cluster and without kubectl: the kustomize overlays rendered here (resources,
strategic-merge patches, image tags), every manifest validated against the Kubernetes OpenAPI schemas that
`kubernetes-validate` bundles (the ServiceMonitor, a CRD, structurally), and the probes, port, flags and
environment checked against the server itself: its route table (`create_app(...).router`) and its CLI
(`build_config` on the container's args and env, `serve --help`). Where kubectl is installed, its own
`kubectl kustomize` must render the same objects as the renderer here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO

yaml = pytest.importorskip("yaml", reason="pyyaml is needed to read the manifests")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
from kubernetes_validate.utils import all_versions  # noqa: E402

ROOT = REPO
K8S = ROOT / "deploy/k8s"
BASE = K8S / "base"
OVERLAYS = ("cpu", "gpu")
# the oldest release the manifests claim (PodDisruptionBudget.unhealthyPodEvictionPolicy is GA in 1.31)
# and the newest schemas the package bundles
K8S_VERSIONS = ("1.31.0", max(all_versions(), key=lambda v: tuple(map(int, v.split(".")))))
DRAIN_CLEANUP_S = (
    20  # margin past SHUTDOWN_TIMEOUT, as compose keeps (tests/system/deploy/test_docker_files.py)
)
CRDS = {"monitoring.coreos.com/v1": {"ServiceMonitor"}}
# strategic-merge keys of the lists the overlays patch; any other list is replaced whole
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


# --- a small kustomize: resources, patches (strategic merge), images ------------------------------------------


def render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        [body] = [d for d in yaml.safe_load_all((directory / patch["path"]).read_text()) if d]
        index = _find(docs, body["kind"], body["metadata"]["name"])
        docs[index] = _merge(docs[index], body)
    for image in kustomization.get("images", []):
        for container in _containers(docs):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return docs


def _find(docs: list[dict], kind: str, name: str) -> int:
    matches = [n for n, d in enumerate(docs) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"a patch targets {kind}/{name}, which the base has {len(matches)} times"
    return matches[0]


def _merge(base, patch, field: str = ""):
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = _merge(base[key], value, key) if key in base else value
        return merged
    key = MERGE_KEYS.get(field)
    if key and isinstance(base, list) and isinstance(patch, list):
        by_key = {item[key]: item for item in patch}
        added = [item for item in patch if item[key] not in {b[key] for b in base}]
        # kustomize puts the patch's new items first, then the base's, each merged with its patch item
        return added + [_merge(item, by_key[item[key]]) if item[key] in by_key else item for item in base]
    return patch


def _containers(docs: list[dict]) -> list[dict]:
    return [c for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]]


def _one(docs: list[dict], kind: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


@pytest.fixture(scope="module", params=["base", *OVERLAYS])
def rendered(request) -> tuple[str, list[dict]]:
    directory = BASE if request.param == "base" else K8S / "overlays" / request.param
    return request.param, render(directory)


# --- the manifests are valid ---------------------------------------------------------------------------------


def _manifest_files() -> list[Path]:
    return sorted(
        p
        for p in K8S.rglob("*.yaml")
        if p.name != "kustomization.yaml" and "patch" not in p.name and p.parent.name != "k8s"
    )


def test_every_base_manifest_is_listed_in_the_kustomization():
    listed = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in _manifest_files())


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_manifests_validate_against_the_kubernetes_schemas(rendered, version):
    _, docs = rendered
    checked = set()
    for doc in docs:
        if doc["kind"] in CRDS.get(doc["apiVersion"], ()):
            continue  # structurally, below
        # strict: a misspelt or misplaced field fails, not only a wrong type
        kubernetes_validate.validate(doc, version, strict=True)
        checked.add(doc["kind"])
    assert checked == {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "PersistentVolumeClaim",
    }


def test_the_schema_check_rejects_a_broken_manifest():
    deployment = _one(render(BASE), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pth"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    deployment = _one(render(BASE), "Deployment")
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "60"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def test_overlay_patches_target_objects_of_the_base():
    base = {(d["kind"], d["metadata"]["name"]) for d in render(BASE)}
    for overlay in OVERLAYS:
        kustomization = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
        assert kustomization["resources"] == ["../../base"]
        for patch in kustomization["patches"]:
            body = yaml.safe_load((K8S / "overlays" / overlay / patch["path"]).read_text())
            assert (body["kind"], body["metadata"]["name"]) in base, (overlay, patch)


KUBECTL = shutil.which("kubectl")


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: the renderer here is the only check")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubectl_kustomize_renders_the_same_objects(overlay):
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    theirs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    ours = {(d["kind"], d["metadata"]["name"]): d for d in render(K8S / "overlays" / overlay)}
    assert theirs == ours


def test_servicemonitor_selects_the_service_and_scrapes_metrics(rendered, routes):
    _, docs = rendered
    monitor, service = _one(docs, "ServiceMonitor"), _one(docs, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
        assert endpoint["port"] in port_names
        assert ("GET", endpoint["path"]) in routes
        assert _seconds(endpoint["scrapeTimeout"]) < _seconds(endpoint["interval"])


# --- the manifests fit together --------------------------------------------------------------------------------


def test_selectors_match_the_pod_labels(rendered):
    _, docs = rendered
    deployment = _one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == pod_labels
    assert _one(docs, "Service")["spec"]["selector"].items() <= pod_labels.items()
    assert _one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_service_targets_the_container_port(rendered):
    _, docs = rendered
    [container] = _containers(docs)
    [port] = _one(docs, "Service")["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}


def test_disruptions_and_scale_down_keep_a_replica_serving(rendered):
    _, docs = rendered
    deployment, hpa, pdb = (
        _one(docs, "Deployment"),
        _one(docs, "HorizontalPodAutoscaler"),
        _one(docs, "PodDisruptionBudget"),
    )
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"] <= deployment["spec"]["replicas"]
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_models_volume_is_the_claim_mounted_read_only(rendered):
    _, docs = rendered
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    [models] = [v for v in pod["volumes"] if v["name"] == "models"]
    assert (
        models["persistentVolumeClaim"]["claimName"]
        == _one(docs, "PersistentVolumeClaim")["metadata"]["name"]
    )
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models"]
    assert mount["readOnly"] is True
    assert _config(pod["containers"][0]).models_root == mount["mountPath"]  # where /admin/models/load reads


def test_keys_come_from_a_secret(rendered):
    _, docs = rendered
    env = {e["name"]: e for e in _containers(docs)[0]["env"]}
    for key in ("API_KEY", "ADMIN_KEY"):
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "pagedserve-keys", "key": key}


def test_overlays_pick_their_image_and_devices():
    cpu, gpu = (_containers(render(K8S / "overlays" / name))[0] for name in OVERLAYS)
    assert cpu["image"] == "pagedserve:cpu" and gpu["image"] == "pagedserve:latest"  # deploy/README.md's tags
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert _config(cpu).model_names == _config(gpu).model_names  # the patches left the rest alone
    assert cpu["resources"]["limits"]["cpu"] == cpu["resources"]["requests"]["cpu"]
    assert int(cpu["resources"]["requests"]["cpu"]) == _config(cpu).models[0].engine.num_threads


# --- probes, port, flags and env against the server -------------------------------------------------------


@pytest.fixture(scope="module")
def routes() -> set[tuple[str, str]]:
    """(method, path) of the server's real route table, the admin routes included."""
    from service.app import create_app

    app = create_app(_config({"args": ["--admin-key", "a"], "env": []}))
    return {(route.method, route.resource.canonical) for route in app.router.routes()}


def _config(container: dict):
    """The ServerConfig the server builds from the container's args and env (Secret values stand in)."""
    from service.cli import build_config, build_parser

    env = {e["name"]: e.get("value", "from-secret") for e in container["env"]}
    return build_config(build_parser().parse_args(["serve", *container["args"]]), env)


def test_probes_ask_the_real_health_routes_on_the_served_port(rendered, routes):
    _, docs = rendered
    [container] = _containers(docs)
    config = _config(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.port in ports.values() and config.host == "0.0.0.0"
    paths = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert ports.get(get["port"], get["port"]) == config.port, probe
        assert ("GET", get["path"]) in routes, probe
        paths[probe] = get["path"]
    # liveness restarts: only a dead or hung engine loop; draining and loading replicas stay live
    assert paths == {
        "startupProbe": "/health/ready",
        "livenessProbe": "/health/live",
        "readinessProbe": "/health/ready",
    }


def test_startup_probe_gives_the_models_time_to_load(rendered):
    _, docs = rendered
    [container] = _containers(docs)
    probe = container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 300


def test_grace_period_covers_prestop_drain_and_cleanup(rendered):
    _, docs = rendered
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    assert 2 <= pre_stop_s <= 15  # long enough for endpoints to update, short of eating the drain
    shutdown_s = _config(container).shutdown_timeout
    assert shutdown_s == float({e["name"]: e.get("value") for e in container["env"]}["SHUTDOWN_TIMEOUT"])
    # the kubelet's grace period counts from the start of preStop
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + shutdown_s + DRAIN_CLEANUP_S


def test_container_runs_the_images_server_with_known_flags(rendered):
    _, docs = rendered
    [container] = _containers(docs)
    assert container["command"] == ["pagedserve", "serve"]
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        cmd = re.search(r"^CMD (.*)$", (ROOT / dockerfile).read_text(), re.M).group(1)
        assert "exec pagedserve serve" in cmd, dockerfile  # the image's own program, flags spelt out
    help_text = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in (a for a in container["args"] if a.startswith("--")):
        assert re.search(rf"(^|[\s,]){re.escape(flag)}\b", help_text), flag


def test_env_names_are_read_by_the_server(rendered):
    _, docs = rendered
    [container] = _containers(docs)
    cli = (ROOT / "service/cli.py").read_text()
    for name in (e["name"] for e in container["env"]):
        assert f'"{name}"' in cli, f"{name} is set but service/cli.py never reads it"


# --- the HPA's metric through the Prometheus adapter -----------------------------------------------------------


def test_hpa_metric_is_the_adapters_name_for_the_waiting_queue(rendered):
    _, docs = rendered
    [metric] = _one(docs, "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "Pods"
    values = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    [rule] = values["rules"]["custom"]
    series = re.match(r"([a-z_:]+)\{", rule["seriesQuery"]).group(1)
    assert series == "pagedserve:num_requests_waiting"
    assert f'{{PREFIX}}{series.removeprefix("pagedserve:")}"' in (ROOT / "service/metrics.py").read_text()
    exposed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert metric["pods"]["metric"]["name"] == exposed
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+)([hms])", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)
