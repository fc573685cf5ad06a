"""The bad-input run: inputs ropekv must refuse with a typed one-line error (exit 2 or 3), or must judge
(a verdict, exit 0 or 1): no traceback, no hang, no silent acceptance, no exit 0 without a verdict.

    .venv/bin/python scripts/bad_inputs.py [CHECKOUT] [--only TEXT]

CHECKOUT is the ropekv checkout to run (default: this one); running it on an older checkout gives the
"before" figures. Each input runs in a subprocess under a 6 GB address-space limit and a 60 s timeout,
so a hang or an allocation of the whole machine shows as HANG / TRACEBACK instead of taking the machine
down. One line per input (its outcome and the last line the command printed), then the counts.

Outcomes: ``ok``; ``TRACEBACK``; ``HANG``; ``SILENT`` (accepted what must be refused, a wrong exit code
such as 130 for an adapter's own KeyboardInterrupt, or an adapter's print inside the report on stdout);
``EXIT0-NO-VERDICT`` (exit 0 without "parity holds"); ``REFUSED`` (refused what must be judged);
``SKIP`` (llama.cpp's inputs where the checkout has no ``.venv-llamacpp``: they run in that venv).
A forged file (a reference-cache entry, a vLLM store entry, a llama.cpp state file, a saved 8-bit
cache) is built the way anyone who can write the folder could, its checksum recomputed; the input
prints ``ACCEPTED`` (counted SILENT) where ropekv took it for sound.

Another user's file (mode 0600) cannot be made while running as root, who reads every file, and the
venv's interpreter may sit in a folder another user cannot enter: those inputs deny the open in-process
(``os.open``/``io.open`` raise EACCES for the file), which is what the kernel does for another user.
The tests hold each refusal (tests/test_adapter_guard.py, tests/test_bad_files.py, tests/test_errors_*.py,
tests/test_saved.py, tests/test_config_reading.py)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import struct
import subprocess
import sys
import tempfile
from collections import Counter

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="See the module docstring.")
parser.add_argument("checkout", nargs="?", default=str(pathlib.Path(__file__).resolve().parents[1]))
parser.add_argument("--only", metavar="TEXT", help="run only the inputs whose name contains TEXT")
parser.add_argument("--timeout", type=float, default=60.0, help="seconds before an input counts as a hang")
cli = parser.parse_args()
root = pathlib.Path(cli.checkout).resolve()
if not (root / "ropekv" / "__init__.py").is_file():
    parser.error(f"{root} is not a ropekv checkout (no ropekv/__init__.py)")
py = sys.executable
work = pathlib.Path(tempfile.mkdtemp(prefix="bad-"))
env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(work / "cache")}
subprocess.run(
    [py, "-c", f"from ropekv.testing.tiny import tiny_checkpoint; tiny_checkpoint('llama', save_to='{work}/llama')"],
    env=env,
    check=True,
    cwd=root,
    capture_output=True,
)
L = str(work / "llama")


def variant(name, **over):
    d = work / name
    subprocess.run(["cp", "-r", L, str(d)], check=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(over)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


# ------------------------------------------------------------------ a user's adapter that misbehaves
adapters = work / "adapters"
adapters.mkdir()
(adapters / "logits_tier.py").write_text((root / "examples" / "adapters" / "logits_tier.py").read_text())
(adapters / "bad_adapter.py").write_text("""
import sys, time
import torch
from transformers import AutoModelForCausalLM
from logits_tier import MyEngine

class Good(MyEngine):
    @classmethod
    def load(cls, model, dtype, **kw):
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype), attn_implementation="eager")
        return cls(hf.eval(), name="bad-adapter")

class Exits(Good):
    def run_case(self, case, tokens):
        sys.exit(0)

class Sleeps(Good):
    def run_case(self, case, tokens):
        time.sleep(3600)

class Prints(Good):
    def run_case(self, case, tokens):
        print("ADAPTER-NOISE")
        return super().run_case(case, tokens)

class Interrupts:
    @classmethod
    def load(cls, model, dtype):
        raise KeyboardInterrupt

class NoCheckpoint(Good):
    @property
    def checkpoint(self):
        return None
    @checkpoint.setter
    def checkpoint(self, value):
        pass

class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")

class BadStr(Good):
    def run_case(self, case, tokens):
        raise Unprintable()

class BadTier(Good):
    @property
    def tier(self):
        raise ValueError("tier unknown")
""")
A = str(adapters / "bad_adapter.py")
check_help = subprocess.run(
    [py, "-m", "ropekv.cli.main", "check", "--help"], capture_output=True, text=True, env=env, cwd=work
).stdout
limit = ["--adapter-timeout", "5"] if "--adapter-timeout" in check_help else []  # older checkouts: none


def adapter(cls, *flags):
    return ["check", L, "--engine", f"{A}:{cls}", "--lengths", "3", "--no-progress", *flags]


# ------------------------------------------------------------------ files
fifo = work / "fifo"
os.mkfifo(fifo)
tok = work / "tok"
tok.mkdir()
subprocess.run(
    [py, "-c", "from tokenizers import Tokenizer, models; import sys; "
     "Tokenizer(models.WordLevel({'a': 0}, unk_token='a')).save(sys.argv[1])", str(tok / "tokenizer.json")],
    check=True, env=env,
)  # fmt: skip
deep = work / "deep"
deep.mkdir()
(deep / "tokenizer.json").write_bytes((tok / "tokenizer.json").read_bytes())
(deep / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
zero = work / "zero"
zero.mkdir()
(zero / "tokenizer.json").write_bytes((tok / "tokenizer.json").read_bytes())
(zero / "tokenizer_config.json").symlink_to("/dev/zero")
refusal_fifo = work / "store-fifo"
refusal_fifo.mkdir()
os.mkfifo(refusal_fifo / "ropekv-refusals.jsonl")
refusal_deep = work / "store-deep"
refusal_deep.mkdir()
(refusal_deep / "ropekv-refusals.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
gguf = work / "strings.gguf"
count = 10**8  # each string an 8-byte length of 0: a sparse file the count fits
with open(gguf, "wb") as f:
    key = b"tokenizer.ggml.tokens"
    f.write(struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", len(key)) + key)
    f.write(struct.pack("<IIQ", 9, 8, count))
    f.truncate(f.tell() + 8 * count + 64)

DENY = """
import io, os, builtins
_deny = {os.path.abspath(p) for p in DENIED}
_os_open, _io_open = os.open, io.open
def _check(p):
    if isinstance(p, (str, os.PathLike)) and os.path.abspath(os.fspath(p)) in _deny:
        raise PermissionError(13, "Permission denied", os.fspath(p))
def _o(p, *a, **k):
    _check(p); return _os_open(p, *a, **k)
def _i(p, *a, **k):
    _check(p); return _io_open(p, *a, **k)
os.open, io.open, builtins.open = _o, _i, _i
"""
TINY_CONVERT = f"""
import shutil
from safetensors.torch import save_file
from ropekv.models import default, load_checkpoint
from ropekv.models.weights import weights_digest
def convert(gguf, out, model=None):
    ck = load_checkpoint({L!r}); digest = weights_digest(ck.weights)
    meta = {{"ropekv.fingerprint": ck.fingerprint, default.DIGEST_KEY: digest,
            "ropekv.conversion": default.CONVERSION_VERSION, "ropekv.gguf_size": str(gguf.stat().st_size)}}
    save_file(dict(ck.weights), str(out / "model.safetensors"), metadata=meta)
    shutil.copy({L!r} + "/config.json", out / "config.json")
    for n in ("tokenizer.json", "tokenizer_config.json"):
        (out / n).write_text("{{}}")
default._convert = convert
"""

VLLM_SIDECAR = f"""
import dataclasses, hashlib
from pathlib import Path
from ropekv.adapters.vllm import sidecar as sc
from ropekv.contract import CacheContract
from ropekv.rope import RopeSpec
NAMES = tuple(f"model.layers.{{i}}.self_attn.attn" for i in range(3))
folder = Path({str(work)!r}) / "store-big" / "abc123"
folder.mkdir(parents=True)
files = []
for i, name in enumerate(NAMES):
    data = bytes([i]) * (1000 + i)
    (folder / f"{{name}}.safetensors").write_bytes(data)
    files.append(sc.LayerFile(f"{{name}}.safetensors", len(data), hashlib.sha256(data).hexdigest()))
rope = RopeSpec(head_dim=64, rotary_dim=64, theta=1e5, max_position_embeddings=8192)
contract = CacheContract(key_form="rotated", rope=rope, num_layers=3, num_kv_heads=3, head_dim=64, block_size=32)
eng = sc.EngineContract(contract=contract, kv_cache_dtype="auto", kernel_isa="vec",
                        attention_backend="CPUAttentionBackendImpl", kv_row_shape=(3, 128), layer_names=NAMES)
side = sc.Sidecar(engine=eng, key=folder.name, num_tokens=64, position_start=0,
                  tokens_sha256=sc.tokens_digest(list(range(64))), layers=tuple(files))
"""
# A producer's hooked keys and values of one prompt and the store entry a consumer injects (as
# tests/test_vllm_store_entries.py builds them, without vLLM).
VLLM_STORE = f"""
import torch
from pathlib import Path
from safetensors.torch import save_file
from ropekv.adapters.vllm.store import consumer_tokens, write_entry
from ropekv.handoff.vllm_entries import entry_findings
B, LAYERS, KVH, D, LENGTH = 16, 2, 2, 8, 35
tmp = Path({str(work)!r}) / f"vllm-{{__import__('os').getpid()}}"
tmp.mkdir()
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, 1000, (LENGTH,), generator=g).tolist()
keys = [torch.randn(LENGTH, KVH, D, generator=g) for _ in range(LAYERS)]
keys[0][5, 0, 2] = 3e-9
values = [torch.randn(LENGTH, KVH, D, generator=g) for _ in range(LAYERS)]
hooked = {{}}
for i in range(LAYERS):
    hooked[f"p0.l{{i}}"], hooked[f"p0.v{{i}}"] = keys[i], values[i]
save_file(hooked, str(tmp / "keys.safetensors"))
producer = {{"side": {{"contract": {{"kernel_isa": "vec"}}, "cache_contract": {{"num_kv_heads": KVH, "head_dim": D}},
             "block_size": B}}, "prompts": [{{"length": LENGTH, "seed": 0, "token_ids": ids, "entries": []}}],
             "keys": str(tmp / "keys.safetensors")}}
store = tmp / "store"
store.mkdir()
def write(keys, values):
    n = consumer_tokens(LENGTH, B)
    write_entry(store, ids[:n], [k[:n] for k in keys], [v[:n] for v in values], isa="vec", block_size=B, overwrite=True)
"""
# A tiny llama's reference cache entry, written by a check (CASE) and rewritten by `rewrite(change)`
# with its checksum recomputed: what anyone who can write the folder can do.
REF_ENTRY = f"""
import json, struct
from pathlib import Path
from safetensors.torch import load_file, save_file
from ropekv import check
from ropekv.models import load_checkpoint
from ropekv.parity import reference_cache as rc
from ropekv.parity.cases import Case
ck = load_checkpoint({L!r})
CASE = [Case(length=240, block_size=16, decode_steps=2)]
refs = Path({str(work)!r}) / f"refs-{{__import__('os').getpid()}}"
def entry():
    (e,) = refs.glob("*.safetensors")
    return e
def rewrite(change):
    path = entry()
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8 : 8 + n])["__metadata__"]
    tensors = load_file(path)
    change(tensors, meta)
    meta["checksum"] = rc._checksum(tensors)
    save_file(tensors, path, metadata=meta)
"""
# A tiny llama's 8-bit cache saved by ropekv's engine, then its layer-0 key scales rewritten with
# `forge(edit)` (checksum recomputed), and the load into a fresh engine.
FP8_SAVED = f"""
import json, struct, torch
from pathlib import Path
from safetensors.torch import load, save
from ropekv.adapters.native import NativeAdapter
from ropekv.models import load_checkpoint
from ropekv.parity.cases import Case, token_stream
from ropekv.transfer import payload
from ropekv.transfer.saved import load_sequence, save_sequence
ck = load_checkpoint({L!r})
CASE = Case(length=16, block_size=4)
adapter = NativeAdapter(ck, kv_dtype="fp8", kv_scale="per_head")
engine = adapter.make_engine(CASE)
tokens = token_stream(ck.config.vocab_size, CASE.length, 0)
engine.prefill("s", tokens)
path = Path({str(work)!r}) / f"fp8-{{__import__('os').getpid()}}.safetensors"
save_sequence(engine, "s", path, tokens)
def forge(edit):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    tensors = load(data)
    edit(tensors)
    entries = [(k, payload._st_dtype(t), list(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
               for k, t in sorted(tensors.items())]
    meta["checksum"] = payload._checksum(meta, entries)
    path.write_bytes(save(tensors, metadata=meta))
"""

# llama.cpp's own state moved from a writer context to a fresh reader through ropekv's checked state file
# (run from .venv-llamacpp), the file rewritten on the way by `tamper(path)` with a valid sha256.
LLAMACPP_STATE = f"""
from pathlib import Path
from ropekv.adapters.llamacpp import LlamaCppEngine, state_check
from ropekv.adapters.llamacpp.state_file import read_state_file, write_state_file
from ropekv.parity.cases import token_stream
engine = LlamaCppEngine(None)
tokens = token_stream(engine.config.vocab_size, 24, seed=0).tolist()
path = Path({str(work)!r}) / f"state-{{__import__('os').getpid()}}"
real_save = state_check.save_state
def save(sc, where, toks):
    n = real_save(sc, where, toks)
    tamper(Path(where))
    return n
state_check.save_state = save
def rewrite(path, tokens=None, edit=None):
    header, data = read_state_file(path)
    data = bytearray(data)
    if edit:
        edit(data)
    write_state_file(path, header.contract, list(tokens or header.tokens), header.first_position, bytes(data), header.writer)
def run():
    return state_check.check_transfer(engine, None, tokens, 20, 3, state_path=path)
"""


def api(body: str) -> str:
    """Code that prints RETURNED, or TYPED for a ropekv error (anything else is a traceback)."""
    return (
        "from ropekv.errors import RopeKVError\ntry:\n"
        + "".join(f"    {line}\n" for line in body.strip().splitlines())
        + "    print('RETURNED')\nexcept RopeKVError as exc:\n    print(f'TYPED {type(exc).__name__}: {exc}'[:200])\n"
    )


# name -> (kind, payload, expect): kind "cli" (ropekv argv), "api" (code), "script" (argv of a script),
# "skip" (reason). expect: "refuse" (a typed one-line error), "verdict" (exit 0 or 1 with a verdict),
# "typed" (api: a ropekv error), "returns" (api: no error), "help" (exit 0 with a usage text).
cases: dict[str, tuple[str, object, str]] = {
    # --- section 3: adapters
    "adapter run_case sys.exit(0)": ("cli", adapter("Exits"), "refuse"),
    "adapter run_case sleeps": ("cli", adapter("Sleeps", *limit), "refuse"),
    "adapter prints into the report": ("cli", adapter("Prints"), "verdict"),
    "adapter load KeyboardInterrupt": ("cli", adapter("Interrupts"), "refuse"),
    "adapter checkpoint None": ("cli", adapter("NoCheckpoint"), "refuse"),
    "adapter exception str() raises": ("cli", adapter("BadStr"), "refuse"),
    "adapter tier property raises": ("cli", adapter("BadTier"), "refuse"),
    "fp8 with a custom engine": ("cli", adapter("Good", "--kv-dtype", "fp8"), "verdict"),
    "shift past 2**31": (
        "cli",
        ["check", L, "--ops", "shift:2147483648", "--lengths", "9", "--no-progress"],
        "verdict",
    ),
    # --- section 3: files
    "ropekv-verified.json a FIFO": (
        "api",
        TINY_CONVERT + "import os\nfrom ropekv.models.default import default_checkpoint, cache_dir, VERIFIED_FILE\n"
        "default_checkpoint()\nr = cache_dir() / VERIFIED_FILE\nr.unlink()\nos.mkfifo(r)\ndefault_checkpoint()",
        "returns",
    ),
    "refusal log a FIFO": (
        "api",
        f"from ropekv.handoff.refusals import read_refusals\nread_refusals({str(refusal_fifo)!r}, None)",
        "typed",
    ),
    "refusal log nested 100,000 deep": (
        "api",
        f"from ropekv.handoff.refusals import read_refusals\nread_refusals({str(refusal_deep)!r}, None)",
        "typed",
    ),
    "tokenizer_config.json nested 100,000": (
        "api",
        f"from ropekv.models.tokenizer import Tokenizer\nTokenizer.from_file({str(deep / 'tokenizer.json')!r})",
        "typed",
    ),
    "tokenizer_config.json -> /dev/zero": (
        "api",
        f"from ropekv.models.tokenizer import Tokenizer\nTokenizer.from_file({str(zero / 'tokenizer.json')!r})",
        "typed",
    ),
    "config.json of another user (0600)": (
        "api",
        f"DENIED = [{L + '/config.json'!r}]\n{DENY}\nfrom ropekv.models import load_checkpoint\nload_checkpoint({L!r})",
        "typed",
    ),
    "model.safetensors of another user (0600)": (
        "api",
        f"DENIED = [{L + '/model.safetensors'!r}]\n{DENY}\nfrom ropekv.models import load_checkpoint\n"
        f"load_checkpoint({L!r})",
        "typed",
    ),
    "GGUF array of 10**8 empty strings": (
        "api",
        f"from ropekv.models.gguf_file import open_gguf\nopen_gguf({str(gguf)!r})",
        "typed",
    ),
    "scripts/bad_inputs.py --help": ("script", [str(root / "scripts" / "bad_inputs.py"), "--help"], "help"),
    "vLLM sidecar declaring a 20 GiB layer": (
        "api",
        VLLM_SIDECAR + "big = 20 << 30\nname = f'{NAMES[1]}.safetensors'\n"
        "with open(folder / name, 'wb') as f:\n    f.truncate(big)\n"
        "layers = list(side.layers)\nlayers[1] = sc.LayerFile(name, big, '0' * 64)\n"
        "sc.write_sidecar(folder, dataclasses.replace(side, layers=tuple(layers)))\n"
        "diffs, data = sc.verify_files(folder, sc.read_sidecar(folder))\n"
        "if not any(d.field == 'checksum.layers.1' for d in diffs):\n    print('ACCEPTED')",
        "returns",
    ),
    "vLLM entry, exponent bit flipped in layer 0": (
        "api",
        VLLM_STORE + "k0 = keys[0].clone()\ni = int(k0.abs().argmin())\nk0.view(-1).view(torch.int32)[i] ^= 1 << 23\n"
        "write([k0, *keys[1:]], values)\n(f,) = entry_findings(store, producer, 1)\n"
        "if f['holds'] is not None:\n    print('ACCEPTED')",
        "returns",
    ),
    "vLLM values forged alone": (
        "api",
        VLLM_STORE + "v = [x.clone() for x in values]\nv[1][0, 1, 3] *= 1.5\nwrite(keys, v)\n"
        "(f,) = entry_findings(store, producer, 1)\n"
        "if f['holds'] is not None or f['value_mismatch'] is None:\n    print('ACCEPTED')",
        "returns",
    ),
    "vLLM stale refusal of an earlier run": (
        "api",
        "import json\nfrom pathlib import Path\nfrom ropekv.handoff.refusals import REFUSALS_FILE, read_refusals\n"
        f"store = Path({str(work)!r}) / 'store-stale'\nstore.mkdir()\n"
        "old = {'request_id': 'r0', 'key': 'k', 'fields': ['rope.theta'], 'message': 'm', 'policy': 'fail', "
        "'run': 'earlier'}\n(store / REFUSALS_FILE).write_text(json.dumps(old) + '\\n')\n"
        "if read_refusals(store, 'this-run'):\n    print('ACCEPTED')",
        "returns",
    ),
    "vLLM entry folder symlinked outside": (
        "api",
        VLLM_STORE + "write(keys, values)\n(e,) = [p for p in store.iterdir() if p.is_dir()]\n"
        "e.rename(tmp / 'copy')\ne.symlink_to(tmp / 'copy')\n(f,) = entry_findings(store, producer, 1)\n"
        "if f['holds'] is not None or 'symbolic link' not in (f.get('error') or ''):\n    print('ACCEPTED')",
        "returns",
    ),
    "reference-cache entry of another user": (
        "api",
        REF_ENTRY + "check(ck, cases=CASE, reference_cache=refs)\n"
        f"DENIED = [str(entry())]\n{DENY}\n"
        "r = check(ck, cases=CASE, reference_cache=refs)\n"
        "if not r.passed or r.cases[0].reference_source != 'recomputed (corrupt entry)':\n    print('ACCEPTED')",
        "returns",
    ),
    "reference-cache entry saved 1e300 s": (
        "api",
        REF_ENTRY + "check(ck, cases=CASE, reference_cache=refs)\n"
        "rewrite(lambda t, m: m.__setitem__('seconds', '1e300'))\n"
        "r = check(ck, cases=CASE, reference_cache=refs)\n"
        "import re\nif r.reference_cache['seconds_saved'] != 0 or re.search('[0-9]{30}', r.table()):\n"
        "    print('ACCEPTED')",
        "returns",
    ),
    "reference-cache rows planted with bfloat16 angles": (
        "api",
        REF_ENTRY + "import torch\nfrom ropekv.rope import RopeSpec\nfrom ropekv.bugs.registry import FAULTS\n"
        "real = RopeSpec.angles\n"
        "def bf16(self, positions, seq_len=None):\n"
        "    inv = self.inv_freq(seq_len).to(torch.bfloat16)\n"
        "    return (positions.to(torch.bfloat16)[:, None] * inv[None, :]).to(torch.float64)\n"
        "RopeSpec.angles = bf16\ncheck(ck, cases=CASE, reference_cache=refs)\nRopeSpec.angles = real\n"
        "if check(FAULTS['low-precision-angles'].adapter(ck), cases=CASE, reference_cache=refs).passed:\n"
        "    print('ACCEPTED')",
        "returns",
    ),
    "llama.cpp state, 32 bytes flipped, sha256 recomputed": (
        "llamacpp",
        # One bit in each of 32 cache values a third of the way in (llama-cpp-python 0.3.36's layout puts
        # the bit in a float32's mantissa): the reader's decode moves 0.02 from the writer's logits, while
        # against its own forward it stays within float32's tolerance (8e-4 against 5e-3).
        LLAMACPP_STATE + "def flip(data):\n    at = len(data) // 3 + 2\n    for k in range(32):\n"
        "        data[at + 4 * k] ^= 1\n"
        "tamper = lambda p: rewrite(p, edit=flip)\nif run().passed:\n    print('ACCEPTED')",
        "returns",
    ),
    "llama.cpp state listing other tokens": (
        "llamacpp",
        LLAMACPP_STATE + "tamper = lambda p: rewrite(p, tokens=[t + 1 for t in tokens[:20]])\nrun()",
        "typed",
    ),
    "saved fp8 per-head scales wrong length": (
        "api",
        FP8_SAVED + "def edit(t):\n    s = t['layers.0.k_scale']\n"
        "    t['layers.0.k_scale'] = s[:1].clone() if s.numel() > 1 else torch.cat([s, s])\n"
        "forge(edit)\nload_sequence(adapter.make_engine(CASE), path)",
        "typed",
    ),
    "saved fp8 scalar scale for a vector": (
        "api",
        FP8_SAVED + "def edit(t):\n    t['layers.0.k_scale'] = t['layers.0.k_scale'][0].clone().reshape(())\n"
        "forge(edit)\nload_sequence(adapter.make_engine(CASE), path)",
        "typed",
    ),
    # --- earlier runs' inputs
    "ops rollback:--3": ("cli", ["check", L, "--ops", "rollback:--3"], "refuse"),
    "block-sizes 1e18": ("cli", ["check", L, "--block-sizes", str(10**18), "--lengths", "17"], "refuse"),
    "lengths 1,,2": ("cli", ["check", L, "--lengths", "1,,2"], "refuse"),
    "handoff timeout 1e14": ("cli", ["handoff", L, "--lengths", "5", "--timeout", "1e14"], "refuse"),
    "config arch llama, model_type qwen2": ("cli", ["check", variant("mt", model_type="qwen2")], "refuse"),
    "config hidden_act 0": ("cli", ["check", variant("act", hidden_act=0), "--lengths", "17"], "refuse"),
    "saved cache a FIFO": (
        "api",
        "from ropekv.engine.engine import Engine\nfrom ropekv.transfer.saved import load_sequence\n"
        "from ropekv.testing.tiny import tiny_checkpoint\nfrom ropekv.contract import CacheContract\n"
        "c = tiny_checkpoint('llama')\ne = Engine(c, CacheContract.for_model(c.config, key_form='rotated'))\n"
        f"load_sequence(e, {str(fifo)!r})",
        "typed",
    ),
}


def judge(kind: str, expect: str, p, hung: bool) -> str:
    if hung:
        return "HANG"
    out, err = p.stdout, p.stderr
    if "Traceback" in out + err or "MemoryError" in err:
        return "TRACEBACK"
    if kind in ("api", "llamacpp"):
        if "ACCEPTED" in out:  # a forgery or a bad file taken for sound
            return "SILENT"
        got = "typed" if "TYPED " in out else ("returns" if "RETURNED" in out else "?")
        return "ok" if got == expect else ("SILENT" if got == "returns" else f"WRONG ({got}, rc={p.returncode})")
    if expect == "help":
        return "ok" if p.returncode == 0 and "usage:" in out else f"WRONG rc={p.returncode}"
    if p.returncode == 0 and "parity holds" not in out:
        return "EXIT0-NO-VERDICT"
    if "ADAPTER-NOISE" in out:
        return "SILENT"  # the adapter's print inside the report
    if expect == "verdict":
        return "ok" if p.returncode in (0, 1) else f"REFUSED rc={p.returncode}"
    if p.returncode in (0, 1, 130):
        return f"SILENT rc={p.returncode}"
    return "ok" if p.returncode in (2, 3) else f"WRONG rc={p.returncode}"


LLAMACPP_PY = root / ".venv-llamacpp" / "bin" / "python"  # llama.cpp's inputs run in its own venv


def run(kind: str, payload) -> tuple[subprocess.CompletedProcess | None, bool]:
    argv = (
        ["-c", api(payload)]
        if kind in ("api", "llamacpp")
        else (["-m", "ropekv.cli.main", *payload] if kind == "cli" else payload)
    )
    python = str(LLAMACPP_PY) if kind == "llamacpp" else py
    cmd = ["bash", "-c", 'ulimit -v 6000000; exec "$@"', "x", python, *argv]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=cli.timeout, env=env, cwd=work)
        return p, False
    except subprocess.TimeoutExpired:
        return None, True


counts: Counter[str] = Counter()
for name, (kind, payload, expect) in cases.items():
    if cli.only and cli.only not in name:
        continue
    if kind == "llamacpp" and not LLAMACPP_PY.is_file():
        kind, payload = "skip", f"no {LLAMACPP_PY} (make setup-llamacpp)"
    if kind == "skip":
        counts["SKIP"] += 1
        print(f"{name:42} {'SKIP':18} {payload}", flush=True)
        continue
    p, hung = run(kind, payload)
    verdict = judge(kind, expect, p, hung)
    counts[verdict.split(" ")[0]] += 1
    text = "" if p is None else (p.stdout.strip() if kind == "api" else p.stderr.strip()) or p.stdout.strip()
    last = (text.splitlines() or [""])[-1][:120]
    print(f"{name:42} {verdict:18} {last}", flush=True)
    if os.environ.get("BAD_INPUTS_DEBUG") and p is not None:
        print(p.stderr[-1500:])
print(
    f"\n{sum(counts.values())} inputs: {counts['TRACEBACK']} tracebacks, {counts['HANG']} hangs, "
    f"{counts['SILENT']} silent acceptances, {counts['EXIT0-NO-VERDICT']} exit 0 without a verdict, "
    f"{counts['REFUSED']} refusals of what must be judged, {counts['WRONG']} other wrong outcomes, "
    f"{counts['SKIP']} not built here, {counts['ok']} ok"
)
