"""``ropekv bench --quick`` runs end to end and writes valid JSON.

Only that it runs and what it writes: no figure is asserted (timings on a shared CI machine mean
nothing, and the goal ratios are for the default model on the reference machine, see
docs/performance.md). The checkpoint is the tiny random llama that transformers itself writes.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pytest
import torch

from ropekv.bench.run import GOALS, RETIRED_FIGURES, measured_contexts
from ropekv.cache.paged import PagedKVCache
from ropekv.contract import CacheContract
from ropekv.engine.attention import attend
from ropekv.engine.rotation import RopeTables, StepContext, rotate
from ropekv.engine.transformer import rms_norm
from ropekv.errors import UsageError
from ropekv.rope import RopeScaling, RopeSpec

CONTEXTS = (16, 64)


@pytest.fixture(scope="module")
def bench_run(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path, plot_path = out / "bench.json", out / "bench.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ropekv.cli.main",
            "bench",
            str(tiny_llama_dir),
            "--quick",
            "--threads",
            "1",
            "--contexts",
            ",".join(map(str, CONTEXTS)),
            "--steps",
            "2",
            "--bandwidth-mib",
            "64",
            "--json",
            str(json_path),
            "--plot",
            str(plot_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(json_path.read_text()), plot_path


def _numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)
    elif isinstance(value, float):
        yield value


def test_quick_bench_writes_every_goal(bench_run) -> None:
    _, doc, _ = bench_run
    assert doc["format"] == "ropekv.bench" and doc["quick"] is True
    assert set(doc["goals"]) == set(GOALS)
    assert {
        "decode_step_over_floor_1024",
        "decode_step_over_floor_4096",
        "rotate_on_read_over_rotated_4096",
        "sweep_over_longest_prefill",
        "naive_over_sweep",
        "handoff_over_bare_sendrecv",
        "cache_bytes_over_ideal",
    } <= set(GOALS)  # the earlier JSON names stay (the two retired decode goals under "retired_figures")
    assert not set(RETIRED_FIGURES) & set(GOALS)
    assert set(RETIRED_FIGURES) <= set(doc["retired_figures"])
    for name, value in doc["goals"].items():
        if name == "naive_over_sweep":  # --quick skips the naive sweep and says so with null
            assert value is None
        else:
            assert isinstance(value, float) and value > 0, (name, value)
    assert set(doc["goal_targets"]) == set(GOALS) and set(doc["goals_met"]) == set(GOALS)


def test_quick_bench_holds_the_raw_figures(bench_run) -> None:
    _, doc, _ = bench_run
    assert doc["contexts"] == list(CONTEXTS)
    assert set(doc["transformers_decode_tokens_per_s"]) == {str(c) for c in CONTEXTS}
    for engine in ("rotated", "rotate_on_read"):
        runs = doc["decode"]["ropekv"][engine]["runs"]
        assert [r["context"] for r in runs] == list(CONTEXTS)
        for r in runs:
            assert r["tokens_per_s"] > 0 and len(r["step_seconds"]) == 2
            assert r["step_bytes"]["total"] == r["step_bytes"]["weights"] + r["step_bytes"]["kv_cache"]
    assert doc["bandwidth"]["bytes_per_s"] > 0
    assert doc["sweep"]["check_passed"] is True and doc["sweep"]["naive_seconds"] is None
    assert doc["handoff"]["payload_bytes"] > doc["handoff"]["tensor_bytes"] > 0
    assert doc["memory"]["cache"]["within_bound"] is True
    assert doc["memory"]["check_peak_rss_bytes"] > 0
    for key in ("cpu_model", "usable_cpus", "memory_bytes", "torch", "threads"):
        assert key in doc["machine"]
    assert doc["machine"]["threads"] == 1
    assert all(math.isfinite(x) for x in _numbers(doc))


def test_the_decode_floor_goal_is_the_step_over_its_matvecs_plus_its_kv_bytes(bench_run) -> None:
    """Recomputed here from the raw figures: the median rotated step, the matvec floor's median step and
    the KV bytes the step reads over the measured copy bandwidth."""
    _, doc, _ = bench_run
    for ctx in (1024, 4096):
        used = doc["goal_contexts"][f"decode_step_over_floor_{ctx}"]
        i = doc["contexts"].index(used)
        run = doc["decode"]["ropekv"]["rotated"]["runs"][i]
        floor = statistics.median(doc["weights_matvec_floor"]["runs"][i]["step_seconds"])
        kv = run["step_bytes"]["kv_cache"] / doc["bandwidth"]["bytes_per_s"]
        assert run["step_bytes"]["kv_cache"] > 0
        assert doc["goals"][f"decode_step_over_floor_{ctx}"] == pytest.approx(
            statistics.median(run["step_seconds"]) / (floor + kv)
        )


def test_quick_bench_prints_a_table_and_a_plot(bench_run) -> None:
    proc, _, plot_path = bench_run
    assert "decode, one sequence" in proc.stdout and "goals" in proc.stdout
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_bench_states_the_matvec_ceilings(bench_run) -> None:
    """The two retired decode figures' ceilings are the matvec floor's own figures at their context, over
    transformers' tokens/s and over the bandwidth limit (recomputed here from the raw step times),
    and the table prints them under the goals and the time each engine spends above the floor."""
    proc, doc, _ = bench_run
    ctx = doc["retired_figures"]["context"]
    i = doc["contexts"].index(ctx)
    floor = doc["weights_matvec_floor"]["runs"][i]["step_seconds"]
    hf = doc["decode"]["transformers"]["runs"][i]["step_seconds"]
    limit = doc["decode"]["ropekv"]["rotated"]["runs"][i]["bandwidth_limit_tokens_per_s"]
    assert doc["ceilings"]["decode_vs_transformers_1024"] == pytest.approx(
        statistics.median(hf) / statistics.median(floor)
    )
    assert doc["ceilings"]["decode_fraction_of_bandwidth_limit_1024"] == pytest.approx(
        1 / statistics.median(floor) / limit
    )
    assert f"retired figure 'decode speed vs transformers (tokens/s ropekv / transformers)' at context {ctx}" in (
        proc.stdout
    )
    assert "time per step above the matvec floor" in proc.stdout


def test_contexts_past_the_model_start_where_their_steps_still_fit() -> None:
    assert measured_contexts([1024, 4096, 8192], 8192, 14) == [1024, 4096, 8178]
    assert measured_contexts([8192, 9000], 8192, 14) == [8178]
    assert measured_contexts([128], 8192, 14) == [128]
    with pytest.raises(UsageError, match="no room"):
        measured_contexts([16], 10, 14)


# ---------------------------------------------------------------------- the hot paths the bench drove


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("heads", [1, 3])
def test_step_table_rotation_is_rope_rotate(layout, rotary_dim, dtype, heads) -> None:
    """A step's cos/sin table (``RopeTables.table``, handed to every layer in the step context) rotates
    as ``RopeSpec.rotate`` does, within the rounding of its fused multiply-adds; positions a table cannot
    serve (negative, huge, length-dependent RoPE) get no table, and the policy computes them."""
    spec = RopeSpec(head_dim=64, rotary_dim=rotary_dim, theta=100000.0, layout=layout, max_position_embeddings=8192)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    tables = RopeTables(spec, work, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for positions in (torch.arange(4097), torch.randint(0, 9000, (333,), generator=g), torch.tensor([0])):
        table = tables.table(positions, heads)
        x = torch.randn(positions.numel(), 3, 64, generator=g).to(dtype)
        ctx = StepContext(phase="decode", seq_len=int(positions.max()) + 1, tables=(table,))
        expected = spec.rotate(x, positions)
        got = rotate(spec, x, positions, ctx)
        assert got.dtype == dtype and table.serves(spec, positions, x)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-12 if dtype == torch.float64 else 2e-6
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        assert not table.serves(spec, positions.clone(), x)  # only the tensor it was built from
        out = torch.empty(x.shape, dtype=work)
        assert table.rotate(x, out) is out
        torch.testing.assert_close(out.to(dtype), expected, rtol=tol, atol=tol)
    assert tables.table(torch.tensor([5, -1, 7])) is None and tables.table(torch.tensor([3, 1 << 21])) is None
    dynamic = spec.replace(scaling=RopeScaling("dynamic", factor=2.0))
    assert RopeTables(dynamic, work, torch.device("cpu")).table(torch.arange(4)) is None


def test_rotation_keeps_no_state_between_steps() -> None:
    """Nothing is memoized in module state: the policy reads only the tables its step hands it."""
    import ropekv.engine.rotation as rotation

    spec = RopeSpec(head_dim=8, rotary_dim=8, theta=10000.0)
    positions = torch.arange(5)
    x = torch.randn(5, 2, 8)
    wrong = RopeTables(spec.replace(theta=20.0), torch.float32, torch.device("cpu")).table(positions)
    assert not wrong.serves(spec, positions, x)  # a table of another spec never serves
    ctx = StepContext(phase="decode", seq_len=5, tables=(wrong,))
    assert torch.equal(rotate(spec, x, positions, ctx), spec.rotate(x, positions))
    assert not any(isinstance(v, (dict, list)) for k, v in vars(rotation).items() if not k.startswith("__"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_engine_rms_norm_is_the_spelled_out_formula_bit_for_bit(dtype) -> None:
    g = torch.Generator().manual_seed(3)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    for rows, dim in ((1, 576), (7, 64), (300, 1536), (2, 4096), (5, 100)):
        for scale in (1e-3, 1.0, 1e3):
            x = (torch.randn(rows, dim, generator=g) * scale).to(dtype)
            weight = (1 + torch.randn(dim, generator=g)).to(dtype)
            xf = x.to(work)
            expected = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
            assert torch.equal(rms_norm(x, weight, 1e-5), expected)


def test_attend_without_mask_is_attend_with_everything_visible() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 9, 64, generator=g)
    k, v = torch.randn(300, 3, 64, generator=g), torch.randn(300, 3, 64, generator=g)
    out_a, logits_a = attend(q, k, v, torch.ones(1, 300, dtype=torch.bool))
    out_b, logits_b = attend(q, k, v, None)
    assert torch.equal(out_a, out_b) and torch.equal(logits_a, logits_b)


def _cache_contract(window=None, sinks=0) -> CacheContract:
    rope = RopeSpec(head_dim=8, rotary_dim=8, theta=10000.0)
    return CacheContract(
        key_form="rotated",
        rope=rope,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        window=window,
        window_layers=(1,) if window else (),
        sink_tokens=sinks,
        block_size=4,
    )


def test_uncopied_cache_views_hold_what_copied_ones_hold() -> None:
    """``view(copy=False)`` (the engine's read: pool slices when the rows are consecutive) must show the
    same tokens as the gathered copy, whether the rows are consecutive or not (forks, wrapped rings)."""
    cache = PagedKVCache(_cache_contract(window=5, sinks=1), num_blocks=32)
    g = torch.Generator().manual_seed(2)

    def append(seq, n):
        start = cache.last_position(seq) + 1
        keys = [torch.randn(n, 2, 8, generator=g) for _ in range(2)]
        values = [torch.randn(n, 2, 8, generator=g) for _ in range(2)]
        cache.append(seq, torch.arange(start, start + n), keys, values, key_form="rotated")

    shared = set()

    def check() -> None:
        for seq in cache.seq_ids():
            for layer in (0, 1):
                copied, uncopied = cache.view(seq, layer), cache.view(seq, layer, copy=False)
                for field in ("keys", "values", "positions", "slots"):
                    assert torch.equal(getattr(copied, field), getattr(uncopied, field)), (seq, layer, field)
                pool = cache.keys[layer].untyped_storage().data_ptr()
                shared.add(uncopied.keys.untyped_storage().data_ptr() == pool)

    cache.create("a")
    append("a", 5)  # consecutive rows in both layers
    check()
    append("a", 4)  # layer 1's ring (1 sink + 5) has wrapped
    check()
    cache.fork("b", "a", 9)  # the last block is shared, then copied on write: not consecutive
    append("b", 4)
    cache.create("c")
    for _ in range(3):
        append("c", 3)
        append("a", 2)
        check()
    assert shared == {True, False}  # both paths ran


@pytest.mark.parametrize("window, sinks", [(None, 0), (37, 0), (37, 3)])
def test_attend_in_query_blocks_matches_attend_at_once(window, sinks) -> None:
    """A long prefill without logits goes in query blocks that read only the keys they can see; it must
    agree with the one-block computation within float32 rounding (written out independently here)."""
    from ropekv.engine.attention import visibility

    g = torch.Generator().manual_seed(4)
    n, cached = 700, 300
    q = torch.randn(n, 6, 16, generator=g)
    k, v = torch.randn(cached + n, 2, 16, generator=g), torch.randn(cached + n, 2, 16, generator=g)
    positions = torch.arange(cached, cached + n)
    mask = visibility(positions, torch.arange(cached + n), window, sinks)
    expected, _ = attend(q, k, v, mask)
    import ropekv.engine.attention as attention

    old = attention._BLOCK_BYTES
    attention._BLOCK_BYTES = 6 * (cached + n) * 4 * 64  # 64 query rows a block
    try:
        blocked, logits = attend(q, k, v, mask, with_logits=False)
    finally:
        attention._BLOCK_BYTES = old
    assert logits is None
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k.double().repeat_interleave(3, dim=1)) / 4.0
    reference = torch.einsum(
        "hnm,mhd->nhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v.double().repeat_interleave(3, dim=1)
    )
    torch.testing.assert_close(blocked.double(), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(blocked, expected, rtol=1e-5, atol=1e-6)


def test_attend_over_segments_is_attend_over_the_joined_keys() -> None:
    """A decode step reads the cached keys/values in place (segments) instead of joining them first."""
    from ropekv.engine.attention import attend_segments

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 9, 64, generator=g)
    k, v = torch.randn(1025, 3, 64, generator=g), torch.randn(1025, 3, 64, generator=g)
    joined, _ = attend(q, k, v, None)
    split = attend_segments(q, (k[:1024], k[1024:]), (v[:1024], v[1024:]))
    torch.testing.assert_close(split, joined, rtol=1e-6, atol=1e-6)
    assert torch.equal(attend_segments(q, (k,), (v,)), joined)


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
@pytest.mark.parametrize("window", [None, 9])
def test_unprobed_decode_reads_like_the_probed_one(tiny_llama_dir, key_form, window) -> None:
    """An unprobed decode step reads the cached keys in place (attend_segments) and rotates raw keys
    into a reused scratch; a probed step joins and keeps them. Both must give the same logits, and both
    must agree with the engine's own full forward over the same tokens."""
    from ropekv.engine import Engine
    from ropekv.models import load_checkpoint

    ckpt = load_checkpoint(tiny_llama_dir)
    contract = CacheContract.for_model(
        ckpt.config, key_form=key_form, block_size=4, dtype="float32", weights_fingerprint=ckpt.weights_fingerprint
    )
    if window is not None:
        contract = contract.replace(window=window, window_layers=(0,))
    tokens = torch.randint(0, ckpt.config.vocab_size, (30,), generator=torch.Generator().manual_seed(6))
    fast, probed = Engine(ckpt, contract, 16), Engine(ckpt, contract, 16)
    for engine in (fast, probed):
        engine.prefill("s", tokens[:20], chunk_size=7)
    for t in range(20, 30):
        a = fast.decode("s", int(tokens[t])).logits
        b = probed.decode("s", int(tokens[t]), probe=True).logits
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if window is None:
        full = fast.forward_full(tokens[:30]).logits[-1]
        torch.testing.assert_close(a[-1], full, rtol=1e-4, atol=1e-4)


def test_compiled_rotation_keeps_the_eager_step(tiny_llama_dir) -> None:
    """``compile_rotation`` (one torch.compile'd pass over the keys a rotate-on-read step turns) must
    give the eager step's logits within float32 rounding, at contexts past one compiled shape."""
    from ropekv.engine import Engine
    from ropekv.models import load_checkpoint

    ckpt = load_checkpoint(tiny_llama_dir)
    contract = CacheContract.for_model(
        ckpt.config, key_form="raw", block_size=4, dtype="float32", weights_fingerprint=ckpt.weights_fingerprint
    )
    tokens = torch.randint(0, ckpt.config.vocab_size, (40,), generator=torch.Generator().manual_seed(7))
    eager, compiled = Engine(ckpt, contract, 16), Engine(ckpt, contract, 16, compile_rotation=True)
    for engine in (eager, compiled):
        engine.prefill("s", tokens[:30])
    for t in range(30, 40):
        torch.testing.assert_close(
            compiled.decode("s", int(tokens[t])).logits, eager.decode("s", int(tokens[t])).logits, rtol=1e-5, atol=1e-5
        )


# ---------------------------------------------------------------------- logits only where a check reads them


def test_logits_of_the_rows_a_check_reads_are_those_rows_of_all_logits(tiny_llama_dir) -> None:
    """A long check computes logits only at its probed rows (all rows of 8,190 tokens are GBs): the
    reference's ``logits_for="probed"``, the engine's ``forward_full(logits_rows=)`` and a prefill's
    last-row logits are those rows of the all-rows forward (to the rounding of a matmul over fewer rows)."""
    from ropekv.engine import Engine
    from ropekv.models import ReferenceDecoder, load_checkpoint

    ckpt = load_checkpoint(str(tiny_llama_dir))
    tokens = torch.arange(40) % ckpt.config.vocab_size
    rows = [39, 7, 20]
    ref = ReferenceDecoder(ckpt)
    every, probed = ref.forward(tokens, probe_rows=rows), ref.forward(tokens, probe_rows=rows, logits_for="probed")
    assert probed.probed_logits and not every.probed_logits and probed.logits.shape[0] == 3
    torch.testing.assert_close(probed.logits, every.logits[rows], rtol=1e-12, atol=1e-12)
    with pytest.raises(UsageError, match="logits_for"):
        ref.forward(tokens, logits_for="probed")  # no probe rows to compute
    contract = CacheContract.for_model(ckpt.config, key_form="rotated", block_size=8)
    engine = Engine(ckpt, contract, num_blocks=16)
    full = engine.forward_full(tokens)
    torch.testing.assert_close(
        engine.forward_full(tokens, logits_rows=rows).logits, full.logits[rows], rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(engine.prefill("s", tokens), full.logits[-1], rtol=1e-5, atol=1e-5)


def test_a_check_reports_the_seconds_of_its_unavoidable_parts(tiny_llama_dir) -> None:
    from ropekv import check
    from ropekv.adapters.native import NativeAdapter
    from ropekv.models import load_checkpoint

    report = check(
        NativeAdapter(load_checkpoint(str(tiny_llama_dir))),
        lengths=[30],
        block_sizes=[8],
        prefix_offsets=[0],
        decode_steps=2,
    )
    parts = report.phase_seconds
    assert set(parts) == {"float64_reference_forwards", "engine_full_forwards", "cached_runs"}
    assert all(v > 0 for v in parts.values()) and sum(parts.values()) < report.seconds
    assert report.to_dict()["phase_seconds"].keys() == parts.keys()


def test_the_long_context_comparison_divides_the_two_models_seconds_per_context() -> None:
    from ropekv.bench.long_context import format_against

    def run(length: int, check: float, ref: float | None) -> dict:
        return {"length": length, "check_seconds": check, "parts": {"float64_reference_forward": {"seconds": ref}}}

    doc = {
        "runs": [run(2048, 10.0, 2.0), run(32768, 40.0, None)],
        "against": {"runs": [run(2048, 30.0, 8.0), run(32768, 100.0, 50.0), run(99, 1.0, 1.0)]},
    }
    lines = format_against(doc).splitlines()
    assert len(lines) == 4  # header, rule, the two shared contexts (99 is only in the other model)
    assert lines[2].split() == ["2048", "10.0", "30.0", "3.00x", "2.0", "8.0", "4.00x"]
    assert lines[3].split() == ["32768", "40.0", "100.0", "2.50x", "-", "50.0", "-"]


def test_the_long_context_table_states_the_run_s_own_memory_target() -> None:
    from ropekv.bench.long_context import PARTS, format_table

    part = {"seconds": 1.0, "peak_rss_bytes": 1 << 30}
    run = {
        "length": 32766,
        "check_seconds": 5.0,
        "startup_seconds": 1.0,
        "check_peak_rss_bytes": int(9.99 * 2**30),
        "parts": dict.fromkeys(PARTS, part),
        "floor_seconds": 3.0,
        "check_over_floor": 4.0 / 3.0,
        "load_average_start": [0.0, 0.0, 0.0],
    }
    doc = {
        "runs": [run],
        "goals": {"check_over_floor": 4.0 / 3.0, "peak_rss_bytes_at_longest": run["check_peak_rss_bytes"]},
        "targets": {"check_over_floor": 1.5, "peak_rss_bytes_at_longest": 12 << 30},
    }
    assert format_table(doc).splitlines()[-1] == (
        "check/floor at worst 1.33x (target <= 1.5x); peak RSS at the longest 9.99 GiB (target < 12 GiB)"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--lengths", "0"],
        ["--lengths", "2048,x"],
        ["--lengths", str((1 << 20) + 1)],
        ["--decode-steps", "0"],
        ["--threads", "1000"],
        ["--peak-rss-gib", "nan"],
        ["--peak-rss-gib", "0"],
    ],
)
def test_the_long_context_bench_refuses_unbounded_settings_before_running_anything(args, capsys) -> None:
    from ropekv.bench.long_context import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and "must" in capsys.readouterr().err


def test_the_engine_checks_table_gives_each_engine_its_parts_and_the_worst_ratio() -> None:
    from ropekv.bench.engine_checks import format_table

    run = {
        "engine": "vllm",
        "check_seconds": 100.0,
        "check_exit_code": 0,
        "passed": True,
        "cases": 8,
        "judged": 8,
        "interpreter_and_imports_seconds": 10.0,
        "engine_start_seconds": 20.0,
        "phase_seconds": {"float64_reference_forwards": 0.0, "cached_runs": 30.0, "engine_full_forwards": 25.0},
        "harness_seconds": 5.0,
        "reference_cache": {"hits": 8, "computed": 0, "recomputed": 0},
        "check_over_parts": 1.2,
    }
    slow = {**run, "engine": "mlx", "passed": False, "check_over_parts": 1.8, "reference_cache": None}
    lines = format_table([run, slow, {"engine": "llamacpp", "error": "not found"}]).splitlines()
    assert lines[2].split() == ["vllm", "PASS", "(8/8)", "100.0", "10.0", "20.0", "0.0", "30.0", "25.0", "5.0"] + [
        "1.20x",
        "8",
        "hit(s),",
        "0",
        "computed",
    ]
    assert lines[3].split()[:3] == ["mlx", "FAIL", "(8/8)"] and lines[3].split()[-2:] == ["1.80x", "-"]
    assert lines[4].split() == ["llamacpp", "not", "found"]
    assert lines[-1] == "check over its parts at worst 1.80x (target <= 1.5x): MISSED"


def test_the_kernels_floor_runs_each_layers_attention_over_the_keys_a_step_reads(tiny_llama_dir) -> None:
    """The kernels floor: per layer its projections, and two attention matmuls over exactly the keys a
    decode step at that position reads (every key; a sliding layer its window plus sinks), then the
    LM head. Recorded from the aten calls it makes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ropekv.bench.decode import kernels_floor_driver, step_bytes
    from ropekv.engine.transformer import DecoderWeights
    from ropekv.models import load_checkpoint

    ckpt = load_checkpoint(tiny_llama_dir)
    cfg = ckpt.config
    contract = CacheContract.for_model(
        ckpt.config, key_form="rotated", block_size=4, dtype="float32", weights_fingerprint=ckpt.weights_fingerprint
    ).replace(window=5, window_layers=(1,), sink_tokens=2)
    weights = DecoderWeights.from_checkpoint(ckpt, torch.float32)
    driver = kernels_floor_driver(weights, contract, 40)

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("bmm", "mm", "addmm", "linear"):
                self.calls.append((name, tuple(args[0].shape), tuple(args[1].shape)))
            return func(*args, **(kwargs or {}))

    for position in (3, 20):
        with Record() as rec:
            driver.decode(position)
        bmms = [c for c in rec.calls if c[0] == "bmm"]
        assert len(bmms) == 2 * cfg.num_layers
        for layer in range(cfg.num_layers):
            scores, out = bmms[2 * layer], bmms[2 * layer + 1]
            seen = min(position + 1, 5 + 2) if layer == 1 else position + 1
            assert scores[2] == (contract.num_kv_heads, contract.head_dim, seen), (layer, scores)
            assert out[2] == (contract.num_kv_heads, seen, contract.head_dim), (layer, out)
        # its KV bytes are the ones the bench charges a step with (step_bytes)
        kv = sum(2 * b[2][0] * b[2][1] * b[2][2] * 4 for b in bmms[0::2])
        assert kv == step_bytes(ckpt, contract, weights, position + 1)["kv_cache"]
        assert len(rec.calls) - len(bmms) == driver.keep["matrices"] == 4 * cfg.num_layers + 1
    with pytest.raises(ValueError, match="outside its 40 cached rows"):
        driver.decode(40)


def test_quick_bench_splits_the_step_into_its_kernels(bench_run) -> None:
    """The kernels floor's figures, recomputed from the raw step times: the attention matmuls' share
    (kernels floor minus matvec floor), the rate they read the KV at, and each step over its kernels."""
    proc, doc, _ = bench_run
    for i, ctx in enumerate(doc["contexts"]):
        k = doc["kernels_floor"]["runs"][i]
        f = doc["weights_matvec_floor"]["runs"][i]
        r = doc["decode"]["ropekv"]["rotated"]["runs"][i]
        assert k["context"] == ctx and len(k["step_seconds"]) == 2
        attention = statistics.median(k["step_seconds"]) - statistics.median(f["step_seconds"])
        assert k["attention_seconds"] == pytest.approx(attention)
        if attention > 0:
            assert k["kv_read_bytes_per_s"] == pytest.approx(r["step_bytes"]["kv_cache"] / attention)
        assert r["step_over_kernels_floor"] == pytest.approx(
            statistics.median(r["step_seconds"]) / statistics.median(k["step_seconds"])
        )
    assert "the step's kernels alone at context" in proc.stdout
    assert "attention matmuls alone" in proc.stdout


@pytest.mark.parametrize("arch, handed_off", [("llama", 8), ("mistral", 20)])
def test_the_handoff_payload_is_a_forked_prefix_or_the_whole_sliding_sequence(
    tiny_llama_dir, tiny_mistral_dir, arch, handed_off
) -> None:
    """The handoff bench forks the first ``handoff_tokens`` of its decode sequence. Where sliding
    layers keep only their window (tiny mistral: 5 tokens), a shorter prefix's rows are overwritten,
    so the whole sequence goes instead (the fork used to refuse it and end the bench)."""
    from ropekv.bench.run import handoff_payload
    from ropekv.engine import Engine
    from ropekv.models import load_checkpoint
    from ropekv.transfer.payload import read_payload

    ckpt = load_checkpoint(tiny_llama_dir if arch == "llama" else tiny_mistral_dir)
    contract = CacheContract.for_model(
        ckpt.config, key_form="rotated", block_size=4, dtype="float32", weights_fingerprint=ckpt.weights_fingerprint
    )
    assert bool(contract.window_layers) == (arch == "mistral")
    engine = Engine(ckpt, contract, 16)
    tokens = torch.randint(0, ckpt.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    engine.prefill("bench", tokens)
    said: list[str] = []
    payload, n = handoff_payload(engine, "bench", tokens, 8, said.append)
    handoff = read_payload(payload)
    assert n == handoff.num_tokens == handed_off
    assert torch.equal(handoff.tokens, tokens[:handed_off])
    assert torch.equal(handoff.positions, torch.arange(handed_off))
    assert engine.cache.seq_ids() == ["bench"]  # the fork is given back
    assert bool(said) == (arch == "mistral") and (not said or "whole sequence" in said[0])
