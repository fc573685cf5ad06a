"""The check at real model sizes: random-weight checkpoints of Llama-3.2-1B and -3B shapes.

The bench writes each checkpoint itself (bfloat16 safetensors shards, one tensor generated at a time,
with a ``config.json`` of the real model's fields: hidden size, layers, heads, KV heads, intermediate
size, the 128,256-token vocabulary, llama3 RoPE scaling at theta 500,000, tied embeddings), cached
under ``$XDG_CACHE_HOME/ropekv/bench-models/`` so a rerun skips the writing. Then, per shape, two
processes of their own:

- ``ropekv check DIR --lengths 100 --block-sizes 16 --prefix-offsets 0 --decode-steps 2``: its exit
  code, verdict and peak RSS (``ru_maxrss`` of the child);
- the parts: the same checkpoint load and engine, measured from inside: the engine's own weights
  (``DecoderWeights.nbytes``) and its KV pool for the case, checkpoint bytes *not* shared with the
  engine, resident memory after loading (the token-independent base), then the peak above that base
  of the float64 reference forward as the check runs it, of the engine's full forward and of the
  cached run, each alone (the peak is reset between them through ``/proc/self/clear_refs``).

Targets: the check passes; the reference's own peak stays under 1.5 GiB above the base (3B shapes);
the whole check's peak RSS is within 1.3x of the engine's weights plus KV pool.

``python -m ropekv.bench.big_model --shapes 1b,3b [--json PATH]`` (or ``ropekv bench --big-models
1b,3b``) prints the figures against the targets; ``--parts DIR`` is the per-shape child (internal).
It takes minutes and needs about 1.4x the float32 model in memory (7 GiB for 1B, 17 GiB for 3B).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .machine import load_average

# The fields of meta-llama/Llama-3.2-{1B,3B}'s config.json that fix the shapes and the RoPE.
_LLAMA_32 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "intermediate_size": 8192,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
SHAPES: dict[str, dict[str, Any]] = {
    "1b": {
        **_LLAMA_32,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "head_dim": 64,
    },
    "3b": {
        **_LLAMA_32,
        "hidden_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "head_dim": 128,
    },
}
NAMES = {"1b": "Llama-3.2-1B shapes", "3b": "Llama-3.2-3B shapes"}
CHECK_ARGS = ["--lengths", "100", "--block-sizes", "16", "--prefix-offsets", "0", "--decode-steps", "2"]
TARGET_REFERENCE_OVER_BASE = 1.5 * 2**30  # bytes, for the 3B shapes
TARGET_CHECK_OVER_ENGINE = 1.3  # check peak RSS / (engine weights + KV pool)
SHARD_BYTES = 1 << 30
WEIGHT_STD = 0.02  # transformers' initializer range for llama: activations and logits of unit scale
_COMPLETE = "ropekv-bench-complete.json"  # written last: a folder without it is rewritten


def tensor_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a llama ``config`` (transformers' names, tied embeddings: no ``lm_head``)."""
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config["vocab_size"], h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    out.append(("model.norm.weight", (h,)))
    return out


def parameter_count(config: dict[str, Any]) -> int:
    return sum(math.prod(shape) for _, shape in tensor_shapes(config))


def _tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """One bfloat16 tensor: norm weights one (as initialized), matrices N(0, 0.02^2), seeded by name."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return (torch.randn(shape, generator=g) * WEIGHT_STD).to(torch.bfloat16)


def write_checkpoint(
    config: dict[str, Any],
    final: Path,
    *,
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    say: Callable[[str], None] = lambda m: None,
) -> Path:
    """The llama checkpoint folder ``final`` of ``config``, written shard by shard (bfloat16, shards of
    at most ``shard_bytes`` or one tensor) unless a complete one of the same config and seed is there.
    Never more than one shard's tensors in memory."""
    from safetensors.torch import save_file

    root = final.parent
    record = {"config": config, "seed": seed, "shard_bytes": shard_bytes}
    marker = final / _COMPLETE
    if marker.is_file() and json.loads(marker.read_text()) == record:
        return final
    shapes = tensor_shapes(config)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, s in shapes:
        n = math.prod(s) * 2
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, s))
        size += n
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        say(f"  writing {final.name}/{file} ({len(shard)} tensors)")
        save_file({name: _tensor(name, s, seed) for name, s in shard}, str(tmp / file), metadata={"format": "pt"})
        weight_map.update({name: file for name, _ in shard})
    total = sum(math.prod(s) * 2 for _, s in shapes)
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / _COMPLETE).write_text(json.dumps(record))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


# ---------------------------------------------------------------------- the child that measures the parts


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_above(base: int, work: Callable[[], object]) -> int | None:
    """Peak resident bytes above ``base`` while ``work`` runs (None: the peak could not be reset)."""
    if not _reset_peak():
        return None
    work()
    return _status_kib("VmHWM") * 1024 - base


def measure_parts(model_dir: Path) -> dict[str, Any]:
    """What the check of ``model_dir`` holds, part by part (module docstring)."""
    from ..adapters.native import NativeAdapter
    from ..models import load_checkpoint
    from ..models.reference import ReferenceDecoder
    from ..parity.cases import Case, token_stream

    out: dict[str, Any] = {"interpreter_rss_bytes": _status_kib("VmRSS") * 1024}
    t0 = time.perf_counter()
    checkpoint = load_checkpoint(model_dir)
    out["load_seconds"] = time.perf_counter() - t0
    out["checkpoint_float32_bytes"] = sum(t.numel() * t.element_size() for t in checkpoint.weights.values())
    out["rss_after_load_bytes"] = _status_kib("VmRSS") * 1024
    out["load_peak_rss_bytes"] = _status_kib("VmHWM") * 1024
    case = Case(length=100, block_size=16, decode_steps=2)
    adapter = NativeAdapter(checkpoint)
    engine = adapter.make_engine(case)
    weights = engine.weights
    out["engine_dtype"] = adapter.dtype_name
    out["engine_weights_bytes"] = weights.nbytes()
    out["kv_pool_bytes"] = engine.cache.nbytes()
    storages = {t.untyped_storage().data_ptr() for t in _tensors_of(weights)}
    out["checkpoint_bytes_not_shared_with_engine"] = sum(
        t.numel() * t.element_size()
        for t in checkpoint.weights.values()
        if t.untyped_storage().data_ptr() not in storages
    )
    base = _status_kib("VmRSS") * 1024
    out["base_rss_bytes"] = base  # token-independent: interpreter, checkpoint, engine weights, its pool
    tokens = token_stream(checkpoint.config.vocab_size, case.total)
    rows = list(case.decode_positions)
    reference = ReferenceDecoder(checkpoint, dtype=torch.float64)
    with torch.no_grad():
        t0 = time.perf_counter()
        out["reference_peak_above_base_bytes"] = _peak_above(
            base, lambda: reference.forward(tokens[: case.total], probe_rows=rows, logits_for="probed")
        )
        out["reference_seconds"] = time.perf_counter() - t0
        out["engine_full_forward_peak_above_base_bytes"] = _peak_above(
            base, lambda: adapter.full_forward(tokens[: case.total], rows, case)
        )
        out["cached_run_peak_above_base_bytes"] = _peak_above(base, lambda: adapter.run_case(case, tokens))
    out["peak_resettable"] = out["reference_peak_above_base_bytes"] is not None
    return out


def _tensors_of(weights) -> list[torch.Tensor]:
    """Every tensor of a :class:`~ropekv.engine.transformer.DecoderWeights` (its nbytes walks the same)."""
    found: list[torch.Tensor] = []

    def walk(x: object) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif hasattr(x, "__dataclass_fields__"):
            for name in x.__dataclass_fields__:  # type: ignore[attr-defined]
                walk(getattr(x, name))

    walk(weights)
    return found


# ---------------------------------------------------------------------- the driver


def _child(argv: list[str], log: Path, threads: int) -> tuple[float, int, int]:
    """Run ``argv`` (stderr shown), returning wall seconds, the child's peak RSS bytes and exit code."""
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # interrupted: do not leave the child running on its own
            proc.kill()
            proc.wait()
            raise
    return time.perf_counter() - t0, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def measure(
    shapes: list[str],
    root: Path,
    workdir: Path,
    *,
    threads: int = 2,
    progress: Callable[[str], None] = lambda m: None,
) -> dict[str, Any]:
    runs = []
    for shape in shapes:
        config = SHAPES[shape]
        entry: dict[str, Any] = {
            "shape": shape,
            "name": NAMES[shape],
            "parameters": parameter_count(config),
            "load_average_start": load_average(),
        }
        t0 = time.perf_counter()
        progress(f"{NAMES[shape]}: checkpoint ({entry['parameters'] / 1e9:.2f}B parameters, bfloat16)")
        model_dir = write_checkpoint(config, root / f"llama-3.2-{shape}-shapes-seed0", say=progress)
        entry["model_dir"] = str(model_dir)
        entry["write_seconds"] = time.perf_counter() - t0
        entry["disk_bytes"] = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
        report = workdir / f"check-{shape}.json"
        argv = [sys.executable, "-m", "ropekv.cli.main", "check", str(model_dir), *CHECK_ARGS]
        progress(f"  ropekv check {model_dir} {' '.join(CHECK_ARGS)}")
        wall, rss, code = _child(
            [*argv, "--no-progress", "--json", str(report)], workdir / f"check-{shape}.log", threads
        )
        doc = json.loads(report.read_text()) if report.exists() else {}
        entry.update(
            check_seconds=wall,
            check_peak_rss_bytes=rss,
            check_exit_code=code,
            check_passed=doc.get("passed"),
            check_phase_seconds=doc.get("phase_seconds"),
            max_abs_logit_diff=max((c.get("max_abs_logit_diff") or 0.0 for c in doc.get("cases", [])), default=None),
        )
        progress(f"    {wall:.0f} s, peak RSS {rss / 2**30:.2f} GiB, exit {code}")
        progress("  the parts, in a process of their own")
        parts_json = workdir / f"parts-{shape}.json"
        argv = [sys.executable, "-m", "ropekv.bench.big_model", "--parts", str(model_dir), "--json", str(parts_json)]
        wall, rss, code = _child(argv, workdir / f"parts-{shape}.log", threads)
        if code != 0 or not parts_json.exists():
            log = (workdir / f"parts-{shape}.log").read_text(errors="replace")
            raise RuntimeError(f"the parts process of {shape} exited {code} (its stderr is above):\n{log[-3000:]}")
        parts = json.loads(parts_json.read_text())
        parts.update(process_seconds=wall, process_peak_rss_bytes=rss)
        entry["parts"] = parts
        engine = parts["engine_weights_bytes"] + parts["kv_pool_bytes"]
        entry["check_over_engine"] = entry["check_peak_rss_bytes"] / engine
        entry["load_average_end"] = load_average()
        runs.append(entry)
    return {
        "format": "ropekv.big-model",
        "version": 1,
        "threads": threads,
        "check_args": CHECK_ARGS,
        "runs": runs,
        "targets": {
            "check_passes": True,
            "reference_peak_above_base_bytes_3b": TARGET_REFERENCE_OVER_BASE,
            "check_over_engine": TARGET_CHECK_OVER_ENGINE,
        },
        "goals_met": _verdicts(runs),
    }


def _verdicts(runs: list[dict[str, Any]]) -> dict[str, bool | None]:
    ref = [r["parts"]["reference_peak_above_base_bytes"] for r in runs if r["shape"] == "3b"]
    return {
        "check_passes": all(r["check_passed"] is True for r in runs),
        "reference_peak_above_base_3b": (ref[0] < TARGET_REFERENCE_OVER_BASE) if ref and ref[0] is not None else None,
        "check_over_engine": all(r["check_over_engine"] <= TARGET_CHECK_OVER_ENGINE for r in runs),
    }


def format_table(doc: dict[str, Any]) -> str:
    gib = 2**30
    lines = [f"ropekv check {' '.join(doc['check_args'])} on random-weight checkpoints, {doc['threads']} thread(s)"]
    for r in doc["runs"]:
        p = r["parts"]
        engine = p["engine_weights_bytes"] + p["kv_pool_bytes"]

        lines += [
            "",
            f"{r['name']}: {r['parameters'] / 1e9:.3f}B parameters, {r['disk_bytes'] / gib:.2f} GiB bfloat16 on disk",
            f"  check: {'PASS' if r['check_passed'] else 'FAIL'} (exit {r['check_exit_code']}), {r['check_seconds']:.0f} s, "
            f"peak RSS {r['check_peak_rss_bytes'] / gib:.2f} GiB, max|dlogit| "
            + ("-" if r["max_abs_logit_diff"] is None else f"{r['max_abs_logit_diff']:.2e}"),
            f"  engine weights ({p['engine_dtype']}) {p['engine_weights_bytes'] / gib:.2f} GiB + KV pool "
            f"{p['kv_pool_bytes'] / gib:.3f} GiB = {engine / gib:.2f} GiB; checkpoint tensors not shared with the engine "
            f"{p['checkpoint_bytes_not_shared_with_engine'] / gib:.2f} GiB",
            f"  resident: interpreter {p['interpreter_rss_bytes'] / gib:.2f} GiB, after the load "
            f"{p['rss_after_load_bytes'] / gib:.2f} GiB (load peak {p['load_peak_rss_bytes'] / gib:.2f} GiB), base with "
            f"the engine {p['base_rss_bytes'] / gib:.2f} GiB",
            f"  peak above the base: float64 reference {_gib(p['reference_peak_above_base_bytes'])} "
            f"({p['reference_seconds']:.0f} s), engine full forward {_gib(p['engine_full_forward_peak_above_base_bytes'])}, "
            f"cached run {_gib(p['cached_run_peak_above_base_bytes'])}",
            f"  check peak RSS / (engine weights + KV) = {r['check_over_engine']:.3f}x (target <= {TARGET_CHECK_OVER_ENGINE}x)",
        ]
    g = doc["goals_met"]
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    lines += [
        "",
        f"check passes on every shape: {verdict[g['check_passes']]}",
        f"reference peak above the base, 3B shapes, < {TARGET_REFERENCE_OVER_BASE / gib:.1f} GiB: "
        f"{verdict[g['reference_peak_above_base_3b']]}",
        f"check peak RSS within {TARGET_CHECK_OVER_ENGINE}x of the engine's weights + KV: {verdict[g['check_over_engine']]}",
    ]
    return "\n".join(lines)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def default_root() -> Path:
    from ..models.embedded import cache_root

    return cache_root() / "bench-models"


def shape_list(text: str) -> list[str]:
    """``"1b,3b"`` as a list of :data:`SHAPES` names (ValueError naming the unknown one)."""
    out = [s.strip().lower() for s in text.split(",") if s.strip()]
    bad = [s for s in out if s not in SHAPES]
    if bad or not out:
        raise ValueError(f"shapes must be a comma-separated list of {', '.join(SHAPES)}, got {text!r}")
    return list(dict.fromkeys(out))


def run(shapes: list[str], json_path: Path | None, threads: int, root: Path | None = None) -> dict[str, Any]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ropekv-big-") as tmp:
        doc = measure(
            shapes,
            root or default_root(),
            Path(tmp),
            threads=threads,
            progress=lambda m: print(m, file=sys.stderr, flush=True),
        )
    print(format_table(doc))
    if json_path is not None:
        json_path.write_text(json.dumps(doc, indent=1))
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ropekv.bench.big_model", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1b,3b", help="comma-separated: 1b, 3b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: the ropekv cache)")
    p.add_argument("--parts", default=None, metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.parts is not None:
        Path(args.json).write_text(json.dumps(measure_parts(Path(args.parts))))
        return 0
    try:
        shapes = shape_list(args.shapes)
    except ValueError as exc:
        p.error(str(exc))
    run(shapes, Path(args.json) if args.json else None, args.threads, Path(args.dir) if args.dir else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
