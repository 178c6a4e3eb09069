"""deploy/k8s rendered by `kubectl kustomize` (nothing is applied): every part renders, every
object passes the Kubernetes OpenAPI schemas of kubernetes-validate in strict mode (unknown
fields are errors), and the ServiceMonitors pass a schema of their own below and scrape what
Prometheus's example config does."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.support.containers import (
    DEPLOY,
    KUSTOMIZATIONS,
    OLDEST_KUBERNETES,
    RENDER,
    SITES,
    kubernetes_validate,
    needs_kubectl,
    needs_kubernetes_validate,
    objects_of_kind,
    prometheus_jobs,
    selects,
    service_ports,
    yaml,
)

pytestmark = pytest.mark.usefixtures("no_config_overrides")


@RENDER
@needs_kubectl
def test_kustomize_renders_every_part(rendered: dict[str, list[dict[str, Any]]]) -> None:
    whole = rendered[""]
    kinds = sorted({(d["apiVersion"], d["kind"]) for d in whole})
    assert kinds == [
        ("apps/v1", "StatefulSet"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("v1", "ConfigMap"),
        ("v1", "Namespace"),
        ("v1", "Service"),
    ]
    names = {d["metadata"]["name"] for d in objects_of_kind(whole, "StatefulSet")}
    assert names == {"crossdc-coordinator", *(f"crossdc-site-{s}" for s in SITES)}
    for doc in whole:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "crossdc"
    assert not objects_of_kind(whole, "Secret"), (
        "no kit is rendered: the Secrets are made beforehand"
    )
    parts = [d for part in KUSTOMIZATIONS[1:-1] for d in rendered[part]]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, parts)) == sorted(key(d) for d in whole if d["kind"] != "Namespace")


@RENDER
@needs_kubectl
@needs_kubernetes_validate
@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, "latest"])
def test_rendered_objects_match_the_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], version: str
) -> None:
    assert kubernetes_validate is not None
    if version == "latest":
        version = kubernetes_validate.latest_version()
    checked = 0
    for part, docs in rendered.items():
        for doc in docs:
            if doc["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # not a built-in kind: test_servicemonitors_match_their_schema
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                pytest.fail(
                    f"{part or '.'}: {doc['kind']}/{doc['metadata']['name']}: {path}: {exc}"
                )
            checked += 1
    assert checked > 0


# The ServiceMonitor is a custom resource: the schemas above do not know it. This is the part of
# monitoring.coreos.com/v1 ServiceMonitor that these manifests use, in the field names and value
# forms of the Prometheus Operator's API reference, with every other field refused.
_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
SERVICEMONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": _LABELS,
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": _LABELS},
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {
                                            "type": "array",
                                            "items": {
                                                "type": "string",
                                                "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$",
                                            },
                                        },
                                        "targetLabel": {"type": "string"},
                                        "regex": {"type": "string"},
                                        "replacement": {"type": "string"},
                                        "separator": {"type": "string"},
                                        "action": {"enum": ["replace", "keep", "drop", "labelmap"]},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


@RENDER
@needs_kubectl
def test_servicemonitors_match_their_schema(rendered: dict[str, list[dict[str, Any]]]) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    whole = rendered[""]
    monitors = objects_of_kind(whole, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {"crossdc-coordinator", "crossdc-site"}
    example = prometheus_jobs(
        yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    )
    interval = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["global"]
    services = objects_of_kind(whole, "Service")
    for monitor in monitors:
        jsonschema.validate(monitor, SERVICEMONITOR_SCHEMA)
        spec = monitor["spec"]
        selected = [
            s
            for s in services
            if s["metadata"]["namespace"] == monitor["metadata"]["namespace"]
            and selects(spec["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        role = monitor["metadata"]["labels"]["app.kubernetes.io/component"]
        assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected} == {role}
        assert len(selected) == (1 if role == "coordinator" else len(SITES))
        jobs = {s["metadata"]["labels"][spec["jobLabel"]] for s in selected}
        assert jobs == {f"crossdc-{role}"} and jobs <= set(example), "the jobs alerts.yml uses"
        (job,) = jobs
        for endpoint in spec["endpoints"]:
            for service in selected:
                assert endpoint["port"] in service_ports(service)
            assert endpoint["path"] == example[job]["metrics_path"]
            assert endpoint["interval"] == interval["scrape_interval"]
            assert endpoint["scrapeTimeout"] == interval["scrape_timeout"]
            assert endpoint.get("honorLabels", False) == example[job].get("honor_labels", False)
            for relabel in endpoint.get("relabelings", []):
                assert relabel["targetLabel"] == "site"
                (source,) = relabel["sourceLabels"]
                label = source.removeprefix("__meta_kubernetes_service_label_")
                for service in selected:
                    names = {
                        re.sub(r"[^a-zA-Z0-9_]", "_", k): v
                        for k, v in service["metadata"]["labels"].items()
                    }
                    assert names[label] in SITES
