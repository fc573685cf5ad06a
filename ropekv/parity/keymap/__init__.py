"""The key map: one fit of every key the kernel read and of its query, per head (see :mod:`.fit`)."""
