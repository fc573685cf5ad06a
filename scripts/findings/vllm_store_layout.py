"""Finding: what vLLM's ExampleConnector stores is a raw view of the CPU paged cache, keyed by token ids
only, with nothing else.

A producer (``kv_role="kv_producer"``, float32, block 32, the embedded SmolLM2-135M) prefills a
70-token prompt. The script lists what it wrote, shows that a file's rows are not tokens' keys and
values (row ``t`` of the ``[tokens, heads, 2 * head_dim]`` tensor against token ``t``'s post-RoPE key
hooked on vLLM's ``Attention`` module), that ropekv's unpacking by kernel ISA
(``ropekv.adapters.vllm.store``) gives exactly the hooked keys, and what the float64 reference says
of them. Then a 65-token prompt, sent twice: the producer stores its first 64 tokens, and the same
prompt looks up the hash of its first 32 (``(n - 2) // B * B``), so the second request is prefilled in
full again, although the entry of its own tokens is there.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=2 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \
        .venv-vllm/bin/python scripts/findings/vllm_store_layout.py
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

BLOCK = 32


def main(root: Path) -> None:
    import torch
    from safetensors import safe_open
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from ropekv.adapters.vllm import VLLMEngine, store
    from ropekv.adapters.vllm.engine import cos_sin_tolerance
    from ropekv.adapters.vllm.store_check import check_entry, reference_kv, relative_error
    from ropekv.adapters.vllm.store_payload import vllm_cache_contract
    from ropekv.parity.cases import token_stream

    config = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={"shared_storage_path": str(root)},
    )
    engine = VLLMEngine(
        None,
        dtype="float32",
        block_size=BLOCK,
        enable_prefix_caching=False,
        kv_transfer_config=config,
        num_gpu_blocks_override=32,
        max_model_len=256,
    )
    cfg = engine.checkpoint.config
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)

    def run(prompt):
        engine.probes.reset()
        with engine.probes.installed():
            engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return list(engine.probes.forwards)

    prompt = token_stream(cfg.vocab_size, 70).tolist()
    forwards = run(prompt)
    print(f"vLLM {engine.vllm_version}, {engine.name}, kernel ISA {engine.contract.kernel_isa!r}")
    print(f"store {root}: {sorted(p.name for p in root.iterdir())}")
    T = store.producer_tokens(len(prompt), BLOCK)
    print(f"entry_key(prompt[:{T}]) = {store.entry_key(prompt[:T])}")
    entry = store.find_entry(root, prompt[:T])
    assert entry is not None
    files = sorted(p.name for p in entry.directory.iterdir())
    print(f"{len(files)} files: {files[0]}, {files[1]}, ..., {files[-1]}")
    with safe_open(str(entry.path(0)), "pt") as f:
        raw = f.get_tensor("kv_cache")
        print(
            f"{entry.layer_names[0]}: tensors {list(f.keys())}, {raw.dtype} {list(raw.shape)}, metadata {f.metadata()}"
        )
    hooked = forwards[0].layers[0].k_rot  # [70, KVH, D] vLLM's post-RoPE keys, as its Attention module got them
    D = cfg.head_dim
    print(f"token 1's key, head 0, channels 0..3 (hooked): {[round(x, 4) for x in hooked[1, 0, :4].tolist()]}")
    print(f"file row 1, head 0, channels 0..3:              {[round(x, 4) for x in raw[1, 0, :4].tolist()]}")
    print(
        f"file row 0, head 0, channels 0..3:              {[round(x, 4) for x in raw[0, 0, :4].tolist()]} "
        f"(= token 0..3's channel 0: {[round(x, 4) for x in hooked[:4, 0, 0].tolist()]})"
    )
    print(f"rows read as [key | value] per token: relative error {relative_error(raw[:, :, :D], hooked[:T]):.3g}")
    stored = store.read_entry(
        entry, num_kv_heads=cfg.num_kv_heads, head_dim=D, block_size=BLOCK, isa=engine.contract.kernel_isa
    )
    equal = all(torch.equal(stored.keys[i], forwards[0].layers[i].k_rot[:T]) for i in range(cfg.num_layers))
    print(
        f"unpacked by ISA {engine.contract.kernel_isa!r}: keys equal to the hooked keys in all {cfg.num_layers} layers: {equal}"
    )
    ref_k, ref_v = reference_kv(engine.checkpoint, prompt[:T])
    contract = vllm_cache_contract(
        engine.checkpoint, engine.contract, cos_sin_tolerance=cos_sin_tolerance(engine.dtype)
    )
    result = check_entry(stored, token_ids=prompt, contract=contract, reference_keys=ref_k, reference_values=ref_v)
    print("against the float64 reference: " + "; ".join(result.summary()))

    short = token_stream(cfg.vocab_size, 65, seed=1).tolist()
    first, second = run(short), run(short)
    print(
        f"65-token prompt: stored as {store.producer_tokens(65, BLOCK)} tokens "
        f"(entry present: {store.find_entry(root, short[:64]) is not None}); the same prompt looks up "
        f"{store.consumer_tokens(65, BLOCK)} tokens (entry present: {store.find_entry(root, short[:32]) is not None}); "
        f"first forward of request 1 starts at {int(first[0].positions[0])}, of request 2 at "
        f"{int(second[0].positions[0])} ({second[0].positions.numel()} tokens computed)"
    )


if __name__ == "__main__":
    for key, value in {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": "2",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
    }.items():
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory(prefix="vllm-store-") as d:
        main(Path(d))
