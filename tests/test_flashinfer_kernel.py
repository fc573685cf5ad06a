"""The CPU pieces of the FlashInfer GPU check: the page table, the CPU stand-in for FlashInfer's kernel
(against an independent float64 attention), and the isolated-key probe that recovers what a kernel
multiplied from its log-sum-exps alone."""

from __future__ import annotations

import math

import pytest
import torch

from ropekv.adapters.flashinfer.angles import angle_errors, angle_probe, phases_from
from ropekv.adapters.flashinfer.cpu_kernel import CpuPagedKernel
from ropekv.adapters.flashinfer.pages import PageTable
from ropekv.adapters.flashinfer.probe import key_probe, probe_alpha, recover_keys
from ropekv.errors import UsageError
from ropekv.rope import RopeSpec

THETA = 10000.0


def _spec(d: int) -> RopeSpec:
    return RopeSpec(head_dim=d, rotary_dim=d, theta=THETA)


def test_page_table_places_entries_by_page_list_and_refuses_bad_tables():
    t = PageTable.of([[3, 1], [0]], [5, 2], page_size=3)
    assert t.kv_lens().tolist() == [5, 2]
    assert t.slots(0).tolist() == [9, 10, 11, 3, 4]  # page 3 then page 1: slots are not positions
    assert t.slots(1).tolist() == [0, 1]
    pages = torch.arange(4 * 3 * 1 * 2, dtype=torch.float32).view(4, 3, 1, 2)
    assert torch.equal(t.gather(pages, 0)[:, 0, 0], torch.tensor([18.0, 20.0, 22.0, 6.0, 8.0]))
    with pytest.raises(UsageError, match="needs 2 pages"):
        PageTable.of([[3]], [5], page_size=3)
    with pytest.raises(UsageError, match="at least one entry"):
        PageTable.of([[3]], [0], page_size=3)
    with pytest.raises(UsageError, match="page_size"):
        PageTable.of([[3]], [1], page_size=0)
    i32 = torch.int32
    with pytest.raises(UsageError, match="last_len"):
        PageTable(torch.tensor([0, 1], dtype=i32), torch.tensor([0], dtype=i32), torch.tensor([4], dtype=i32), 3)
    with pytest.raises(UsageError, match="indptr"):
        PageTable(torch.tensor([0, 2], dtype=i32), torch.tensor([0], dtype=i32), torch.tensor([1], dtype=i32), 3)


def _attention64(q, k, v, positions_q, rotate, scale):
    """Decode attention in float64 with ropekv's RoPE: q [B, H, D] at positions_q [B], k/v [B, n, KVH, D]."""
    B, H, D = q.shape
    n, kvh = k.shape[1], k.shape[2]
    q, k, v = q.double(), k.double(), v.double()
    if rotate:
        spec = _spec(D)
        k = torch.stack([spec.rotate(k[b], torch.arange(n)) for b in range(B)])
        q = torch.stack([spec.rotate(q[b : b + 1], positions_q[b : b + 1])[0] for b in range(B)])
    k = k.repeat_interleave(H // kvh, dim=2)
    v = v.repeat_interleave(H // kvh, dim=2)
    s = torch.einsum("bhd,bnhd->bhn", q, k) * scale
    return torch.einsum("bhn,bnhd->bhd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


@pytest.mark.parametrize("rotate", [True, False])
def test_cpu_kernel_appends_into_pages_and_decodes_like_float64_attention(rotate):
    g = torch.Generator().manual_seed(1)
    kvh, h, d, ps, n = 2, 4, 16, 3, 7
    kernel = CpuPagedKernel()
    k_pages = torch.zeros(5, ps, kvh, d, dtype=torch.float16)
    v_pages = torch.zeros_like(k_pages)
    table = PageTable.of([[4, 0, 2]], [n], ps)
    k = torch.randn(n, kvh, d, generator=g).half()
    v = torch.randn(n, kvh, d, generator=g).half()
    kernel.append(k_pages, v_pages, k, v, table, torch.zeros(n, dtype=torch.int32), torch.arange(n, dtype=torch.int32))
    assert torch.equal(table.gather(k_pages, 0), k) and torch.equal(table.gather(v_pages, 0), v)
    assert k_pages[1].abs().sum() == 0  # a page outside the table stays untouched
    q = torch.randn(1, h, d, generator=g).half()
    out, lse2 = kernel.decode(q, k_pages, v_pages, table, rotate=rotate, sm_scale=d**-0.5, rope_theta=THETA)
    want_out, want_lse = _attention64(q, k[None], v[None], torch.tensor([n - 1]), rotate, d**-0.5)
    assert out.dtype == torch.float16 and lse2.dtype == torch.float32
    assert torch.allclose(out.double(), want_out, atol=2e-3)
    assert torch.allclose(lse2.double() * math.log(2.0), want_lse, atol=1e-5)  # base 2, as FlashInfer's


def test_cpu_kernel_refuses_an_append_past_the_table():
    k_pages = torch.zeros(2, 2, 1, 4)
    table = PageTable.of([[0]], [1], 2)
    with pytest.raises(UsageError, match="past its request"):
        CpuPagedKernel().append(
            k_pages, k_pages.clone(), torch.ones(1, 1, 4), torch.ones(1, 1, 4), table, torch.zeros(1), torch.ones(1)
        )


class _TwiceKernel(CpuPagedKernel):
    """A kernel that rotates keys by twice their index: the probe must report what it did."""

    def decode(self, q, k_pages, v_pages, table, *, rotate, sm_scale, rope_theta):
        n = int(table.kv_lens()[0])
        flat = k_pages.reshape(-1, *k_pages.shape[2:]).clone()
        for b in range(table.batch_size):
            slots = table.slots(b)
            keys = k_pages.reshape(-1, *k_pages.shape[2:])[slots].double()
            flat[slots] = _spec(q.shape[-1]).rotate(keys, torch.arange(n)).to(flat.dtype)  # one extra R(j)
        return super().decode(
            q, flat.view_as(k_pages), v_pages, table, rotate=rotate, sm_scale=sm_scale, rope_theta=rope_theta
        )


@pytest.mark.parametrize("rotate", [True, False])
def test_probe_recovers_the_keys_a_kernel_multiplied_from_its_log_sum_exps(rotate):
    g = torch.Generator().manual_seed(2)
    n, kvh, h, d, ps = 9, 2, 4, 16, 4
    stored = (3 * torch.randn(n, kvh, d, generator=g)).half()
    alpha = probe_alpha(stored)
    assert alpha == 2.0 ** math.floor(
        math.log2(16 / float(torch.sqrt(stored[..., :8].float() ** 2 + stored[..., 8:].float() ** 2).max()))
    )
    probe = key_probe(stored, ps, h, alpha)
    _, lse2 = CpuPagedKernel().decode(
        probe.q, probe.k_pages, probe.v_pages, probe.table, rotate=rotate, sm_scale=1.0, rope_theta=THETA
    )
    rec = recover_keys(lse2, alpha, n, kvh, d)
    want = stored.double()
    if rotate:  # seen from the query at n - 1: R(j - (n - 1)) k_j
        want = _spec(d).rotate(want, torch.arange(n) - (n - 1))
    assert torch.allclose(rec.keys, want, atol=2e-4 * float(want.abs().max()))
    assert rec.calibration < 1e-5  # zero queries read log2(n): base 2, n - 1 zero keys at score 0
    assert rec.sign_gap < 1e-2


def test_probe_sees_a_kernel_that_rotates_keys_twice():
    g = torch.Generator().manual_seed(3)
    n, kvh, h, d = 6, 2, 4, 16
    stored = torch.randn(n, kvh, d, generator=g).half()
    alpha = probe_alpha(stored)
    probe = key_probe(stored, 4, h, alpha)
    _, lse2 = _TwiceKernel().decode(
        probe.q, probe.k_pages, probe.v_pages, probe.table, rotate=True, sm_scale=1.0, rope_theta=THETA
    )
    keys = recover_keys(lse2, alpha, n, kvh, d).keys
    want = _spec(d).rotate(stored.double(), 2 * torch.arange(n) - (n - 1))
    assert torch.allclose(keys, want, atol=3e-3)
    assert not torch.allclose(keys, _spec(d).rotate(stored.double(), torch.arange(n) - (n - 1)), atol=0.1)


def test_recover_keys_refuses_a_shape_that_does_not_fit():
    with pytest.raises(UsageError, match="does not fit"):
        recover_keys(torch.zeros(10, 4), 1.0, 3, 2, 16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_angle_probe_reads_the_relative_phase_a_kernel_turned_a_key_by(dtype):
    p, d = 300, 16
    for j in (0, 150, 299):
        probe = angle_probe(d, 4, 2, 7, j, p + 1, dtype, "cpu")
        _, lse2 = CpuPagedKernel().decode(
            probe.q, probe.k_pages, probe.v_pages, probe.table, rotate=True, sm_scale=1.0, rope_theta=THETA
        )
        e = angle_errors(lse2, d, THETA, j, p, dtype)
        # the stand-in turns float32 angles accurately: what transformers' float32 angles do, to 1e-7
        assert e.kernel < 5e-6 and abs(e.kernel - e.float32) < 2e-7 and e.norm < 1e-6
    probe = angle_probe(d, 4, 2, 7, 150, p + 1, dtype, "cpu")
    _, lse2 = _TwiceKernel().decode(
        probe.q, probe.k_pages, probe.v_pages, probe.table, rotate=True, sm_scale=1.0, rope_theta=THETA
    )
    assert angle_errors(lse2, d, THETA, 150, p, dtype).kernel > 0.5  # a key turned twice is seen so
    with pytest.raises(UsageError, match="directions"):
        phases_from(lse2[:-1], p + 1, d, dtype)
