"""``ropekv bench``: decode speed against transformers and the memory-bandwidth limit, rotate-on-read
cost, parity sweep cost, handoff throughput and cache memory (see docs/performance.md)."""
