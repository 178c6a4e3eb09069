"""Kits made with the real `crossdc keys` through deploy/docker/make-kits.sh, mounted as compose
secrets, turned into Secrets by deploy/k8s/kit-secrets.sh and copied by the init containers' own
scripts before the real kit loaders read them."""

from __future__ import annotations

import base64
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from comm.security.kits import issued_certificates
from comm.security.registry import CertificateRegistry
from comm.security.rolekits import load_coordinator_kit, load_site_kit
from tests.support.containers import (
    FAST,
    KIT_SECRETS,
    KUBECTL,
    MAKE_KITS,
    OLDEST_KUBERNETES,
    SITES,
    kubernetes_validate,
    main_container,
    mounts_of,
    needs_kubectl,
    objects_of_kind,
    pod_spec,
    venv_tool,
    volume_of,
    workload_config,
    yaml,
)

pytestmark = pytest.mark.usefixtures("no_config_overrides")


def _crossdc() -> str:
    tool = venv_tool("crossdc")
    if tool is None:
        pytest.skip("the crossdc command is not installed (pip install -e .)")
    return tool


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
    for statefulset in objects_of_kind(whole, "StatefulSet"):
        name = statefulset["metadata"]["name"]
        secret = secrets[volume_of(statefulset, "kit-secret")["secret"]["secretName"]]
        assert secret["metadata"]["namespace"] == statefulset["metadata"]["namespace"]
        if kubernetes_validate is not None:
            kubernetes_validate.validate(secret, OLDEST_KUBERNETES, strict=True)
        (init,) = pod_spec(statefulset)["initContainers"]
        env = {e["name"]: e["value"] for e in init["env"]}
        assert mounts_of(init)[env["KIT_SECRET"]]["name"] == "kit-secret"
        assert mounts_of(init)[env["KIT_DIR"]]["name"] == "kit"
        assert mounts_of(main_container(statefulset))[env["KIT_DIR"]]["readOnly"] is True
        _, cfg = workload_config(whole, statefulset, tmp_path)
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
