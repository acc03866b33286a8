"""Fair baselines: FKV and ED on the model's own fastest attention, with no score bookkeeping.

FKV (full cache) and ED (Algorithm 3: prefill the whole prompt in one pass, then keep only the newest pair, and
again whenever the cache reaches ``kv_max`` pairs) never read attention weights, so they run on the attention
kernel the model offers -- FlashAttention-2 where installed on CUDA with a half dtype, else PyTorch SDPA -- through
``DenseCache``: per layer one preallocated K/V buffer written by index (gpt-fast style). Which slots are held is
a host integer range ``[0, length)``: FKV appends; ED copies the newest pair to slot 0 (no sort, no gather).

Pads: left padding occupies the first slots of the prompt. Prefill passes the 2D padding mask (HF builds the
causal mask); a decode step passes a mask only while padded slots are still held (FKV always, ED never after
its first eviction): with SDPA a view of a preallocated 4D boolean mask, with other kernels a view of the 2D one.

The kept positions (per layer, sample, KV head) follow from host integers and the padding mask, so nothing is
tracked per step on the device.

Memory: each pass's attention workspace is counted from host integers as HF's attention path allocates it
(``workspace.dense_workspace_bytes``: a padded prefill's 4D mask, its additive copy and GQA's K/V copies;
FlashAttention-2's gathered copies of the real pairs, in every decode step while pads are held) and recorded as
``peak_workspace_bytes``, the number the planner predicts; ``tests/test_memory.py`` measures it.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import is_flash_attn_2_available

from .cache import SlotLayer
from .method import Method
from .schedule import Phase
from .workspace import FLASH, SDPA, SDPA_REPEAT, dense_workspace_bytes

logger = logging.getLogger(__name__)


def fastest_attention(model: torch.nn.Module, padded_fkv: bool = False) -> str:
    """The fastest attention implementation ``model`` offers on its device (``choose_attention``); ``padded_fkv``:
    the run is FKV on a left-padded batch."""
    param = next(model.parameters())
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    return choose_attention(
        _capability(param.device),
        param.dtype,
        flash=getattr(model, "_supports_flash_attn", False) and is_flash_attn_2_available(),
        sdpa=getattr(model, "_supports_sdpa", False),
        padded_fkv=padded_fkv,
        current=model.config._attn_implementation,
        gqa=(getattr(config, "num_key_value_heads", None) or heads) != heads,
    )


def choose_attention(
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    *,
    flash: bool,
    sdpa: bool,
    padded_fkv: bool,
    current: str,
    gqa: bool = False,
) -> str:
    """FlashAttention-2 where it runs and pays: a CUDA card of compute capability >= 8.0 (a V100 or TITAN V is 7.0,
    where its kernels do not exist), float16/bfloat16, the package installed and the model supporting it, and not
    FKV on a left-padded batch (whose every decode step would gather the unpadded K/V with host syncs in every
    layer). Otherwise SDPA where the model supports it -- for a GQA model in a half dtype on a card below 8.0 with
    K/V copied per query head first (``SDPA_REPEAT``: SDPA's memory-efficient kernel rejects ``enable_gqa`` there
    and the math kernel would hold every score) -- else the model's own. ``capability`` None: not CUDA."""
    half = dtype in (torch.float16, torch.bfloat16)
    if capability is not None and tuple(capability) >= (8, 0) and half and flash and not padded_fkv:
        return FLASH
    if sdpa and gqa and half and capability is not None and tuple(capability) < (8, 0):
        return SDPA_REPEAT
    return SDPA if sdpa else current


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


class _OneGroup:
    """An attention module seen with as many KV heads as query heads: HF's SDPA function then neither repeats K/V
    nor asks SDPA for ``enable_gqa`` (it reads ``num_key_value_groups`` only when the module has one)."""

    def __init__(self, module: torch.nn.Module):
        self._module = module

    def __getattr__(self, name: str):
        if name == "num_key_value_groups":
            raise AttributeError(name)
        return getattr(self._module, name)


def sdpa_repeat_kv(module, query, key, value, attention_mask, **kwargs):
    """HF's SDPA attention with K and V copied per query head first (``SDPA_REPEAT``): key/value [B, Hkv, L, D]
    -> [B, Hq, L, D], so SDPA runs its memory-efficient kernel on a card below compute capability 8.0."""
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [B, Hq, L, D] each
    return sdpa_attention_forward(_OneGroup(module), query, key, value, attention_mask, **kwargs)


def register_sdpa_repeat() -> None:
    """Register ``sdpa_repeat_kv`` as ``SDPA_REPEAT`` beside HF's attention functions, with SDPA's mask builder
    (once: a registration made before, or wrapped since, stays)."""
    if SDPA_REPEAT not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(SDPA_REPEAT, sdpa_repeat_kv)
        AttentionMaskInterface.register(SDPA_REPEAT, sdpa_mask)


def dense_prefill_attention(query: torch.Tensor, key: torch.Tensor):
    """The SDPA function a pool's dense prefill hands a layer to: ``sdpa_repeat_kv`` for GQA on a card below compute
    capability 8.0 (as ``choose_attention``), else HF's own."""
    gqa = query.shape[1] != key.shape[1]
    chosen = choose_attention(
        _capability(query.device), query.dtype, flash=False, sdpa=True, padded_fkv=False, current=SDPA, gqa=gqa
    )
    return sdpa_repeat_kv if chosen == SDPA_REPEAT else sdpa_attention_forward


@contextlib.contextmanager
def use_attention(model: torch.nn.Module, name: str):
    """Run ``model`` with attention implementation ``name`` inside the block, restoring its own after."""
    if name == SDPA_REPEAT:
        register_sdpa_repeat()
    previous = model.config._attn_implementation
    if name != previous:
        model.set_attn_implementation(name)
    try:
        yield model
    finally:
        if name != previous:
            model.set_attn_implementation(previous)


class DenseLayer(SlotLayer):
    """One decoder layer: keys/values [B, H, C, D]; slots [0, cache.length) hold pairs, in position order."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._allocate(
            key_states.shape[0], key_states.shape[1], key_states.shape[-1], value_states.shape[-1], self.cache.reserve
        )
        self.is_initialized = True

    def _allocate(self, batch: int, heads: int, k_dim: int, v_dim: int, capacity: int) -> None:
        kw = dict(dtype=self.dtype, device=self.device)
        self.keys = torch.zeros(batch, heads, capacity, k_dim, **kw)
        self.values = torch.zeros(batch, heads, capacity, v_dim, **kw)
        self.cache.note_capacity()

    def get_seq_length(self) -> int:
        return self.cache.start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.start + query_length, 0

    def kv_bytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the pass's pairs [B, H, n, D] (RoPE applied) at slots [start, start + n); return the held slots
        [B, H, start + n, D] as views. ED first moves its newest pair to slot 0 when the phase evicts."""
        cache = self.cache
        if cache.phase is None:
            raise RuntimeError("DenseCache is driven by batchmax_tp.core.engine.generate (cache.begin(phase) per pass)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if cache.keep_newest:
            self._keep_newest(cache.held_before - 1)
        a, b = cache.start, cache.length
        self.keys[:, :, a:b] = key_states
        self.values[:, :, a:b] = value_states
        return self.keys[:, :, :b], self.values[:, :, :b]  # [B, H, b, D] views

    def _keep_newest(self, newest: int) -> None:
        """ED's eviction: the pair at slot ``newest`` moves to slot 0 (into a ``kv_max`` buffer once the
        prompt-sized one is no longer needed)."""
        method, src_k, src_v = self.cache.method, self.keys, self.values
        if src_k.shape[2] > method.kv_max:
            B, H, _, Dk = src_k.shape
            self._allocate(B, H, Dk, src_v.shape[-1], method.kv_max)
        method.keep_newest(self.keys, src_k, newest)
        method.keep_newest(self.values, src_v, newest)

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def kept_positions(self) -> list[list[list[int]]]:
        """Sorted real positions held, per sample and local KV head (host integers; for tests and inspection)."""
        if self.keys is None:
            return []
        held = self.cache.held_positions()
        return [[list(row)] * self.keys.shape[1] for row in held]


class DenseCache(Cache):
    """Preallocated K/V cache for FKV and ED, driven by the engine's phases (``begin`` before each pass).

    ``reserve``: slots per (sample, head) allocated at prefill (FKV: prompt + generation; ED: max(kv_max, prompt),
    shrunk to ``kv_max`` at the first eviction). ``attention_mask``: the batch's [B, s] left-padding mask.
    """

    peak_meta_bytes = 0  # no per-slot bookkeeping (the decode mask is counted by the planner as slot_meta)

    def __init__(self, method: Method, num_layers: int, reserve: int, attention_mask: torch.Tensor, impl: str = SDPA):
        if method.reads_scores:
            raise ValueError(
                f"DenseCache serves the baselines fkv and ed (no attention scores read), not {method.name!r}"
            )
        super().__init__(layers=[DenseLayer(self, i) for i in range(num_layers)])
        self.method = method
        self.reserve = reserve
        self.impl = impl
        self.phase: Phase | None = None
        self.peak_kv_bytes = 0
        self.peak_workspace_bytes = 0
        self.prompt_mask = attention_mask.bool()  # [B, s]
        self.prompt_len = attention_mask.shape[1]
        self._host_mask = self.prompt_mask.cpu()  # one host copy, before any timing
        pads = (~self._host_mask).sum(-1)  # [B] left pads per row
        self._pads = pads.tolist()
        self.max_pads = int(pads.max()) if pads.numel() else 0  # slots [0, max_pads) may hold a pad
        self._shape = None  # (query heads, KV heads, head dim, element bytes) once ``note_workspace`` saw them
        self._mask2d = self._mask4d = None
        if not method.evicts and self.max_pads and reserve > self.prompt_len:  # FKV holds its pads all run
            full = torch.ones(attention_mask.shape[0], reserve, dtype=torch.bool, device=attention_mask.device)
            full[:, : self.prompt_len] = self.prompt_mask
            self._mask2d = full  # [B, C]
            self._mask4d = full[:, None, None, :]  # [B, 1, 1, C]: a view, sliced per decode step
        # Host integers shared by every layer (and every tensor-parallel rank):
        self.seen = 0  # padded position of the next token
        self.held_before = 0  # slots held before this pass (before its eviction)
        self.start = 0  # slot where this pass writes (= pairs held after its eviction)
        self.length = 0  # slots held after this pass
        self.keep_newest = False

    def begin(self, phase: Phase | None) -> None:
        """State the next forward pass: ED keeps only its newest pair first when ``phase.evict``."""
        self.phase = phase
        if phase is None:
            return
        self.held_before = self.length
        self.keep_newest = self.method.keeps_newest_only and phase.evict > 0
        self.start = 1 if self.keep_newest else self.length
        self.length = self.start + phase.size
        self.seen = phase.end
        if phase.kind == "decode" and self._shape is not None:
            self._note_pass(1)

    def attention_mask(self) -> torch.Tensor | None:
        """The mask to hand the model for the pass stated by ``begin``: None when no held slot can be a pad."""
        first_held = self.seen - self.length  # padded position of slot 0
        if first_held >= self.max_pads:
            return None
        if self.phase.kind == "prefill":
            return self.prompt_mask[:, self.phase.start : self.phase.end]  # [B, s]: HF builds the causal mask
        if self.impl in (SDPA, SDPA_REPEAT):
            return self._mask4d[..., : self.length]  # [B, 1, 1, L] view
        return self._mask2d[:, : self.length]  # [B, L] view

    def note_capacity(self) -> None:
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes())

    def note_workspace(self, config) -> None:
        """Record the prefill's attention workspace (``workspace.dense_workspace_bytes``) once it has shown the
        local shapes (``config``: the model's, for the query heads per KV head); from then on each decode step's is
        recorded as ``begin`` states it."""
        heads = config.num_attention_heads
        groups = heads // (getattr(config, "num_key_value_heads", None) or heads)
        layer = self.layers[0]
        if layer.keys is None:
            return
        _, H, _, D = layer.keys.shape
        self._shape = (groups * H, H, D, layer.keys.element_size())
        self._note_pass(self.prompt_len)

    def _note_pass(self, queries: int) -> None:
        """Record the workspace of the pass ``begin`` stated: ``queries`` over the slots held, with a mask when a
        held slot may be a pad; FlashAttention-2 gathers the real pairs among them (counted from the host mask)."""
        q_heads, kv_heads, D, elem = self._shape
        first = self.seen - self.length  # padded position of slot 0
        padded = first < self.max_pads
        real = None
        if padded and self.impl == FLASH:
            real = sum(self.length - max(0, p - first) for p in self._pads)
        est = dense_workspace_bytes(
            len(self._pads),
            q_heads,
            kv_heads,
            D,
            queries,
            self.length,
            elem,
            padded=padded,
            impl=self.impl,
            real=real,
            align=self.prompt_mask.device.type == "cuda",
        )
        self.peak_workspace_bytes = max(self.peak_workspace_bytes, est)

    def kv_bytes(self) -> int:
        """Bytes of the K/V buffers allocated now (all layers)."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def meta_bytes(self) -> int:
        """No per-slot bookkeeping; the 2D decode mask (FKV with padding) is the only extra buffer."""
        return 0 if self._mask2d is None else self._mask2d.numel()

    def held_positions(self) -> list[list[int]]:
        """Per sample: the real positions in slots [0, length), i.e. padded positions [seen - length, seen)."""
        first = self.seen - self.length
        rows = []
        for mask_row in self._host_mask.tolist():
            rows.append([p for p in range(first, self.seen) if p >= self.prompt_len or mask_row[p]])
        return rows

    def kept_positions(self) -> list[list[list[list[int]]]]:
        """Per layer, sample and local KV head: the sorted positions of the pairs held."""
        return [layer.kept_positions() for layer in self.layers]
