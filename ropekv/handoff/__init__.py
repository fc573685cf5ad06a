"""The served prefill -> decode handoff: worker processes on torch.distributed (workers.py) and the
adapter that runs a parity case across them (adapter.py). Built on ropekv.transfer's wire formats and
import, and on ropekv's own engine adapter; above both in the layers."""
