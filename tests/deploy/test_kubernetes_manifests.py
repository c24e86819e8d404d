"""deploy/kubernetes/: the base and both overlays render, every object validates against the Kubernetes
schema kubernetes-validate ships (its newest version, strict: unknown fields fail), and the manifests say
what the code needs: probes on the health endpoints, a grace period longer than the drain, every environment
variable from a ConfigMap or Secret key that exists, selectors that pick the gateway's pods."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

from apps.gateway.config import GatewayConfig
from tests.support.kustomize import KustomizeError, render

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
TARGETS = {"base": KUBERNETES / "base", "embedded": KUBERNETES / "overlays" / "embedded",
           "production": KUBERNETES / "overlays" / "production"}
# Custom resources: no schema in kubernetes-validate; their fields are checked below instead.
CRD_KINDS = frozenset({("monitoring.coreos.com/v1", "ServiceMonitor")})
GATEWAY = "tokenpools-gateway"
SECRET, CONFIG = "tokenpools-secrets", "tokenpools-config"
# Every setting the code reads (tokenpools_site/settings.py reads them all), and the variables that only
# the manifests' `$(VAR)` arguments use.
SETTINGS = frozenset(re.findall(r'env_\w+\(\s*"([A-Z][A-Z0-9_]*)"', (ROOT / "tokenpools_site" / "settings.py").read_text()))
ARGUMENT = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")

Object = dict[str, Any]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Object]]:
    return {name: render(path) for name, path in TARGETS.items()}


def find(objects: list[Object], kind: str, name: str) -> Object:
    [obj] = [obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"] == name]
    return obj


def pod_owners(objects: list[Object]) -> list[Object]:
    return [obj for obj in objects if obj["kind"] in ("Deployment", "Job")]


def containers(owner: Object) -> list[Object]:
    spec = owner["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def gateway_container(objects: list[Object]) -> Object:
    [container] = [c for c in find(objects, "Deployment", GATEWAY)["spec"]["template"]["spec"]["containers"]
                   if c["name"] == "gateway"]
    return container


def data(obj: Object) -> dict[str, str]:
    return {**obj.get("data", {}), **obj.get("stringData", {})}


def environment(objects: list[Object], container: Object) -> dict[str, str]:
    """The container's variables: their literal values, `<reference>` for a secretKeyRef or configMapKeyRef."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef") or source["secretRef"]
        env.update(data(find(objects, "ConfigMap" if "configMapRef" in source else "Secret", ref["name"])))
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "<reference>")
    return env


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_validates_against_the_kubernetes_schema(rendered: dict[str, list[Object]], target: str) -> None:
    version = latest_version()
    assert tuple(int(part) for part in version.split(".")[:2]) >= (1, 33), version  # a current Kubernetes
    validated = set()
    for obj in rendered[target]:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
            validated.add(obj["kind"])
        except SchemaNotFoundError:
            assert (obj["apiVersion"], obj["kind"]) in CRD_KINDS, f"no schema for {obj['apiVersion']} {obj['kind']}"
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            pytest.fail(f"{target}: {obj['kind']}/{obj['metadata']['name']}: {path}: {error.message}")
    assert {"Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget"} <= validated


def test_the_strict_schema_catches_a_misspelt_field(rendered: dict[str, list[Object]]) -> None:
    """The validation above would fail on a typo: it is strict, not only shaped-like."""
    deployment = find(rendered["production"], "Deployment", GATEWAY)
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/readyz"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, latest_version(), strict=True)


@pytest.mark.parametrize("target", TARGETS)
def test_the_base_and_overlays_hold_what_the_issue_lists(rendered: dict[str, list[Object]], target: str) -> None:
    kinds = {(obj["kind"], obj["metadata"]["name"]) for obj in rendered[target]}
    expected = {("Deployment", GATEWAY), ("Service", GATEWAY), ("PodDisruptionBudget", GATEWAY),
                ("ConfigMap", CONFIG), ("Secret", SECRET), ("ServiceMonitor", GATEWAY)}
    production_only = {("HorizontalPodAutoscaler", GATEWAY), ("Job", "tokenpools-migrate"),
                       ("Deployment", "tokenpools-celery-worker"), ("Deployment", "tokenpools-celery-beat")}
    assert expected <= kinds
    if target == "embedded":
        assert not production_only & kinds  # no broker, no shared database, one replica
    else:
        assert production_only <= kinds
    assert all(obj["metadata"].get("namespace") == "tokenpools" for obj in rendered[target] if obj["kind"] != "Namespace")


@pytest.mark.parametrize("target", TARGETS)
def test_the_gateway_is_probed_on_its_health_endpoints_on_its_port(rendered: dict[str, list[Object]], target: str) -> None:
    container = gateway_container(rendered[target])
    [port] = container["ports"]
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"), ("startupProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert get["port"] in (port["name"], port["containerPort"]), probe
    # serve listens where the ConfigMap says; the container port must be that one.
    env = environment(rendered[target], container)
    assert int(env["GATEWAY_PORT"]) == port["containerPort"]
    assert container["command"][:3] == ["python", "manage.py", "serve"]
    assert container["args"] == ["--host", "0.0.0.0", "--port", "$(GATEWAY_PORT)", "--workers", "$(GATEWAY_WORKERS)"]


@pytest.mark.parametrize("target", TARGETS)
def test_termination_grace_outlasts_the_drain(rendered: dict[str, list[Object]], target: str) -> None:
    [default] = [field.default for field in dataclasses.fields(GatewayConfig) if field.name == "drain_timeout_s"]
    assert isinstance(default, float)
    deployment = find(rendered[target], "Deployment", GATEWAY)
    container = gateway_container(rendered[target])
    drain = float(environment(rendered[target], container).get("GATEWAY_DRAIN_TIMEOUT_S", default))
    pause = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > max(drain, default) + pause, (grace, drain, default, pause)


@pytest.mark.parametrize("target", TARGETS)
def test_every_variable_comes_from_a_key_that_exists(rendered: dict[str, list[Object]], target: str) -> None:
    objects = rendered[target]
    for owner in pod_owners(objects):
        for container in containers(owner):
            where = f"{target}: {owner['metadata']['name']}/{container['name']}"
            for source in container.get("envFrom", []):
                kind = "ConfigMap" if "configMapRef" in source else "Secret"
                find(objects, kind, (source.get("configMapRef") or source["secretRef"])["name"])
            for var in container.get("env", []):
                ref = var.get("valueFrom", {})
                for kind, key_ref in (("Secret", ref.get("secretKeyRef")), ("ConfigMap", ref.get("configMapKeyRef"))):
                    if key_ref:
                        assert key_ref["key"] in data(find(objects, kind, key_ref["name"])), f"{where}: {var['name']}"
                assert var["name"] in SETTINGS, f"{where}: {var['name']} is no setting the code reads"
            env = environment(objects, container)
            for word in (*container.get("command", []), *container.get("args", [])):
                for name in ARGUMENT.findall(word):
                    assert name in env, f"{where}: $({name}) is not in its environment"
            # As settings.py and serve check at start-up:
            if env.get("DEPLOYMENT") == "production":
                assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY"} <= set(env), where
            if int(env.get("GATEWAY_WORKERS", "1")) > 1 and container["name"] == "gateway":
                assert "REDIS_URL" in env, where
    argument_names = {name for owner in pod_owners(objects) for container in containers(owner)
                      for word in container.get("args", []) for name in ARGUMENT.findall(word)}
    for kind, name in (("ConfigMap", CONFIG), ("Secret", SECRET)):
        for key in data(find(objects, kind, name)):
            assert key in SETTINGS | argument_names, f"{target}: {kind} key {key} is read by nothing"


@pytest.mark.parametrize("target", TARGETS)
def test_the_gateway_environment_passes_the_strict_settings(rendered: dict[str, list[Object]], target: str) -> None:
    """The ConfigMap's values parse (settings.py stops on a bad one) and give the mode the overlay means."""
    objects = rendered[target]
    container = gateway_container(objects)
    secret = data(find(objects, "Secret", SECRET))
    env = environment(objects, container)
    for var in container.get("env", []):
        if "valueFrom" in var:
            env[var["name"]] = secret[var["valueFrom"]["secretKeyRef"]["key"]]
    script = ("import json, django; django.setup(); from django.conf import settings as s; print(json.dumps("
              "[s.DEPLOYMENT, s.GATEWAY_STATE_BACKEND, s.CELERY_BROKER_URL, s.GATEWAY_DRAIN_TIMEOUT_S]))")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "DJANGO_SETTINGS_MODULE": "tokenpools_site.settings", **env})
    assert result.returncode == 0, result.stderr[-2000:]
    deployment, backend, broker, drain = json.loads(result.stdout.strip().splitlines()[-1])
    if target == "embedded":
        assert (deployment, backend, broker) == ("embedded", "memory", "memory://")
    else:
        assert (deployment, backend, broker) == ("production", "redis", env["REDIS_URL"])
    assert drain == float(env["GATEWAY_DRAIN_TIMEOUT_S"])


@pytest.mark.parametrize("target", TARGETS)
def test_the_service_pdb_and_hpa_pick_the_gateway(rendered: dict[str, list[Object]], target: str) -> None:
    objects = rendered[target]
    deployment = find(objects, "Deployment", GATEWAY)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels_match(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    others = [owner["spec"]["template"]["metadata"]["labels"] for owner in pod_owners(objects) if owner is not deployment]
    service = find(objects, "Service", GATEWAY)
    pdb = find(objects, "PodDisruptionBudget", GATEWAY)
    for selector in (service["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"]):
        assert labels_match(selector, pod_labels)
        assert not any(labels_match(selector, labels) for labels in others)  # not the Celery or migration pods
    container_ports = {port["name"] for port in gateway_container(objects)["ports"]}
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= container_ports
    hpas = [obj for obj in objects if obj["kind"] == "HorizontalPodAutoscaler"]
    for hpa in hpas:
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": GATEWAY}
        assert hpa["spec"]["minReplicas"] <= deployment["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]


@pytest.mark.parametrize("target", TARGETS)
def test_the_service_monitor_scrapes_metrics_with_the_token(rendered: dict[str, list[Object]], target: str) -> None:
    objects = rendered[target]
    monitor = find(objects, "ServiceMonitor", GATEWAY)
    service = find(objects, "Service", GATEWAY)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert labels_match(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["authorization"]["type"] == "Bearer"
    credentials = endpoint["authorization"]["credentials"]
    assert credentials == {"name": SECRET, "key": "METRICS_TOKEN"}
    assert "METRICS_TOKEN" in data(find(objects, "Secret", SECRET))
    # The gateway checks the same token the monitor sends.
    [gateway_token] = [var for var in gateway_container(objects)["env"] if var["name"] == "METRICS_TOKEN"]
    assert gateway_token["valueFrom"]["secretKeyRef"] == credentials


@pytest.mark.parametrize("target", TARGETS)
def test_images_come_from_the_kustomization(rendered: dict[str, list[Object]], target: str) -> None:
    [image] = yaml.safe_load((TARGETS[target] / "kustomization.yaml").read_text())["images"]
    expected = f"{image.get('newName', image['name'])}:{image['newTag']}"
    used = {container["image"] for owner in pod_owners(rendered[target]) for container in containers(owner)}
    assert used == {expected}
    if target == "production":
        assert expected == "registry.example.com/tokenpools:0.1.0"
    else:
        assert expected == "tokenpools:latest"


@pytest.mark.parametrize("target", TARGETS)
def test_pods_run_unprivileged_with_resources(rendered: dict[str, list[Object]], target: str) -> None:
    for owner in pod_owners(rendered[target]):
        pod = owner["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        for container in containers(owner):
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]
            assert {"cpu", "memory"} <= set(container["resources"]["limits"]), container["name"]


def test_embedded_runs_one_pod_without_redis(rendered: dict[str, list[Object]]) -> None:
    objects = rendered["embedded"]
    deployment = find(objects, "Deployment", GATEWAY)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never two pods with two sets of limits
    pod = deployment["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for container in containers(deployment):
        env = environment(objects, container)
        assert "REDIS_URL" not in env and env["DEPLOYMENT"] == "embedded"
        database = env["DATABASE_URL"]
        assert database.startswith("sqlite:////")
        [mount] = [m for m in container["volumeMounts"] if database[len("sqlite:///"):].startswith(m["mountPath"] + "/")]
        assert "emptyDir" in volumes[mount["name"]]
    [init] = pod["initContainers"]
    assert init["command"] == ["python", "manage.py", "migrate", "--noinput"]  # the pod's own SQLite file
    assert not {"DATABASE_URL", "REDIS_URL"} & set(data(find(objects, "Secret", SECRET)))


def test_production_runs_three_gateways_and_one_beat(rendered: dict[str, list[Object]]) -> None:
    objects = rendered["production"]
    assert find(objects, "Deployment", GATEWAY)["spec"]["replicas"] == 3
    assert find(objects, "HorizontalPodAutoscaler", GATEWAY)["spec"]["minReplicas"] == 3
    for target in ("base", "production"):
        beat = find(rendered[target], "Deployment", "tokenpools-celery-beat")
        assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"] == {"type": "Recreate"}
        [container] = beat["spec"]["template"]["spec"]["containers"]
        assert container["command"][:4] == ["celery", "-A", "workers.celery", "beat"]
        worker = find(rendered[target], "Deployment", "tokenpools-celery-worker")
        assert worker["spec"]["template"]["spec"]["containers"][0]["command"][:4] == [
            "celery", "-A", "workers.celery", "worker"]
        job = find(rendered[target], "Job", "tokenpools-migrate")
        assert job["spec"]["template"]["spec"]["containers"][0]["command"] == [
            "python", "manage.py", "migrate", "--noinput"]
    for var in gateway_container(objects)["env"]:
        if var["name"] in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "METRICS_TOKEN"):
            assert var["valueFrom"]["secretKeyRef"]["name"] == SECRET  # never a literal in a manifest


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl on the PATH to compare with")
@pytest.mark.parametrize("target", TARGETS)
def test_the_renderer_agrees_with_kubectl_kustomize(rendered: dict[str, list[Object]], target: str) -> None:
    result = subprocess.run(["kubectl", "kustomize", str(TARGETS[target])], capture_output=True, text=True,
                            timeout=60)
    if result.returncode != 0 and "unknown command" in result.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert result.returncode == 0, result.stderr
    theirs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    def keyed(objects: list[Object]) -> dict[tuple[str, str], Object]:
        return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}

    assert keyed(rendered[target]) == keyed(theirs)


def test_the_renderer_refuses_what_it_does_not_know(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nconfigMapGenerator: [{name: x, literals: [a=b]}]\n")
    with pytest.raises(KustomizeError, match="configMapGenerator"):
        render(tmp_path)
