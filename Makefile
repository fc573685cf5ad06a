.PHONY: setup check lint test test-core bench setup-engines test-engines
setup:
	@bash scripts/setup.sh

# The main job: the parity check on the embedded default checkpoint (SmolLM2-135M).
check: setup
	.venv/bin/ropekv check

# The whole suite: lint, every venv set up, then ropekv's own tests in .venv beside each real engine's
# tests in its own venv (vLLM, mlx-lm, llama.cpp, ONNX Runtime GenAI, CTranslate2: their pins conflict
# with ropekv's), three jobs side by side (none of them keeps both cores busy all the time). An engine
# that cannot be installed fails its set-up, and with it `make test`: nothing is skipped.
test: lint setup-engines
	@$(MAKE) --no-print-directory -O -j3 suite-core lane-vllm lane-mlx-llamacpp

# Lint, format and types (config in pyproject.toml); `make test` runs it first, so CI enforces it.
LINT_PATHS = ropekv tests engine_tests scripts examples
lint: setup
	.venv/bin/ruff check $(LINT_PATHS)
	.venv/bin/ruff format --check $(LINT_PATHS)
	.venv/bin/mypy

test-core: lint
	.venv/bin/python -m pytest

# ropekv's own suite without its lint (`make test` lints first, once).
.PHONY: suite-core
suite-core: setup
	.venv/bin/python -m pytest

bench: setup
	.venv/bin/ropekv bench

setup-engines: setup-vllm setup-mlx setup-llamacpp setup-ort setup-ct2
# The engines' suites run in two lanes side by side, after their venvs are set up one by one (each
# set-up installs ropekv editable from this tree): vLLM, ONNX Runtime GenAI, CTranslate2, then the
# replay corpus (each of its releases in a venv of its own, cached outside the tree:
# scripts/test-replay.sh); and mlx-lm then llama.cpp. Much of each vLLM start is single-threaded, so on
# two cores the lanes overlap; -O prints each lane's output together.
test-engines: setup-engines
	@$(MAKE) --no-print-directory -O -j2 lane-vllm lane-mlx-llamacpp

.PHONY: lane-vllm lane-mlx-llamacpp
lane-vllm:
	@bash scripts/test-vllm.sh
	@bash scripts/test-ort.sh
	@bash scripts/test-ct2.sh
	@bash scripts/test-replay.sh
lane-mlx-llamacpp:
	@bash scripts/test-mlx.sh
	@bash scripts/test-llamacpp.sh

.PHONY: setup-vllm test-vllm
setup-vllm:
	@bash scripts/setup-vllm.sh

test-vllm: setup-vllm
	@bash scripts/test-vllm.sh

.PHONY: setup-mlx test-mlx
setup-mlx:
	@bash scripts/setup-mlx.sh

test-mlx: setup-mlx
	@bash scripts/test-mlx.sh

.PHONY: setup-llamacpp test-llamacpp
setup-llamacpp:
	@bash scripts/setup-llamacpp.sh

test-llamacpp: setup-llamacpp
	@bash scripts/test-llamacpp.sh

.PHONY: setup-ort test-ort
setup-ort:
	@bash scripts/setup-ort.sh

test-ort: setup-ort
	@bash scripts/test-ort.sh

.PHONY: setup-ct2 test-ct2
setup-ct2:
	@bash scripts/setup-ct2.sh

test-ct2: setup-ct2
	@bash scripts/test-ct2.sh

# Replays the corpus of shipped engine bugs (ropekv/replay/corpus.toml): each buggy release must fail with
# its bug class, each fixed one pass. Its mlx-lm releases need setup-mlx's OpenBLAS.
.PHONY: test-replay
test-replay: setup setup-mlx
	@bash scripts/test-replay.sh
