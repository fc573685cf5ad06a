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

.PHONY: setup-llamacpp test-llamacpp
setup-llamacpp:
	@bash scripts/setup-llamacpp.sh

test-llamacpp: setup-llamacpp
	@bash scripts/test-llamacpp.sh
