"""deploy/k8s/examples/sharded-coordinator rendered by `kubectl kustomize` (nothing is applied):
the coordinator as a StatefulSet of S pods, pod N shard N, against the CLI, the config and the
Kubernetes schemas."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from coordinator.sharding import control_endpoint, resolve, shard_config
from tests.deploy.test_kustomize import SERVICEMONITOR_SCHEMA
from tests.support.containers import (
    K8S,
    OLDEST_KUBERNETES,
    RENDER,
    is_under,
    kubernetes_validate,
    main_container,
    mounts_of,
    named_object,
    needs_kubectl,
    needs_kubernetes_validate,
    objects_of_kind,
    render_kustomization,
    selects,
    tcp_endpoint,
    workload_config,
)

pytestmark = pytest.mark.usefixtures("no_config_overrides")

OVERLAY = "examples/sharded-coordinator"


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render_kustomization(OVERLAY)


@RENDER
@needs_kubectl
@needs_kubernetes_validate
@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, "latest"])
def test_the_sharded_coordinator_matches_the_kubernetes_schemas(
    docs: list[dict[str, Any]], version: str
) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    assert kubernetes_validate is not None
    if version == "latest":
        version = kubernetes_validate.latest_version()
    kinds = []
    for doc in docs:
        kinds.append(doc["kind"])
        if doc["kind"] == "ServiceMonitor":
            jsonschema.validate(doc, SERVICEMONITOR_SCHEMA)
        else:
            kubernetes_validate.validate(doc, version, strict=True)
    assert sorted(kinds) == [
        "ConfigMap",
        "NetworkPolicy",
        "Service",
        "Service",
        "ServiceMonitor",
        "StatefulSet",
    ]


@RENDER
@needs_kubectl
def test_pod_n_is_shard_n_with_its_own_state(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    (statefulset,) = objects_of_kind(docs, "StatefulSet")
    name = statefulset["metadata"]["name"]
    args, cfg = workload_config(docs, statefulset, tmp_path)
    replicas = statefulset["spec"]["replicas"]
    assert args.command == "coordinator" and args.shard == "ordinal"
    assert cfg.shards == replicas > 1 and cfg.shard_ports == "same"
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"
    claims = {c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]}
    mounts = mounts_of(main_container(statefulset))
    shards = []
    for ordinal in range(replicas):
        identity = resolve(cfg.shards, args.shard, {}, hostname=lambda o=ordinal: f"{name}-{o}")
        shards.append(identity.index)
        own = shard_config(cfg, identity)
        assert own.bind == cfg.bind and own.metrics_port == cfg.metrics_port
        (state,) = [m for m in mounts if is_under(own.state_dir, m)]
        assert mounts[state]["name"] in claims, "each shard's state is on its pod's claim"
    assert shards == list(range(replicas))


@RENDER
@needs_kubectl
def test_every_shard_has_a_name_and_shard_zero_the_service(docs: list[dict[str, Any]]) -> None:
    (statefulset,) = objects_of_kind(docs, "StatefulSet")
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    headless = named_object(docs, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert selects(headless["spec"]["selector"], pod_labels)
    front = named_object(docs, "Service", "crossdc-coordinator")
    pod0 = {**pod_labels, "statefulset.kubernetes.io/pod-name": "crossdc-coordinator-0"}
    pod1 = {**pod_labels, "statefulset.kubernetes.io/pod-name": "crossdc-coordinator-1"}
    assert selects(front["spec"]["selector"], pod0)
    assert not selects(front["spec"]["selector"], pod1)
    (monitor,) = objects_of_kind(docs, "ServiceMonitor")
    selected = [
        s["metadata"]["name"]
        for s in objects_of_kind(docs, "Service")
        if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert selected == [headless["metadata"]["name"]], "every shard scraped once"


@RENDER
@needs_kubectl
def test_the_other_shards_reach_shard_zeros_control_plane(
    docs: list[dict[str, Any]], tmp_path: Path
) -> None:
    (statefulset,) = objects_of_kind(docs, "StatefulSet")
    _, cfg = workload_config(docs, statefulset, tmp_path)
    host, port = tcp_endpoint(control_endpoint(cfg, {}))
    headless = statefulset["spec"]["serviceName"]
    assert host == f"{statefulset['metadata']['name']}-0.{headless}", "pod 0 by its DNS name"
    assert port == tcp_endpoint(cfg.shard_control_bind.replace("0.0.0.0", "x"))[1]
    container = main_container(statefulset)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["control"] == port
    assert {"wan", "metrics"} <= set(ports), "the base's ports are kept"
    service = named_object(docs, "Service", headless)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["control"] == port
    (policy,) = objects_of_kind(docs, "NetworkPolicy")
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    from_shards = [
        rule
        for rule in policy["spec"]["ingress"]
        if any(
            selects(peer.get("podSelector", {}).get("matchLabels", {}), pod_labels)
            for peer in rule["from"]
            if "namespaceSelector" not in peer
        )
    ]
    assert [{p["port"] for p in rule["ports"]} for rule in from_shards] == [{port}]


def test_the_sharded_config_is_the_coordinators_but_for_the_shard_keys() -> None:
    base = tomllib.loads((K8S / "coordinator" / "coordinator.toml").read_text())
    sharded = tomllib.loads((K8S / OVERLAY / "coordinator.toml").read_text())
    keys = ("shards", "shard_ports", "shard_control_bind", "shard_control")
    own = {k: sharded["coordinator"].pop(k) for k in keys}
    assert own == {
        "shards": 2,
        "shard_ports": "same",
        "shard_control_bind": "tcp://0.0.0.0:7720",
        "shard_control": "tcp://crossdc-coordinator-0.crossdc-coordinator-shards:7720",
    }
    assert sharded == base
