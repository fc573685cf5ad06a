"""``ropekv check``: the parity harness from the command line (the project's main job)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import shlex
import sys

from ..adapters.registry import ENGINES, engine_module
from ..argtypes import strict_int, suggest
from ..contract import DTYPES, KV_DTYPES, KV_SCALES
from ..errors import UsageError
from ..parity.cases import LONG_CONTEXT, ImageGrid
from .adapter_guard import DEFAULT_TIMEOUT_S, AdapterGuard
from .custom_engine import CustomEngine
from .options import (
    add_model_argument,
    block_size_list,
    int_list,
    non_negative_int,
    positive_int,
    positive_int_list,
    seed,
    timeout_seconds,
    writable_path,
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "check",
        help="prove cached decoding matches a full forward, layer by layer",
        description="Cached prefill + decode against the engine's own full forward and an "
        "independent float64 reference, layer by layer; names the bug on divergence. "
        "Exit 0: parity holds; 1: divergence; 2: bad input or a broken adapter; 3: contract refused; "
        "130: interrupted.",
    )
    add_model_argument(p)
    p.add_argument(
        "--engine",
        type=_engine,
        default="ropekv",
        metavar="ENGINE",
        help="the engine to check: "
        + "; ".join(f"{e.name}: {e.summary}" + (f" (from {e.venv})" if e.venv else "") for e in ENGINES.values())
        + "; or your own adapter, module:Class or path/to/file.py:Class, built by Class.load(MODEL, "
        "dtype=DTYPE) (runs that code, as pytest does; docs/adapters.md)",
    )
    p.add_argument(
        "--adapter-timeout",
        type=timeout_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"with --engine module:Class: the longest one call into the adapter (load, run_case, ...) may take "
        f"before the check stops with an error naming the call (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument("--key-form", choices=("raw", "rotated"), default=None, help="cache key form (default rotated)")
    p.add_argument(
        "--backend",
        choices=("rotated", "rotate_on_read"),
        default=None,
        help="attention backend (default: the one the key form needs)",
    )
    p.add_argument("--lengths", type=positive_int_list, help="prompt lengths, e.g. 1,17,513")
    p.add_argument("--block-sizes", type=block_size_list, help="cache block sizes, e.g. 1,7,16")
    p.add_argument("--prefix-offsets", type=int_list, help="prefix-cache hit lengths, e.g. 0,13")
    p.add_argument("--window", type=positive_int, help="sliding window applied to every layer")
    p.add_argument("--sinks", type=non_negative_int, default=0, help="sink tokens kept forever (with --window)")
    p.add_argument("--chunk", type=positive_int, help="prefill chunk size")
    p.add_argument("--decode-steps", type=positive_int, help="decode steps per case (default 3)")
    p.add_argument(
        "--image-grid",
        metavar="RxC@S",
        help="image-like M-RoPE positions in every case: an R x C image at token S (e.g. 4x4@5; "
        "M-RoPE models on ropekv's own engine only; no vision tower, the positions only)",
    )
    p.add_argument(
        "--long",
        action="store_true",
        help=f"add the long case ({LONG_CONTEXT:,} tokens) to the default matrix of a model with sliding layers",
    )
    p.add_argument(
        "--ops",
        metavar="OPS",
        help="cache operations to check, e.g. rollback:3,evict:5,shift:1000,batch:3,restore "
        "(rollback:N rejected draft tokens, evict:N tokens, shift:DELTA positions, batch:ROWS "
        "sequences, restore, spec:K draft tokens of one speculative step; see docs/ops.md); each runs on every case the other flags give, "
        "or on its own default case",
    )
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="float32",
        help="the engine's compute and cache dtype (sets the tolerance; default float32)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        help="store ropekv's KV cache in another dtype than it computes in: fp8 = float8_e4m3fn codes with "
        "per-layer scales, dequantized to float32 on read (vLLM's kv_cache_dtype=fp8; needs --dtype float32; "
        "sets the fp8 tolerance, docs/faults.md); with --engine module:Class it is passed to Class.load(..., "
        "kv_dtype='fp8') and sets the fp8 tolerance",
    )
    p.add_argument(
        "--kv-scale",
        choices=KV_SCALES,
        help="with --kv-dtype fp8: one scale per layer (per_tensor, the default) or per layer and KV head (per_head)",
    )
    p.add_argument("--inject", metavar="FAULT", help="run a catalogued fault (see --list-faults)")
    p.add_argument("--list-faults", action="store_true", help="list the fault catalogue and exit")
    p.add_argument("--json", metavar="PATH", help="write the whole report as JSON")
    p.add_argument(
        "--reference-cache",
        metavar="DIR",
        help="store each case's float64 reference rows in DIR (created if missing) and reuse them in later "
        "checks of the same model on any engine; a stale or corrupt entry is recomputed (docs/performance.md)",
    )
    p.add_argument(
        "--reference-cache-trust-engine",
        action="store_true",
        help="store reference rows even though --engine loaded adapter code into this process (that code "
        "can change ropekv's reference; by default such a check reads the cache but writes nothing to it)",
    )
    p.add_argument("--plot", metavar="PATH", help="write a PNG of divergence per layer against position")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device of ropekv's engine (default cpu)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the token sequence")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for entry in ENGINES.values():
        if entry.venv is not None and importlib.util.find_spec(entry.module) is not None:
            importlib.import_module(entry.module).add_arguments(
                p.add_argument_group(f"{entry.name} engine", f"options of --engine {entry.name}")
            )
    p.set_defaults(handler=run)


def _engine(text: str) -> str:
    """A registered engine's name, or ``module:Class`` / ``file.py:Class`` (checked when run)."""
    if text in ENGINES or ":" in text:
        return text
    raise argparse.ArgumentTypeError(
        f"unknown engine {text!r}; choose one of {', '.join(ENGINES)}, or module:Class / path/to/file.py:Class"
        + suggest(text, ENGINES)
    )


def run(args: argparse.Namespace) -> int:
    from ..adapters.native import NativeAdapter
    from ..bugs.registry import ARCH_FAULTS, FAULTS, get_fault, listing
    from ..faults.native import NativeFault
    from ..parity.compare import kv_tolerance

    if args.list_faults:
        for f in [*FAULTS.values(), *ARCH_FAULTS.values()]:
            print(listing(f))
        return 0
    # Everything that can be refused is refused before any heavy work.
    fault = get_fault(args.inject) if args.inject else None
    json_path = writable_path(args.json, "--json")
    plot_path = writable_path(args.plot, "--plot")
    from ..parity.reference_cache import ReferenceStore

    store = (
        None
        if args.reference_cache is None
        else ReferenceStore(args.reference_cache, trust_engine=args.reference_cache_trust_engine)
    )
    if args.sinks < 0 or (args.sinks and args.window is None):
        raise UsageError("--sinks needs --window and must be >= 0")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available")
    if args.engine != "ropekv" and (fault or args.key_form or args.backend):
        raise UsageError(
            f"--engine {args.engine} checks the engine's own cache; --inject/--key-form/--backend "
            "apply to ropekv's engine"
        )
    if args.kv_scale is not None and args.kv_dtype is None:
        raise UsageError("--kv-scale sets the scales of an 8-bit cache: it needs --kv-dtype fp8")
    custom = CustomEngine.parse(args.engine)  # a malformed module:Class is refused here
    if args.kv_dtype is not None and custom is not None and args.kv_scale is not None:
        raise UsageError("--kv-scale sets the scales of ropekv's own 8-bit cache; your adapter chooses its own")
    if args.kv_dtype is not None and custom is None and (args.engine != "ropekv" or args.dtype != "float32"):
        raise UsageError(
            f"--kv-dtype {args.kv_dtype} stores ropekv's own cache in 8 bits and dequantizes it to float32: it needs "
            f"--engine ropekv and --dtype float32, or your own adapter (--engine module:Class) "
            f"(got --engine {args.engine}, --dtype {args.dtype})"
        )
    kv_native = isinstance(fault, NativeFault)  # ropekv's own engine, where a cache dtype can be chosen
    if isinstance(fault, NativeFault) and fault.kv_dtype is not None and args.dtype != "float32":
        raise UsageError(f"fault {fault.name!r} runs an 8-bit cache dequantized to float32: it needs --dtype float32")
    if fault is not None and not kv_native and args.kv_dtype is not None:
        raise UsageError(f"--kv-dtype applies to ropekv's own engine; fault {fault.name!r} runs another")
    if args.engine != "ropekv" and args.device != "cpu":
        raise UsageError(f"--device applies to ropekv's engine; --engine {args.engine} picks its own device")
    external = custom is None and ENGINES[args.engine].venv is not None
    module = engine_module(args.engine) if external else None  # EngineUnavailable before any heavy work

    from ..api import check
    from ..models import load_config

    # The config alone (config.json / GGUF metadata) decides whether the cases fit the model: refuse
    # them before any weight is read. An external engine without case flags lists its own default
    # matrix; what it cannot honour (case windows on llama.cpp, cache operations) the harness reports
    # n/a in its row, with the reason.
    from ..parity.cases import build_matrix, model_window, parse_ops

    ops = parse_ops(args.ops) if args.ops is not None else None
    no_case_flags = (
        all(
            v is None
            for v in (
                args.lengths,
                args.block_sizes,
                args.prefix_offsets,
                args.window,
                args.chunk,
                args.decode_steps,
                ops,
            )
        )
        and not args.sinks
        and not args.long
    )
    if module is not None and no_case_flags:  # an external engine
        cases = module.default_cases(args)
    else:
        cfg = load_config(args.model)
        cases = build_matrix(
            ops=ops,
            lengths=args.lengths,
            block_sizes=args.block_sizes,
            prefix_offsets=args.prefix_offsets,
            window=args.window,
            sink_tokens=args.sinks,
            chunk=args.chunk,
            decode_steps=args.decode_steps,
            max_positions=cfg.position_limit,
            windowed=None if args.window is not None else model_window(cfg.layer_attentions),
            long=args.long,
        )
    if args.image_grid is not None:
        if module is not None or custom is not None or args.engine == "hf":
            raise UsageError("--image-grid runs on ropekv's own engine only (the others take no mRoPE positions)")
        image = _image_grid(args.image_grid)
        cases = [dataclasses.replace(c, image=image) for c in cases]
    longest = max(c.total for c in cases)
    if args.window is not None and args.window + args.sinks >= longest:
        raise UsageError(
            f"--window {args.window} is not smaller than the longest context ({longest} tokens): it would never wrap"
        )
    adapter = build_adapter(args, module=module, custom=custom, fault=fault)
    from ..models.default import display_name
    from ..parity.report import plural

    ckpt = adapter.checkpoint
    cfg = ckpt.config
    print(
        f"model: {display_name(ckpt)} ({cfg.architecture}, {cfg.num_layers} layers, fingerprint {ckpt.fingerprint}); "
        f"engine: {adapter.name} ({adapter.tier} tier); {plural(len(cases), 'case')}",
    )  # on stdout with the table: `ropekv check > out.txt` keeps which model and engine it judged
    for warning in cfg.warnings:  # fields the architecture's reference implementation ignores
        print(f"ropekv: warning: {warning}", file=sys.stderr)
    progress = "off" if args.no_progress else ("bar" if sys.stderr.isatty() else "lines")
    tolerance = module.engine_tolerance(adapter) if module is not None else None
    if isinstance(adapter, NativeAdapter) and adapter.kv_dtype is not None:  # an 8-bit cache's noise floor
        tolerance = kv_tolerance(adapter.kv_dtype)
    if custom is not None and args.kv_dtype is not None:  # the adapter was asked for an 8-bit cache
        tolerance = kv_tolerance(args.kv_dtype)

    report = check(adapter, cases=cases, seed=args.seed, progress=progress, tolerance=tolerance, reference_cache=store)
    print(report.table())
    code = 0 if report.passed else 1
    if json_path is not None:
        facts = {**report.provenance, "command": shlex.join(args.command_line), "exit_code": code}
        json_path.write_text(dataclasses.replace(report, provenance=facts).to_json())
        print(f"report written to {json_path}", file=sys.stderr)
    if plot_path is not None:
        from ..parity.plot import plot_report

        plot_report(report, plot_path)
        print(f"plot written to {plot_path}", file=sys.stderr)
    return code


def build_adapter(args: argparse.Namespace, *, module=None, custom: CustomEngine | None = None, fault=None):
    """The adapter ``ropekv check`` judges for parsed ``args``: an external engine's (``module``, its
    adapter module), a custom one, HF's, ropekv's engine with ``fault``, or ropekv's own engine. The
    engine starts here (its model read, the engine built); the benchmarks time this call."""
    from ..adapters.native import NativeAdapter
    from ..faults.native import NativeFault
    from ..models import load_checkpoint

    if module is not None:
        return module.from_args(args)
    if custom is not None:
        guard = AdapterGuard(custom.spec, args.adapter_timeout)
        return custom.load(args.model, args.dtype, guard=guard, kv_dtype=args.kv_dtype)
    if args.engine == "hf":
        from ..adapters.hf import HFEngine

        return HFEngine.load(args.model, dtype=args.dtype)
    if fault is not None:
        kv = {"kv_dtype": args.kv_dtype, "kv_scale": args.kv_scale or "per_tensor"}
        return fault.adapter(
            load_checkpoint(args.model),
            dtype=args.dtype,
            key_form=args.key_form,
            **(kv if isinstance(fault, NativeFault) else {}),
        )
    return NativeAdapter(
        load_checkpoint(args.model),
        key_form=args.key_form or "rotated",
        backend=args.backend,
        dtype=args.dtype,
        device=args.device,
        kv_dtype=args.kv_dtype,
        kv_scale=args.kv_scale or "per_tensor",
    )


def _image_grid(text: str) -> ImageGrid:
    """``"4x4@5"`` -> ImageGrid(start=5, rows=4, cols=4); a one-line UsageError otherwise."""
    grid, at, start = text.partition("@")
    rows, x, cols = grid.partition("x")
    values = [strict_int(v) for v in (rows, cols, start)]
    if not (at and x) or any(v is None for v in values):
        raise UsageError(f"--image-grid {text!r}: write ROWSxCOLS@START, e.g. 4x4@5")
    r, c, st = (int(v) for v in values if v is not None)
    return ImageGrid(start=st, rows=r, cols=c)
