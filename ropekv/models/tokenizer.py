"""A tokenizer rebuilt from a GGUF file's vocabulary (``tokenizers`` library): byte-level BPE (below),
or Gemma's SentencePiece vocabulary (:mod:`~ropekv.models.tokenizer_spm`).

A GGUF carries no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``, already
spelled in GPT-2's byte alphabet), the merges, per-token types and the special token ids. The split
rule is named by ``tokenizer.ggml.pre``; we rebuild the one llama.cpp applies (``llama-vocab.cpp``):

- ``"smollm"`` (also starcoder & co): every numeric character alone (``\\p{N}``), then the GPT-2 regex.
  That is SmolLM2's own ``tokenizer.json`` (``Digits(individual_digits=True)`` + ``ByteLevel``).
- ``"gpt2"`` (also mpt, olmo, jais): the GPT-2 regex only.

transformers' GGUF conversion (5.x, ``integrations/gguf/gguf_tokenizer_mapping.py``) has no entry for
``smollm`` and falls back to the plain GPT-2 regex. The two agree on every ASCII text (SmolLM2's
merges contain no digit merges), but differ on a non-ASCII numeral that follows a space or another
numeral (``" ²"``): we follow llama.cpp and the original tokenizer there.

Tokens typed CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens, so both
are matched whole in text (``<|im_start|>``), as llama.cpp does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from ..errors import CheckpointError, ConfigError
from ..files import read_json, regular_file_size
from .gguf_file import open_gguf
from .tokenizer_spm import gemma_backend, respelled

_CONTROL, _USER_DEFINED = 3, 4
_MAX_TOKENIZER_CONFIG_BYTES = 16 << 20  # transformers' tokenizer_config.json: kilobytes (a chat template)
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2_ONLY = ("gpt2", "mpt", "olmo", "jais")
SUPPORTED_PRE = _DIGITS_FIRST + _GPT2_ONLY
_SENTENCEPIECE_ARCHITECTURES = ("gemma3",)  # SentencePiece vocabularies ropekv rebuilds (checked against transformers)


class Tokenizer:
    """Text <-> token ids. ``encode`` adds a BOS only when the source file asks for it."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (``tokenizer.ggml.model`` must be ``gpt2``)."""
        return cls.from_gguf_reader(open_gguf(path), path)

    @classmethod
    def from_gguf_reader(cls, reader: Any, path: str | os.PathLike) -> Tokenizer:
        """:meth:`from_gguf` on an open ``gguf.GGUFReader`` (``path`` only names it in errors)."""
        fields = reader.fields

        def get(key: str, default: Any = None) -> Any:
            field = fields.get(key)
            return default if field is None else field.contents()

        model = get("tokenizer.ggml.model")
        arch = get("general.architecture")
        if model == "llama" and arch in _SENTENCEPIECE_ARCHITECTURES:
            return cls._from_sentencepiece(get, path)
        if model != "gpt2":
            raise ConfigError(
                f"{path}: tokenizer model {model!r} is not supported (byte-level BPE 'gpt2', "
                f"or SentencePiece 'llama' of {', '.join(_SENTENCEPIECE_ARCHITECTURES)})"
            )
        pre = get("tokenizer.ggml.pre")
        if pre not in SUPPORTED_PRE:
            raise ConfigError(
                f"{path}: tokenizer pre-type {pre!r} is not supported; supported: {', '.join(SUPPORTED_PRE)}"
            )
        tokens, merges = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise CheckpointError(f"{path}: GGUF has no tokenizer.ggml.tokens / tokenizer.ggml.merges")
        types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise CheckpointError(f"{path}: {len(types)} token types for {len(tokens)} tokens")

        vocab = {token: i for i, token in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise CheckpointError(f"{path}: duplicate entries in tokenizer.ggml.tokens")
        pairs = []
        for m in merges:
            parts = m.split(" ")
            if len(parts) != 2:
                raise CheckpointError(f"{path}: malformed merge {m!r}")
            pairs.append((parts[0], parts[1]))
        backend = _Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if pre in _DIGITS_FIRST
            else byte_level
        )
        backend.decoder = decoders.ByteLevel()
        return cls._finish(backend, tokens, types, get, path, add_bos_default=False)

    @classmethod
    def _from_sentencepiece(cls, get: Any, path: str | os.PathLike) -> Tokenizer:
        """Gemma's SentencePiece vocabulary (:mod:`~ropekv.models.tokenizer_spm`)."""
        tokens = get("tokenizer.ggml.tokens")
        if not tokens:
            raise CheckpointError(f"{path}: GGUF has no tokenizer.ggml.tokens")
        types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise CheckpointError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
        pieces = respelled(tokens)
        if len(set(pieces)) != len(pieces):
            raise CheckpointError(f"{path}: duplicate entries in tokenizer.ggml.tokens")
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        return cls._finish(gemma_backend(pieces), pieces, types, get, path, add_bos_default=True)

    @classmethod
    def _finish(
        cls,
        backend: _Backend,
        tokens: list[str],
        types: list[int],
        get: Any,
        path: str | os.PathLike,
        *,
        add_bos_default: bool,
    ) -> Tokenizer:
        """Control tokens as special added tokens, user-defined ones as plain added tokens (both
        matched whole in text, as llama.cpp does), then the BOS/EOS ids and flags from the file."""
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
        )
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
        )
        if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise CheckpointError(f"{path}: added tokens do not map onto the vocabulary")
        bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
            add_bos=bool(get("tokenizer.ggml.add_bos_token", add_bos_default)),
            chat_template=get("tokenizer.chat_template"),
        )

    @classmethod
    def from_file(cls, tokenizer_json: str | os.PathLike) -> Tokenizer:
        """Load what :meth:`save` wrote: ``tokenizer.json`` plus its sibling ``tokenizer_config.json``
        (transformers' names; the latter holds the BOS/EOS tokens and the BOS flag)."""
        tokenizer_json = Path(tokenizer_json)
        regular_file_size(tokenizer_json, "tokenizer file", CheckpointError)  # no FIFO or device to the reader
        try:
            backend = _Backend.from_file(str(tokenizer_json))
        except Exception as exc:  # tokenizers raises a bare Exception for unreadable or malformed JSON
            raise CheckpointError(f"{tokenizer_json}: cannot load tokenizer: {exc}") from None
        extra: dict[str, Any] = {}
        config_path = tokenizer_json.with_name("tokenizer_config.json")
        if config_path.exists() or config_path.is_symlink():
            # bounded in size and depth: a link to /dev/zero or a document nested 100,000 deep is one line
            data = read_json(config_path, "tokenizer config", CheckpointError, max_bytes=_MAX_TOKENIZER_CONFIG_BYTES)
            if not isinstance(data, dict):
                raise CheckpointError(f"{config_path}: a tokenizer config is a JSON object, got {type(data).__name__}")
            extra = data

        def token_id(name: str) -> int | None:
            token = extra.get(name)
            return None if token is None else backend.token_to_id(token)

        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            add_bos=bool(extra.get("add_bos_token", False)),
            chat_template=extra.get("chat_template"),
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write ``path`` (a ``tokenizer.json``) and ``tokenizer_config.json`` beside it."""
        path = Path(path)
        self.backend.save(str(path))
        config: dict[str, Any] = {
            "bos_token": None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id),
            "eos_token": None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id),
            "add_bos_token": self.add_bos,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        path.with_name("tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    # ------------------------------------------------------------------ use

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) stay whole."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (special tokens kept by default, as transformers does)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
