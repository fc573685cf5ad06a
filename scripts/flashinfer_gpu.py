#!/usr/bin/env python3
"""The FlashInfer check's GPU part: record FlashInfer's paged append and decode on a bundle.

Runs on a machine with a CUDA GPU, nvcc and flashinfer-python installed (it JIT-compiles the decode
kernels it needs: head_dim of the bundle's model, ROPE_LLAMA and NONE, float16 and bfloat16, in
parallel threads first). It imports only ``ropekv.adapters.flashinfer`` (torch and safetensors); the
verdict is computed on CPU afterwards from what it writes (``scripts/flashinfer_verdict.py``):

    python scripts/flashinfer_gpu.py --bundle DIR --out DIR

writes ``flashinfer-<dtype>-<setup>.safetensors`` per recording, ``flashinfer-angles.safetensors`` (the
in-kernel rotation's relative phase at long positions: ``ropekv.adapters.flashinfer.angles``, judged by
``scripts/flashinfer_angles.py``) and ``summary.json`` (versions, device, compile and run seconds, errors). A module that does not compile, or a run that fails, is written to
the summary and the rest still run; the exit code is 1 if anything failed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# (query position p, key indices j) of the angle probe; the CPU dry run keeps to short requests
ANGLE_POSITIONS = (127, 1023, 8191, 32767, 131071)
CPU_ANGLE_POSITIONS = (31, 63)
ANGLE_DTYPES = ("float16", "bfloat16")

PLAN = (
    ("float16", "raw-keys"),
    ("float16", "rotated-before-append"),
    ("float16", "rotated-keys"),
    ("bfloat16", "raw-keys"),
    ("bfloat16", "rotated-before-append"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--bundle", required=True, help="folder holding weights.safetensors (scripts/flashinfer_pack.py)"
    )
    parser.add_argument("--out", required=True, help="folder for the recordings and summary.json")
    parser.add_argument(
        "--cpu-standin",
        action="store_true",
        help="drive the CPU stand-in instead of FlashInfer (a dry run of this script)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from ropekv.adapters.flashinfer.angles import angle_probe
    from ropekv.adapters.flashinfer.bundle import DTYPE_NAMES, load_bundle, save_recording
    from ropekv.adapters.flashinfer.cpu_kernel import CpuPagedKernel
    from ropekv.adapters.flashinfer.driver import SETUPS
    from ropekv.adapters.flashinfer.kernel import FlashInferKernel
    from ropekv.adapters.flashinfer.probe import recover_keys
    from ropekv.adapters.flashinfer.record import record

    summary: dict = {"errors": {}, "compile_seconds": {}, "run_seconds": {}, "probe_layer0": {}}
    kernel = CpuPagedKernel() if args.cpu_standin else FlashInferKernel()
    device = "cpu" if args.cpu_standin else "cuda"
    summary.update(
        flashinfer=kernel.version,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device="cpu" if args.cpu_standin else torch.cuda.get_device_name(0),
        python=platform.python_version(),
        recorded=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    print(json.dumps({k: summary[k] for k in ("flashinfer", "torch", "cuda", "device")}), flush=True)
    bundle = load_bundle(args.bundle)
    d = bundle.shapes.head_dim

    # JIT: every module this run needs, compiled side by side (ninja, each under its own lock), then
    # loaded one at a time (loading registers torch ops)
    jobs = {
        f"decode-{dt}-{'rope' if rot else 'none'}": (dt, rot)
        for dt, rot in sorted({(dt, SETUPS[s].kernel_rotates) for dt, s in PLAN})
    }
    if not args.cpu_standin:
        with ThreadPoolExecutor(len(jobs) + 1) as pool:
            futures = {name: pool.submit(kernel.build, DTYPE_NAMES[dt], d, rot) for name, (dt, rot) in jobs.items()}
            futures["page"] = pool.submit(kernel.build_page)
            for name, fut in futures.items():
                try:
                    summary["compile_seconds"][name] = round(fut.result(), 1)
                except Exception as exc:  # report and go on: the other modules may still run
                    summary["errors"][name] = _tail(exc)
                print(f"module {name}: {summary['compile_seconds'].get(name, 'FAILED')} s", flush=True)
        for name, (dt, rot) in jobs.items():
            if name in summary["errors"] or "page" in summary["errors"]:
                continue
            try:
                kernel.load(DTYPE_NAMES[dt], d, rot)
            except Exception as exc:
                summary["errors"][name] = _tail(exc)
                print(f"module {name}: load FAILED", flush=True)
    compiled_total = time.perf_counter() - started
    summary["compile_wall_seconds"] = round(compiled_total, 1)

    for dtype, setup_name in PLAN:
        name = f"{dtype}-{setup_name}"
        setup = SETUPS[setup_name]
        module = f"decode-{dtype}-{'rope' if setup.kernel_rotates else 'none'}"
        if module in summary["errors"] or "page" in summary["errors"]:
            summary["errors"][name] = f"skipped: module {module} or page did not build"
            continue
        try:
            tensors, meta = record(kernel, bundle, dtype, setup, device=device)
            meta.update({k: summary[k] for k in ("flashinfer", "torch", "cuda", "device", "recorded")})
            meta["compile_seconds"] = summary["compile_seconds"]
            save_recording(out / f"flashinfer-{name}.safetensors", tensors, meta)
            summary["run_seconds"][name] = meta["seconds"]
            c = bundle.cases[0]
            rec = recover_keys(
                tensors["c0.cached.s0.l0.probe_lse"],
                float(tensors["c0.cached.s0.l0.probe_alpha"]),
                c.length + 1,
                bundle.shapes.num_kv_heads,
                d,
            )
            summary["probe_layer0"][name] = {"calibration": rec.calibration, "sign_gap": rec.sign_gap}
            print(f"{name}: {meta['seconds']} s, probe calibration {rec.calibration:.2e}", flush=True)
        except Exception as exc:
            summary["errors"][name] = _tail(exc)
            print(f"{name}: FAILED {summary['errors'][name][-400:]}", flush=True)
    try:
        t0 = time.perf_counter()
        positions = CPU_ANGLE_POSITIONS if args.cpu_standin else ANGLE_POSITIONS
        angles = {}
        for dtype in ANGLE_DTYPES:
            for p in positions:
                for j in (0, p // 2, p - 1):
                    probe = angle_probe(
                        d, bundle.shapes.num_heads, bundle.shapes.num_kv_heads, 16, j, p + 1, DTYPE_NAMES[dtype], device
                    )
                    _, lse = kernel.decode(
                        probe.q,
                        probe.k_pages,
                        probe.v_pages,
                        probe.table,
                        rotate=True,
                        sm_scale=1.0,
                        rope_theta=bundle.shapes.rope_theta,
                    )
                    angles[f"{dtype}.p{p}.j{j}"] = lse.float().cpu()
        meta = {k: summary[k] for k in ("flashinfer", "torch", "cuda", "device", "recorded")}
        meta.update(
            kind="angles",
            positions=list(positions),
            dtypes=list(ANGLE_DTYPES),
            head_dim=d,
            rope_theta=bundle.shapes.rope_theta,
        )
        save_recording(out / "flashinfer-angles.safetensors", angles, meta)
        summary["run_seconds"]["angles"] = round(time.perf_counter() - t0, 3)
        print(f"angles: {summary['run_seconds']['angles']} s", flush=True)
    except Exception as exc:
        summary["errors"]["angles"] = _tail(exc)
    summary["total_seconds"] = round(time.perf_counter() - started, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "errors"}, indent=1), flush=True)
    for k, v in summary["errors"].items():
        print(f"ERROR {k}: {v[-1500:]}", flush=True)
    return 1 if summary["errors"] else 0


def _tail(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))[-6000:]


if __name__ == "__main__":
    sys.exit(main())
