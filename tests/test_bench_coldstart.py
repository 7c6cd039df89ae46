"""``benchmarks/coldstart.py``: medians, ratios, the table, and one real fresh process.

No timing is asserted (the machines are noisy); the targets are the benchmark's to
print. What is asserted is behaviour: a fresh ClientApp process imports none of the
heavy modules the benchmark watches.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("coldstart")


def test_medians_and_ratios_to_the_bare_process_by_hand(bench: ModuleType) -> None:
    # Prepare: three bare and three clientapp processes
    samples = [
        bench.Sample("bare", 2.0, 1.5, 700.0, ()),
        bench.Sample("bare", 4.0, 3.0, 720.0, ()),
        bench.Sample("bare", 3.0, 2.0, 710.0, ()),
        bench.Sample("clientapp", 3.3, 2.5, 781.0, ()),
        bench.Sample("clientapp", 9.0, 8.0, 800.0, ("matplotlib",)),
        bench.Sample("clientapp", 3.6, 2.6, 790.0, ()),
    ]

    # Execute
    table = bench.summarise(samples)

    # Assert: medians 3.0 s / 710 MB and 3.6 s / 790 MB
    assert table["bare"]["wall_s"] == 3.0 and table["bare"]["peak_rss_mb"] == 710.0
    assert table["clientapp"]["time_ratio"] == pytest.approx(3.6 / 3.0)
    assert table["clientapp"]["rss_ratio"] == pytest.approx(790.0 / 710.0)
    assert table["clientapp"]["heavy"] == ["matplotlib"]
    assert "clientapp+strategies" not in table
    assert "| clientapp | 3 | 3.60 (3.30-9.00) | 790 | 1.20x | 1.11x | matplotlib |" in (
        bench.markdown(table)
    )


@pytest.mark.slow
def test_a_fresh_clientapp_process_imports_nothing_heavy(bench: ModuleType, tmp_path: Path) -> None:
    # Execute: one bare and one ClientApp process, spawned as the benchmark does
    bench.main(["--repeats", "1", "--cases", "bare,clientapp", "--out", str(tmp_path)])

    # Assert: both measured and written; the ClientApp loaded none of HEAVY
    report = json.loads((tmp_path / "coldstart.json").read_text())
    assert {s["case"] for s in report["samples"]} == {"bare", "clientapp"}
    assert all(s["peak_rss_mb"] > 50 for s in report["samples"])
    assert report["table"]["clientapp"]["heavy"] == []
    assert (tmp_path / "table.md").read_text().count("\n") == 4
