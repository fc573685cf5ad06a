"""Prefill->decode handoff: parity across it, the contract at the import boundary, the all-or-nothing
import, the rotate-on-transfer fault, and the torch.distributed workers on localhost (gloo).

In-process tests use :class:`HandoffAdapter` (prefill engine -> payload bytes -> decode engine). The
multi-process tests start real ranks (a few seconds each) and keep to one short run per scenario.
"""

import dataclasses
import json
import time

import pytest
import torch
from handoff_hooks import CorruptInFlight, KillDecodeMidTransfer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ropekv import check
from ropekv.bugs.registry import get_handoff_fault
from ropekv.cache.quant import LayerScales
from ropekv.cli.main import main
from ropekv.contract import CacheContract, KvQuant, MlaCache
from ropekv.engine import Engine
from ropekv.errors import CacheError, CapacityError, ContractMismatch, PayloadError, RopeKVError, UsageError
from ropekv.handoff.adapter import HandoffAdapter
from ropekv.handoff.workers import launch
from ropekv.models import load_checkpoint
from ropekv.parity.cases import Case
from ropekv.rope import RopeScaling, RopeSpec
from ropekv.transfer import Handoff, read_payload, write_payload
from ropekv.transfer.handshake import decide
from ropekv.transfer.importer import export_handoff, import_handoff
from ropekv.transfer.payload import window_rows

CASES = [
    Case(length=17),
    Case(length=20, prefix=5, block_size=7),  # a prefix-cache hit on the prefill side
    Case(length=20, block_size=5, window=7, sink_tokens=2),  # a wrapped ring travels as its live rows
]


@pytest.fixture(scope="module")
def ckpt(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


@pytest.fixture(scope="module")
def base(ckpt):
    return CacheContract.for_model(ckpt.config, key_form="rotated", weights_fingerprint=ckpt.weights_fingerprint)


def tokens(n, offset=20):
    return torch.arange(offset, offset + n) % 90 + 5


def prefilled(ckpt, contract, n, seq="s", num_blocks=16):
    engine = Engine(ckpt, contract, num_blocks)
    engine.prefill(seq, tokens(n))
    return engine


# ---------------------------------------------------------------------- parity across the handoff


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_parity_holds_across_the_handoff(ckpt, key_form):
    adapter = HandoffAdapter(ckpt, prefill_key_form=key_form)
    report = check(adapter, cases=CASES)
    assert report.passed, report.table()
    assert [t.tokens for t in adapter.transfers] == [17, 25, 20]
    assert all(t.payload_bytes > t.tensor_bytes for t in adapter.transfers)


@pytest.mark.parametrize("prefill, decode, conversion", [("raw", "rotated", "rotate"), ("rotated", "raw", "unrotate")])
def test_explicit_conversion_passes(ckpt, prefill, decode, conversion):
    adapter = HandoffAdapter(ckpt, prefill_key_form=prefill, decode_key_form=decode, convert="explicit")
    assert adapter.conversion == conversion
    report = check(adapter, cases=CASES[:2])
    assert report.passed, report.table()


def test_key_form_mismatch_is_refused_unless_converted_explicitly(ckpt):
    with pytest.raises(ContractMismatch, match="convert='explicit' would convert") as e:
        HandoffAdapter(ckpt, prefill_key_form="rotated", decode_key_form="raw")
    assert "key_form" in e.value.fields and "twice their position" in str(e.value)


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_rotate_on_transfer_is_caught_and_named(ckpt, key_form):
    fault = get_handoff_fault("rotate-on-transfer")
    report = check(HandoffAdapter(ckpt, prefill_key_form=key_form, policy=fault.policy()), cases=[Case(length=17)])
    assert not report.passed
    assert report.diagnosis.kind == fault.kind == "rotate_on_transfer", report.table()


def test_unknown_handoff_fault_is_a_usage_error():
    with pytest.raises(UsageError, match="rotate-on-transfer"):
        get_handoff_fault("rotate-twice")


# ---------------------------------------------------------------------- the contract at the boundary


def variants(base: CacheContract) -> dict[str, CacheContract]:
    """field -> a contract differing from ``base`` in (at least) that field."""
    rope = base.rope
    raw = base.with_key_form("raw")
    small = rope.replace(head_dim=8, rotary_dim=8)
    linear = base.replace(rope=rope.replace(scaling=RopeScaling("linear", factor=2.0)))
    return {
        "key_form": raw,
        "rotation_index": raw.replace(rotation_index="cache"),
        "rope.head_dim": base.replace(rope=small, head_dim=8),
        "head_dim": base.replace(rope=small, head_dim=8),
        "rope.rotary_dim": base.replace(rope=rope.replace(rotary_dim=8)),
        "rope.theta": base.replace(rope=rope.replace(theta=500000.0)),
        "rope.layout": base.replace(rope=rope.replace(layout="gptj")),
        "rope.scaling.rope_type": linear,
        "rope.scaling.factor": linear,
        "rope.attention_factor": base.replace(rope=rope.replace(attention_factor=1.2)),
        # the length dynamic NTK grows its base past (it changes no key under any other type)
        "rope.max_position_embeddings": base.replace(
            rope=rope.replace(scaling=RopeScaling("dynamic", factor=2.0), max_position_embeddings=4096)
        ),
        "window": base.replace(window=7, window_layers=(0, 1)),
        "window_layers": base.replace(window=7, window_layers=(1,)),
        "sink_tokens": base.replace(window=7, window_layers=(0, 1), sink_tokens=2),
        # a writer whose layer 1 (or every layer) is chunked (llama4): named per layer too
        "chunk_size": base.replace(chunk_size=8, chunk_layers=(1,)),
        "chunk_layers": base.replace(chunk_size=8, chunk_layers=(0, 1)),
        "layers.1.attention": base.replace(chunk_size=8, chunk_layers=(1,)),
        # a writer whose RoPE is Qwen2-VL's mRoPE (sections of the pairs by three position streams)
        "rope.mrope_section": base.replace(rope=rope.replace(mrope_section=(rope.rotary_dim // 2,))),
        "block_size": base.replace(block_size=8),
        "dtype": base.replace(dtype="bfloat16"),
        "block_layout": base.replace(block_layout="blocks,2,heads,block,dim"),
        # a writer whose cache is 8-bit (float8_e4m3fn codes with per-layer scales)
        "kv_quant": base.replace(
            dtype="float8_e4m3fn",
            kv_quant=KvQuant("per_tensor", "after_rope" if base.key_form == "rotated" else "before_rope"),
        ),
        "num_layers": base.replace(num_layers=3),
        "num_kv_heads": base.replace(num_kv_heads=4),
        "weights_fingerprint": base.replace(weights_fingerprint="another-model"),
        "config_fingerprint": base.replace(config_fingerprint="another-config"),
        # a writer whose layer 1 has no position embedding (NoPE)
        "layer_ropes": base.replace(layer_ropes=(rope, None) + (rope,) * (base.num_layers - 2)),
        # a writer rotating the trailing half of each key, and one that is multi-head latent attention
        "rope.rotary_offset": base.replace(
            rope=rope.replace(rotary_dim=rope.head_dim // 2, rotary_offset=rope.head_dim // 2)
        ),
        "mla": base.replace(
            rope=rope.replace(rotary_dim=rope.head_dim // 2, rotary_offset=rope.head_dim // 2),
            mla=MlaCache("expanded", rope.head_dim // 2, rope.head_dim // 2, 8, 16),
        ),
    }


def synthetic(c: CacheContract, n: int = 9, seq_id="incoming") -> Handoff:
    """A well-formed handoff under ``c`` (random keys), whatever its shapes."""
    g = torch.Generator().manual_seed(n)
    parts = {"keys": [], "values": []}
    for layer in range(c.num_layers):
        rows = len(window_rows(n, c.window, c.sink_tokens)) if layer in c.window_layers else n
        for part in parts.values():
            part.append(torch.randn(rows, c.num_kv_heads, c.head_dim, generator=g).to(c.torch_dtype))
    one = torch.ones(1 if c.kv_quant is None or c.kv_quant.scale == "per_tensor" else c.num_kv_heads)
    return Handoff(
        contract=c,
        seq_id=seq_id,
        tokens=tokens(n),
        positions=torch.arange(n),
        keys=tuple(parts["keys"]),
        values=tuple(parts["values"]),
        scales=None if c.kv_quant is None else tuple(LayerScales(one, one) for _ in range(c.num_layers)),
    )


def test_variants_cover_every_contract_field(base):
    # rotation_sites differs only where stored keys would be read wrong: tests/test_contract_rotation_sites.py
    top = {f.name for f in dataclasses.fields(CacheContract)} - {"rope", "rotation_sites"}
    rope = {f"rope.{f.name}" for f in dataclasses.fields(RopeSpec)} - {"rope.scaling"}
    assert top | rope <= set(variants(base))


@pytest.mark.parametrize("convert", ["never", "explicit"])
def test_each_contract_mismatch_is_refused_with_the_field_named(ckpt, base, convert):
    engine = prefilled(ckpt, base, 10, seq="other")
    before = engine.cache.state_digest()
    for field, theirs in variants(base).items():
        if convert == "explicit" and field == "key_form":
            continue  # converted: see test_explicit_conversion_passes
        with pytest.raises(ContractMismatch) as e:
            import_handoff(engine.cache, synthetic(theirs), convert=convert)
        assert field in e.value.fields and field in str(e.value), field
        assert engine.cache.state_digest() == before, field
        verdict = decide(base, theirs, convert, rank=1)
        assert not verdict.accepted and field in verdict.fields and field in verdict.message, field
    assert engine.cache.seq_ids() == ["other"]


def test_handshake_accepts_equal_contracts_and_a_convertible_key_form(base):
    assert decide(base, base, "never", rank=1).accepted
    verdict = decide(base, base.with_key_form("raw"), "explicit", rank=1)
    assert verdict.accepted and verdict.conversion == "rotate" and "key_form" in verdict.fields


def test_conversion_is_refused_for_length_dependent_rope(base):
    dynamic = base.replace(rope=base.rope.replace(scaling=RopeScaling("dynamic", factor=2.0))).with_key_form("raw")
    verdict = decide(dynamic, dynamic.with_key_form("rotated"), "explicit", rank=1)
    assert not verdict.accepted and "depend on the sequence length" in verdict.message


# ---------------------------------------------------------------------- all or nothing


def test_import_is_all_or_nothing(ckpt, base):
    engine = prefilled(ckpt, base, 20, seq="other", num_blocks=3)  # 2 of 3 blocks in use
    twin = prefilled(ckpt, base, 20, seq="other", num_blocks=3)
    before = engine.cache.state_digest()
    big = export_handoff(prefilled(ckpt, base, 40).cache, "s", tokens(40))
    failures = [
        (lambda: import_handoff(engine.cache, big), CapacityError),  # needs 3 blocks, 1 free
        (lambda: import_handoff(engine.cache, big, seq_id="other"), CacheError),  # the id is taken
        (lambda: import_handoff(engine.cache, synthetic(base.with_key_form("raw"))), ContractMismatch),
        (lambda: import_handoff(engine.cache, big, convert="sometimes"), UsageError),
        (lambda: import_handoff(engine.cache, b"payload bytes"), UsageError),
    ]
    for attempt, error in failures:
        with pytest.raises(error):
            attempt()
        assert engine.cache.state_digest() == before
        assert engine.cache.seq_ids() == ["other"]
    small = export_handoff(prefilled(ckpt, base, 10).cache, "s", tokens(10))
    assert import_handoff(engine.cache, read_payload(write_payload(small)), seq_id="new") == "new"
    assert engine.num_tokens("new") == 10
    assert torch.equal(engine.decode("other", 3).logits, twin.decode("other", 3).logits)


def test_imported_sequence_decodes_like_the_original(ckpt, base):
    source = prefilled(ckpt, base, 23)
    target = Engine(ckpt, base, 16)
    import_handoff(target.cache, read_payload(write_payload(export_handoff(source.cache, "s", tokens(23)))))
    for t in (4, 9):
        torch.testing.assert_close(target.decode("s", t).logits, source.decode("s", t).logits, rtol=0, atol=0)


@pytest.mark.parametrize("sinks", [0, 2])
def test_all_sliding_wrapped_ring_round_trips(ckpt, base, sinks):
    windowed = base.replace(window=5, window_layers=(0, 1), sink_tokens=sinks, block_size=3)
    source = prefilled(ckpt, windowed, 14)
    h = export_handoff(source.cache, "s", tokens(14))
    assert torch.equal(h.positions, torch.arange(14))
    assert h.keys[0].shape[0] == sinks + 5
    target = Engine(ckpt, windowed, 16)
    import_handoff(target.cache, read_payload(write_payload(h)))
    torch.testing.assert_close(target.decode("s", 7).logits, source.decode("s", 7).logits, rtol=0, atol=0)


def test_export_refuses_positions_the_ring_no_longer_determines(ckpt, base):
    windowed = base.replace(window=3, window_layers=(0, 1))
    engine = Engine(ckpt, windowed, 16)
    late = synthetic(windowed, n=8, seq_id="late")
    import_handoff(engine.cache, dataclasses.replace(late, positions=torch.arange(8) + 100))
    with pytest.raises(CacheError, match="do not determine"):
        export_handoff(engine.cache, "late", tokens(8))


def test_export_checks_its_tokens(ckpt, base):
    engine = prefilled(ckpt, base, 5)
    with pytest.raises(UsageError, match="one per cached token"):
        export_handoff(engine.cache, "s", tokens(4))
    with pytest.raises(CacheError, match="unknown"):
        export_handoff(engine.cache, "missing", tokens(5))


@pytest.fixture(scope="module")
def damaged_target(ckpt, base):
    engine = prefilled(ckpt, base, 6, seq="other")
    data = write_payload(export_handoff(prefilled(ckpt, base, 7).cache, "s", tokens(7)))
    return engine, data, engine.cache.state_digest()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.integers(min_value=0), min_size=1, max_size=4), cut=st.integers(min_value=0))
def test_damaged_payloads_never_reach_the_cache(damaged_target, flips, cut):
    engine, data, digest = damaged_target
    damaged = bytearray(data)
    for f in flips:
        damaged[f % len(data)] ^= 1 << (f % 8)
    damaged = bytes(damaged[: len(data) - cut % 64])
    if damaged == data:
        return
    with pytest.raises(PayloadError):
        import_handoff(engine.cache, read_payload(damaged))
    assert engine.cache.state_digest() == digest


# ---------------------------------------------------------------------- workers on localhost (gloo)


def _worker_args(model_dir, *extra):
    return [str(model_dir), "--lengths", "5,9", "--decode-steps", "2", "--timeout", "20", *extra]


def test_killed_decode_worker_then_a_restart(tiny_llama_dir, tmp_path):
    t0 = time.monotonic()
    (tmp_path / "killed").mkdir()
    outcomes = launch(
        _worker_args(tiny_llama_dir),
        2,
        timeout=20,
        workdir=tmp_path / "killed",
        hooks=KillDecodeMidTransfer(1),
    )
    elapsed = time.monotonic() - t0
    prefill, decode = outcomes
    assert decode.exitcode == -9  # SIGKILL after the header of the second payload
    assert prefill.exitcode == 4 and prefill.result["status"] == "transport", prefill.log
    assert "seq1-L9" in prefill.result["error"] and "rank 1" in prefill.result["error"]
    assert [t["seq_id"] for t in prefill.result["transfers"]] == ["seq0-L5"]
    assert elapsed < 20  # the connection reset shows at once; far below the 20 s wait bound

    # The same sequences again; the first copy of seq1 is damaged on the wire, refused by its checksum
    # without touching the decode worker's cache, and sent again.
    (tmp_path / "restart").mkdir()
    outcomes = launch(
        _worker_args(tiny_llama_dir), 2, timeout=20, workdir=tmp_path / "restart", hooks=CorruptInFlight(1)
    )
    prefill, decode = outcomes
    assert (prefill.exitcode, decode.exitcode) == (0, 0), prefill.log + decode.log
    assert [t["attempts"] for t in prefill.result["transfers"]] == [1, 2]
    received = decode.result["received"]
    assert [r["seq_id"] for r in received] == ["seq0-L5", "seq1-L9", "seq1-L9"]
    assert "checksum" in received[1]["refused"] and "refused" not in received[2]
    assert decode.result["report"]["passed"]


def _run_cli(capsys, *args):
    code = main(["handoff", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_passes_with_conversion_and_two_decode_workers(tiny_llama_dir, tmp_path, capsys):
    report, saved = tmp_path / "report.json", tmp_path / "first.payload"
    code, out, err = _run_cli(
        capsys,
        *_worker_args(tiny_llama_dir),
        "--key-form-decode",
        "raw",
        "--convert",
        "explicit",
        "--decode-workers",
        "2",
        "--json",
        str(report),
        "--save-payload",
        str(saved),
    )
    assert code == 0, err
    assert out.count("parity holds") == 2 and "key form converted at import (unrotate)" in out
    doc = json.loads(report.read_text())
    assert doc["passed"] and doc["exit_code"] == 0 and len(doc["runs"][0]["parity"]["cases"]) == 2
    assert [a["conversion"] for a in doc["runs"][0]["handoff"]["handshake"]["answers"]] == ["unrotate", "unrotate"]
    assert [t["decode_rank"] for t in doc["runs"][0]["handoff"]["transfers"]] == [1, 2]
    assert doc["runs"][0]["handoff"]["bytes_per_second"] > 0
    first = read_payload(saved.read_bytes())
    assert first.num_tokens == 5 and first.contract.key_form == "rotated"


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--key-form-decode", "raw"], "key_form"),
        (["--decode-rope-theta", "20000"], "rope.theta"),
    ],
)
def test_cli_refuses_a_mismatch_with_exit_3(tiny_llama_dir, tmp_path, capsys, flags, field):
    report = tmp_path / "report.json"
    code, out, err = _run_cli(capsys, *_worker_args(tiny_llama_dir), *flags, "--json", str(report))
    assert code == 3
    assert "refused the prefill contract" in err and field in err
    doc = json.loads(report.read_text())
    assert doc["runs"][0]["parity"] is None and not doc["runs"][0]["handoff"]["handshake"]["accepted"]
    assert field in doc["runs"][0]["handoff"]["handshake"]["fields"] and doc["runs"][0]["handoff"]["transfers"] == []


def test_cli_catches_rotate_on_transfer(tiny_llama_dir, tmp_path, capsys):
    report = tmp_path / "report.json"
    code, out, err = _run_cli(
        capsys, *_worker_args(tiny_llama_dir), "--inject", "rotate-on-transfer", "--json", str(report)
    )
    assert code == 1, err
    assert "diagnosis: rotate_on_transfer" in out
    assert json.loads(report.read_text())["runs"][0]["parity"]["diagnosis"]["kind"] == "rotate_on_transfer"


def test_cli_checks_paths_and_flags_before_starting_workers(tiny_llama_dir, tmp_path, capsys):
    for flags, match in (
        (["--json", str(tmp_path / "missing" / "r.json")], "does not exist"),
        (["--save-payload", str(tmp_path)], "is a directory"),
        (["--decode-workers", "3"], "distinct length"),
        (["--lengths", "0,4"], "positive"),
    ):
        code, _, err = _run_cli(capsys, *_worker_args(tiny_llama_dir), *flags)
        assert code == 2 and match in err, (flags, err)


def test_worker_outside_a_launcher_says_how_to_run(monkeypatch, capsys):
    from ropekv.handoff.workers import main as worker_main

    monkeypatch.delenv("RANK", raising=False)
    assert worker_main(["--lengths", "3"]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_errors_are_typed():
    assert issubclass(PayloadError, RopeKVError) and ContractMismatch.exit_code == 3


def test_cli_block_sizes_run_one_handoff_each_and_faults_are_listed(tiny_llama_dir, tmp_path, capsys):
    report = tmp_path / "report.json"
    args = [a for a in _worker_args(tiny_llama_dir)]
    if "--block-sizes" in args:
        i = args.index("--block-sizes")
        del args[i : i + 2]
    code, out, err = _run_cli(capsys, *args, "--block-sizes", "3,5", "--json", str(report))
    assert code == 0, err
    assert "block size 3:" in out and "block size 5:" in out and out.count("parity holds") == 2
    doc = json.loads(report.read_text())
    assert [r["block_size"] for r in doc["runs"]] == [3, 5] and doc["passed"]
    assert {
        r["handoff"]["transfers"][0]["contract"]["block_size"]
        if "contract" in r["handoff"]["transfers"][0]
        else r["block_size"]
        for r in doc["runs"]
    } == {3, 5}
    assert main(["handoff", "--list-faults"]) == 0
    assert "rotate-on-transfer" in capsys.readouterr().out
