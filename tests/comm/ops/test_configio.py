"""Config files: TOML onto dataclasses, errors naming the field, env overrides, CLI exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from comm.ops.configio import ConfigError, build, dump_toml, env_overrides, load_section
from coordinator.config import CoordinatorConfig
from site_agent.config import SiteConfig
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(60)


def test_build_nested_and_explicit_wins() -> None:
    cfg = build(
        SiteConfig,
        {
            "site_id": "eu",
            "coordinator": "tcp://h:1",
            "channel": {"heartbeat_interval_s": 2.0},
            "security": {"insecure": True},
        },
        prefix="site",
        seed=7,
    )
    assert cfg.channel.heartbeat_interval_s == 2.0 and cfg.seed == 7


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ({"bogus": 1}, "unknown key coordinator.bogus"),
        ({"min_sites": "two"}, "coordinator.min_sites must be an integer"),
        ({"min_sites": 0}, "coordinator.min_sites must be >= 1"),
        ({"quorum_fraction": 1.5}, "coordinator.quorum_fraction"),
        ({"outer_warmup_steps": -1}, "coordinator.outer_warmup_steps must be >= 0"),
        ({"sync_fraction": 0}, "coordinator.sync_fraction must be in"),
        ({"align_arrivals": "yes"}, "coordinator.align_arrivals"),
        ({"uplink_codec": "zip9"}, "coordinator.uplink_codec"),
        ({"codec_loss_costs": {"zip9": 0.0}}, "coordinator.codec_loss_costs.zip9"),
        ({"codec_loss_costs": {"int4": "low"}}, "coordinator.codec_loss_costs.int4 must be"),
        ({"codec_loss_costs": {"int3/": 0.0}}, "a pair is UPLINK/DOWNLINK"),
        ({"codec_loss_costs": {"int3/zip9": 0.0}}, r"codec_loss_costs.int3/zip9 \(downlink\)"),
        ({"codec_loss_budget": -0.1}, "coordinator.codec_loss_budget must be >= 0"),
        ({"channel": {"chunk_bytes": 1}}, "channel.chunk_bytes"),
        ({"faults": {"kill_before_storing_round": -1}}, "faults.kill_before_storing_round"),
        ({"faults": {"kill_at_random": 1}}, "kill_at_random"),
    ],
)
def test_bad_coordinator_config_names_the_field(table: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        build(CoordinatorConfig, table, prefix="coordinator")


def test_secure_by_default_refuses_a_config_without_keys() -> None:
    with pytest.raises(ConfigError, match="security.kit_dir is required"):
        build(CoordinatorConfig, {}, prefix="coordinator")
    with pytest.raises(ConfigError, match="security.kit_dir is required"):
        build(SiteConfig, {"site_id": "eu", "coordinator": "tcp://h:1"}, prefix="site")


def test_site_config_errors() -> None:
    with pytest.raises(ConfigError, match="site.coordinator"):
        build(SiteConfig, {"site_id": "eu"}, prefix="site")
    with pytest.raises(ConfigError, match="site.job.grad_clip"):
        build(
            SiteConfig,
            {
                "site_id": "eu",
                "coordinator": "tcp://h:1",
                "job": {"grad_clip": -1.0},
                "security": {"insecure": True},
            },
            prefix="site",
        )
    # The default job's options are checked when the config is read, by the job's own check.
    with pytest.raises(ConfigError, match="model.d_model"):
        build(
            SiteConfig,
            {
                "site_id": "eu",
                "coordinator": "tcp://h:1",
                "job": {"options": {"model": {"d_model": 30, "num_heads": 4}}},
                "security": {"insecure": True},
            },
            prefix="site",
        )
    with pytest.raises(ConfigError, match="site.stages=20 exceeds the model's 6 layers"):
        build(
            SiteConfig,
            {
                "site_id": "eu",
                "coordinator": "tcp://h:1",
                "stages": 20,
                "security": {"insecure": True},
            },
            prefix="site",
        )


def test_env_overrides_parse_toml_values() -> None:
    env = {
        "CROSSDC_SITE_SEED": "9",
        "CROSSDC_SITE_MODEL__D_MODEL": "64",
        "CROSSDC_SITE_SITE_ID": "eu",
        "OTHER": "x",
    }
    assert env_overrides("site", env) == {"seed": 9, "model": {"d_model": 64}, "site_id": "eu"}


def test_dump_toml_round_trips(tmp_path: Path) -> None:
    doc = {
        "coordinator": {
            "min_sites": 3,
            "bind": "tcp://127.0.0.1:0",
            "outer_lr": 0.5,
            "channel": {"chunk_bytes": 65536},
            "security": {"insecure": True},
        }
    }
    path = tmp_path / "c.toml"
    path.write_text(dump_toml(doc))
    cfg = load_section(CoordinatorConfig, path, "coordinator")
    assert cfg.min_sites == 3 and cfg.channel.chunk_bytes == 65536 and cfg.outer_lr == 0.5


def test_unknown_table_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[coordinatr]\nmin_sites = 2\n")
    with pytest.raises(ConfigError, match="unknown table"):
        load_section(CoordinatorConfig, path, "coordinator")


def test_cli_bad_config_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[coordinator]\nmin_sites = -1\n[coordinator.security]\ninsecure = true\n")
    proc = subprocess.run(
        [sys.executable, "-m", "crossdc", "coordinator", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "coordinator.min_sites" in lines[0]


def test_shipped_example_configs_load() -> None:
    root = ROOT / "deploy" / "config"
    from coordinator.config import load_coordinator_config
    from site_agent.config import load_site_config

    assert load_coordinator_config(root / "coordinator.toml").min_sites >= 1
    for path in sorted(root.glob("site-*.toml")):
        assert load_site_config(path).site_id


def test_cli_missing_key_kit_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    missing = tmp_path / "no-kit"
    path.write_text(
        f'[coordinator]\nstate_dir = "{tmp_path}/state"\n[coordinator.security]\nkit_dir = "{missing}"\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "crossdc", "coordinator", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0]


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ("seed = 1\n[coordinator.initial_model.model]\nnum_layer = 2\n", "model.num_layer"),
        ("seed = 1\n[coordinator.initial_model.model]\nnum_heads = 0\n", "num_heads"),
        ("sed = 1\n", "initial_model.sed"),
    ],
)
def test_cli_bad_initial_model_prints_one_line_and_exits_2(
    tmp_path: Path, table: str, named: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        f'[coordinator]\nstate_dir = "{tmp_path}/state"\nmetrics_port = 0\n'
        f"[coordinator.security]\ninsecure = true\n[coordinator.initial_model]\n{table}"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "crossdc", "coordinator", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], lines


def _code_default(cls: Any, parts: list[str]) -> Any:
    """The code's default for the dotted key ``parts`` under dataclass ``cls`` (``NO_DEFAULT``
    for a required field); an optional table (default None) is descended into its class."""
    import dataclasses
    import typing

    from site_agent.config import JobConfig
    from site_agent.jobs.bytegpt import ByteGPTOptions
    from site_agent.jobs.bytegpt.model import ModelConfig

    hints = typing.get_type_hints(cls)
    f = {f.name: f for f in dataclasses.fields(cls)}[parts[0]]
    if len(parts) > 1:
        kind = hints[f.name]
        inner = [a for a in (kind, *typing.get_args(kind)) if dataclasses.is_dataclass(a)]
        if inner:
            return _code_default(inner[0], parts[1:])
        if cls is JobConfig and f.name == "options":  # the default job's: the byte GPT's
            return _code_default(ByteGPTOptions, parts[1:])
        assert f.name == "model", f"no table {parts[0]} in {cls.__name__}"
        return _code_default(ModelConfig, parts[1:])  # initial_model.model: the sites' model
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return NO_DEFAULT


NO_DEFAULT = object()


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "deploy" / "config").iterdir()))
def test_example_config_values_are_the_code_defaults_unless_noted(name: str) -> None:
    """Every value in an example config equals the code's default, or its line says
    ``default: X`` with X the code's default: the examples cannot drift from the code."""
    import re
    import tomllib

    path = ROOT / "deploy" / "config" / name
    doc = tomllib.loads(path.read_text())
    ((section, _),) = doc.items()
    cls = CoordinatorConfig if section == "coordinator" else SiteConfig
    table: list[str] = []
    checked = 0
    for line in path.read_text().splitlines():
        if header := re.match(r"^\[([\w.]+)\]", line):
            table = header.group(1).split(".")
            continue
        key = re.match(r"^(\w+)\s*=", line)
        if not key:
            continue
        parts = [*table[1:], key.group(1)]
        value: Any = doc[table[0]]
        for part in parts:
            value = value[part]
        default = _code_default(cls, parts)
        if isinstance(default, tuple):
            default = list(default)
        note = re.search(r"\(default: (.*)\)$", line) or re.search(r"# default: (.*)$", line)
        where = f"{name}: {'.'.join([*table, key.group(1)])}"
        if note:
            stated = tomllib.loads(f"v = {note.group(1)}")["v"]
            assert stated == default, f"{where} says default {stated!r}, the code's is {default!r}"
        elif default is not NO_DEFAULT:
            assert value == default, f"{where} = {value!r} but the default is {default!r}"
        checked += 1
    assert checked >= 10
