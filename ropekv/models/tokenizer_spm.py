"""Gemma's SentencePiece vocabulary from a GGUF, rebuilt as a ``tokenizers`` BPE with byte fallback.

A gemma3 GGUF (``tokenizer.ggml.model = "llama"``) stores the pieces in the ``\u2581`` (U+2581) space
spelling, their scores and types, but no merges. We rebuild what transformers' ``GemmaTokenizer`` is:
spaces normalized to ``\u2581``, a BPE over the pieces with byte fallback (``<0x..>`` pieces) and
``<unk>``. Two details of the file, as transformers' GGUF conversion also handles them:

- pieces made only of spaces (``"  "``) are stored with real spaces, while the text they must match
  is normalized to ``\u2581\u2581``: they are respelled;
- the merges are every split of a piece into two pieces, ranked by the merged piece's position in
  the file (earlier first; Gemma's scores do not follow the merge order), ties broken by the
  halves' positions then the longer left half.

The independent check is transformers' own GGUF tokenizer (``tests/test_embedded_models.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"


def respelled(tokens: Sequence[str]) -> list[str]:
    """The pieces as the normalized text spells them: runs of real spaces become ``\u2581`` runs."""
    return [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def merges_by_position(pieces: Sequence[str]) -> list[tuple[str, str]]:
    """Every ``(left, right)`` split of a piece into two pieces, earlier merged pieces first."""
    index: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        index.setdefault(piece, i)
    ranked: list[tuple[int, int, int, int, int, str, str]] = []
    for i, piece in enumerate(pieces):
        if index[piece] != i:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = index.get(left), index.get(right)
            if li is not None and ri is not None:
                ranked.append((i, -len(left), -len(right), li, ri, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def gemma_backend(pieces: Sequence[str]) -> Tokenizer:
    """The BPE ``Tokenizer`` of Gemma's ``pieces`` (already :func:`respelled`); added tokens are the
    caller's."""
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        vocab.setdefault(piece, i)
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges_by_position(pieces),
            fuse_unk=True,
            unk_token="<unk>",
            byte_fallback=True,
        )
    )
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend
