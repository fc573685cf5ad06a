"""vLLM bfloat16 (kernel ``amx`` where the CPU has AMX tiles, else ``vec``): its contract, parity within
bfloat16's tolerance, and a decode fault still caught and named."""

from __future__ import annotations

import torch
from conftest import BLOCK, BUDGET

from ropekv import check
from ropekv.adapters.vllm import vllm_cases
from ropekv.faults.vllm import injected
from ropekv.parity.cases import Case

CASES = [
    c
    for c in vllm_cases(BLOCK, max_num_batched_tokens=BUDGET, long_context=200, decode_steps=2)
    if c.length in (BLOCK + 1, 20, 200)
]  # above a block, a non-block prefix hit, a chunked prefill


def test_the_bfloat16_contract(engine_bf16):
    c = engine_bf16.contract
    assert c.kernel_isa == ("amx" if torch.cpu._is_amx_tile_supported() else "vec")
    assert (c.dtype, c.cos_sin_dtype) == ("bfloat16", "bfloat16")  # vLLM casts its cos/sin table to the model dtype
    assert 1e-3 < c.cos_sin_max_error < 4e-3  # bfloat16 rounding of cos/sin (2**-9 relative), no more
    assert engine_bf16.contract_diff == ()


def test_parity_holds_within_bfloat16_tolerance(engine_bf16):
    report = check(engine_bf16, cases=CASES)
    print(report.table())
    assert report.passed, report.table()
    assert [r.notes[0].split(" of ")[0] for r in report.cases if r.case.prefix] == ["vLLM took 32"]


def test_double_rotation_is_caught_and_named_in_bfloat16(engine_bf16):
    case = Case(length=40, prefix=BLOCK, block_size=BLOCK, decode_steps=1)
    with injected(engine_bf16, "double_rotation"):
        report = check(engine_bf16, cases=[case])
    assert not report.passed and report.diagnosis.kind == "double_rotation", report.table()
