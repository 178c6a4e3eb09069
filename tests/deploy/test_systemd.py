"""deploy/systemd: the units run the CLI with restart and hardening, can write the example
configs' state dirs, and pass `systemd-analyze verify`; the example configs agree on theta0."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from crossdc.cli_common import EXIT_BAD_CONFIG
from site_agent.exits import EXIT_AUTH_REFUSED, EXIT_CANNOT_START, EXIT_FATAL
from tests.support.deploy import CONFIGS, SYSTEMD, SYSTEMD_ANALYZE


def _unit(name: str) -> str:
    return (SYSTEMD / name).read_text()


def _unit_values(text: str, key: str) -> list[str]:
    return re.findall(rf"^{key}=(.*)$", text, flags=re.M)


@pytest.mark.timeout(30)
def test_units_run_the_cli_with_restart_and_hardening() -> None:
    coord, agent = _unit("crossdc-coordinator.service"), _unit("crossdc-agent@.service")
    assert re.search(r"^ExecStart=\S+/crossdc coordinator --config \S+\.toml$", coord, re.M)
    assert re.search(
        r"^ExecStart=\S+/crossdc agent --config /etc/crossdc/site-%i\.toml$", agent, re.M
    )
    assert _unit_values(coord, "RestartPreventExitStatus") == [str(EXIT_BAD_CONFIG)]
    assert EXIT_CANNOT_START == EXIT_BAD_CONFIG  # a pipelined site's leader says it so
    assert _unit_values(agent, "RestartPreventExitStatus") == [
        f"{EXIT_BAD_CONFIG} {EXIT_FATAL} {EXIT_AUTH_REFUSED}"
    ]
    assert _unit_values(agent, "KillMode") == ["mixed"]  # the leader drains, then the rest
    for text in (coord, agent):
        assert _unit_values(text, "Restart") == ["on-failure"]
        assert _unit_values(text, "NoNewPrivileges") == ["yes"]
        assert _unit_values(text, "ProtectSystem") == ["strict"]
        assert _unit_values(text, "User") == ["crossdc"]


@pytest.mark.timeout(30)
def test_the_example_coordinator_builds_the_example_sites_theta0() -> None:
    """The coordinator's [initial_model] names the seed and model every example site builds, so
    the sites join in sync and nothing is uploaded."""
    from coordinator.config import load_coordinator_config
    from crossdc.bench.local_trainer import bytegpt_options
    from site_agent.config import load_site_config

    initial = load_coordinator_config(CONFIGS / "coordinator.toml").initial_model
    assert initial is not None
    for path in sorted(CONFIGS.glob("site-*.toml")):
        site = load_site_config(path)
        assert site.seed == initial.seed, path.name
        model = bytegpt_options(site).model
        assert dataclasses.asdict(model) == {
            **dataclasses.asdict(type(model)()),
            **initial.model,
        }, path.name


@pytest.mark.timeout(30)
def test_units_can_write_the_state_dirs_of_the_example_configs() -> None:
    coord = tomllib.loads((CONFIGS / "coordinator.toml").read_text())["coordinator"]
    assert _unit_values(_unit("crossdc-coordinator.service"), "ReadWritePaths") == [
        coord["state_dir"]
    ]
    agent = _unit("crossdc-agent@.service")
    for path in sorted(CONFIGS.glob("site-*.toml")):
        site = tomllib.loads(path.read_text())["site"]
        writable = [p.replace("%i", site["site_id"]) for p in _unit_values(agent, "ReadWritePaths")]
        assert site["state_dir"] in writable, path.name
        assert f"site-{site['site_id']}.toml" == path.name


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.timeout(60)
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """``systemd-analyze verify`` on the units, with ExecStart pointed at this checkout's crossdc
    (verify insists that the binary exists) and the template instantiated as site "eu"."""
    crossdc = Path(sys.executable).parent / "crossdc"
    if not crossdc.exists():
        pytest.skip(f"{crossdc} is not installed (pip install -e .)")
    units = []
    for src in sorted(SYSTEMD.glob("*.service")):
        dst = tmp_path / src.name.replace("@.", "@eu.")
        dst.write_text(src.read_text().replace("/opt/crossdc/venv/bin/crossdc", str(crossdc)))
        units.append(dst)
    assert len(units) == 3
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", *map(str, units)], capture_output=True, text=True, timeout=45
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and "Failed to" in output and not any(u.name in output for u in units):
        pytest.skip(f"systemd-analyze verify cannot run here: {output.strip()[:300]}")
    assert proc.returncode == 0, output
    # Unknown keys and bad values are only warnings (exit 0): any line about our units fails.
    complaints = [ln for ln in output.splitlines() if any(u.name in ln for u in units)]
    assert not complaints, "\n".join(complaints)


@pytest.mark.timeout(30)
def test_the_shard_template_is_the_coordinator_unit_run_as_shard_i() -> None:
    """``crossdc-coordinator@N`` runs shard N from the same config as the plain unit, with the
    same service settings, and may write exactly the state dir shard N derives from it."""
    from coordinator.config import load_coordinator_config
    from coordinator.sharding import resolve, shard_config

    plain, template = _unit("crossdc-coordinator.service"), _unit("crossdc-coordinator@.service")
    (exec_start,) = _unit_values(template, "ExecStart")
    assert exec_start == _unit_values(plain, "ExecStart")[0] + " --shard %i"
    differ = {"ExecStart", "StateDirectory", "ReadWritePaths", "Description"}
    settings = lambda text: [  # noqa: E731
        ln for ln in text.splitlines() if re.match(r"^\w+=", ln) and ln.split("=")[0] not in differ
    ]
    assert settings(template) == settings(plain)
    cfg = dataclasses.replace(
        load_coordinator_config(CONFIGS / "coordinator.toml"), shards=2, shard_ports="offset"
    )
    for shard in range(cfg.shards):
        own = shard_config(cfg, resolve(cfg.shards, str(shard), {}))
        (writable,) = _unit_values(template, "ReadWritePaths")
        (state,) = _unit_values(template, "StateDirectory")
        assert writable.replace("%i", str(shard)) == own.state_dir
        assert f"/var/lib/{state}".replace("%i", str(shard)) == own.state_dir
