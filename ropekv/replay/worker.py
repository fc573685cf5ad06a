"""One side of a replay entry, run inside that release's venv: ``python -m ropekv.replay.worker REQUEST OUT``.

``REQUEST`` is a JSON file (engine, model folder, case, options); the result goes to ``OUT`` as JSON:
the release that really ran, the verdict, the diagnosed bug class and where the first divergence was.
A ropekv error (an unsupported release, a model the engine cannot load) is written as ``error`` with
its one-line message; the driver (:mod:`ropekv.replay.run`) turns it into the entry's failure.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import RopeKVError


def run_side(request: dict[str, Any]) -> dict[str, Any]:
    """Load the model in the engine, run ``ropekv.check`` on the one case, summarize the report."""
    from ..api import check
    from ..parity.cases import Case

    start = time.monotonic()
    engine = _engine(request["engine"], Path(request["model_dir"]), request.get("options", {}))
    spec = request["case"]
    case = Case(
        length=int(spec["length"]),
        decode_steps=int(spec["decode_steps"]),
        prefix=int(spec.get("prefix", 0)),
        chunk=None if spec.get("chunk") is None else int(spec["chunk"]),
    )
    report = check(engine, cases=[case], seed=int(request.get("seed", 0)))
    described = engine.describe().to_dict()
    result: dict[str, Any] = {
        "engine": described.get("engine"),
        "version": _version(described),
        "passed": report.passed,
        "kind": report.diagnosis.kind.value if report.diagnosis is not None else None,
        "evidence": report.diagnosis.evidence if report.diagnosis is not None else None,
        "seconds": round(time.monotonic() - start, 2),
        # where the engine reads the config otherwise than transformers (the reference follows the engine)
        "reading": list(engine.checkpoint.config.warnings),
    }
    for r in report.cases:
        result["case"] = r.case.label() if hasattr(r.case, "label") else str(r.case)
        result["max_dlogit"] = r.max_abs_logit_diff
        result["notes"] = list(r.notes)
        d = r.first_divergence
        if d is not None:
            result["divergence"] = f"step {d.step} (position {d.query_position}) layer {d.layer} vs {d.against}"
    return result


def _engine(name: str, folder: Path, options: dict[str, Any]) -> Any:
    if name == "transformers":
        from ..adapters.hf import HFEngine

        return HFEngine.load(folder, attn_implementation="eager", **options)
    if name == "mlx-lm":
        from ..adapters.mlx import MLXEngine

        return MLXEngine(folder, **options)
    raise RopeKVError(f"replay worker: unknown engine {name!r}")


def _version(described: dict[str, Any]) -> str | None:
    if "transformers_version" in described:
        return str(described["transformers_version"])
    versions = described.get("versions")
    if isinstance(versions, dict) and "mlx-lm" in versions:
        return str(versions["mlx-lm"])
    return None


def main(argv: list[str]) -> int:
    request_file, out_file = argv
    request = json.loads(Path(request_file).read_text())
    try:
        result = run_side(request)
    except RopeKVError as exc:
        result = {"error": " ".join(str(exc).splitlines()) or type(exc).__name__}
    Path(out_file).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
