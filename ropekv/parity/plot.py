"""A PNG a person can read at a glance: divergence per layer against position.

Left: for every decode step of every case (x, labelled by position; each case named under its band)
and every layer (y), the attention-logit error against the float64 reference divided by the
tolerance, on a log colour scale: clean runs are dark blue, anything above 1 (the tolerance) is red;
the first divergence of each failing case is ringed. Right: the worst error per decode step against
decode position, reference and self-parity, with the tolerance line. A logits-tier report (no layers)
shows the next-token logits error in both panels instead. Cases that did not apply (``n/a``) were
not run and are left out; the title counts them.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from .report import ParityReport


def _plain(x: float, _pos: object = None) -> str:
    """Tick labels as plain numbers: 1, 20, 300, 4,000; 0.001 rather than 10^-3 (1e-05 below that)."""
    if x >= 1:
        return f"{x:,.0f}"
    return f"{x:.4f}".rstrip("0") if x >= 1e-4 else f"{x:.0e}"


def plot_report(report: ParityReport, path: str | Path) -> None:
    """Write the PNG of ``report`` to ``path``."""
    fig = figure(report)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(report: ParityReport) -> Figure:
    """The two panels of ``report`` (module doc), as a matplotlib figure the caller closes."""
    cases = report.judged  # an n/a case has no figures to show
    layered = any(any(row) for r in cases for row in r.attn_errors)
    key = "attn_logits" if layered else "final_logits"
    tol = report.tolerances["reference"][key]
    tol_self = report.tolerances["self"][key]
    columns: list[list[float]] = []
    labels: list[str] = []
    bands: list[tuple[int, int, str, bool]] = []
    marks: list[tuple[int, int]] = []
    for r in cases:
        start = len(columns)
        rows = r.attn_errors if layered else [(e,) for e in r.logit_errors]
        for s, (pos, errs) in enumerate(zip(r.positions, rows)):
            columns.append([min(e, 1e6) for e in errs])
            labels.append(str(pos))
            fd = r.first_divergence
            if fd is not None and fd.against == "reference" and fd.step == s:
                marks.append((len(columns) - 1, fd.layer if (layered and fd.layer is not None) else 0))
        bands.append((start, len(columns), r.case.label(), r.passed))
    grid = np.array(columns, dtype=float).T / tol  # [layers, steps]
    grid = np.log10(np.clip(grid, 1e-6, 1e6))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [3, 2]})
    im = ax1.imshow(grid, aspect="auto", origin="lower", cmap="coolwarm", vmin=-4, vmax=4, interpolation="nearest")
    for start, end, label, passed in bands:
        if start:
            ax1.axvline(start - 0.5, color="black", lw=0.6)
        ax1.text(
            (start + end - 1) / 2,
            -0.06,
            label,
            transform=ax1.get_xaxis_transform(),
            rotation=30,
            ha="right",
            va="top",
            fontsize=7,
            color="black" if passed else "tab:red",
        )
    for x, y in marks:
        ax1.plot(x, y, "o", ms=12, mfc="none", mec="black", mew=1.5)
    step = max(1, len(labels) // 40)
    ax1.set_xticks(range(0, len(labels), step))
    ax1.set_xticklabels(labels[::step], fontsize=6)
    ax1.tick_params(axis="x", pad=1)
    ax1.set_ylabel("layer" if layered else "next-token logits")
    n_layers = grid.shape[0]
    ax1.set_yticks(list(range(0, n_layers, max(1, n_layers // 15))) if layered else [])
    what = "attention-logit" if layered else "next-token logits"
    ax1.set_title(f"{what} error / tolerance vs float64 reference (log10); o = first divergence", fontsize=9)
    fig.colorbar(im, ax=ax1, label="log10(error / tolerance): > 0 diverges")

    shown = {"pass": False, "fail": False}
    for r in cases:
        ref_rows = r.attn_errors if layered else [(e,) for e in r.logit_errors]
        self_rows = r.self_attn_errors if layered else [(e,) for e in r.self_logit_errors]
        ref = [max(max(row), 1e-12) for row in ref_rows]
        slf = [max(max(row), 1e-12) for row in self_rows]
        color = "tab:blue" if r.passed else "tab:red"
        shown["pass" if r.passed else "fail"] = True
        ax2.plot(r.positions, ref, "o-", color=color, ms=3, lw=1)
        ax2.plot(r.positions, slf, "x--", color=color, ms=3, lw=0.8, alpha=0.6)
    ax2.axhline(tol, color="black", lw=1, ls=":", label=f"tolerance vs reference ({tol:g})")
    if tol_self != tol:
        ax2.axhline(tol_self, color="gray", lw=1, ls=":", label=f"tolerance vs self ({tol_self:g})")
    if shown["pass"]:
        ax2.plot([], [], "o-", color="tab:blue", label="passing case (o: vs float64, x: vs self)")
    if shown["fail"]:
        ax2.plot([], [], "o-", color="tab:red", label="failing case (o: vs float64, x: vs self)")
    ax2.set_yscale("log")
    ax2.yaxis.set_major_formatter(FuncFormatter(_plain))
    positions = [p for r in cases for p in r.positions]
    if max(positions) > 20 * max(1, min(positions)):  # a log axis only where positions span decades
        ax2.set_xscale("log")
        ax2.xaxis.set_minor_formatter(FuncFormatter(lambda x, p: ""))
    else:  # positions are integers: no ticks between them (40 40 40 41 41 for one case)
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.xaxis.set_major_formatter(FuncFormatter(_plain))
    ax2.set_xlabel("decode position")
    ax2.set_ylabel(f"worst {'layer' if layered else 'step'} {what} error (scale-aware)")
    ax2.legend(fontsize=8, loc="best")
    verdict = "PASS" if report.passed else "FAIL"
    diag = f" - {report.diagnosis.kind}" if report.diagnosis else ""
    skipped = len(report.not_applicable)
    diag += f" ({skipped} n/a)" if skipped else ""
    fig.suptitle(
        f"ropekv check: {report.model.get('name', '')} / {report.engine.get('name', '')} "
        f"({report.tier} tier): {verdict}{diag}",
        fontsize=11,
    )
    fig.tight_layout()
    return fig
