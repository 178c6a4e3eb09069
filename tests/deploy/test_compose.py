"""deploy/compose.yaml, parsed (and given to `docker compose config` where a Compose v2 is
installed): its services, image, commands, ports, secrets, volumes, and the Prometheus and
Grafana it runs; every config a service mounts is loaded with the real loaders."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import load_coordinator_config
from crossdc.bench.local_trainer import bytegpt_options
from crossdc.cli import build_parser
from site_agent.config import load_site_config
from tests.support.containers import (
    COMPOSE,
    CROSSDC_SERVICES,
    DEPLOY,
    DOCKER,
    DOCKERFILE,
    FAST,
    ROOT,
    SITES,
    Instruction,
    is_under,
    prometheus_jobs,
    tcp_endpoint,
    yaml,
)

pytestmark = pytest.mark.usefixtures("no_config_overrides")


def _compose_command() -> list[str] | None:
    """Docker Compose v2 (`docker compose` or a `docker-compose` v2 binary), if installed."""
    candidates: list[list[str]] = []
    docker = shutil.which("docker")
    if docker:
        candidates.append([docker, "compose"])
    standalone = shutil.which("docker-compose")
    if standalone:
        candidates.append([standalone])
    for cmd in candidates:
        try:
            out = subprocess.run(
                [*cmd, "version", "--short"], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip().lstrip("v").startswith("2"):
            return cmd
    return None


def _compose_path(source: str) -> Path:
    return (COMPOSE.parent / source).resolve()


def _binds(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Short-syntax volumes: container path -> (source, read-only)."""
    out = {}
    for entry in service.get("volumes", []):
        source, target, *mode = entry.split(":")
        out[target] = (source, "ro" in mode)
    return out


def _service_config(service: dict[str, Any]) -> tuple[argparse.Namespace, Any]:
    args = build_parser().parse_args(service["command"])
    source, read_only = _binds(service)[args.config]
    assert read_only, f"{args.config} is mounted read-only"
    path = _compose_path(source)
    assert path.is_file(), f"{source} does not exist"
    if args.command == "coordinator":
        return args, load_coordinator_config(path)
    return args, load_site_config(path)


@FAST
def test_compose_has_the_federation_and_its_monitoring(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {*CROSSDC_SERVICES, "prometheus", "grafana"}
    for name in CROSSDC_SERVICES:
        service = compose["services"][name]
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"]
        assert "no-new-privileges:true" in service["security_opt"]
        assert "user" not in service or service["user"] != "root"


@FAST
def test_compose_image_is_built_from_the_dockerfile(
    compose: dict[str, Any], dockerfile: list[Instruction]
) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    build_args = {a.args.partition("=")[0] for a in dockerfile if a.name == "ARG"}
    for name in CROSSDC_SERVICES:
        service = compose["services"][name]
        assert service["image"] == f"crossdc:{version}"
        build = service["build"]
        assert _compose_path(build["context"]) == ROOT
        assert (ROOT / build["dockerfile"]).resolve() == DOCKERFILE
        assert set(build.get("args", {})) <= build_args, "build args the Dockerfile declares"


@FAST
def test_compose_commands_parse_and_load_their_configs(compose: dict[str, Any]) -> None:
    seen = set()
    for name in CROSSDC_SERVICES:
        args, cfg = _service_config(compose["services"][name])
        expected = "coordinator" if name == "coordinator" else "agent"
        assert args.command == expected and not args.insecure
        if expected == "agent":
            assert cfg.site_id == name.removeprefix("site-")
            seen.add(cfg.site_id)
    assert seen == set(SITES)


@FAST
def test_compose_ports_agree_with_the_configs(compose: dict[str, Any]) -> None:
    published: dict[int, str] = {}
    for name in CROSSDC_SERVICES:
        service = compose["services"][name]
        _, cfg = _service_config(service)
        ports = {}
        for entry in service["ports"]:
            host_ip, host_port, container_port = entry.split(":")
            assert host_ip == "127.0.0.1", f"{name}: {entry} is published on loopback only"
            assert int(host_port) not in published, f"host port {host_port} published twice"
            published[int(host_port)] = name
            ports[int(container_port)] = int(host_port)
        assert cfg.metrics_host == "0.0.0.0", "/metrics must listen beyond the container"
        wanted = {cfg.metrics_port}
        if name == "coordinator":
            _, bind_port = tcp_endpoint(cfg.bind.replace("0.0.0.0", "coordinator"))
            assert bind_port == 7710 and cfg.metrics_port == 9710
            wanted.add(bind_port)
        else:
            assert cfg.metrics_port == 9711
        assert set(ports) == wanted, f"{name} publishes {sorted(ports)}, its config {wanted}"
        check = service["healthcheck"]["test"]
        assert check[:2] == ["CMD", "crossdc"]
        status = build_parser().parse_args(check[2:])
        assert status.command == "status" and status.url == f"http://127.0.0.1:{cfg.metrics_port}"


@FAST
def test_compose_sites_reach_the_coordinator_service(compose: dict[str, Any]) -> None:
    _, coord = _service_config(compose["services"]["coordinator"])
    _, bind_port = tcp_endpoint(coord.bind.replace("0.0.0.0", "x"))
    shards = set()
    for site in SITES:
        service = compose["services"][f"site-{site}"]
        _, cfg = _service_config(service)
        host, port = tcp_endpoint(cfg.coordinator)
        assert host in compose["services"] and host == "coordinator" and port == bind_port
        assert "coordinator" in service["depends_on"]
        opts = bytegpt_options(cfg)
        assert opts.data.num_shards == len(SITES)
        shards.add(opts.data.shard_index)
        assert coord.initial_model is not None
        assert dataclasses.asdict(opts.model) == {
            **dataclasses.asdict(opts.model),
            **coord.initial_model.model,
        }, "the coordinator builds the sites' model"
        assert cfg.seed == coord.initial_model.seed
    assert shards == set(range(len(SITES)))
    assert coord.min_sites <= len(SITES)


@FAST
def test_compose_kits_are_secrets_at_the_configs_kit_dir(compose: dict[str, Any]) -> None:
    secrets = compose["secrets"]
    for name in CROSSDC_SERVICES:
        service = compose["services"][name]
        _, cfg = _service_config(service)
        assert not cfg.security.insecure
        (secret,) = service["secrets"]
        assert cfg.security.kit_dir == f"/run/secrets/{secret}"
        # deploy/docker/make-kits.sh names the kits after the services.
        assert _compose_path(secrets[secret]["file"]) == (DOCKER / "kits" / name).resolve()
    assert (DOCKER / ".gitignore").read_text().split() == ["/kits/"], "kits stay out of git"


@FAST
def test_compose_state_is_on_named_volumes(compose: dict[str, Any]) -> None:
    for name in CROSSDC_SERVICES:
        service = compose["services"][name]
        _, cfg = _service_config(service)
        mounts = {t: s for t, (s, _) in _binds(service).items() if not s.startswith((".", "/"))}
        (target,) = [t for t in mounts if is_under(cfg.state_dir, t)]
        assert target == "/var/lib/crossdc" and mounts[target] in compose["volumes"]
        assert "/tmp" in service["tmpfs"], "a read-only root file system still has a /tmp"
    named = [
        s
        for svc in compose["services"].values()
        for s, _ in _binds(svc).values()
        if s[0] not in "./"
    ]
    assert len(named) == len(set(named)), "no two services share a state volume"


@FAST
def test_compose_prometheus_scrapes_every_role(compose: dict[str, Any]) -> None:
    service = compose["services"]["prometheus"]
    binds = _binds(service)
    config_target = next(a[len("--config.file=") :] for a in service["command"] if "config" in a)
    config = yaml.safe_load(_compose_path(binds[config_target][0]).read_text())
    example = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["global"] == example["global"]
    for rule_file in config["rule_files"]:
        source, read_only = binds[str(Path(config_target).parent / rule_file)]
        assert read_only and _compose_path(source) == DEPLOY / "prometheus" / "alerts.yml"
    jobs, example_jobs = prometheus_jobs(config), prometheus_jobs(example)
    assert set(jobs) == set(example_jobs)
    for name, job in jobs.items():
        for key in set(job) | set(example_jobs[name]):
            if key != "static_configs":
                assert job.get(key) == example_jobs[name].get(key), f"{name}.{key}"
    targets = {
        t: group.get("labels", {})
        for job in jobs.values()
        for group in job["static_configs"]
        for t in group["targets"]
    }
    want = {}
    for name in CROSSDC_SERVICES:
        _, cfg = _service_config(compose["services"][name])
        want[f"{name}:{cfg.metrics_port}"] = {} if name == "coordinator" else {"site": cfg.site_id}
    assert targets == want
    example_labels = sorted(
        (g.get("labels") or {}).get("site", "")
        for g in example_jobs["crossdc-site"]["static_configs"]
    )
    assert example_labels == sorted(SITES)


@FAST
@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_compose_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    shutil.copy(DOCKER / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    out = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@FAST
def test_compose_grafana_provisions_the_dashboard(compose: dict[str, Any]) -> None:
    binds = _binds(compose["services"]["grafana"])
    by_source = {_compose_path(s): t for t, (s, ro) in binds.items() if ro}
    provider_file = DEPLOY / "grafana" / "provisioning" / "dashboards" / "crossdc.yml"
    assert by_source[provider_file].startswith("/etc/grafana/provisioning/dashboards/")
    provider = yaml.safe_load(provider_file.read_text())["providers"][0]
    dashboard_target = by_source[DEPLOY / "grafana" / "crossdc-dashboard.json"]
    assert str(Path(dashboard_target).parent) == provider["options"]["path"]
    datasources = by_source[DOCKER / "grafana" / "datasources.yml"]
    assert datasources.startswith("/etc/grafana/provisioning/datasources/")
    ours = yaml.safe_load((DOCKER / "grafana" / "datasources.yml").read_text())["datasources"]
    example_file = DEPLOY / "grafana" / "provisioning" / "datasources" / "crossdc.yml"
    example = yaml.safe_load(example_file.read_text())["datasources"]
    assert [(d["name"], d["uid"], d["type"]) for d in ours] == [
        (d["name"], d["uid"], d["type"]) for d in example
    ]
    assert ours[0]["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    assert ours[0]["jsonData"] == example[0]["jsonData"]


@pytest.mark.timeout(120)
def test_compose_file_passes_docker_compose_config() -> None:
    cmd = _compose_command()
    if cmd is None:
        pytest.skip("Docker Compose v2 is not installed (docker compose / docker-compose)")
    out = subprocess.run(
        [*cmd, "-f", str(COMPOSE), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    for name in CROSSDC_SERVICES:
        (secret,) = resolved["services"][name]["secrets"]
        assert secret["target"] == f"/run/secrets/{secret['source']}"
