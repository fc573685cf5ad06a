"""The bug classes the forensics name: one spelling for every producer and reader.

A :class:`BugClass` member is a ``str`` equal to its value, so a report's JSON ``"kind"`` and any
comparison with a plain string (a fault's expected kind) read the same as before the enum existed.
``j`` is a key's logical position, ``t`` the query's, ``P`` a cached prefix's length, ``B`` the
block size.
"""

from __future__ import annotations

from enum import StrEnum


class BugClass(StrEnum):
    # the general forensics: where the query and keys really sit
    DOUBLE_ROTATION = "double_rotation"  # keys rotated when written and again when read: they sit at 2j
    MISSING_ROTATION = "missing_rotation"  # keys stored raw and read as if rotated: they sit at 0
    SLOT_AS_POSITION = "slot_as_position"  # keys rotated by their physical slot, not their logical position
    IGNORED_PREFIX_OFFSET = "ignored_prefix_offset"  # keys after a cached prefix sit at j - P
    BLOCK_LOCAL_POSITION = "block_local_position"  # keys rotated by their index inside their block (j mod B)
    # the query rotated at t plus an offset; the cached keys right, or the newest ones (written by the steps
    # whose offset went wrong, the query's own step included) off with it
    QUERY_POSITION_OFFSET = "query_position_offset"
    KEY_POSITION_OFFSET = "key_position_offset"  # query right, keys (all or some) at j plus one constant
    FREQUENCY_MISMATCH = "frequency_mismatch"  # still rotations, at other frequencies (theta, scale)
    LAYOUT_MISMATCH = "layout_mismatch"  # the channels paired the other way (neox against gptj)
    LOW_PRECISION_ANGLES = "low_precision_angles"  # angles computed in bf16/fp16: an error growing with position
    STALE_DYNAMIC_SCALING = "stale_dynamic_scaling"  # length-dependent RoPE: keys keep an earlier length's
    ROTATE_ON_TRANSFER = "rotate_on_transfer"  # a prefill->decode handoff rotated rotated keys once more
    # cache operations (docs/ops.md; ropekv.parity.ops), tried first when the case ran one
    ROLLBACK_OFFSET = "rollback_offset"  # the offset kept a rejected draft: the query sits past its position
    ROLLBACK_STALE_KEYS = "rollback_stale_keys"  # ring slots a rolled-back draft overwrote keep its keys
    EVICT_OFFSET = "evict_offset"  # the offset counts kept rows: later positions lose the evicted tokens
    SHIFT_NOT_ROTATED = "shift_not_rotated"  # rotated keys relabelled by a shift but not turned by it
    SHIFT_ROTATED_RAW = "shift_rotated_raw"  # raw keys turned by a shift although the reader rotates them
    SHIFT_APPLIED_TWICE = "shift_applied_twice"  # rotated keys turned twice for one relabelling
    PADDING_OFFSET = "padding_offset"  # a shared cursor over a left-padded batch: a row's query off by its padding
    RESTORE_OFFSET_LOST = "restore_offset_lost"  # a restored sequence's offset restarted at 0
    # per-layer RoPE features
    NOPE_ROTATED = "nope_rotated"  # a layer without position embedding had its query or keys turned
    PARTIAL_ROTARY_MISMATCH = "partial_rotary_mismatch"  # partial rotary: pass-through channels turned too
    LAYER_ROPE_MISMATCH = "layer_rope_mismatch"  # a layer turned under another layer's RoPE (local/global)
    MLA_ROPE_ROTATED_TWICE = "mla_rope_rotated_twice"  # latent attention: the rope part rotated twice
    # masks: not a rotation at all
    WINDOW_MISMATCH = "window_mismatch"  # the kernel read keys the window hides, or missed visible ones
    CHUNK_MISMATCH = "chunk_mismatch"  # chunked attention: keys of an earlier chunk read, or of its own missed
    # the adapter, not the engine: the final logits agree, the recorded
    # attention does not, so the record is wrong (most often the positions the adapter labels its keys with)
    MISLABELLED_KEYS = "mislabelled_keys"
    # speculative decoding (ropekv.parity.speculative): a spec:K case's verify pass
    SPEC_VERIFY_POSITION_OFFSET = "spec_verify_position_offset"  # the verify pass rotated its draft off by c
    # position index width (ropekv.parity.position_width)
    POSITION_WRAPPED = "position_wrapped"  # positions narrowed to int16/int32: they wrap past 2**15 / 2**31
    # block seam (ropekv.parity.block_seam)
    BLOCK_SEAM = "block_seam"  # a non-aligned prefix hit: the seam block's recomputed rows hold other contents
    # transfer_layout (ropekv.parity.transfer_layout): the receiver read the sender's block bytes in another order
    BLOCK_LAYOUT_MISMATCH = "block_layout_mismatch"  # received (row, head) holds another sent (row, head)
    # mRoPE axes: image-like keys whose h/w sections turned at their t position
    MROPE_AXES_COLLAPSED = "mrope_axes_collapsed"
    # rope magnitude (ropekv.parity.magnitude): angles right, the attention factor dropped or applied twice
    ROPE_MAGNITUDE = "rope_magnitude"  # query/keys at their positions but scaled: |c| / (A |r|) != 1
    # mixed rotations (ropekv.parity.mixed_rotations): one cache holding keys rotated under two specs, each over
    # its own range of rows (LongRoPE's short factors on the early chunks of a prefill, its long ones on the later)
    MIXED_ROTATIONS = "mixed_rotations"
    # quantized KV: the query right, cached keys at their positions but
    # scaled by one constant factor per row range (8-bit codes dequantized with another scale than theirs)
    KV_SCALE_MISMATCH = "kv_scale_mismatch"
    # contents, not rotations: a layer's values off while its attention is right; the rows a prefill
    # wrote holding other contents from a layer on (a prefill-only bug below it)
    VALUE_MISMATCH = "value_mismatch"
    PREFILL_ROWS_DIVERGED = "prefill_rows_diverged"
    # nothing above fits, or nothing is wrong at this layer (the evidence says which)
    UNKNOWN = "unknown"
