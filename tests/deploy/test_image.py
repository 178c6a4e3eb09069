"""deploy/docker/Dockerfile and .dockerignore, read instruction by instruction (nothing is
built): the base image argument, pinned CPU torch before the project, a non-root user, the
crossdc entrypoint, state on a volume, and no secret or state in the build context."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest

from tests.support.containers import (
    DOCKERIGNORE,
    EXAMPLES,
    FAST,
    ROOT,
    SITES,
    Instruction,
    final_stage,
    image_user,
    is_under,
)

pytestmark = pytest.mark.usefixtures("no_config_overrides")


def _arg_defaults(instructions: list[Instruction], stage: int) -> dict[str, str]:
    out = {}
    for ins in instructions:
        if ins.name == "ARG" and ins.stage in (0, stage):
            name, _, default = ins.args.partition("=")
            out[name] = default
    return out


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
    uid, gid = image_user(dockerfile)
    assert uid != 0 and gid != 0
    created = " ".join(i.args for i in dockerfile if i.name == "RUN")
    assert f"--uid {uid}" in created and f"--gid {gid}" in created, "the USER is created"


@FAST
def test_dockerfile_entrypoint_is_the_crossdc_console_script(
    dockerfile: list[Instruction],
) -> None:
    final = final_stage(dockerfile)
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
    final = final_stage(dockerfile)
    volumes = [v for i in final if i.name == "VOLUME" for v in i.exec_form()]
    assert volumes == ["/var/lib/crossdc"]
    env = " ".join(i.args for i in final if i.name == "ENV")
    assert "HOME=/var/lib/crossdc" in env, "caches (torch, triton) go to the volume"
    uid, _ = image_user(dockerfile)
    runs = " ".join(i.args for i in final if i.name == "RUN")
    assert "install -d -o crossdc -g crossdc -m 0750 /var/lib/crossdc" in runs, (
        f"the volume belongs to the image's user ({uid}), so a new named volume is writable"
    )
    for path in (EXAMPLES / "coordinator.toml", *(EXAMPLES / f"site-{s}.toml" for s in SITES)):
        table = tomllib.loads(path.read_text())
        state_dir = next(iter(table.values()))["state_dir"]
        assert is_under(state_dir, volumes[0]), f"{path.name}: state_dir outside the volume"


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
