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
``SKIP`` (an input this script does not build: its reason is printed).

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


def api(body: str) -> str:
    """Code that prints RETURNED, or TYPED for a ropekv error (anything else is a traceback)."""
    return (
        "from ropekv.errors import RopeKVError\ntry:\n"
        + "".join(f"    {line}\n" for line in body.strip().splitlines())
        + "    print('RETURNED')\nexcept RopeKVError as exc:\n    print(f'TYPED {type(exc).__name__}: {exc}'[:200])\n"
    )


OTHER = "another helper's item"
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
        f"from ropekv.handoff.refusals import read_refusals\nread_refusals({str(refusal_fifo)!r})",
        "typed",
    ),
    "refusal log nested 100,000 deep": (
        "api",
        f"from ropekv.handoff.refusals import read_refusals\nread_refusals({str(refusal_deep)!r})",
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
    "vLLM sidecar declaring a 20 GiB layer": ("skip", f"{OTHER}: needs a vLLM store entry", ""),
    "vLLM entry, exponent bit flipped in layer 0": ("skip", f"{OTHER}: needs a vLLM store entry", ""),
    "vLLM stale refusal of an earlier run": ("skip", f"{OTHER}: needs a vLLM handoff", ""),
    "vLLM entry folder symlinked outside": ("skip", f"{OTHER}: needs a vLLM handoff", ""),
    "reference-cache entry of another user": ("skip", f"{OTHER}: needs a forged reference-cache entry", ""),
    "reference-cache entry saved 1e300 s": ("skip", f"{OTHER}: needs a forged reference-cache entry", ""),
    "saved fp8 per-head scales wrong length": ("skip", f"{OTHER}: needs a saved fp8 file", ""),
    "saved fp8 scalar scale for a vector": ("skip", f"{OTHER}: needs a saved fp8 file", ""),
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
    if kind == "api":
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


def run(kind: str, payload) -> tuple[subprocess.CompletedProcess | None, bool]:
    argv = (
        ["-c", api(payload)] if kind == "api" else (["-m", "ropekv.cli.main", *payload] if kind == "cli" else payload)
    )
    cmd = ["bash", "-c", 'ulimit -v 6000000; exec "$@"', "x", py, *argv]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=cli.timeout, env=env, cwd=work)
        return p, False
    except subprocess.TimeoutExpired:
        return None, True


counts: Counter[str] = Counter()
for name, (kind, payload, expect) in cases.items():
    if cli.only and cli.only not in name:
        continue
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
