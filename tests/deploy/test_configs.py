"""The configs the containers mount, held to the example configs of deploy/config (only
addresses and kit paths may differ), and the commands docs/containers.md shows, parsed by the
CLI's own parser."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import CoordinatorConfig, load_coordinator_config
from crossdc.cli import build_parser
from site_agent.config import SiteConfig, load_site_config
from tests.support.containers import DEPLOY, DOCKER, EXAMPLES, FAST, K8S, ROOT, SITES

pytestmark = pytest.mark.usefixtures("no_config_overrides")


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


@FAST
def test_deploy_files_name_the_byte_gpt_options_as_a_site_config_spells_them() -> None:
    """Comments of the example configs, units and manifests name the byte GPT's settings where
    a site's config holds them ([site.job.options.model]), not the site tables of before."""
    before = re.compile(r"\[site\.(model|data|optim)\]|\bsite\.(model|data|optim)\.")
    stale = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted(DEPLOY.rglob("*"))
        if path.is_file()
        for number, line in enumerate(path.read_bytes().decode(errors="replace").splitlines(), 1)
        if before.search(line)
    ]
    assert not stale, stale
