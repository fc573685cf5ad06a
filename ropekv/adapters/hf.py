"""The transformers adapter: ropekv's parity harness on any HF RoPE causal LM, unmodified.

``HFEngine(model)`` wraps an already constructed ``*ForCausalLM`` (any architecture of ropekv.models.families) so
``ropekv.check(HFEngine(model), ...)`` compares the model's cached path (its ``DynamicCache`` by
default, ``StaticCache`` on request, sliding-window layers where the config has them) with its own
cache-free forward and with ropekv's float64 reference built from the model's config and state dict.

How it sees inside without changing the model's code:

- attention logits: a probe registered through transformers' ``AttentionInterface`` under a name of
  its own (plus the original implementation's mask function under the same name in
  ``AttentionMaskInterface``). It records the query and keys exactly as the kernel receives them
  (after RoPE, after ``cache.update``), recomputes the scaled pre-softmax logits from them and the
  mask HF passes, then delegates to the real implementation for the output;
- key positions: index ``i`` of the kernel's key tensor holds position ``kv_offset + i``, where
  ``kv_offset`` is what the cache reported to HF's own mask builder (``Cache.get_mask_sizes``) before
  the update, read by a pre-hook on each attention module; unwritten static slots are dropped after
  checking they are masked. ``key_slots`` is that index (the physical slot for a ``StaticCache``);
- layer inputs: forward pre-hooks on the decoder layers; raw keys (:meth:`HFEngine.raw_keys`): forward
  hooks on ``k_norm`` where present, else ``k_proj``; for multi-head latent attention (DeepSeek) on
  ``kv_a_proj_with_mqa`` (the unrotated rope part) and ``kv_b_proj`` (the per-head position-free part).
  transformers' DeepSeek caches the compressed latent and rotated rope part, and its attention function
  receives the expanded per-head keys: those are what is recorded. DeepSeek V3's interleaved rotation
  leaves the rope part de-interleaved (pairs ``2m, 2m+1`` written to ``m, m + n``): the same channel
  permutation of q and k, so every logit is the interleaved rotation's.

Everything is installed for the duration of one adapter call and removed in ``finally``: the attention
implementation is set back, the registrations and hooks are removed, and the rotary embedding's state
(dynamic NTK grows ``inv_freq`` as it sees longer sequences) is restored. Each request (a case's
parent prefill, its continuation, a full forward) starts from the rotary state of a fresh model.

Case parameters: ``block_size`` does not exist for transformers' caches and is reported as ignored. A
case window (``case.window`` set) is applied as a custom 4D attention mask over a full
``DynamicCache``, HF's supported way to pass a mask it has no builder for (sinks included); with
``case.window=None`` the model's own windows and cache layers are used. See docs/adapters.md.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from ..contract import DTYPES
from ..errors import CheckpointError, RopeKVError, UsageError
from ..models import resolve_model_dir
from ..models.config import Checkpoint
from ..models.families import FAMILIES, family_of
from ..models.hf_config import read_model_config
from ..parity.cases import Case
from ..parity.protocol import CaseRun, EngineDescription, FullRun, Ignored, StepRecord, Tier
from ..parity.recorder import AttentionRecorder
from .hf_generate import generate_ignored, run_generate_case
from .hf_legacy import LegacyLayerSeen, LegacyProbes, install_legacy, legacy_key_positions
from .hf_versions import HFVersion, require_supported

try:
    import transformers
    from transformers import DynamicCache, StaticCache

    _HAS_TRANSFORMERS = True
except ImportError:  # pragma: no cover - exercised only without the extra
    _HAS_TRANSFORMERS = False

CACHE_KINDS = ("dynamic", "static")
DRIVES = ("forward", "generate")
_PARENT_EXTRA = 3  # tokens of another continuation the parent request cached beyond the prefix
_serial = itertools.count()


def _need_transformers() -> HFVersion:
    """The installed release, if the adapter drives it (else one line naming the supported range)."""
    if not _HAS_TRANSFORMERS:
        raise UsageError("the HF engine needs transformers: pip install 'ropekv[hf]'")
    return require_supported(transformers.__version__)


def _interfaces() -> tuple[Any, Any, Any, Any]:
    """transformers' attention and mask registries (4.53 and later only)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    return ALL_ATTENTION_FUNCTIONS, AttentionInterface, ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface


@dataclass
class _Call:
    """What one model call records: the rows (indices into this call's tokens) to probe."""

    positions: torch.Tensor  # [q] logical positions of this call's tokens
    rows: torch.Tensor | None  # [R] indices into the q tokens to record; None records nothing
    recorder: AttentionRecorder  # the layers' attention as the kernel saw it
    raw: bool = False  # record raw keys (k_proj / k_norm output)
    kv_offset: dict[int, int] = field(default_factory=dict)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [R, hidden]
    raw_keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [q, KVH, D]


class HFEngine:
    """A transformers causal LM as an :class:`~ropekv.parity.protocol.EngineAdapter`.

    ``cache``: ``"dynamic"`` (``DynamicCache(config=...)``, sliding layers keep only their window) or
    ``"static"`` (``StaticCache``); default: static when ``model.generation_config.cache_implementation``
    says so, else dynamic. Use as a context manager to keep the probes installed across many calls.
    """

    key_form = "rotated"  # transformers rotates keys before cache.update
    tier = Tier.FORENSICS

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        cache: str | None = None,
        name: str | None = None,
        drive: str = "forward",
        cache_implementation: str | None = None,
    ):
        self.version = _need_transformers()
        if drive not in DRIVES:
            raise UsageError(f"drive must be one of {', '.join(DRIVES)}, got {drive!r}")
        if cache_implementation is not None and drive != "generate":
            raise UsageError("cache_implementation is generate()'s option: it needs drive='generate'")
        self.drive = drive
        self.cache_implementation = cache_implementation
        if not isinstance(model, transformers.PreTrainedModel):
            raise UsageError(f"HFEngine needs a transformers PreTrainedModel, got {type(model).__name__}")
        self.model = model
        gen = getattr(model, "generation_config", None)
        default = "static" if getattr(gen, "cache_implementation", None) == "static" else "dynamic"
        self.cache_kind = cache or default
        if self.cache_kind not in CACHE_KINDS:
            raise UsageError(f"cache must be one of {', '.join(CACHE_KINDS)}, got {cache!r}")
        self.layers, self.attentions = self._decoder_layers()
        impl = model.config._attn_implementation
        if not isinstance(impl, str):
            raise UsageError(f"HFEngine needs one attention implementation for the model, got {impl!r}")
        self.attn_implementation = impl
        self.backend = impl  # what ropekv.check compares a --backend flag with
        self.dtype = next(model.parameters()).dtype
        names = {v: k for k, v in DTYPES.items()}
        if self.dtype not in names:
            raise UsageError(f"unsupported model dtype {self.dtype}")
        self.dtype_name = names[self.dtype]
        cache_text = f"{self.cache_kind} cache"
        if drive == "generate":
            cache_text = f"generate() with {cache_implementation or 'its default'} cache"
        self.name = name or f"transformers {self.version.text} {type(model).__name__} ({impl} attention, {cache_text})"
        self._probe_name = f"ropekv_probe_{next(_serial)}"
        self._depth = 0
        self._call: _Call | None = None
        self._restore: list = []
        self._checkpoint: Checkpoint | None = None
        self._fresh_rope = [(m, _fresh(state)) for m, state in _rope_states(model)]

    # ------------------------------------------------------------------ construction

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        dtype: str | None = "float32",
        *,
        cache: str | None = None,
        attn_implementation: str | None = None,
        drive: str = "forward",
        cache_implementation: str | None = None,
    ) -> HFEngine:
        """Load a transformers directory from disk (None: the embedded default, SmolLM2-135M).

        Local files only, safetensors only, never checkpoint code (``trust_remote_code=False``).
        ``drive`` and ``cache_implementation``: as for the constructor.
        """
        version = _need_transformers()
        dtype = dtype or "float32"
        if dtype not in DTYPES:
            raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        folder = resolve_model_dir(path)  # None or an embedded model's name: its converted folder
        if not folder.is_dir() or not (folder / "config.json").is_file():
            raise CheckpointError(
                f"{folder}: the HF engine needs a transformers directory with config.json "
                "(GGUF files and single weight files are for the ropekv engine)"
            )
        # ropekv shows its own progress; transformers' loading bars and warnings would interleave with it.
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        auto: Any = transformers.AutoModelForCausalLM  # an auto class of transformers
        if _multimodal(folder):  # Qwen2-VL: the image-text class, checked as its text model
            auto = transformers.AutoModelForImageTextToText
        try:
            model = auto.from_pretrained(
                folder,
                **{version.dtype_keyword: DTYPES[dtype]},
                local_files_only=True,
                trust_remote_code=False,
                use_safetensors=True,
                attn_implementation=attn_implementation,
            )
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{folder}: transformers could not load it: {exc}") from None
        return cls(model.eval(), cache=cache, drive=drive, cache_implementation=cache_implementation)

    @property
    def checkpoint(self) -> Checkpoint:
        """The model as a ropekv :class:`Checkpoint`: its config dict and state dict in float32.

        Built once, from the object (a model never saved to disk works too); float32 tensors are
        shared with the model, not copied. The fingerprint hashes the config and every weight byte.
        """
        if self._checkpoint is None:
            source = f"transformers {type(self.model).__name__} {getattr(self.model, 'name_or_path', '') or ''}".strip()
            self._checkpoint = Checkpoint.from_tensors(
                read_model_config(self.model.config.to_dict(), source=source), self.model.state_dict(), source=source
            )
        return self._checkpoint

    # ------------------------------------------------------------------ the protocol

    def describe(self) -> EngineDescription:
        rope = self.model.config.to_dict().get("rope_parameters")
        return EngineDescription(
            name=self.name,
            key_form=self.key_form,
            ops=("rollback",),  # DynamicCache.crop
            extra={
                "engine": "transformers",
                "transformers_version": transformers.__version__,
                "model_class": type(self.model).__name__,
                "attn_implementation": self.attn_implementation,
                "cache": {"dynamic": "DynamicCache", "static": "StaticCache"}[self.cache_kind]
                if self.drive == "forward"
                else f"generate()'s {self.cache_implementation or 'default'}",
                "drive": self.drive,
                "probes": "AttentionInterface"
                if self.version.attention_interface
                else "apply_rotary_pos_emb, Cache.update and the attention module's mask (a release before 4.53)",
                "dtype": self.dtype_name,
                "rope_parameters": rope,
                "windows": "the model's own when case.window is None; a case window (and sinks) as a custom 4D "
                "attention mask over a full DynamicCache",
                "rope_state": "reset to a fresh model's before each request",
            },
        )

    def ignored(self, case: Case) -> tuple[Ignored, ...]:
        """``block_size`` never applies; a case window overrides a static cache (see the module doc)."""
        out = [Ignored("block_size")]
        if self.drive == "generate":
            return (*out, *generate_ignored(case))
        if case.window is not None and self.cache_kind == "static":
            out.append(Ignored("cache", "cache=static (a case window runs on a full DynamicCache)"))
        if case.op is not None and not (case.op.kind == "rollback" and self._croppable(case)):
            # The harness refuses such a case (UsageError) rather than pass it.
            out.append(
                Ignored(
                    "op", f"op: the transformers adapter runs only rollback (DynamicCache.crop), not {case.op.label()}"
                )
            )
        return tuple(out)

    @torch.no_grad()
    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        if self.drive == "generate":
            return run_generate_case(self, case, tokens)
        with self._session():
            self._reset_rope()
            cache = self._new_cache(case)
            start = case.prefix
            if case.prefix:
                # A prefix-cache hit: an earlier request cached the prefix (and, where the cache can be
                # cropped, another continuation that must not leak into this one).
                extra = _PARENT_EXTRA if self._croppable(case) else 0
                parent = tokens[: case.prefix]
                if extra:
                    parent = torch.cat([parent, (tokens[:extra] + 1) % self.checkpoint.config.vocab_size])
                self._prefill(cache, parent, 0, case)
                cache = copy.deepcopy(cache)
                if extra:
                    cache.crop(-extra)
                self._reset_rope()  # the continuation is a new request
            self._prefill(cache, tokens[start : start + case.length], start, case)
            notes: tuple[str, ...] = ()
            if case.op is not None and case.op.kind == "rollback":  # a verified draft, all rejected
                self._prefill(
                    cache, case.draft_tokens(tokens, self.checkpoint.config.vocab_size), start + case.length, case
                )
                cache.crop(-case.op.amount)
                notes = (f"a {case.op.amount}-token draft was prefilled and rolled back with DynamicCache.crop",)
            steps = []
            for t in case.decode_positions:
                out, layers, _ = self._forward(tokens[t : t + 1], t, cache, case, rows=[0])
                steps.append(StepRecord(position=t, logits=out.logits[0, -1], layers=layers))
            return CaseRun(tuple(steps), notes=notes)

    @torch.no_grad()
    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        """One cache-free forward (``use_cache=False``) over ``tokens``, probed at ``rows``."""
        with self._session():
            self._reset_rope()
            out, layers, _ = self._forward(tokens, 0, None, case, rows=rows)
            return FullRun(rows=torch.as_tensor(rows), logits=out.logits[0, rows], layers=layers)

    @torch.no_grad()
    def raw_keys(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per layer ``[T, KVH, D]``: the keys before RoPE (k_proj, then k_norm where present) of a
        cache-free forward over ``tokens``; what ropekv's forensics compare rotated keys with."""
        with self._session():
            self._reset_rope()
            call = self._forward(tokens, 0, None, Case(length=1), rows=None, raw=True)[2]
            if len(call.raw_keys) != len(self.layers):
                raise UsageError(
                    f"{type(self.model).__name__}: its raw keys have no module of their own to hook "
                    "(fused query_key_value, or a per-head k norm)"
                )
            return tuple(call.raw_keys[i] for i in range(len(self.layers)))

    # ------------------------------------------------------------------ install / restore

    def __enter__(self) -> HFEngine:
        self._install()
        return self

    def __exit__(self, *exc: object) -> None:
        self._uninstall()

    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        self._install()
        try:
            yield
        finally:
            self._uninstall()

    def _install(self) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        model, name, impl = self.model, self._probe_name, self.attn_implementation
        undo = self._restore
        try:
            saved_rope = _rope_states(model)
            undo.append(lambda: _apply_rope(saved_rope))
            was_training = model.training
            undo.append(lambda: model.train(was_training))
            model.eval()
            if not self.version.attention_interface:
                install_legacy(model, self.attentions, LegacyProbes(self._legacy_record), undo)
            elif self._attention_method is None:
                _, AttentionInterface, ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface = _interfaces()
                AttentionInterface.register(name, self._probe)
                undo.append(lambda: AttentionInterface._global_mapping.pop(name, None))
                if impl in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
                    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
                    undo.append(lambda: AttentionMaskInterface._global_mapping.pop(name, None))
                model.set_attn_implementation(name)
                undo.append(lambda: model.set_attn_implementation(impl))
            else:  # an architecture with its own attention method (GPT-J's _attn): wrap it per module
                for attn in self.attentions:
                    setattr(attn, self._attention_method, self._method_probe(attn, self._attention_method))
                    undo.append(lambda attn=attn: delattr(attn, self._attention_method))
            for i, (layer, attn) in enumerate(zip(self.layers, self.attentions)):
                k_mod = getattr(attn, "k_norm", None) or getattr(attn, "k_proj", None)
                if getattr(attn, "k_layernorm", None) is not None:  # a k norm whose output layout varies
                    k_mod = None
                undo.append(layer.register_forward_pre_hook(self._hidden_hook(i), with_kwargs=True).remove)
                if self.version.attention_interface:
                    undo.append(attn.register_forward_pre_hook(self._offset_hook(i), with_kwargs=True).remove)
                if hasattr(attn, "kv_a_proj_with_mqa"):  # MLA: raw key = [k_nope from kv_b_proj, shared k_pe]
                    undo += [h.remove for h in self._mla_raw_key_hooks(i, attn)]
                elif k_mod is not None:  # fused qkv_proj (phi3, gpt_neox) has no separate raw-key module
                    undo.append(k_mod.register_forward_hook(self._raw_key_hook(i, attn.head_dim)).remove)
        except BaseException:
            self._uninstall()
            raise

    def _uninstall(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return
        errors = []
        while self._restore:
            try:
                self._restore.pop()()
            except Exception as exc:  # keep undoing the rest; report the first failure afterwards
                errors.append(exc)
        self._call = None
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ probes

    def _hidden_hook(self, layer: int):
        def hook(module, args, kwargs):
            call = self._call
            if call is not None and call.rows is not None:
                hidden = args[0] if args else kwargs["hidden_states"]  # [B, q, hidden]
                call.hidden[layer] = hidden[0, call.rows].detach().clone()

        return hook

    def _offset_hook(self, layer: int):
        def hook(module, args, kwargs):
            call = self._call
            cache = kwargs.get("past_key_values", kwargs.get("layer_past"))  # gpt_neox: layer_past
            if call is not None and cache is not None:
                hidden = args[0] if args else kwargs["hidden_states"]
                call.kv_offset[layer] = _kv_offset(cache, call.positions, hidden.shape[1], layer)

        return hook

    def _raw_key_hook(self, layer: int, head_dim: int):
        def hook(module, args, output):
            call = self._call
            if call is not None and call.raw:
                call.raw_keys[layer] = output[0].reshape(output.shape[1], -1, head_dim).detach().clone()

        return hook

    def _mla_raw_key_hooks(self, layer: int, attn: Any) -> list:
        """Multi-head latent attention (DeepSeek V2/V3): the raw key of head ``h`` is ``[k_nope_h, k_pe]``,
        ``k_nope`` from ``kv_b_proj``'s output, ``k_pe`` (one head, not rotated) the last
        ``qk_rope_head_dim`` channels of ``kv_a_proj_with_mqa``'s; both seen on the cache-free forward."""
        rope, nope = attn.qk_rope_head_dim, attn.qk_nope_head_dim
        parts: dict[str, torch.Tensor] = {}

        def pe_hook(module, args, output):
            if self._call is not None and self._call.raw:
                parts["k_pe"] = output.reshape(-1, output.shape[-1])[:, -rope:].detach()  # [T, rope]

        def nope_hook(module, args, output):
            call = self._call
            if call is not None and call.raw and "k_pe" in parts:
                flat = output.reshape(-1, output.shape[-1])  # [T, H * (nope + v)] (called on the [1, 1, T, r] latent)
                n = flat.shape[0]
                k_nope = flat.reshape(n, -1, nope + attn.v_head_dim)[..., :nope]  # [T, H, nope]
                k_pe = parts.pop("k_pe")[:, None, :].expand(n, k_nope.shape[1], rope)
                call.raw_keys[layer] = torch.cat((k_nope, k_pe), dim=-1).detach().clone()

        return [attn.kv_a_proj_with_mqa.register_forward_hook(pe_hook), attn.kv_b_proj.register_forward_hook(nope_hook)]

    def _method_probe(self, module: torch.nn.Module, method: str):
        """``module``'s own attention method ``method`` (``Family.hf_attention_method``), recording first."""
        original = getattr(module, method)  # the bound class method

        def probe(query, key, value, attention_mask=None, *args, **kwargs):
            call = self._call
            if call is not None and call.rows is not None:
                self._record(call, module, query, key, attention_mask, {})
            return original(query, key, value, attention_mask, *args, **kwargs)

        return probe

    def _delegate(self, module: torch.nn.Module):
        impl = self.attn_implementation
        if impl == "eager":  # each model file has its own eager function (softcapping, sinks, ...)
            home = sys.modules[type(module).__module__]
            return home.eager_attention_forward
        return _interfaces()[0][impl]

    def _probe(self, module, query, key, value, attention_mask, **kwargs):
        """Registered attention function: record what the kernel gets, then run the real one."""
        call = self._call
        if call is not None and call.rows is not None:
            self._record(call, module, query, key, attention_mask, kwargs)
        return self._delegate(module)(module, query, key, value, attention_mask, **kwargs)

    def _new_call(self, positions: torch.Tensor, rows: torch.Tensor | None) -> _Call:
        """A call recording ``rows`` (None: nothing) of a forward over tokens at ``positions [q]``."""
        return _Call(positions, rows, AttentionRecorder(len(self.layers)))

    def _legacy_record(self, layer: int, module: torch.nn.Module, seen: LegacyLayerSeen) -> None:
        """A release before 4.53 (:mod:`.hf_legacy`): the rotated query, the keys the cache returned (or,
        without a cache, this call's rotated keys) and the mask the attention module was called with."""
        call = self._call
        if call is None or call.rows is None:
            return
        if seen.q is None:
            raise RopeKVError(f"layer {layer}: transformers did not call apply_rotary_pos_emb in this attention")
        key = seen.k_cache if seen.k_cache is not None else seen.k_rope
        assert key is not None  # set together with q
        kpos = legacy_key_positions(key.shape[2], int(call.positions.max()))
        self._record(call, module, seen.q, key, seen.mask, {}, kpos=kpos)

    def _record(self, call: _Call, module, query, key, mask, kwargs, kpos: torch.Tensor | None = None) -> None:
        """Hand the shared recorder the query rows and the keys exactly as the kernel gets them. For
        one row (a decode step) only the keys HF's mask lets it see; for several rows every written key
        (the harness masks by position). Unwritten static-cache slots must be masked, and are dropped.
        ``kpos [N]``: the keys' positions where the caller knows them (else from the cache's mask offset)."""
        layer = module.layer_idx
        q = query[0].transpose(0, 1)  # [q, H, D]
        k = key[0].transpose(0, 1)  # [N, KVH, D]
        num_keys = k.shape[0]
        rows = call.rows
        assert rows is not None  # only a call with rows is recorded
        qpos = call.positions[rows]  # [R]
        if kpos is None:
            kpos = call.kv_offset.get(layer, 0) + torch.arange(num_keys)  # [N]
        visible = _visibility(mask, rows, qpos, kpos, kwargs.get("sliding_window"))  # [R, N]
        written = kpos <= int(call.positions.max())
        if bool(visible[:, ~written].any()):
            raise RopeKVError(
                f"layer {layer}: transformers' attention mask lets a query see cache slots past the "
                "newest token (unwritten slots)"
            )
        keep = visible[0] if rows.numel() == 1 else written
        call.recorder.record(
            layer,
            q=q[rows],
            k=k[keep],
            key_positions=kpos[keep],
            key_slots=torch.arange(num_keys)[keep],
            hidden_in=call.hidden.get(layer),
        )

    # ------------------------------------------------------------------ running

    def _forward(self, ids: torch.Tensor, start: int, cache, case: Case, rows, raw: bool = False):
        positions = torch.arange(start, start + ids.shape[0])
        mask = None
        if case.window is not None:
            kv_len = (cache.get_seq_length() if cache is not None else 0) + ids.shape[0]
            mask = self._window_mask(positions, kv_len, case.window, case.sink_tokens)
        call = _Call(
            positions,
            None if rows is None else torch.as_tensor(rows, dtype=torch.long),
            AttentionRecorder(len(self.layers)),
            raw,
        )
        self._call = call
        try:
            keep = self.version.logits_keyword
            out = self.model(
                input_ids=ids[None],
                position_ids=positions[None],
                cache_position=positions,
                attention_mask=mask,
                past_key_values=cache,
                use_cache=cache is not None,
                **({keep: 0 if rows is not None else 1} if keep else {}),
            )
        finally:
            self._call = None
        layers = call.recorder.take()
        if rows is not None and len(layers) != len(self.layers):
            raise UsageError(
                f"{type(self.model).__name__}: {len(self.layers) - len(layers)} layers did not call the "
                "attention function through transformers' AttentionInterface, so ropekv cannot see them"
            )
        return out, layers, call

    def _prefill(self, cache, tokens: torch.Tensor, start: int, case: Case) -> None:
        chunk = case.chunk or tokens.shape[0]
        for i in range(0, tokens.shape[0], chunk):
            self._forward(tokens[i : i + chunk], start + i, cache, case, rows=None)

    def _new_cache(self, case: Case):
        if case.window is not None:
            return DynamicCache()  # full layers: the case's window comes from the mask
        if self.cache_kind == "static":
            batch: dict[str, Any] = {"max_batch_size": 1} if self.version.static_cache_batch_keyword else {}
            return StaticCache(config=self.model.config, max_cache_len=case.total, **batch)
        return DynamicCache(config=self.model.config) if self.version.cache_takes_config else DynamicCache()

    def _croppable(self, case: Case) -> bool:
        """Dynamic caches whose layers all keep every token can be cropped back to the prefix (transformers
        keeps a chunked layer in a sliding layer of one chunk, so it cannot be cropped either)."""
        sliding = any(a.kind != "full" for a in self.checkpoint.config.layer_attentions)
        return case.window is not None or (self.cache_kind == "dynamic" and not sliding)

    def _window_mask(self, positions: torch.Tensor, kv_len: int, window: int, sinks: int) -> torch.Tensor:
        """``[1, 1, q, kv_len]``: key j visible to query i iff j <= i and (i - window < j or j < sinks);
        additive (0 / dtype min) for eager attention, boolean otherwise."""
        i, j = positions[:, None], torch.arange(kv_len)[None, :]
        visible = (j <= i) & ((j > i - window) | (j < sinks))
        if self.attn_implementation == "eager":
            return torch.zeros(visible.shape, dtype=self.dtype).masked_fill(~visible, torch.finfo(self.dtype).min)[
                None, None
            ]
        return visible[None, None]

    def _reset_rope(self) -> None:
        _apply_rope(self._fresh_rope)

    def _decoder_layers(self) -> tuple[list[torch.nn.Module], list[Any]]:
        """The decoder layers and their attention modules, where the architecture's description says
        they are (``Family.hf_layers`` or ``layers_prefix``, and ``attn_module``; llama's names for an
        undescribed one). The attention modules are transformers' own classes (``Any``: their
        attributes, ``head_dim`` and the MLA projections, are read as each architecture names them)."""
        config = self.model.config
        name = family_of(getattr(config, "model_type", None))
        fam = FAMILIES.get(name) if name is not None else None
        where, attn_name = (
            (fam.hf.layers or fam.tensors.layers_prefix, fam.hf.attn_module) if fam else ("model.layers", "self_attn")
        )
        self._attention_method = fam.hf.attention_method if fam else None
        if fam is not None and fam.hf.attention_inline:
            raise UsageError(
                f"{type(self.model).__name__}: transformers' {fam.name} computes attention inline (no "
                "attention interface, no attention method), so the transformers adapter cannot record "
                "it; check the checkpoint with ropekv's engine (ropekv check DIR)"
            )
        try:
            layers: torch.nn.ModuleList | None = cast(torch.nn.ModuleList, self.model.get_submodule(where))
        except AttributeError:
            layers = None
        if layers is None or not all(hasattr(block, attn_name) for block in layers):
            raise UsageError(f"{type(self.model).__name__}: expected decoder layers {where} with a {attn_name} module")
        return list(layers), [getattr(block, attn_name) for block in layers]


# ---------------------------------------------------------------------- helpers


def _multimodal(folder: Path) -> bool:
    """Whether ``folder``'s config names an architecture described through its text_config (Qwen2-VL)."""
    import json

    from ..models.families import FAMILIES, family_of

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False  # transformers' own loader reports it
    if not isinstance(config, dict):
        return False
    family = family_of(config.get("model_type"))
    return family is not None and FAMILIES[family].reading.text_config


def _visibility(
    mask, rows: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """``visible [R, N]`` from the mask HF gave the kernel.

    None (sdpa's ``is_causal`` path, masks-free kernels): causal by position, within ``sliding_window``
    if the kernel was given one. A 2D mask is a padding mask on top of that. A 4D boolean mask is
    used as is; a 4D float mask is additive, entries below half the dtype's minimum count as masked
    and any other nonzero entry (a positional bias) is refused: it is not RoPE and ropekv would miss it.
    """
    n = kpos.shape[0]
    causal = kpos[None, :] <= qpos[:, None]  # [R, N]
    if sliding_window is not None:
        causal &= kpos[None, :] > qpos[:, None] - sliding_window
    if mask is None:
        return causal
    if mask.dim() == 2:
        return causal & mask[0, -n:].bool()[None, :]
    if mask.dim() != 4 or not (mask.shape[-1] >= n or mask.shape[-1] == 1) or mask.shape[1] != 1:
        raise RopeKVError(f"unexpected attention mask of shape {tuple(mask.shape)} for {n} keys")
    # eager slices the key columns and broadcasts a mask of one row or one column, as the kernel does
    m = mask[0, 0][:, :n].expand(max(int(rows.max()) + 1, mask.shape[-2]), n)[rows]  # [R, N]
    if m.dtype == torch.bool:
        return m
    visible = m > torch.finfo(m.dtype).min / 2
    if bool((m[visible] != 0).any()):
        raise RopeKVError("the attention mask carries an additive bias besides masking; ropekv checks RoPE only")
    return visible


def _rope_states(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict]]:
    """The mutable state of every rotary embedding module: its ``*inv_freq`` buffers and the
    attributes dynamic / LongRoPE updates change (``*max_seq_len_cached``, ``attention_scaling``,
    ``*long_inv_freq``)."""
    out = []
    for m in model.modules():
        buffers = {n: b.clone() for n, b in m._buffers.items() if n.endswith("inv_freq") and b is not None}
        if not buffers:
            continue
        attrs = {
            a: copy.copy(v)
            for a, v in vars(m).items()
            if a.endswith(("max_seq_len_cached", "long_inv_freq")) or a == "attention_scaling"
        }
        out.append((m, {"buffers": buffers, "attrs": attrs}))
    return out


def _fresh(state: dict) -> dict:
    """``state`` as a fresh model has it: ``inv_freq`` = ``original_inv_freq``, cached length = original."""
    buffers, attrs = dict(state["buffers"]), dict(state["attrs"])
    for n in list(buffers):
        if n.endswith("original_inv_freq"):
            buffers[n[: -len("original_inv_freq")] + "inv_freq"] = buffers[n].clone()
    return {
        "buffers": buffers,
        "attrs": {a: v for a, v in attrs.items() if not a.endswith("long_inv_freq")},
        "original_len": True,
    }


def _apply_rope(states: list[tuple[torch.nn.Module, dict]]) -> None:
    for m, state in states:
        for n, b in state["buffers"].items():
            m._buffers[n] = b.clone()
        for a in [a for a in vars(m) if a.endswith("long_inv_freq") and a not in state["attrs"]]:
            delattr(m, a)
        for a, v in state["attrs"].items():
            if state.get("original_len") and a.endswith("max_seq_len_cached") and hasattr(m, "original_max_seq_len"):
                v = m.original_max_seq_len
            setattr(m, a, copy.copy(v))


def _kv_offset(cache: Any, positions: torch.Tensor, query_length: int, layer: int) -> int:
    """The position of the first key the cache hands layer ``layer``'s kernel, as the cache tells HF's mask
    builder (``get_mask_sizes``: it takes the call's ``cache_position`` before 5.0, its length after)."""
    import inspect

    first = next(iter(inspect.signature(cache.get_mask_sizes).parameters))
    arg = positions if first == "cache_position" else query_length
    return int(cache.get_mask_sizes(arg, layer)[1])
