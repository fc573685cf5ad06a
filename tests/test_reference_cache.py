"""``--reference-cache``: the float64 reference of a check, computed once and reused by any engine.

Reference computations are counted at the decoder's one entry point (:meth:`ReferenceDecoder.forward`,
which the plain rows and the cache operations' own references both call); the figures a cached check
reports are compared with those of a check without any cache, which computes every reference.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import threading
from pathlib import Path

import pytest
import torch
import transformers

from ropekv import check
from ropekv.adapters.hf import HFEngine
from ropekv.adapters.native import NativeAdapter
from ropekv.bugs.registry import FAULTS
from ropekv.errors import UsageError
from ropekv.models import load_checkpoint
from ropekv.models.config import Checkpoint
from ropekv.models.gguf_file import permute_qk
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity import reference_cache as rc
from ropekv.parity.cases import Case, build_matrix, parse_ops
from ropekv.parity.compare import NextToken, RefRow

# Plain cases of three attention groups (full, a window with sinks), and cache operations: an eviction
# and a shift have a forward of their own, a rollback reads the plain one.
PLAIN = [
    Case(length=17, block_size=7),
    Case(length=30, prefix=13, block_size=7, chunk=9),
    Case(length=40, block_size=5, window=13, sink_tokens=2, chunk=9, decode_steps=2),
]
CASES = PLAIN + build_matrix(ops=parse_ops("evict:3,shift:50,rollback:2"), lengths=[20], max_positions=256)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path) -> Checkpoint:
    return load_checkpoint(tiny_llama_dir)


class Forwards(list):
    """Lengths of the whole reference forwards run; ``layer0``: those of the layer-0 checks."""

    def __init__(self) -> None:
        super().__init__()
        self.layer0: list[int] = []


@pytest.fixture
def forwards(monkeypatch) -> Forwards:
    """Counts the whole float64 reference forwards run (one entry per call); the layer-0 forwards that
    check a stored entry (``num_layers=1``) are counted in ``layer0``."""
    calls = Forwards()
    real = ReferenceDecoder.forward

    def counted(self, tokens, **kwargs):
        (calls.layer0 if kwargs.get("num_layers") is not None else calls).append(len(tokens))
        return real(self, tokens, **kwargs)

    monkeypatch.setattr(ReferenceDecoder, "forward", counted)
    return calls


def _figures(report, notes: bool = True) -> list[dict]:
    """Every judged figure of every case (the timings and the cache's own fields left out; the notes
    too with ``notes=False``: a recomputed entry's case says why in one)."""
    out = []
    for r in report.cases:
        d = r.to_dict()
        del d["seconds"], d["reference_source"]
        if not notes:
            del d["notes"]
        out.append(d)
    return out


def _sources(report) -> list[str | None]:
    return [r.reference_source for r in report.cases]


def test_a_second_check_computes_no_reference_and_reports_the_same(llama, tmp_path, forwards):
    plain = check(llama, cases=CASES)
    assert plain.passed, plain.table()
    assert forwards and plain.reference_cache is None and set(_sources(plain)) == {None}
    forwards.clear()

    first = check(llama, cases=CASES, reference_cache=tmp_path / "refs")
    assert forwards, "an empty cache computes the reference"
    assert _sources(first) == ["computed"] * len(CASES)
    assert first.reference_cache["computed"] == len(CASES) and first.reference_cache["hits"] == 0
    assert first.reference_cache["seconds_spent"] > 0
    assert len(list((tmp_path / "refs").glob("*.safetensors"))) == len(CASES)
    first_forwards = list(forwards)
    forwards.clear()

    second = check(llama, cases=CASES, reference_cache=tmp_path / "refs")
    assert forwards == [], "every reference came from the cache"
    assert _sources(second) == ["cache hit"] * len(CASES)
    summary = second.reference_cache
    assert (summary["hits"], summary["computed"], summary["recomputed"]) == (len(CASES), 0, 0)
    assert summary["seconds_saved"] == pytest.approx(first.reference_cache["seconds_spent"], rel=1e-6)
    # only the layer-0 forwards that check the entries: at most one per forward the first check ran
    assert 0 < len(forwards.layer0) <= len(first_forwards)
    assert _figures(second) == _figures(first) == _figures(plain)
    assert second.passed == plain.passed
    table = second.table()
    assert f"{len(CASES)} cases from the cache, 0 computed, 0 recomputed (corrupt entry)" in table
    assert table.count("reference: cache hit") == len(CASES)
    data = json.loads(second.to_json())
    assert data["reference_cache"]["hits"] == len(CASES)
    assert {c["reference_source"] for c in data["cases"]} == {"cache hit"}


def test_other_engines_on_the_same_weights_reuse_it(llama, tiny_llama_dir, tmp_path, forwards):
    refs = tmp_path / "refs"
    check(llama, cases=PLAIN, reference_cache=refs)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    hf_plain = check(HFEngine(model), cases=PLAIN)  # computes its own reference
    forwards.clear()
    raw = check(NativeAdapter(llama, key_form="raw", backend="rotate_on_read"), cases=PLAIN, reference_cache=refs)
    bf16 = check(llama, cases=PLAIN, dtype="bfloat16", reference_cache=refs)
    hf = check(HFEngine(model), cases=PLAIN, reference_cache=refs)
    assert forwards == [], "no engine configuration changes the reference"
    for report in (raw, bf16, hf):
        assert report.passed, report.table()
        assert _sources(report) == ["cache hit"] * len(PLAIN)
    assert _figures(hf) == _figures(hf_plain), "the rows ropekv's engine stored judge HF as its own would"


def test_cases_that_differ_only_in_how_the_cache_was_filled_share_an_entry(llama, tmp_path, forwards):
    refs = tmp_path / "refs"
    check(llama, cases=[Case(length=17, block_size=7)], reference_cache=refs)
    forwards.clear()
    other = check(llama, cases=[Case(length=17, block_size=16, chunk=5)], reference_cache=refs)
    assert forwards == [] and _sources(other) == ["cache hit"]
    shifted = check(llama, cases=[Case(length=12, prefix=5, block_size=3)], reference_cache=refs)
    assert forwards == [] and _sources(shifted) == ["cache hit"]  # the same positions 17, 18, 19


def _changed_weights(llama: Checkpoint) -> Checkpoint:
    weights = dict(llama.weights)
    name = "model.layers.0.self_attn.k_proj.weight"
    weights[name] = weights[name] * 1.001
    return Checkpoint.from_tensors(llama.config, weights)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"cases": [Case(length=18, block_size=7)]}, id="another position"),
        pytest.param({"cases": [Case(length=17, block_size=7, decode_steps=4)]}, id="more decode steps"),
        pytest.param({"cases": [Case(length=17, block_size=7, window=9)]}, id="a window"),
        pytest.param({"seed": 1}, id="another token stream"),
        pytest.param({"reference": "float32"}, id="another reference dtype"),
        pytest.param({"model": _changed_weights}, id="other weights"),
    ],
)
def test_what_changes_the_reference_misses(llama, tmp_path, forwards, change):
    refs = tmp_path / "refs"
    base = [Case(length=17, block_size=7)]
    check(llama, cases=base, reference_cache=refs)
    forwards.clear()
    model = change.get("model", lambda c: c)(llama)
    assert (model.fingerprint != llama.fingerprint) == ("model" in change)
    report = check(
        model,
        cases=change.get("cases", base),
        seed=change.get("seed", 0),
        reference=change.get("reference", "float64"),
        reference_cache=refs,
    )
    assert forwards, "the reference was computed"
    assert _sources(report) == ["computed"]
    assert len(list(refs.glob("*.safetensors"))) == 2


def _flip_data_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40  # in the last tensor's bytes
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def _rewrite_metadata(path: Path, field: str, value: str) -> None:
    """Edit one metadata field in place (same length, so the offsets stay right)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    old = header["__metadata__"][field]
    header["__metadata__"][field] = value[: len(old)].ljust(len(old), "0")
    text = json.dumps(header, separators=(",", ":")).encode()
    text = text + b" " * (n - len(text)) if len(text) <= n else text
    assert len(text) == n, "the edit must keep the header's length"
    path.write_bytes(raw[:8] + text + raw[8 + n :])


def _swap_checksum(path: Path) -> None:
    _rewrite_metadata(path, "checksum", "0" * 64)


def _other_key(path: Path) -> None:
    _rewrite_metadata(path, "key", "f" * 64)


def _header_not_json(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[8:20] = b"#" * 12
    path.write_bytes(bytes(raw))


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x00" * 7)


def _too_large(path: Path) -> None:
    with path.open("ab") as f:
        f.truncate(path.stat().st_size + (64 << 20))  # sparse: the size alone refuses it


@pytest.mark.parametrize(
    "corrupt,why",
    [
        (_flip_data_byte, "checksum mismatch"),
        (_truncate, "truncated"),
        (_swap_checksum, "checksum mismatch"),
        (_other_key, "its key is not this case's"),
        (_garbage, "truncated"),
        (_header_not_json, "not JSON"),
        (_too_large, "more than"),
    ],
)
def test_a_corrupt_entry_is_recomputed_and_reported(llama, tmp_path, forwards, corrupt, why):
    refs = tmp_path / "refs"
    cases = [Case(length=17, block_size=7), Case(length=40, block_size=5, window=13, sink_tokens=2, decode_steps=2)]
    clean = check(llama, cases=cases, reference_cache=refs)
    corrupt(sorted(refs.glob("*.safetensors"))[0])
    forwards.clear()
    report = check(llama, cases=cases, reference_cache=refs)
    assert forwards, "the corrupt entry's reference was computed again"
    assert sorted(_sources(report)) == ["cache hit", "recomputed (corrupt entry)"]
    bad = next(r for r in report.cases if r.reference_source == "recomputed (corrupt entry)")
    assert any(why in n for n in bad.notes), bad.notes
    assert report.reference_cache["recomputed"] == 1
    assert "1 recomputed (corrupt entry)" in report.table()
    assert _figures(report, notes=False) == _figures(clean, notes=False)
    forwards.clear()
    again = check(llama, cases=cases, reference_cache=refs)  # the entry was overwritten with a valid one
    assert forwards == [] and _sources(again) == ["cache hit", "cache hit"]
    assert not list(refs.glob(".*.tmp")), "no temporary file is left behind"


@pytest.mark.parametrize("fault", ["block-local-position", "evict-offset", "shift-not-rotated"])
def test_an_injected_fault_still_fails_with_the_cache(llama, tmp_path, fault):
    refs = tmp_path / "refs"
    check(llama, cases=CASES, reference_cache=refs)  # the cache holds every clean reference
    without = check(FAULTS[fault].adapter(llama), cases=CASES)
    cached = check(FAULTS[fault].adapter(llama), cases=CASES, reference_cache=refs)
    assert not without.passed
    assert set(_sources(cached)) == {"cache hit"}
    assert not cached.passed and [r.passed for r in cached.cases] == [r.passed for r in without.cases]
    assert cached.diagnosis is not None and without.diagnosis is not None
    assert cached.diagnosis.kind == without.diagnosis.kind


def test_a_bad_folder_is_a_usage_error(llama, tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        check(llama, cases=PLAIN[:1], reference_cache=tmp_path / "a_file")
    with pytest.raises(UsageError, match="does not exist"):
        check(llama, cases=PLAIN[:1], reference_cache=tmp_path / "no" / "refs")
    assert not (tmp_path / "no").exists()
    with pytest.raises(UsageError, match="no parity cases"):  # refused after the folder was accepted
        check(llama, cases=[], reference_cache=tmp_path / "refs")
    assert not (tmp_path / "refs").exists(), "a refused check creates no folder"


def test_concurrent_writers_leave_one_whole_entry(llama, tmp_path):
    store = rc.ReferenceStore(tmp_path / "refs")
    case = Case(length=17, block_size=7).for_model(llama.config.layer_attentions)
    tokens = torch.arange(16, 40)
    fields = rc.entry_fields(llama.fingerprint, "float64", case, tokens)
    cfg = llama.config
    positions = tuple(case.decode_positions)
    shape = rc.RowsShape(positions, cfg.num_layers, cfg.num_heads, cfg.hidden_size, cfg.vocab_size, torch.float64)

    def rows(seed: int):
        g = torch.Generator().manual_seed(seed)
        return {
            t: RefRow(
                hidden_in=tuple(
                    torch.randn(cfg.hidden_size, generator=g, dtype=torch.float64) for _ in range(cfg.num_layers)
                ),
                attn_logits=tuple(
                    torch.randn(cfg.num_heads, t + 1, generator=g, dtype=torch.float64) for _ in range(cfg.num_layers)
                ),
                logits=NextToken(torch.randn(cfg.vocab_size, generator=g, dtype=torch.float64)),
            )
            for t in positions
        }

    written = [rows(s) for s in range(8)]
    threads = [
        threading.Thread(target=store.save, args=(fields, w, {t: t + 1 for t in positions}, 0.5)) for w in written
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = store.load(fields, shape)
    assert got is not None and got.seconds == 0.5
    first = got.rows[positions[0]].logits.values
    assert any(torch.equal(first, w[positions[0]].logits.values) for w in written), "one writer's whole entry"
    winner = next(w for w in written if torch.equal(first, w[positions[0]].logits.values))
    for t in positions:
        assert torch.equal(got.rows[t].attn_logits[-1], winner[t].attn_logits[-1])
    assert [p.name for p in (tmp_path / "refs").iterdir()] == [store.path(rc.entry_key(fields)).name]


def _gptj_presentation(ckpt: Checkpoint, nudge: float = 0.0) -> Checkpoint:
    """The same weights as llama.cpp's converter stores them (Q/K rows permuted per head, RoPE pairs
    interleaved); ``nudge`` changes one query weight, making another model."""
    cfg = ckpt.config
    gptj_cfg = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, layout="gptj"))
    state = {}
    for name, t in ckpt.weights.items():
        if ".q_proj." in name or ".k_proj." in name:
            heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            t = torch.from_numpy(permute_qk(t.numpy().copy(), heads))
        state[name] = t.clone()
    if nudge:
        state["model.layers.0.self_attn.q_proj.weight"][0, 0] += nudge
    return Checkpoint.from_tensors(gptj_cfg, state)


def test_the_gptj_presentation_of_the_same_weights_reads_the_neox_rows(llama, tmp_path, forwards):
    """llama.cpp runs a llama GGUF with its Q/K rows as stored (gptj pairing): another fingerprint (the
    contract tells the two apart) but the same reference rows, so it reads the entries a check of the
    transformers presentation stored. Another model in the gptj presentation does not."""
    refs = tmp_path / "refs"
    gptj = _gptj_presentation(llama)
    assert gptj.fingerprint != llama.fingerprint
    own = check(gptj, cases=PLAIN)  # its own float64 reference, no cache
    assert own.passed, own.table()
    check(llama, cases=PLAIN, reference_cache=refs)
    forwards.clear()
    shared = check(gptj, cases=PLAIN, reference_cache=refs)
    assert forwards == [], "the gptj presentation computed a reference of its own"
    assert _sources(shared) == ["cache hit"] * len(PLAIN) and shared.passed, shared.table()
    for a, b in zip(own.cases, shared.cases):  # the neox rows judge it as its own rows do
        assert a.passed == b.passed
        for key in ("max_abs_logit_diff", "max_attn_error"):
            x, y = a.to_dict().get(key), b.to_dict().get(key)
            assert (x is None) == (y is None), key
            if x is not None:
                assert y == pytest.approx(x, rel=1e-6, abs=1e-9), key
    other = check(_gptj_presentation(llama, nudge=0.5), cases=PLAIN, reference_cache=refs)
    assert _sources(other) == ["computed"] * len(PLAIN), "another model's gptj rows never read these"
