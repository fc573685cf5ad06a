"""Reproduce docs/findings.md: transformers' dynamic NTK RoPE with a KV cache, on SmolLM2-135M.

Usage (from the repository root): ``.venv/bin/python docs/img/make_findings.py``. Writes
``docs/img/dynamic_ntk.png`` and ``docs/img/dynamic_ntk_report.json`` and prints the report table.

The embedded SmolLM2-135M is loaded into transformers with its RoPE switched to dynamic NTK (factor 2)
and ``max_position_embeddings`` lowered to 64, so a short prompt's decode crosses the original length.
Nothing else is changed: the cached path is transformers' own ``DynamicCache``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from ropekv.adapters.hf import HFEngine  # noqa: E402
from ropekv.models.default import default_checkpoint_dir  # noqa: E402
from ropekv.parity.cases import Case  # noqa: E402
from ropekv.parity.harness import check  # noqa: E402

ORIGINAL, FACTOR = 64, 2.0
CASES = [Case(length=48, decode_steps=24), Case(length=30, prefix=13, chunk=17, decode_steps=24)]
HERE = Path(__file__).resolve().parent


def dynamic_smollm2() -> torch.nn.Module:
    folder = default_checkpoint_dir()
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    theta = config.rope_parameters["rope_theta"]
    config.rope_parameters = {"rope_type": "dynamic", "factor": FACTOR, "rope_theta": theta}
    config.max_position_embeddings = ORIGINAL
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, config=config, dtype=torch.float32, local_files_only=True, use_safetensors=True).eval()


def plot(report, path: Path) -> None:
    """Per-layer attention-logit error of the first case against decode position (log scale)."""
    result = report.cases[0]
    pos = list(result.positions)
    errors = torch.tensor(result.attn_errors).clamp_min(1e-9)  # [steps, layers]
    self_err = torch.tensor(result.self_attn_errors).clamp_min(1e-9)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    cmap = plt.get_cmap("viridis")
    n = errors.shape[1]
    for layer in range(n):
        ax.plot(pos, errors[:, layer], color=cmap(layer / max(1, n - 1)), lw=0.8, alpha=0.7)
    ax.plot(pos, errors.max(dim=1).values, color="black", lw=2, label="worst layer vs float64 reference")
    ax.plot(pos, self_err.max(dim=1).values, color="tab:red", lw=1.5, ls="--",
            label="worst layer vs HF's own full forward")
    tol = report.tolerances["reference"]["attn_logits"]
    ax.axhline(tol, color="gray", ls=":", label=f"tolerance {tol:g}")
    ax.axvline(ORIGINAL - 0.5, color="tab:orange", ls="--", label=f"original length {ORIGINAL}")
    ax.set_yscale("log")
    ax.set_xlabel("decode position t")
    ax.set_ylabel("scale-aware attention-logit error")
    ax.set_title(f"SmolLM2-135M, HF dynamic NTK (factor {FACTOR:g}), DynamicCache, {result.case.label()}\n"
                 f"thin lines: layers 0 (purple) to {n - 1} (yellow)", fontsize=9)
    ax.legend(fontsize=8, loc="center left")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    engine = HFEngine(dynamic_smollm2())
    # Explicit cases: the default matrix is capped at max_position_embeddings, which is the point here.
    report = check(engine, cases=CASES)
    print(report.table())
    (HERE / "dynamic_ntk_report.json").write_text(report.to_json(indent=None) + "\n")
    try:
        from ropekv.parity.plot import plot_report  # written in parallel; use it once it exists
    except ImportError:
        plot_report = None
    if plot_report is not None:
        plot_report(report, HERE / "dynamic_ntk_report_plot.png")
    plot(report, HERE / "dynamic_ntk.png")
    return 0 if not report.passed else 1  # the finding is that parity fails


if __name__ == "__main__":
    sys.exit(main())
