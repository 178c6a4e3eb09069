"""The codec benchmark's report shape (figures are not asserted: wall-clock time varies)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(120)


def test_benchmark_report_shape(capsys: pytest.CaptureFixture[str]) -> None:
    from crossdc.bench.codecs import main, run

    report = run(size_mib=1, repeats=1)
    assert report["memcpy_gbps"] > 0
    names = [c["name"] for c in report["codecs"]]
    assert names == ["fp32", "fp16", "bf16", "int8", "int4", "topk:0.01", "int8+zstd"]
    for c in report["codecs"]:
        assert set(c) == {"name", "ratio", "encode_gbps", "decode_gbps", "max_abs_err"}
    ratios = {c["name"]: c["ratio"] for c in report["codecs"]}
    assert ratios["int8"] >= 3.9 and ratios["int4"] >= 7.5 and ratios["fp32"] == 1.0
    assert main(["--json", "--size-mib", "1", "--repeats", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["codecs"][0]["name"] == "fp32"
    assert main(["--size-mib", "1", "--repeats", "1"]) == 0
    assert "int8+zstd" in capsys.readouterr().out
