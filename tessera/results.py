"""Results of a run, written as the run goes: config, per-round metrics, summary, plots.

Layout of ``<output-dir>/<run-name>/``:

- ``config.json``: the resolved run config, the nodes' device profiles and
  architectures, written after the handshake (rewritten when nodes join).
- ``metrics.jsonl``: one JSON object per round, appended and flushed to disk at the
  end of every round, so a crash loses at most the round in flight.
- ``checkpoint.npz``: the server's state after the last checkpointed round
  (:mod:`tessera.checkpoint`), from which run-config ``resume=<folder>`` continues;
  on resume, once the checkpoint is accepted, ``metrics.jsonl`` is cut back to its
  round (rounds after it are run again) and appended to, so every round appears
  exactly once; a refused checkpoint leaves the folder as it was.
- ``summary.json``: final figures, written at the end.
- ``accuracy.png``, ``bytes.png``, ``label_distribution.png``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.checkpoint import CheckpointError, StateTree, load_state, refusal, save_state
from tessera.config import MAX_ROUNDS
from tessera.state_checks import StateFileError, get_int

CHECKPOINT = "checkpoint.npz"


def _json_default(value: Any) -> Any:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"cannot serialise {type(value).__name__} to JSON")


def _clean(value: Any) -> Any:
    """Replace NaN/inf by None so the files are strict JSON (numpy values included)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """Serialise to strict JSON (NaN becomes null)."""
    return json.dumps(_clean(value), default=_json_default, sort_keys=False)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _records_up_to(path: Path, last: int) -> list[dict[str, Any]]:
    """Return the round records of ``metrics.jsonl`` at ``path`` up to round ``last``.

    A line that is not JSON was cut by a crash: it and the lines after it are
    dropped (those rounds run again). A complete line must be a round record.

    Raises
    ------
    CheckpointError
        If the file is not UTF-8 text or a complete line is not an object whose
        ``round`` is an integer >= 0; the message names the file, the line and the
        fix.
    """
    kept: list[dict[str, Any]] = []
    if not path.exists():
        return kept
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(
            f"{path} is not UTF-8 text ({err}); the file is damaged or edited: restore it "
            "from a copy, or start afresh without run-config 'resume'"
        ) from err
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break  # a line cut by the crash: it and anything after are redone
        try:
            if not isinstance(record, dict):
                raise StateFileError(
                    "", f"holds a JSON {type(record).__name__}, not a round record (an object)"
                )
            if get_int(record, "round", default=0) <= last:
                kept.append(record)
        except StateFileError as err:
            raise CheckpointError(
                f"{path} line {number}: {err}; the file is damaged or edited: restore it "
                "from a copy, or start afresh without run-config 'resume'"
            ) from err
    return kept


class ResultsWriter:
    """Writes one run's results folder.

    Parameters
    ----------
    directory : Path
        ``<output-dir>/<run-name>``; created if missing. A folder that already
        holds a non-empty ``metrics.jsonl`` raises, so that runs never mix (use
        :meth:`resume` to continue one).
    create : bool, optional
        Whether to create the folder now; ``False`` leaves it to :meth:`create`,
        called once the run is accepted (the ServerApp's build), so a refused run
        leaves no empty folder behind.
    """

    def __init__(self, directory: Path, *, create: bool = True, _resuming: bool = False) -> None:
        self.directory = directory.resolve()
        metrics = self.directory / "metrics.jsonl"
        if not _resuming and metrics.exists() and metrics.stat().st_size > 0:
            raise FileExistsError(
                f"results folder {self.directory} already holds a run; choose another "
                "run-config 'run-name', remove the folder, or continue it with "
                f"run-config resume='{self.directory}'"
            )
        if create:
            self.create()
        self.metrics_path = metrics
        self.checkpoint_path = self.directory / CHECKPOINT
        self.rounds: list[dict[str, Any]] = []

    def create(self) -> None:
        """Create the results folder (once the run is accepted, with ``create=False``)."""
        self.directory.mkdir(parents=True, exist_ok=True)

    @classmethod
    def reopen(cls, directory: Path) -> tuple[ResultsWriter, StateTree]:
        """Read a run's folder to continue it from its checkpoint; rewrite nothing yet.

        The writer's ``rounds`` hold the records of ``metrics.jsonl`` up to the
        checkpoint's round; once the checkpoint is accepted (the scheme's
        ``load_state_dict``), :meth:`cut_metrics` drops the later ones from the file.

        Returns
        -------
        tuple[ResultsWriter, StateTree]
            The writer and the checkpoint.

        Raises
        ------
        CheckpointError
            If the folder has no readable checkpoint, its ``round`` is not an
            integer from 0 to :data:`~tessera.config.MAX_ROUNDS`, or a complete
            line of ``metrics.jsonl`` is not a round record (an object whose
            ``round`` is an integer >= 0); the message names the file, the field
            and the fix.
        """
        folder = Path(directory).expanduser().resolve()
        if not (folder / CHECKPOINT).is_file():
            raise CheckpointError(
                f"run-config 'resume' is '{directory}', which holds no {CHECKPOINT}; name "
                "the results folder of a run that wrote checkpoints (checkpoint-every >= 1)"
            )
        state = load_state(folder / CHECKPOINT)
        try:
            last = get_int(state, "round", default=0)
            if last > MAX_ROUNDS:
                raise StateFileError(
                    "round", f"is {last}; expected at most {MAX_ROUNDS}, the most rounds a run has"
                )
        except StateFileError as err:
            raise refusal(state, err) from err
        writer = cls(folder, create=False, _resuming=True)
        writer.rounds = _records_up_to(writer.metrics_path, last)
        return writer, state

    def cut_metrics(self) -> None:
        """Rewrite ``metrics.jsonl`` with :attr:`rounds` only (atomically).

        On resume, once the checkpoint is accepted: the rounds after it, written
        before the crash, are dropped (they run again).
        """
        _write_atomic(self.metrics_path, "".join(dumps(r) + "\n" for r in self.rounds))

    @classmethod
    def resume(cls, directory: Path) -> tuple[ResultsWriter, StateTree]:
        """Reopen a run's folder and cut ``metrics.jsonl`` back to its checkpoint.

        :meth:`reopen`, then :meth:`cut_metrics`: ``metrics.jsonl`` keeps the rounds
        up to the checkpoint's (later ones, written after the last checkpoint, are
        dropped: they will run again). Only for a checkpoint already accepted: a
        caller that still checks it (the ServerApp's build) calls :meth:`reopen`,
        checks, then :meth:`cut_metrics`.

        Returns
        -------
        tuple[ResultsWriter, StateTree]
            The writer (its ``rounds`` hold the kept records) and the checkpoint.

        Raises
        ------
        CheckpointError
            As :meth:`reopen`. Nothing is rewritten then.
        """
        writer, state = cls.reopen(directory)
        writer.cut_metrics()
        return writer, state

    def write_checkpoint(self, state: Mapping[str, Any]) -> int:
        """Write the server's state to ``checkpoint.npz`` atomically; return its size."""
        return save_state(self.checkpoint_path, state)

    def write_config(self, config: Mapping[str, Any]) -> None:
        """Write ``config.json`` (atomically)."""
        _write_atomic(
            self.directory / "config.json",
            json.dumps(_clean(dict(config)), default=_json_default, indent=2),
        )

    def append_round(self, record: Mapping[str, Any]) -> None:
        """Append one round to ``metrics.jsonl`` and flush it to disk."""
        self.rounds.append(dict(record))
        with self.metrics_path.open("a", encoding="utf-8") as fh:
            fh.write(dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        """Write ``summary.json`` (atomically)."""
        _write_atomic(
            self.directory / "summary.json",
            json.dumps(_clean(dict(summary)), default=_json_default, indent=2),
        )

    def plot_rounds(self) -> list[Path]:
        """Plot accuracy and bytes per round from the rounds written so far."""
        return plot_rounds(self.rounds, self.directory)


def plot_rounds(rounds: Sequence[Mapping[str, Any]], directory: Path) -> list[Path]:
    """Write ``accuracy.png`` and ``bytes.png`` for a list of round records.

    Parameters
    ----------
    rounds : Sequence[Mapping[str, Any]]
        Records as written to ``metrics.jsonl``.
    directory : Path
        Where the PNGs go.

    Returns
    -------
    list[Path]
        The files written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not rounds:
        return []
    xs = [r["round"] for r in rounds]
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    mean = np.array([_nan(r.get("personal_accuracy_mean")) for r in rounds])
    std = np.array([_nan(r.get("personal_accuracy_std")) for r in rounds])
    ax.plot(xs, mean, marker="o", label="personalised (mean over clients)")
    ax.fill_between(xs, np.clip(mean - std, 0, 1), np.clip(mean + std, 0, 1), alpha=0.2)
    glob = [_nan(r.get("global_accuracy")) for r in rounds]
    if not all(math.isnan(g) for g in glob):
        ax.plot(xs, glob, marker="s", label="global model(s) on the server test set")
    archs = sorted({c["arch"] for r in rounds for c in r.get("clients", [])})
    for arch in archs:
        per = []
        for r in rounds:
            accs = [
                c["test_accuracy"]
                for c in r.get("clients", [])
                if c["arch"] == arch and c.get("test_accuracy") is not None
            ]
            per.append(float(np.mean(accs)) if accs else math.nan)
        ax.plot(xs, per, linestyle="--", alpha=0.7, label=f"clients on {arch}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Accuracy per round")
    fig.tight_layout()
    path = directory / "accuracy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    up = [r.get("bytes_up_total", 0) / 1e6 for r in rounds]
    down = [r.get("bytes_down_total", 0) / 1e6 for r in rounds]
    width = 0.4
    ax.bar([x - width / 2 for x in xs], up, width=width, label="upload (clients to server)")
    ax.bar([x + width / 2 for x in xs], down, width=width, label="download (server to clients)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("MB per round (all clients)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title("Bytes per round")
    fig.tight_layout()
    path = directory / "bytes.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def _nan(value: Any) -> float:
    return math.nan if value is None else float(value)


def format_round_row(record: Mapping[str, Any], num_rounds: int) -> str:
    """Format one line of the per-round results table printed to the terminal."""
    glob = record.get("global_accuracy")
    glob_s = (
        "-" if glob is None or (isinstance(glob, float) and math.isnan(glob)) else f"{glob:.3f}"
    )
    mean = record.get("personal_accuracy_mean")
    std = record.get("personal_accuracy_std") or 0.0
    pers = "-" if mean is None or math.isnan(mean) else f"{mean:.3f}±{std:.3f}"
    cells = [
        f"{record['round']}/{num_rounds}".rjust(7),
        f"{record['num_ok']}/{record['num_sent']}".rjust(7),
        str(record["num_rejected"]).rjust(3),
        str(record["num_failed"]).rjust(4),
        pers.rjust(14),
        glob_s.rjust(6),
        f"{record['bytes_up_total'] / 1e6:.3f}".rjust(8),
        f"{record['bytes_down_total'] / 1e6:.3f}".rjust(8),
        f"{record['round_seconds']:.2f}".rjust(7),
    ]
    row = "| " + " | ".join(cells) + " |"
    if record.get("skipped"):
        row += f" skipped: {record.get('skip_reason')}"
    return row


TABLE_HEADER = (
    "|   round | ok/sent | rej | fail | pers. acc ±std | global |    up MB |  down MB | seconds |"
)
