"""``crossdc plot``: the four PNG figures of a run directory, from the coordinator's durable
history (written by the real state store) and the sites' status files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.file_store import FileStateStore
from coordinator.state import GlobalState
from crossdc import plot
from crossdc.cli import main

pytestmark = pytest.mark.timeout(120)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_dir(root: Path, rounds: int = 3) -> Path:
    params = {"w": np.zeros(4, np.float32)}
    store = FileStateStore(str(root / "coordinator"), keep=2)
    history: list[dict[str, object]] = []
    for r in range(1, rounds + 1):
        history.append(
            {
                "round_id": r,
                "global_version": r,
                "duration_s": 10.0,
                "finished_unix": 1_000_000.0 + 10 * r,
                "wire_bytes_in": 3000,
                "wire_bytes_out": 2000,
                "update_bytes": 2400,
                "update_bytes_by_site": {"eu": 1200, "us": 1200},
                "broadcast_bytes": 1800,
            }
        )
        store.save(
            GlobalState(
                params=params,
                momentum=params,
                residual=params,
                global_version=r,
                round_counter=r,
                model_fingerprint="fp",
                history=tuple(history),
                val_losses={v: 5.0 - v for v in range(r + 1)},
            )
        )
    for site, util in (("eu", 0.97), ("us", None)):
        (root / f"site-{site}").mkdir()
        (root / f"site-{site}" / "status.json").write_text(
            json.dumps({"site_id": site, "compute_utilization": util})
        )
    return root


def test_plot_writes_the_four_figures(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run")
    paths = plot.plot_run(run, tmp_path / "out")
    assert [p.name for p in paths] == list(plot.FIGURES)
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, path


def test_loss_points_count_every_byte_up_to_each_version(tmp_path: Path) -> None:
    from coordinator.history_log import read_history

    log = read_history(_run_dir(tmp_path / "run") / "coordinator")
    seconds, wan_bytes, losses = plot._loss_points(list(log.history), log.val_losses)
    assert losses == [5.0, 4.0, 3.0, 2.0]
    assert wan_bytes == [0.0, 5000.0, 10000.0, 15000.0]
    assert seconds == [0.0, 10.0, 20.0, 30.0]


def test_cli_plot_and_its_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run_dir(tmp_path / "run", rounds=1)
    assert main(["plot", str(run), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["figures"]
    assert all(Path(f).parent == run and Path(f).exists() for f in figures)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(empty)]) == 1
    assert "holds no completed round" in capsys.readouterr().err


def test_without_matplotlib_a_figure_names_the_plot_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """matplotlib is the optional ``plot`` extra: without it a figure fails with a message that
    says how to install it, and reading a run or a frontier never needs it."""
    run = _run_dir(tmp_path / "run", rounds=1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(plot.PlotUnavailable, match=r"crossdc\[plot\]"):
        plot.plot_run(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["plot", str(run)]) == 1
    assert "pip install 'crossdc[plot]'" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_the_cli_passes_plot_options_through(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``crossdc plot --frontier ...`` reaches the plot command (its first token is an option);
    other commands still refuse options they do not know."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"config": {}}))
    assert main(["plot", "--frontier", str(bad), "--table"]) == 1
    assert "neither a sweep's frontier.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["status", "--no-such-option"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err
