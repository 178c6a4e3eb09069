"""The rendered Kubernetes workloads against the CLI, the configs and the image: commands,
configs and ports agree, sites reach the coordinator's Service, pods run unprivileged, network
policies let in only sites and Prometheus, and the pipelined site runs torchrun in the agent."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crossdc.bench.local_trainer import bytegpt_options
from tests.support.containers import (
    RENDER,
    ROOT,
    SITES,
    Instruction,
    image_user,
    is_under,
    main_container,
    mounts_of,
    named_object,
    needs_kubectl,
    objects_of_kind,
    pod_spec,
    selects,
    service_ports,
    tcp_endpoint,
    volume_of,
    workload_config,
)

pytestmark = pytest.mark.usefixtures("no_config_overrides")


def _workloads(rendered: dict[str, list[dict[str, Any]]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for part, docs in rendered.items():
        for statefulset in objects_of_kind(docs, "StatefulSet"):
            yield part, statefulset


@RENDER
@needs_kubectl
def test_k8s_commands_configs_and_ports_agree(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    for part, statefulset in _workloads(rendered):
        docs = rendered[part]
        args, cfg = workload_config(docs, statefulset, tmp_path)
        container = main_container(statefulset)
        role = statefulset["metadata"]["labels"]["app.kubernetes.io/component"]
        assert args.command == ("coordinator" if role == "coordinator" else "agent")
        assert not args.insecure and not cfg.security.insecure
        assert args.command != "agent" or (args.stages is None and args.replicas is None), (
            "stages and replicas come from the site's config, as for every site"
        )
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert cfg.metrics_host == "0.0.0.0" and ports["metrics"] == cfg.metrics_port
        if role == "coordinator":
            assert ports["wan"] == tcp_endpoint(cfg.bind.replace("0.0.0.0", "x"))[1] == 7710
            assert cfg.metrics_port == 9710
        else:
            assert set(ports) == {"metrics"} and cfg.metrics_port == 9711
            assert statefulset["metadata"]["labels"]["crossdc.io/site"] == cfg.site_id
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] == "metrics"
        service = named_object(docs, "Service", statefulset["spec"]["serviceName"])
        assert selects(
            service["spec"]["selector"], statefulset["spec"]["template"]["metadata"]["labels"]
        )
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]]
        mounts = mounts_of(container)
        (state,) = [m for m in mounts if is_under(cfg.state_dir, m)]
        claims = {c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]}
        assert mounts[state]["name"] in claims, "the state is on the StatefulSet's claim"
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert "HOME" not in env, "HOME stays the image's, on the state volume"
        assert is_under("/var/lib/crossdc", state)


@RENDER
@needs_kubectl
def test_k8s_sites_reach_the_coordinator_service(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    whole = rendered[""]
    coordinator = named_object(whole, "StatefulSet", "crossdc-coordinator")
    _, coord = workload_config(whole, coordinator, tmp_path)
    service = named_object(whole, "Service", "crossdc-coordinator")
    shards = set()
    for site in SITES:
        _, cfg = workload_config(
            whole, named_object(whole, "StatefulSet", f"crossdc-site-{site}"), tmp_path
        )
        host, port = tcp_endpoint(cfg.coordinator)
        assert host == service["metadata"]["name"] and port == service_ports(service)["wan"]
        data = bytegpt_options(cfg).data
        assert cfg.site_id == site and data.num_shards == len(SITES)
        shards.add(data.shard_index)
        assert coord.initial_model is not None and cfg.seed == coord.initial_model.seed
    assert shards == set(range(len(SITES)))


@RENDER
@needs_kubectl
def test_k8s_pods_run_unprivileged(
    rendered: dict[str, list[dict[str, Any]]], dockerfile: list[Instruction]
) -> None:
    uid, gid = image_user(dockerfile)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for part, statefulset in _workloads(rendered):
        pod = pod_spec(statefulset)
        where = f"{part or '.'}: {statefulset['metadata']['name']}"
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True and (ctx["runAsUser"], ctx["runAsGroup"]) == (uid, gid)
        assert ctx["fsGroup"] == gid and ctx["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False, where
        for container in pod["containers"] + pod.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            requests = container["resources"]["requests"]
            assert "cpu" in requests and "memory" in requests, where
            assert "memory" in container["resources"]["limits"], where
            image, _, tag = container["image"].partition(":")
            assert image == "crossdc" and tag.split("-")[0] == version, where
            assert "/tmp" in mounts_of(container) or container["name"] == "kit", where
        assert statefulset["spec"]["replicas"] == 1, "one coordinator, one agent per site"
        assert pod["terminationGracePeriodSeconds"] >= 60, "as the units' TimeoutStopSec"


def _policy_ports(rule: dict[str, Any]) -> set[int]:
    return {p["port"] for p in rule["ports"]}


@RENDER
@needs_kubectl
def test_k8s_network_policies_let_in_only_sites_and_prometheus(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    whole = rendered[""]
    policies = objects_of_kind(whole, "NetworkPolicy")
    pods = {
        s["metadata"]["name"]: s["spec"]["template"]["metadata"]["labels"]
        for s in objects_of_kind(whole, "StatefulSet")
    }
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    for name, labels in pods.items():
        selecting = [
            p for p in policies if selects(p["spec"]["podSelector"]["matchLabels"], labels)
        ]
        assert len(selecting) == 1, f"{name}: one NetworkPolicy"
        (policy,) = selecting
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        allowed: dict[str, set[int]] = {}
        for rule in policy["spec"]["ingress"]:
            (peer,) = rule["from"]
            if "namespaceSelector" in peer:
                assert peer["podSelector"]["matchLabels"] == prometheus
                allowed.setdefault("prometheus", set()).update(_policy_ports(rule))
            else:
                matched = {
                    n for n, lab in pods.items() if selects(peer["podSelector"]["matchLabels"], lab)
                }
                assert matched == {f"crossdc-site-{s}" for s in SITES}, "every site, no other"
                allowed.setdefault("sites", set()).update(_policy_ports(rule))
        if name == "crossdc-coordinator":
            assert allowed == {"sites": {7710}, "prometheus": {9710}}
        else:
            assert allowed == {"prometheus": {9711}}


@RENDER
@needs_kubectl
def test_k8s_pipelined_site_runs_torchrun_inside_the_agent(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    docs = rendered["examples/pipelined-site"]
    (statefulset,) = objects_of_kind(docs, "StatefulSet")
    args, cfg = workload_config(docs, statefulset, tmp_path)
    container = main_container(statefulset)
    assert (
        container["args"]
        == main_container(named_object(rendered[""], "StatefulSet", "crossdc-site-eu"))["args"]
    )
    world = cfg.stages * cfg.replicas
    assert world > 1 and cfg.device == "cuda", "a pipelined site: crossdc agent starts torchrun"
    for key in ("requests", "limits"):
        assert container["resources"][key]["nvidia.com/gpu"] == world, "one GPU per process"
    assert container["image"].endswith("-cuda")
    shm = volume_of(statefulset, mounts_of(container)["/dev/shm"]["name"])
    assert shm["emptyDir"]["medium"] == "Memory"
    assert volume_of(statefulset, "kit-secret")["secret"]["secretName"] == "crossdc-site-eu-kit"
