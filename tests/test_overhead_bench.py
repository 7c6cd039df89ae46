"""benchmarks/overhead.py by hand: the PSS of a deployment's processes, and its ratios."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.overhead import against_stock_flower, docker_memory_mb, pss_mb, repeat_spread


def _process(root: Path, pid: int, environ: bytes, pss_kb: int | None) -> None:
    folder = root / str(pid)
    folder.mkdir()
    (folder / "environ").write_bytes(environ)
    if pss_kb is not None:
        (folder / "smaps_rollup").write_text(
            f"00400000-7fff [rollup]\nRss:    {pss_kb * 2} kB\nPss:    {pss_kb} kB\n"
        )


def test_pss_sums_the_processes_that_name_the_deployment(tmp_path: Path) -> None:
    # Prepare: two processes of the deployment (1024 kB and 2048 kB of PSS), one of
    # another deployment, one of ours that exited before its smaps could be read
    ours = b"PATH=/bin\0FLWR_HOME=/work/run-7-work/flwr-home\0"
    _process(tmp_path, 11, ours, 1024)
    _process(tmp_path, 12, ours, 2048)
    _process(tmp_path, 13, b"FLWR_HOME=/work/run-8-work/flwr-home\0", 4096)
    _process(tmp_path, 14, ours, None)
    (tmp_path / "self").mkdir()  # not a pid folder

    # Execute / Assert: (1024 + 2048) kB = 3 MB
    assert pss_mb(b"/work/run-7-work", tmp_path) == 3.0
    assert pss_mb(b"/work/run-9-work", tmp_path) == 0.0


def test_docker_memory_sums_the_project_s_containers_by_hand() -> None:
    # Prepare: `docker stats --format '{{.Name}} {{.MemUsage}}'` lines; two of the
    # project (Compose v1 and v2 names), one of another project, one unreadable
    stats = (
        "tessera-overhead-42_clientapp-1_1 512MiB / 1GiB\n"
        "tessera-overhead-42-superlink-1 1.5GiB / 23.4GiB\n"
        "other_clientapp-1_1 100MiB / 1GiB\n"
        "tessera-overhead-42_run_1 --\n"
    )

    # Execute / Assert: 512 MiB + 1.5 GiB = 2048 MiB
    assert docker_memory_mb(stats, "tessera-overhead-42") == 2048.0
    assert docker_memory_mb("tessera-overhead-42_x_1 2048KiB / 1GiB", "tessera-overhead-42") == 2.0


def test_tessera_s_round_is_set_against_flower_s_on_flower_s_own_processes() -> None:
    # Prepare: both compose modes ran, only Tessera's deploy-process mode did
    results = {
        "compose": {"fedavg": {"round_seconds": 2.5}, "flwr-fedavg": {"round_seconds": 6.0}},
        "compose-flower": {
            "fedavg": {"round_seconds": 10.0},
            "flwr-fedavg": {"round_seconds": 20.0},
        },
        "deploy-process": {"fedavg": {"round_seconds": 2.0}, "flwr-fedavg": {"round_seconds": 6.0}},
    }

    # Execute
    ratios = against_stock_flower(results)

    # Assert: Tessera's fedavg on its processes against Flower's loop on Flower's
    assert ratios == {"compose-against-stock-flower": ("compose", "compose-flower", 2.5, 20.0)}


def test_the_repeat_spread_is_each_repeat_s_mean_after_round_one_by_hand() -> None:
    # Prepare: three repeats; round 1 (the handshake's) never counts
    def run(*overheads: float) -> list[dict[str, float]]:
        return [{"round": i + 1, "overhead_seconds": o} for i, o in enumerate(overheads)]

    records = [run(9.0, 1.0, 2.0), run(9.0, 3.0, 3.0), run(9.0, 1.0, 1.0)]

    # Execute
    spread = repeat_spread(records)

    # Assert: the repeats' means are 1.5, 3.0 and 1.0 s
    assert spread["per_repeat"] == [1.5, 3.0, 1.0]
    assert (spread["median"], spread["min"], spread["max"]) == (1.5, 1.0, 3.0)
    with pytest.raises(ValueError, match="--rounds 2"):
        repeat_spread([run(9.0)])
