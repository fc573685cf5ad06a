"""The bad-input run: inputs ropekv must refuse with a typed one-line error (exit 2 or 3): no traceback,
no hang, no silent acceptance. One line per input: its verdict and the last line the command printed.

    .venv/bin/python scripts/bad_inputs.py [CHECKOUT]   (default: this checkout)

Each input runs in a subprocess under a 6 GB address-space limit and a 60 s timeout (a hang or an
allocation of the whole machine shows as HANG / TRACEBACK instead of taking the machine down).
The tests hold each refusal (tests/test_errors_*.py, tests/test_saved.py, tests/test_config_reading.py);
this script is the run the closing figures of a change come from."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parents[1]).resolve()
py = sys.executable
work = pathlib.Path(tempfile.mkdtemp(prefix="bad-"))
env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
# a tiny saved llama and variants of its config
subprocess.run(
    [py, "-c", f"from ropekv.testing.tiny import tiny_checkpoint; tiny_checkpoint('llama', save_to='{work}/llama')"],
    env=env,
    check=True,
    cwd=root,
)


def variant(name, **over):
    d = work / name
    subprocess.run(["cp", "-r", str(work / "llama"), str(d)], check=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(over)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


L = str(work / "llama")
cases = {
    "ops rollback:--3": ["check", L, "--ops", "rollback:--3"],
    "ops rollback:²": ["check", L, "--ops", "rollback:²"],
    "block-sizes 1e18": ["check", L, "--block-sizes", str(10**18), "--lengths", "17"],
    "block-sizes 10^7": ["check", L, "--block-sizes", str(10**7), "--lengths", "17"],
    "lengths 17,": ["check", L, "--lengths", "17,"],
    "lengths 1,,2": ["check", L, "--lengths", "1,,2"],
    "lenghts typo": ["check", L, "--lenghts", "3"],
    "handoff seed huge": ["handoff", L, "--lengths", "5", "--seed", "99999999999999999999999"],
    "handoff timeout 1e14": ["handoff", L, "--lengths", "5", "--timeout", "1e14"],
    "config sliding_window 2**64": [
        "check",
        variant("sw", sliding_window=2**64, model_type="mistral", architectures=["MistralForCausalLM"]),
        "--lengths",
        "17",
    ],
    "config arch llama, model_type qwen2": ["check", variant("mt", model_type="qwen2"), "--lengths", "17"],
    "config hidden_act 0": ["check", variant("act", hidden_act=0), "--lengths", "17"],
    "config rope factor 'x'": [
        "check",
        variant(
            "fac",
            rope_scaling={"rope_type": "default", "factor": "x"},
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "factor": "x"},
        ),
        "--lengths",
        "17",
    ],
}
fifo = work / "fifo"
os.mkfifo(fifo)
api = {
    "Engine.load FIFO": f"from ropekv.engine.engine import Engine\nfrom ropekv.transfer.saved import load_sequence\nfrom ropekv.testing.tiny import tiny_checkpoint\nfrom ropekv.contract import CacheContract\nc=tiny_checkpoint('llama')\ne=Engine(c, CacheContract.for_model(c.config, key_form='rotated'))\nload_sequence(e, r'{fifo}')",
    "Engine.load /dev/zero": "from ropekv.engine.engine import Engine\nfrom ropekv.transfer.saved import load_sequence\nfrom ropekv.testing.tiny import tiny_checkpoint\nfrom ropekv.contract import CacheContract\nc=tiny_checkpoint('llama')\ne=Engine(c, CacheContract.for_model(c.config, key_form='rotated'))\nload_sequence(e, '/dev/zero')",
}


def judge(p, timed_out):
    out = (p.stdout if p else "") + (p.stderr if p else "")
    if timed_out:
        return "HANG"
    if "Traceback" in out:
        return f"TRACEBACK rc={p.returncode}"
    if p.returncode in (0, 1):
        return f"ACCEPTED rc={p.returncode}"
    if p.returncode < 0 or p.returncode == 137:
        return f"KILLED rc={p.returncode}"
    return f"ok rc={p.returncode}"


def run(argv, code=None):
    cmd = ["bash", "-c", 'ulimit -v 6000000; exec "$@"', "x", py] + (
        ["-c", code] if code else ["-m", "ropekv.cli.main", *argv]
    )
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=work)
        return p, False
    except subprocess.TimeoutExpired:
        return None, True


for name, argv in cases.items():
    p, t = run(argv)
    last = "" if p is None else ((p.stderr.strip().splitlines() or [""])[-1])[:150]
    print(f"{name:40} {judge(p, t):22} {last}", flush=True)
for name, code in api.items():
    p, t = run(None, code)
    last = "" if p is None else ((p.stderr.strip().splitlines() or [""])[-1])[:150]
    # API: a typed ropekv error is the right outcome
    verdict = (
        "HANG"
        if t
        else (
            "ok (typed)" if "ropekv.errors" in (p.stderr) or "Error:" in last and "ropekv" in p.stderr else judge(p, t)
        )
    )
    print(f"{name:40} {verdict:22} {last}", flush=True)
