"""benchmarks/cuda.py's pure parts: the round summary by hand, the table, the refusal."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.cuda import main, summarise_run, table


def _round(n: int, train: list[float], **extra: Any) -> dict[str, Any]:
    clients = [
        {"arch": f"m{i}", "profile": "probed", "train_seconds": t} for i, t in enumerate(train)
    ]
    return {
        "round": n,
        "round_seconds": 10.0 * n,
        "slowest_train_seconds": max(train),
        "clients": clients,
        **extra,
    }


def test_the_summary_leaves_round_1_out_and_prefers_the_ensemble_accuracy() -> None:
    # Prepare: round 1 (start-up) is slow; rounds 2 and 3 train 1+3 and 2+2+5 seconds
    rows = [
        _round(1, [9.0], global_accuracy=0.1),
        _round(2, [1.0, 3.0], global_accuracy=0.5),
        _round(3, [2.0, 2.0, 5.0], global_accuracy=0.7, ensemble_accuracy=0.8),
    ]

    # Execute
    s = summarise_run(rows)

    # Assert: node means 2.0 and 3.0 -> 2.5; slowest 3 and 5 -> 4; rounds 20, 30 -> 25
    assert s["train_seconds"] == pytest.approx(2.5)
    assert s["slowest_train_seconds"] == pytest.approx(4.0)
    assert s["round_seconds"] == pytest.approx(25.0)
    assert s["archs"] == ["m0", "m1", "m2"] and s["profiles"] == ["probed"]
    assert s["accuracy"] == 0.8 and s["rounds"] == 3
    # one round only: that round is the figure
    assert summarise_run(rows[:1])["train_seconds"] == pytest.approx(9.0)


def test_the_summary_refuses_a_run_without_rounds_or_replies() -> None:
    with pytest.raises(ValueError, match="ran no round"):
        summarise_run([])
    with pytest.raises(ValueError, match="round 2 has no node that replied"):
        summarise_run([_round(1, [1.0]), {**_round(2, [1.0]), "clients": []}])


def test_the_table_names_each_probe_run_and_the_ratio() -> None:
    profile = {"accelerator": "cuda", "accelerator-name": "GPU X", "train-macs-per-second": 4e12}
    cpu = {"accelerator": "cpu", "accelerator-name": "", "train-macs-per-second": 5e11}
    run = summarise_run([_round(1, [1.0]), _round(2, [0.5])]) | {
        "device": "cuda",
        "wall_seconds": 9,
    }
    result = {
        "probe": {
            "gpu": {"profile": profile, "choices": {"cnn": {"arch": "cnn-5"}}},
            "cpu": {"profile": cpu, "choices": {"cnn": {"arch": "cnn-3"}}},
        },
        "runs": {"fedavg-gpu": run},
        "cpu_over_gpu_train": 16.3,
        "predict": {
            "cuda": {"seconds": 1.0, "accuracy": 0.9},
            "cpu": {"seconds": 2.0, "accuracy": 0.9},
            "labels_differ": 0,
            "samples": 360,
            "recorded": 0.9,
        },
    }

    text = table(result)

    assert "| gpu visible | cuda | GPU X | 4e+12 | default | cnn: cnn-5 |" in text
    assert "| cpu visible | cpu | - | 5e+11 | default | cnn: cnn-3 |" in text
    assert "| fedavg-gpu | cuda | m0 | 0.500 |" in text
    assert "16.30x" in text and "labels that differ: 0 of 360" in text


def test_the_benchmark_refuses_a_machine_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert main(["--out", "/nonexistent"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err
