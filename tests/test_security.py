"""Security: ropekv never executes what it reads, and bounds declared sizes before allocating.

1. The shipped source (``ropekv/``, ``scripts/``, ``examples/``, ``engine_tests/``) holds no unpickling,
   no ``torch.load``, no ``eval``/``exec``, never passes ``trust_remote_code=True``, never sends Python
   objects between ranks (``torch.distributed``'s ``broadcast_object_list``, ``all_gather_object``,
   ``scatter_object_list``, ``recv_object_list`` ... pickle what they send and unpickle what they
   receive), and never loads a model with ``from_pretrained`` without ``use_safetensors=True`` (without
   it transformers falls back to a pickled ``pytorch_model.bin``). Two independent scans over every
   ``.py``: the AST (imports, names, attribute chains, keyword arguments) and a text grep of the code
   with strings and comments blanked out; the grep also reads the shell scripts (their inline Python).
   Both scanners are first shown to catch each pattern on planted samples.
2. Headers that declare absurd sizes (a safetensors header length of 2**40, a GGUF with 2**60
   metadata entries, array elements, string bytes or tensor dims, a 65 MB config.json) are refused
   quickly and with a small peak of traced memory: nothing is allocated for what was declared.
"""

from __future__ import annotations

import ast
import io
import json
import re
import shutil
import struct
import tokenize
from pathlib import Path

import pytest
from bounded import bounded

import ropekv
from ropekv.errors import CheckpointError, ConfigError
from ropekv.models import load_checkpoint
from ropekv.models.gguf_file import load_gguf

PACKAGE = Path(ropekv.__file__).parent
REPO = PACKAGE.parent
SCANNED = ("ropekv", "scripts", "examples", "engine_tests")
SOURCES = sorted(p for d in SCANNED for p in (REPO / d).rglob("*.py"))
SHELL_SOURCES = sorted(p for d in SCANNED for p in (REPO / d).rglob("*.sh"))

# ----------------------------------------------------------------------------------- source scans

UNPICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
CODE_BUILTINS = {"eval", "exec", "compile", "__import__"}
# attribute chains that deserialize with pickle or load code
FORBIDDEN_CHAINS = {"torch.load", "torch.serialization.load", "torch.jit.load", "pd.read_pickle", "pandas.read_pickle"}
# torch.distributed collectives that pickle Python objects on one rank and unpickle them on another
OBJECT_COLLECTIVES = {
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "broadcast_object",
    "send_object",
    "recv_object",
}
# from_pretrained of these reads JSON/text files only; every other class loads weights
_NO_WEIGHTS = re.compile(r"(Tokenizer|TokenizerFast|Config|Processor|FeatureExtractor|GenerationConfig)$")


def _unsafe_from_pretrained(call: ast.Call) -> bool:
    """A ``X.from_pretrained(...)`` that loads weights without an explicit ``use_safetensors=True``."""
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "from_pretrained"):
        return False
    owner = _chain(call.func.value) or ""
    if _NO_WEIGHTS.search(owner.split(".")[-1]):
        return False
    return not any(
        k.arg == "use_safetensors" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )


def _chain(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def ast_findings(source: str, filename: str = "<src>") -> list[str]:
    """Every forbidden construct in ``source``, as ``file:line: what``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [
                f"{filename}:{line}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNPICKLING_MODULES
            ]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in UNPICKLING_MODULES:
                found.append(f"{filename}:{line}: from {module} import ...")
            if module in ("torch", "torch.serialization", "torch.jit") and any(a.name == "load" for a in node.names):
                found.append(f"{filename}:{line}: from {module} import load")
            found += [
                f"{filename}:{line}: from {module} import {a.name} (pickles objects between ranks)"
                for a in node.names
                if a.name in OBJECT_COLLECTIVES
            ]
            if module in ("builtins",) and any(a.name in CODE_BUILTINS for a in node.names):
                found.append(f"{filename}:{line}: from builtins import eval/exec")
        elif isinstance(node, ast.Name) and node.id in CODE_BUILTINS:
            found.append(f"{filename}:{line}: {node.id}")
        elif isinstance(node, ast.Name) and node.id in OBJECT_COLLECTIVES:
            found.append(f"{filename}:{line}: {node.id} (pickles objects between ranks)")
        elif isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain in FORBIDDEN_CHAINS or (chain and chain.split(".")[0] in UNPICKLING_MODULES):
                found.append(f"{filename}:{line}: {chain}")
            if chain in ("builtins.eval", "builtins.exec"):
                found.append(f"{filename}:{line}: {chain}")
            if node.attr in OBJECT_COLLECTIVES:
                found.append(f"{filename}:{line}: {chain or node.attr} (pickles objects between ranks)")
        elif isinstance(node, ast.keyword) and node.arg in ("trust_remote_code", "allow_pickle"):
            if isinstance(node.value, ast.Constant) and node.value.value is True:
                found.append(f"{filename}:{line}: {node.arg}=True")
        elif isinstance(node, ast.Call) and _unsafe_from_pretrained(node):
            found.append(f"{filename}:{line}: from_pretrained without use_safetensors=True")
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "__import__")
        ):
            texts = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if any(
                t in CODE_BUILTINS or t in UNPICKLING_MODULES or t in OBJECT_COLLECTIVES or t == "load" for t in texts
            ):
                found.append(f"{filename}:{line}: getattr/__import__ of {texts}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in UNPICKLING_MODULES:
            found.append(f"{filename}:{line}: string {node.value!r} (importlib.import_module?)")
    return found


def code_only(source: str) -> str:
    """``source`` with every string literal and comment blanked out (line structure kept)."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            out.append((tok.type, '""' if tok.type == tokenize.STRING else ""))
        else:
            out.append((tok.type, tok.string))
    return tokenize.untokenize(out)


GREP_PATTERNS = {
    "import pickle": re.compile(
        r"\bimport\s+(c?pickle|_pickle|dill|cloudpickle|marshal|shelve)\b"
        r"|\bfrom\s+(c?pickle|_pickle|dill|cloudpickle|marshal|shelve)\s+import\b"
    ),
    "torch.load(": re.compile(r"\btorch\s*\.\s*load\s*\("),
    "eval(": re.compile(r"(?<![\w.])eval\s*\("),
    "exec(": re.compile(r"(?<![\w.])exec\s*\("),
    "trust_remote_code=True": re.compile(r"\btrust_remote_code\s*=\s*True\b"),
    "object collective": re.compile(r"\b(" + "|".join(sorted(OBJECT_COLLECTIVES)) + r")\b"),
}
# shell scripts: their inline Python is not parsed, so a from_pretrained call must name
# use_safetensors=True on its own line
SHELL_PATTERNS = {
    **GREP_PATTERNS,
    "from_pretrained without use_safetensors=True": re.compile(
        r"\bfrom_pretrained\s*\((?!.*use_safetensors\s*=\s*True)"
    ),
}


def grep_findings(source: str, filename: str = "<src>") -> list[str]:
    code = code_only(source)
    found = []
    for n, line in enumerate(code.splitlines(), 1):
        found += [f"{filename}:{n}: {name}" for name, pattern in GREP_PATTERNS.items() if pattern.search(line)]
    return found


def shell_findings(source: str, filename: str = "<sh>") -> list[str]:
    """The grep over a shell script, comment lines left out (shell has no tokenizer to blank them)."""
    found = []
    for n, line in enumerate(source.splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue
        found += [f"{filename}:{n}: {name}" for name, pattern in SHELL_PATTERNS.items() if pattern.search(line)]
    return found


PLANTED = {
    "import pickle": "import pickle\n",
    "from pickle": "from pickle import loads\n",
    "import dill": "import dill as d\n",
    "pickle attribute": "import os\nx = pickle.loads(b'')\n",
    "torch.load": "import torch\nw = torch.load('w.bin')\n",
    "torch.load weights_only": "import torch\nw = torch.load('w.bin', weights_only=True)\n",
    "from torch import load": "from torch import load\n",
    "torch.jit.load": "import torch\nm = torch.jit.load('m.pt')\n",
    "np.load pickle": "import numpy as np\na = np.load('a.npy', allow_pickle=True)\n",
    "eval": "x = eval('1 + 1')\n",
    "exec": "exec('x = 1')\n",
    "eval by getattr": "import builtins\nf = getattr(builtins, 'eval')\n",
    "builtins.exec": "import builtins\nbuiltins.exec('x = 1')\n",
    "trust_remote_code": "m = AutoModel.from_pretrained('p', trust_remote_code=True)\n",
    "import_module pickle": "import importlib\np = importlib.import_module('pickle')\n",
    "broadcast_object_list": "import torch.distributed as dist\ndist.broadcast_object_list(box, src=0)\n",
    "all_gather_object": "import torch\ntorch.distributed.all_gather_object(out, obj)\n",
    "scatter_object_list": "from torch.distributed import scatter_object_list\n",
    "recv_object_list": "from torch import distributed\ndistributed.recv_object_list(box, src=1)\n",
    "gather_object by getattr": "import torch.distributed as dist\nf = getattr(dist, 'gather_object')\n",
    "from_pretrained without use_safetensors": "m = AutoModelForCausalLM.from_pretrained(d, local_files_only=True)\n",
    "from_pretrained use_safetensors=False": "m = auto.from_pretrained(d, use_safetensors=False)\n",
    "from_pretrained with **kwargs": "m = transformers.AutoModel.from_pretrained(d, **options)\n",
}
SHELL_PLANTED = {
    "inline from_pretrained": "python -c \"from transformers import AutoModel; AutoModel.from_pretrained('d')\"\n",
    "inline torch.load": "\"$VENV/bin/python\" - <<'EOF'\nimport torch\ntorch.load('w.bin')\nEOF\n",
    "inline broadcast_object_list": "python - <<EOF\ndist.broadcast_object_list(box)\nEOF\n",
}
BENIGN = """
'''A docstring that says trust_remote_code=True is refused and never calls eval( or torch.load( or import pickle.'''
import torch
model = torch.nn.Linear(2, 2)
model.eval()  # nn.Module.eval: a mode switch, not the builtin; also a comment with exec( and eval(
msg = "pickled weights are refused; trust_remote_code=True is an error"
def load(path, *, trust_remote_code=False):
    if trust_remote_code:
        raise ValueError("refused")
    return torch.zeros(1)
tokenizer = AutoTokenizer.from_pretrained(path)  # reads tokenizer.json, no weights
config = transformers.AutoConfig.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, local_files_only=True)
dist.broadcast(length, src=0)  # tensors, never objects: "broadcast_object_list" in a string is fine
"""
BENIGN_SHELL = """# a comment may say torch.load( or broadcast_object_list
python -c "AutoModel.from_pretrained('d', use_safetensors=True)"
"""


@pytest.mark.parametrize("name", list(PLANTED))
def test_the_ast_scan_catches_each_planted_pattern(name):
    assert ast_findings(PLANTED[name]), name


@pytest.mark.parametrize(
    "name",
    [
        "import pickle",
        "from pickle",
        "torch.load",
        "torch.load weights_only",
        "eval",
        "exec",
        "trust_remote_code",
        "broadcast_object_list",
        "all_gather_object",
        "scatter_object_list",
        "recv_object_list",
    ],
)
def test_the_grep_catches_each_planted_pattern(name):
    assert grep_findings(PLANTED[name]), name


@pytest.mark.parametrize("name", list(SHELL_PLANTED))
def test_the_shell_grep_catches_each_planted_pattern(name):
    assert shell_findings(SHELL_PLANTED[name]), name


def test_the_scans_do_not_flag_benign_code():
    assert ast_findings(BENIGN) == []
    assert grep_findings(BENIGN) == []
    assert shell_findings(BENIGN_SHELL) == []


def test_scans_cover_the_whole_package_scripts_examples_and_engine_tests():
    names = {p.relative_to(REPO).as_posix() for p in SOURCES}
    assert {
        "ropekv/models/safetensors_dir.py",
        "ropekv/models/gguf_file.py",
        "ropekv/cli/main.py",
        "ropekv/contract.py",
        "ropekv/bench/handoff.py",
        "ropekv/bench/decode.py",
    } <= names
    assert {p.split("/")[0] for p in names} == set(SCANNED)
    assert len(SOURCES) >= 60
    assert "scripts/setup.sh" in {p.relative_to(REPO).as_posix() for p in SHELL_SOURCES}


def test_no_unpickling_eval_exec_remote_code_object_collectives_or_pickled_weights_anywhere():
    found = []
    for path in SOURCES:
        source = path.read_text(encoding="utf-8")
        rel = str(path.relative_to(REPO))
        found += ast_findings(source, rel) + grep_findings(source, rel)
    for path in SHELL_SOURCES:
        found += shell_findings(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    assert found == [], f"forbidden constructs in {', '.join(SCANNED)}:\n" + "\n".join(found)


# ----------------------------------------------------------------------------------- bounded sizes


@pytest.fixture
def ck(tiny_llama_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "ck"))


@pytest.mark.parametrize("claimed", [2**40, 2**63, 2**64 - 1])
def test_safetensors_header_length_is_bounded(ck, claimed):
    file = ck / "model.safetensors"
    file.write_bytes(struct.pack("<Q", claimed) + b'{"__metadata__": {}}' + b"\0" * 64)
    with bounded(), pytest.raises(CheckpointError, match=rf"model\.safetensors: .*header claims {claimed} bytes"):
        load_checkpoint(ck)


def test_safetensors_tensor_offsets_are_bounded(ck):
    header = json.dumps(
        {"model.norm.weight": {"dtype": "F32", "shape": [2**30, 2**30], "data_offsets": [0, 2**62]}}
    ).encode()
    (ck / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with bounded(), pytest.raises(CheckpointError, match="model.norm.weight"):
        load_checkpoint(ck)


def test_huge_config_json_is_not_read(ck):
    config = ck / "config.json"
    with open(config, "r+b") as f:
        f.truncate(65 * 1024 * 1024)  # sparse: declared size only
    with bounded(), pytest.raises(ConfigError, match="implausibly large"):
        load_checkpoint(ck)


def _gguf(n_tensors: int, kv: bytes, n_kv: int = 1, tensor_info: bytes = b"") -> bytes:
    body = struct.pack("<4sIQQ", b"GGUF", 3, n_tensors, n_kv) + kv + tensor_info
    return body + b"\0" * (-len(body) % 32) + b"\0" * 64


def _str(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


ARCH = _str("general.architecture") + struct.pack("<I", 8) + _str("llama")

ABSURD_GGUF = {
    "tensor count 2**60": (_gguf(2**60, ARCH), "tensors, more than"),
    "metadata count 2**60": (_gguf(0, ARCH, n_kv=2**60), "metadata entries"),
    "string of 2**62 bytes": (
        _gguf(0, _str("general.name") + struct.pack("<I", 8) + struct.pack("<Q", 2**62)),
        "4611686018427387904-byte string",
    ),
    "key of 2**62 bytes": (_gguf(0, struct.pack("<Q", 2**62) + b"abc"), "byte string"),
    "array of 2**60 uint32": (_gguf(0, _str("llama.x") + struct.pack("<IIQ", 9, 4, 2**60)), "array elements"),
    "array of 2**60 strings": (
        _gguf(0, _str("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**60)),
        "array elements",
    ),
    "nested arrays": (
        _gguf(0, _str("x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 10 + struct.pack("<IQ", 4, 0)),
        "too deeply nested",
    ),
    "unknown value type": (_gguf(0, _str("x") + struct.pack("<I", 77)), "unknown"),
    "tensor dims 2**40 x 2**40": (
        _gguf(
            1,
            ARCH,
            tensor_info=_str("token_embd.weight")
            + struct.pack("<I", 2)
            + struct.pack("<QQ", 2**40, 2**40)
            + struct.pack("<IQ", 0, 0),
        ),
        "corrupt",
    ),
    "tensor with 2**31 dims": (
        _gguf(
            1,
            ARCH,
            tensor_info=_str("token_embd.weight")
            + struct.pack("<I", 2**31)
            + struct.pack("<QQ", 4, 4)
            + struct.pack("<IQ", 0, 0),
        ),
        "corrupt",
    ),
}


@pytest.mark.parametrize("case", list(ABSURD_GGUF))
def test_gguf_declared_sizes_are_bounded(case, tmp_path):
    data, match = ABSURD_GGUF[case]
    path = tmp_path / "absurd.gguf"
    path.write_bytes(data)
    with bounded(), pytest.raises(CheckpointError, match=match) as info:
        load_gguf(path)
    assert str(path) in str(info.value)
