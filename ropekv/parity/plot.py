"""A PNG a person can read at a glance: divergence per layer against position.

Left: for every decode step of every case (x, labelled by position) and every layer (y), the
attention-logit error against the float64 reference divided by the tolerance, on a log colour scale:
clean runs are dark blue, anything above 1 (the tolerance) is red. Right: the worst layer's error
against decode position, reference and self-parity, with the tolerance line.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .report import ParityReport  # noqa: E402


def plot_report(report: ParityReport, path: str | Path) -> None:
    tol = report.tolerances["reference"]["attn_logits"]
    tol_self = report.tolerances["self"]["attn_logits"]
    columns, labels, boundaries = [], [], []
    for r in report.cases:
        for pos, errs in zip(r.positions, r.attn_errors):
            columns.append([min(e, 1e6) for e in errs])
            labels.append(str(pos))
        boundaries.append(len(columns))
    grid = np.array(columns, dtype=float).T / tol  # [layers, steps]
    grid = np.log10(np.clip(grid, 1e-6, 1e6))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    im = ax1.imshow(grid, aspect="auto", origin="lower", cmap="coolwarm", vmin=-4, vmax=4, interpolation="nearest")
    for b in boundaries[:-1]:
        ax1.axvline(b - 0.5, color="black", lw=0.6)
    step = max(1, len(labels) // 30)
    ax1.set_xticks(range(0, len(labels), step))
    ax1.set_xticklabels(labels[::step], rotation=90, fontsize=7)
    ax1.set_xlabel("decode position (cases separated by lines)")
    ax1.set_ylabel("layer")
    ax1.set_title("attention-logit error / tolerance vs float64 reference (log10)")
    fig.colorbar(im, ax=ax1, label="log10(error / tolerance): > 0 diverges")

    for r in report.cases:
        ref = [max(max(row), 1e-12) for row in r.attn_errors]
        slf = [max(max(row), 1e-12) for row in r.self_attn_errors]
        color = "tab:blue" if r.passed else "tab:red"
        ax2.plot(r.positions, ref, "o-", color=color, ms=3, lw=1)
        ax2.plot(r.positions, slf, "x--", color=color, ms=3, lw=0.8, alpha=0.6)
    ax2.axhline(tol, color="black", lw=1, ls=":", label=f"tolerance vs reference ({tol:g})")
    if tol_self != tol:
        ax2.axhline(tol_self, color="gray", lw=1, ls=":", label=f"tolerance vs self ({tol_self:g})")
    ax2.plot([], [], "o-", color="tab:blue", label="passing case (o: vs float64, x: vs self)")
    ax2.plot([], [], "o-", color="tab:red", label="failing case")
    ax2.set_yscale("log")
    ax2.set_xscale("log")
    ax2.set_xlabel("decode position")
    ax2.set_ylabel("worst layer's attention-logit error")
    ax2.legend(fontsize=8, loc="best")
    verdict = "PASS" if report.passed else "FAIL"
    diag = f" - {report.diagnosis.kind}" if report.diagnosis else ""
    fig.suptitle(f"ropekv check: {report.model.get('name', '')} / {report.engine.get('name', '')}: {verdict}{diag}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


