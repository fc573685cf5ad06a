.PHONY: setup check test bench
setup:
	@bash scripts/setup.sh

# The main job: the parity check on the embedded default checkpoint (SmolLM2-135M).
check: setup
	.venv/bin/ropekv check

test: setup
	.venv/bin/python -m pytest

bench: setup
	.venv/bin/ropekv bench

# vLLM (CPU build) in its own venv: its torch/transformers pins conflict with .venv's.
.PHONY: setup-vllm test-vllm
setup-vllm:
	@bash scripts/setup-vllm.sh

test-vllm: setup-vllm
	@bash scripts/test-vllm.sh
