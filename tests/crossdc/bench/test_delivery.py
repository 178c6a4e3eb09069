"""``crossdc bench delivery``: each loss is recovered by acknowledged delivery and reported."""

from __future__ import annotations

import json

import pytest

from crossdc.bench import delivery


@pytest.mark.timeout(120)
def test_the_delivery_bench_recovers_every_loss_and_reports_its_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--rtt-ms", "20", "--rate-mbit", "200", "--size-mib", "1", "--repeats", "1", "--json"]
    assert delivery.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    for case in ("lost_after_accept", "rerun_plan", "stalled_transfer"):
        assert len(report[case]["recovery_s"]) == 1 and report[case]["recovery_s"][0] > 0
        assert report[case]["max_recovery_s"] == report[case]["recovery_s"][0]
        assert isinstance(report[case]["within_bound"], bool)
    assert report["lost_after_accept"]["bound_s"] == pytest.approx(0.2)
    # 1 MiB at 200 Mbit/s on top of ten round trips.
    assert report["stalled_transfer"]["bound_s"] == pytest.approx(0.2 + 8 * 2**20 / 200e6)
    # Each case lost one message (the stall two: the transfer and what queued behind it).
    assert report["messages_resent"] >= 4 and report["messages_dropped"] == 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--repeats", "0"], "--repeats"),
        (["--rtt-ms", "0"], "--rtt-ms"),
        (["--size-mib", "-1"], "--size-mib"),
    ],
)
def test_the_delivery_bench_refuses_bad_arguments_before_any_work(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        delivery.main(argv)
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err
