"""The comparison's results folder: one CSV, Markdown tables and plots.

Input is the list of finished cells (``cells.jsonl``): a ``scheme`` cell holds the
protocol fields of one run (:func:`tessera.compare.metrics.run_fields`), a
``centralised`` cell the ceiling's accuracies per architecture
(:func:`tessera.compare.ceiling.train_centralised`) for one partitioning and seed.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tessera.compare.metrics import (
    CEILING,
    FLOOR,
    Spread,
    beats_floor,
    ceiling_for,
    is_floor,
    mean_curve,
    run_learning_rate,
    spread,
)

CSV_FIELDS = (
    "scheme",
    "partitioning",
    "seed",
    "rounds",
    "personal",
    "personal_clients_std",
    "global",
    "ensemble",
    "slices",
    "ceiling_personal",
    "ceiling_global",
    "floor",
    "beats_floor",
    "plateau_personal",
    "plateau_global",
    "bytes_up",
    "bytes_down",
    "bytes",
    "archs",
    "rejected",
    "failed",
    "seconds",
)


def flat_rows(
    cells: Sequence[Mapping[str, Any]],
    floors: Mapping[str, str] | None = None,
    rates: Mapping[tuple[str, str], Mapping[str, float]] | None = None,
) -> list[dict[str, Any]]:
    """One row per (scheme, partitioning, seed), the ceiling rows included.

    A scheme's ``ceiling_*`` is the centralised accuracy of its own architectures
    (:func:`~tessera.compare.metrics.ceiling_for`); ``beats_floor`` compares its
    personalised accuracy with its floor (``floors[scheme]``, default ``local``: a
    family floor such as ``local:fedfa`` trains the scheme's own architectures
    alone) of the same partitioning and seed. The ``centralised`` row is the
    ceiling of ``local``'s architectures (the fleet's own choice, as ``local``
    trains it). ``rates``: per (scheme, partitioning label), the rate each
    architecture's ceiling was tuned to on the validation seed
    (:func:`~tessera.compare.metrics.ceiling_rates`), for schemes whose learning
    rate is tuned; the others take their run's rate.
    """
    floors = floors or {}
    rates = rates or {}
    central = {
        (c["partitioning"], c["seed"]): c["centralised"] for c in cells if c["kind"] == CEILING
    }
    floor = {
        (c["partitioning"], c["seed"], c["scheme"]): c["fields"]
        for c in cells
        if c["kind"] == "scheme" and is_floor(c["scheme"])
    }
    rows: list[dict[str, Any]] = []
    for c in cells:
        where = (c["partitioning"], c["seed"])
        if c["kind"] == CEILING:
            base = floor.get((*where, FLOOR))
            if base is None:
                continue
            personal, glob = ceiling_for(base["client_archs"], base["archs"], c["centralised"])
            rows.append(
                {
                    "scheme": CEILING,
                    "partitioning": c["partitioning"],
                    "seed": c["seed"],
                    "rounds": base["rounds"],
                    "personal": personal,
                    "global": glob,
                    "ceiling_personal": personal,
                    "ceiling_global": glob,
                    "floor": FLOOR,
                    "beats_floor": None if personal is None else personal > base["personal"],
                    "bytes_up": 0.0,
                    "bytes_down": 0.0,
                    "bytes": 0.0,
                    "archs": base["archs"],
                    "slices": {},
                    "seconds": c["seconds"],
                    "personal_curve": [],
                    "global_curve": [],
                    "personal_by_arch": {},
                }
            )
            continue
        f = c["fields"]
        ceiling_personal, ceiling_global = (
            ceiling_for(
                f["client_archs"],
                f["global_by_arch"],
                central[where],
                run_learning_rate(c.get("run_config", {})),
                rates.get((c["scheme"], c["partitioning"])),
            )
            if where in central
            else (None, None)
        )
        own_floor = floors.get(c["scheme"], FLOOR)
        base = floor.get((*where, own_floor))
        rows.append(
            {
                "scheme": c["scheme"],
                "partitioning": c["partitioning"],
                "seed": c["seed"],
                **{k: f[k] for k in _FIELD_KEYS},
                "ceiling_personal": ceiling_personal,
                "ceiling_global": ceiling_global,
                "floor": None if is_floor(c["scheme"]) else own_floor,
                "beats_floor": (
                    None
                    if base is None or is_floor(c["scheme"]) or f["personal"] is None
                    else f["personal"] > base["personal"]
                ),
                "seconds": c["seconds"],
            }
        )
    return rows


_FIELD_KEYS = (
    "rounds",
    "personal",
    "personal_clients_std",
    "global",
    "ensemble",
    "slices",
    "plateau_personal",
    "plateau_global",
    "bytes_up",
    "bytes_down",
    "bytes",
    "archs",
    "rejected",
    "failed",
    "personal_curve",
    "global_curve",
    "personal_by_arch",
)


def write_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Write :data:`CSV_FIELDS` of each row (dicts as JSON, lists joined by ``;``)."""
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            out: dict[str, Any] = {}
            for key in CSV_FIELDS:
                value = row.get(key)
                if isinstance(value, dict):
                    value = json.dumps(value, sort_keys=True)
                elif isinstance(value, list):
                    value = ";".join(str(v) for v in value)
                elif isinstance(value, float) and math.isnan(value):
                    value = None
                out[key] = value
            writer.writerow(out)


def _order(schemes: Sequence[str]) -> list[str]:
    """Return the schemes in the given order, then the floors and the ceiling."""
    body = [s for s in schemes if not is_floor(s) and s != CEILING]
    family = [s for s in schemes if is_floor(s) and s != FLOOR]
    return [*body, FLOOR, *family, CEILING]


def _group(
    rows: Sequence[Mapping[str, Any]],
) -> dict[str, dict[str, list[Mapping[str, Any]]]]:
    groups: dict[str, dict[str, list[Mapping[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        groups[str(row["partitioning"])][str(row["scheme"])].append(row)
    return groups


def _bytes_text(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1e6:
        return f"{value / 1e6:.2f} MB"
    return f"{value / 1e3:.1f} kB"


def _floor_text(rows: Sequence[Mapping[str, Any]], floor: Sequence[Mapping[str, Any]]) -> str:
    """Return the verdict against the floor, paired by seed (seeds without both left out)."""
    by_seed = {f["seed"]: f["personal"] for f in floor if f.get("personal") is not None}
    pairs = [
        (r["personal"], by_seed[r["seed"]])
        for r in rows
        if r.get("personal") is not None and r["seed"] in by_seed
    ]
    if not pairs:
        return "-"
    diff = sum(p - f for p, f in pairs) / len(pairs)
    wins = sum(1 for p, f in pairs if p > f)
    verdict = "above floor" if diff > 0 else "**not above floor**"
    return f"{verdict} ({100 * diff:+.1f}; {wins}/{len(pairs)} seeds)"


def _over(value: Spread, seeds: int) -> str:
    """``mean ± std``, naming how many of the table's seeds it covers when not all.

    A cell still missing for some seed (a ceiling not trained yet, a run that
    failed) would otherwise pass for the mean over every seed.

    Examples
    --------
    >>> _over(Spread(0.5, 0.0, 1), 3)
    '50.0 ± 0.0 (1 of 3 seeds)'
    """
    text = value.text()
    if value.mean is None or value.n >= seeds:
        return text
    return f"{text} ({value.n} of {seeds} seeds)"


def _column(rows: Sequence[Mapping[str, Any]], name: str, seeds: int) -> str:
    """One table cell: a field's spread over the rows' seeds (see :func:`_over`)."""
    return _over(spread(r.get(name) for r in rows), seeds)


def markdown_tables(rows: Sequence[Mapping[str, Any]], schemes: Sequence[str]) -> str:
    """One leaderboard table per partitioning (mean ± std over seeds, in percent).

    Columns: personalised accuracy (every scheme), global model(s) on the server
    test set, the tuned ensemble, the ceiling of the scheme's own architectures,
    the verdict against the floor, bytes per client and round, the plateau round
    and the architectures the fleet trained. A second table lists each sub-model
    slice's accuracy on the server test set.
    """
    out: list[str] = []
    for partitioning, by_scheme in _group(rows).items():
        seeds = sorted({r["seed"] for rs in by_scheme.values() for r in rs})
        out.append(f"### {partitioning} ({len(seeds)} seeds: {', '.join(map(str, seeds))})\n")
        out.append(
            "| scheme | personalised % | global % | ensemble % | ceiling (own archs) % "
            "| vs own floor | bytes / client-round | plateau round (95 %) | archs |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|")
        for scheme in _order(schemes):
            rs = by_scheme.get(scheme)
            if not rs:
                continue
            personal = _column(rs, "personal", len(seeds))
            ceiling = _column(rs, "ceiling_personal", len(seeds))
            own_floor = str(rs[0].get("floor") or FLOOR)
            vs_floor = (
                "floor"
                if is_floor(scheme)
                else "-"
                if scheme == CEILING
                else _floor_text(rs, by_scheme.get(own_floor, []))
                + ("" if own_floor == FLOOR else f" vs {own_floor}")
            )
            plateau = spread(r.get("plateau_personal") for r in rs)
            archs = sorted({a for r in rs for a in r.get("archs") or []})
            label = (
                f"{scheme} (floor)"
                if is_floor(scheme)
                else "centralised (ceiling)"
                if scheme == CEILING
                else scheme
            )
            out.append(
                f"| {label} | {personal} | {_column(rs, 'global', len(seeds))} "
                f"| {_column(rs, 'ensemble', len(seeds))} "
                f"| {'-' if scheme == CEILING else ceiling} | {vs_floor} "
                f"| {_bytes_text(spread(r.get('bytes') for r in rs).mean)} "
                f"| {'-' if plateau.mean is None else f'{plateau.mean:.1f}'} "
                f"| {', '.join(archs) if len(archs) <= 4 else f'{len(archs)} archs'} |"
            )
        slices = _slice_lines(by_scheme, schemes)
        if slices:
            out.append("\nSub-model slices on the server test set (%):\n")
            out.extend(slices)
        out.append("")
    return "\n".join(out)


def _slice_lines(
    by_scheme: Mapping[str, Sequence[Mapping[str, Any]]], schemes: Sequence[str]
) -> list[str]:
    lines = []
    for scheme in schemes:
        rs = by_scheme.get(scheme, [])
        names = sorted({n for r in rs for n in (r.get("slices") or {})})
        if not names:
            continue
        parts = [f"{n}: {spread(r['slices'].get(n) for r in rs).text()}" for n in names]
        lines.append(f"- {scheme}: " + "; ".join(parts))
    return lines


def beats_floor_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, bool | None]]:
    """Per partitioning, per scheme: whether its mean personalised accuracy beats its floor."""
    out: dict[str, dict[str, bool | None]] = {}
    for partitioning, by_scheme in _group(rows).items():
        out[partitioning] = {
            s: beats_floor(
                [r["personal"] for r in rs],
                [r["personal"] for r in by_scheme.get(str(rs[0].get("floor") or FLOOR), [])],
            )
            for s, rs in by_scheme.items()
            if not is_floor(s) and s != CEILING
        }
    return out


def plot_all(rows: Sequence[Mapping[str, Any]], schemes: Sequence[str], folder: Path) -> list[Path]:
    """Write the plots: accuracy by round, against bytes, by architecture, and margins.

    ``accuracy_rounds.png``, ``accuracy_vs_bytes.png``, ``accuracy_by_arch.png`` and
    ``margin_over_floor.png`` (:func:`plot_margins`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _group(rows)
    parts = list(groups)
    order = _order(schemes)
    colours = {s: plt.get_cmap("tab20")(i % 20) for i, s in enumerate(order)}
    paths = []

    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts, strict=True):
        for scheme in order:
            rs = groups[part].get(scheme)
            if not rs:
                continue
            if scheme == CEILING:
                level = spread(r["personal"] for r in rs).mean
                if level is not None:
                    ax.axhline(level, color="k", ls="--", lw=1, label="centralised (ceiling)")
                continue
            mean, std = mean_curve([r["personal_curve"] for r in rs])
            xs = list(range(1, len(mean) + 1))
            colour: Any = "k" if scheme == FLOOR else colours[scheme]
            ax.plot(
                xs,
                mean,
                ls=":" if is_floor(scheme) else "-",
                color=colour,
                label=f"{scheme} (floor)" if is_floor(scheme) else scheme,
            )
            lo = [m - s for m, s in zip(mean, std, strict=True)]
            hi = [m + s for m, s in zip(mean, std, strict=True)]
            ax.fill_between(xs, lo, hi, alpha=0.15, color=colour)
        ax.set_title(f"{part}: personalised accuracy (mean ± std over seeds)")
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    paths.append(folder / "accuracy_rounds.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts, strict=True):
        for scheme in order:
            rs = groups[part].get(scheme)
            if not rs or scheme == CEILING or is_floor(scheme):
                continue
            acc = spread(r["personal"] for r in rs)
            size = spread(r["bytes"] for r in rs)
            if acc.mean is None or not size.mean:
                continue
            ax.errorbar(
                size.mean / 1e3,
                acc.mean,
                yerr=acc.std,
                fmt="o",
                color=colours[scheme],
                label=scheme,
            )
            ax.annotate(
                scheme,
                (size.mean / 1e3, acc.mean),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        floor = spread(r["personal"] for r in groups[part].get(FLOOR, [])).mean
        if floor is not None:
            ax.axhline(floor, color="k", ls=":", lw=1, label="local (floor)")
        ax.set_xscale("log")
        ax.set_title(f"{part}: final accuracy against bytes per client-round")
        ax.set_xlabel("kB exchanged per client and round (up + down)")
        ax.set_ylabel("personalised accuracy")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(folder / "accuracy_vs_bytes.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    paths.append(folder / "accuracy_by_arch.png")
    _plot_archs(groups, parts, order, paths[-1])
    margins = plot_margins(rows, schemes, folder / "margin_over_floor.png")
    if margins is not None:
        paths.append(margins)
    return paths


def _plot_archs(
    groups: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
    parts: Sequence[str],
    order: Sequence[str],
    path: Path,
) -> None:
    """Heat map per partitioning: scheme (and sub-model slices) x architecture."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(parts), figsize=(7 * len(parts), 6), squeeze=False)
    for ax, part in zip(axes[0], parts, strict=True):
        labels: list[str] = []
        cells: list[dict[str, float]] = []
        for scheme in order:
            rs = groups[part].get(scheme)
            if not rs or scheme == CEILING:
                continue
            archs = sorted({a for r in rs for a in r.get("personal_by_arch") or {}})
            labels.append(f"{scheme} (clients)")
            cells.append(
                {
                    a: spread((r.get("personal_by_arch") or {}).get(a) for r in rs).mean or math.nan
                    for a in archs
                }
            )
            names = sorted({n for r in rs for n in r.get("slices") or {}})
            if names:
                labels.append(f"{scheme} (server, slices)")
                cells.append(
                    {
                        n: spread((r.get("slices") or {}).get(n) for r in rs).mean or math.nan
                        for n in names
                    }
                )
        columns = sorted({a for c in cells for a in c})
        grid = np.array([[c.get(a, math.nan) for a in columns] for c in cells], dtype=float)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(columns)), columns, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                if not math.isnan(grid[i, j]):
                    ax.text(
                        j,
                        i,
                        f"{100 * grid[i, j]:.0f}",
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="w" if grid[i, j] < 0.6 else "k",
                    )
        ax.set_title(f"{part}: accuracy by architecture / slice")
        fig.colorbar(image, ax=ax, fraction=0.03)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------ against the floor
def _own_floor(
    by_scheme: Mapping[str, Sequence[Mapping[str, Any]]], rows: Sequence[Mapping[str, Any]]
) -> dict[int, Any]:
    """Return the personalised accuracy of ``rows``' own floor, by seed."""
    floor = str(rows[0].get("floor") or FLOOR)
    return {int(r["seed"]): r["personal"] for r in by_scheme.get(floor, [])}


def floor_margins(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[int, float]]]:
    """Per partitioning, per scheme: its personalised accuracy minus its own floor's, per seed.

    Paired by seed (the same split and fleet); a seed where either value is missing is
    left out. Floors and the ceiling have no margin.

    Examples
    --------
    >>> rows = [
    ...     {"scheme": "local", "partitioning": "iid", "seed": 0, "personal": 0.8, "floor": None},
    ...     {"scheme": "felo", "partitioning": "iid", "seed": 0, "personal": 0.85,
    ...      "floor": "local"},
    ... ]
    >>> {p: {s: {k: round(v, 2) for k, v in m.items()} for s, m in d.items()}
    ...  for p, d in floor_margins(rows).items()}
    {'iid': {'felo': {0: 0.05}}}
    """
    out: dict[str, dict[str, dict[int, float]]] = {}
    for part, by_scheme in _group(rows).items():
        margins: dict[str, dict[int, float]] = {}
        for scheme, rs in by_scheme.items():
            if is_floor(scheme) or scheme == CEILING:
                continue
            own = _own_floor(by_scheme, rs)
            paired = {
                int(r["seed"]): float(r["personal"]) - float(own[int(r["seed"])])
                for r in rs
                if r["personal"] is not None and own.get(int(r["seed"])) is not None
            }
            if paired:
                margins[scheme] = paired
        out[part] = margins
    return out


def floor_gaps(rows: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Per partitioning: the ceiling's mean personalised accuracy minus ``local``'s.

    Both are of ``local``'s architectures (the fleet's own choice), averaged over the
    seeds both have; ``None`` without them. Negative where the floor is above the
    ceiling (pathological label skew: each client's few classes are easier alone).
    """
    out: dict[str, float | None] = {}
    for part, by_scheme in _group(rows).items():
        floor = {int(r["seed"]): r["personal"] for r in by_scheme.get(FLOOR, [])}
        pairs = [
            float(r["personal"]) - float(floor[int(r["seed"])])
            for r in by_scheme.get(CEILING, [])
            if r["personal"] is not None and floor.get(int(r["seed"])) is not None
        ]
        out[part] = sum(pairs) / len(pairs) if pairs else None
    return out


def own_gaps(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per partitioning, per scheme: its own ceiling minus its own floor, mean over seeds.

    The ceiling is the scheme's own architectures trained centrally
    (``ceiling_personal``), the floor the same architectures trained alone
    (``local`` or ``local:<scheme>``), paired by seed. Negative where the floor is
    above the ceiling.
    """
    out: dict[str, dict[str, float]] = {}
    for part, by_scheme in _group(rows).items():
        gaps: dict[str, float] = {}
        for scheme, rs in by_scheme.items():
            if is_floor(scheme) or scheme == CEILING:
                continue
            own = _own_floor(by_scheme, rs)
            pairs = [
                float(r["ceiling_personal"]) - float(own[int(r["seed"])])
                for r in rs
                if r.get("ceiling_personal") is not None and own.get(int(r["seed"])) is not None
            ]
            if pairs:
                gaps[scheme] = sum(pairs) / len(pairs)
        out[part] = gaps
    return out


def goal_section(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: per partitioning, the best scheme's margin over its floor against its gap.

    The best scheme is the one with the largest mean paired margin among those with
    the most seeds; the section says in how many seeds it is above its floor and
    whether its mean margin reaches a third of its own floor-to-ceiling gap
    (:func:`own_gaps`; the goal of a federation that pays on skewed data).
    """
    gaps = own_gaps(rows)
    lines = [
        "",
        "### Against the floor",
        "",
        "| partitioning | best scheme | its margin over its floor (points, mean; per seed) "
        "| seeds above its floor | its floor-to-ceiling gap (points) "
        "| a third of the gap reached |",
        "|---|---|---|---|---|---|",
    ]
    for part, margins in floor_margins(rows).items():
        if not margins:
            continue
        # the most seeds first (a partial scheme is not the best on one lucky seed)
        best = max(
            margins, key=lambda s: (len(margins[s]), sum(margins[s].values()) / len(margins[s]))
        )
        seeds = margins[best]
        mean = sum(seeds.values()) / len(seeds)
        per_seed = ", ".join(f"{100 * seeds[k]:+.1f}" for k in sorted(seeds))
        above = sum(v > 0 for v in seeds.values())
        gap = gaps.get(part, {}).get(best)
        if gap is None:
            gap_text, reached = "-", "-"
        elif gap <= 0:
            gap_text, reached = f"{100 * gap:+.1f}", "impossible: the floor is above the ceiling"
        else:
            gap_text = f"{100 * gap:+.1f}"
            reached = "yes" if mean >= gap / 3 else f"no (needs {100 * gap / 3:+.1f})"
        lines.append(
            f"| {part} | {best} | {100 * mean:+.1f} ({per_seed}) | {above}/{len(seeds)} | "
            f"{gap_text} | {reached} |"
        )
    return "\n".join(lines) + "\n"


def plot_margins(
    rows: Sequence[Mapping[str, Any]], schemes: Sequence[str], path: Path
) -> Path | None:
    """Write ``margin_over_floor.png``: each scheme's paired margin over its floor per seed.

    One panel per partitioning, one row per scheme, a dot per seed and a bar at the
    mean, with lines at 0 (the floor) and at a third of the floor-to-ceiling gap.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    margins = floor_margins(rows)
    gaps = floor_gaps(rows)
    parts = [p for p in margins if margins[p]]
    if not parts:
        return None
    order = [s for s in _order(schemes) if any(s in margins[p] for p in parts)]
    fig, axes = plt.subplots(
        1, len(parts), figsize=(5.5 * len(parts), 0.35 * len(order) + 1.8), squeeze=False
    )
    for ax, part in zip(axes[0], parts, strict=True):
        for y, scheme in enumerate(order):
            seeds = margins[part].get(scheme)
            if not seeds:
                continue
            values = [100 * v for v in seeds.values()]
            mean = sum(values) / len(values)
            ax.scatter(values, [y] * len(values), s=14, color="tab:blue", alpha=0.7)
            ax.plot([mean, mean], [y - 0.3, y + 0.3], color="k", lw=2)
        ax.axvline(0.0, color="k", ls=":", lw=1)
        gap = gaps.get(part)
        if gap is not None and gap > 0:
            ax.axvline(100 * gap / 3, color="tab:green", ls="--", lw=1, label="a third of the gap")
            title = f"{part}: floor-to-ceiling gap {100 * gap:.1f} points"
        elif gap is not None:
            title = f"{part}: floor {100 * -gap:.1f} points above the ceiling"
        else:
            title = part
        ax.set_title(title, fontsize=9)
        ax.set_yticks(range(len(order)))
        ax.set_yticklabels(order, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("personalised accuracy minus its own floor's (points; dot: a seed)")
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
