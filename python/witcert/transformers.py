"""WitCert inside Hugging Face transformers: the certified cache, the meter and the gate in ``model.generate``.

::

    cache = witcert.transformers.CertifiedCache(model, kv="q4_0", tau_k=0.2)
    out = model.generate(**inputs, cache=cache, max_new_tokens=32)
    cache.report().rows[0]        # the first row's `witcert` object, as `witcert serve` returns it

:class:`CertifiedCache` keeps every layer's keys and values in WitCert's C++ paged store (any
``--kv`` format, with the exact tier when a gate is on), one sequence per batch row. The model's
attention runs through ``attn_implementation="witcert"`` (registered with transformers'
``AttentionInterface``): each head's output comes from the store's fused certified attention, with
its meter and, above τ, the gate's repair, so the meters are the engine's own. Its mask function,
registered with ``AttentionMaskInterface``, turns the padding mask into each row's first real
position and recognises the model's sliding window; a mask that is anything else (right padding,
packed sequences, bidirectional or custom mask functions) is refused, never silently dropped.

Scope: decoder-only models whose layers attend causally, over the whole context or within the
model's sliding window (Llama, SmolLM, Mistral, Qwen 2/3, Gemma 3), greedy or sampled generation;
beam search and cache cropping raise ``NotImplementedError``. A sliding-window layer keeps every
position in the store and attends over its window. Tensors on a GPU are attended on the CPU.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function

import witcert
from witcert import _witcert

__all__ = ["CertifiedCache", "Report", "ATTN_IMPLEMENTATION"]

ATTN_IMPLEMENTATION = "witcert"

# The layer whose keys the cache stored last: transformers calls the cache's update and then the
# attention function for the same layer, and passes the attention function no cache of its own.
_active = threading.local()


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class _CertifiedLayer(CacheLayerMixin):
    """One layer of a :class:`CertifiedCache`: its keys and values live in the C++ store."""

    is_croppable = False

    def __init__(self, parent: "CertifiedCache", index: int, sliding: bool):
        super().__init__()
        self.parent = parent
        self.index = index
        self.length = 0
        # A sliding-window layer keeps every position too; its window is applied at attention.
        self.is_sliding = sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        pos0 = self.length
        self.parent._write(self.index, pos0, key_states, value_states)
        self.length += key_states.shape[-2]
        _active.step = (self.parent, self.index, pos0)
        # The attention function reads the store, not these: they are returned for the model's shape checks.
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.parent.capacity

    def reset(self) -> None:
        raise NotImplementedError("a CertifiedCache is not reset: make a new one for a new generation")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search reorders rows; a CertifiedCache keeps one sequence per row")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a CertifiedCache cannot drop written positions (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a CertifiedCache cannot duplicate rows (num_return_sequences, beams)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a CertifiedCache cannot select rows")


@dataclass(frozen=True)
class Report:
    """What a :class:`CertifiedCache` measured. ``rows``: each batch row's ``witcert`` object (the
    schema of a ``witcert serve`` response: a row is a request), over its decode steps. Per (layer,
    query head), arrays ``(layers, q_heads)`` over every row's decode-step cells: ``cells``,
    ``meter_mean`` (the served K meter's mean), ``v_meter_mean``, ``raw_max`` (the largest raw score
    before repair; ``inf``: no guarantee) and ``repaired``."""

    rows: List[Dict[str, Any]]
    cells: np.ndarray
    meter_mean: np.ndarray
    v_meter_mean: np.ndarray
    raw_max: np.ndarray
    repaired: np.ndarray


class CertifiedCache(Cache):
    """A transformers ``Cache`` whose keys and values are held by WitCert, metered and gated.

    ``kv`` and ``kv_v`` name the key and value formats (``"q4_0"``, ``"dither-int8"``, ... as
    ``witcert generate --kv`` takes them; ``None``: the plain fp16 cache, exact and unmetered), ``tau_k``
    (and ``tau_v``, ``granularity``, ``delta``, ``bound``, ``page_size``, ``check_soundness``, ...) the
    gate and meter options of the CLI, the server and the C API. ``capacity`` bounds the positions of
    a row (default: the model's context, at most 4,096); ``decode_budget`` is T of the Tier-B budget.

    Making one switches ``model``'s attention to ``attn_implementation="witcert"``;
    :meth:`close` switches it back.
    """

    def __init__(self, model: Any, kv: Optional[str] = None, kv_v: Optional[str] = None,
                 tau_k: Optional[float] = None, *, capacity: Optional[int] = None, decode_budget: int = 256,
                 **options: Any):
        config = _text_config(model)
        self.layers_count = int(config.num_hidden_layers)
        self.q_heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.q_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.q_heads)
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * self.layers_count)
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown or len(types) != self.layers_count:
            raise NotImplementedError(f"{type(model).__name__} has layers of types {unknown or types}: a "
                                      "CertifiedCache runs full and sliding-window attention layers")
        context = int(getattr(config, "max_position_embeddings", 4096) or 4096)
        self.capacity = int(capacity) if capacity is not None else min(context, 4096)
        if self.capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.decode_budget = int(decode_budget)
        self._options = dict(options, kv=kv, kv_v=kv_v, tau_k=tau_k)
        # A bad option fails here, at construction, not inside generate (on a pool of one position).
        self._make_row(capacity=1).close()
        self._rows: List[witcert.Cache] = []
        self._stats = np.zeros((5, self.layers_count, self.q_heads))  # cells, meter, v_meter sums, raw max, repaired
        self._decoding_from = 0
        self._model = model
        self._previous_attn = getattr(model.config, "_attn_implementation", None)
        register()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        super().__init__(layers=[_CertifiedLayer(self, i, t == "sliding_attention") for i, t in enumerate(types)])

    def _make_row(self, capacity: Optional[int] = None) -> witcert.Cache:
        opts = {k: v for k, v in self._options.items() if v is not None}
        return witcert.Cache(self.layers_count, self.q_heads, self.kv_heads, self.head_dim, capacity or self.capacity,
                             layout="neox", decode_budget=self.decode_budget, **opts)

    @property
    def batch_size(self) -> int:
        return len(self._rows) if self._rows else -1

    def _write(self, layer: int, pos0: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        batch = keys.shape[0]
        if not self._rows:
            self._rows = [self._make_row() for _ in range(batch)]
        if batch != len(self._rows):
            raise ValueError(f"this CertifiedCache holds {len(self._rows)} rows; the model wrote {batch}")
        if pos0 + keys.shape[-2] > self.capacity:
            raise IndexError(f"positions up to {pos0 + keys.shape[-2]} are beyond the cache's capacity "
                             f"{self.capacity} (CertifiedCache(capacity=...))")
        if layer == 0 and pos0 == 0:
            # The prompt: the report counts the decode steps after it, as a server response does.
            self._decoding_from = keys.shape[-2]
            for row in self._rows:
                row.report_start(self._decoding_from)
        # One conversion and one call for the batch; a registered scheme's function is given each row's
        # keys as torch tensors, through the rows' own write_rows.
        k = keys.detach().to(device="cpu", dtype=torch.float32).contiguous()
        v = values.detach().to(device="cpu", dtype=torch.float32).contiguous()
        if any(row._quantize for row in self._rows):
            for b, row in enumerate(self._rows):
                row.write_rows(layer, pos0, k[b], v[b])
        else:
            _witcert.write_batch([row._c for row in self._rows], layer, pos0, k.numpy(), v.numpy())

    def _attend(self, layer: int, pos0: int, query: torch.Tensor, begins: Optional[torch.Tensor], window: int,
                scaling: Optional[float]) -> torch.Tensor:
        batch, heads, steps, d = query.shape
        if heads != self.q_heads or d != self.head_dim:
            raise ValueError(f"the query has {heads} heads of {d}; the cache was made for {self.q_heads} of "
                             f"{self.head_dim}")
        q = query.detach().to(device="cpu", dtype=torch.float32)
        # The store's attention scales logits by 1/sqrt(d): another scale goes into the query.
        factor = 1.0 if scaling is None else float(scaling) * math.sqrt(d)
        if abs(factor - 1.0) > 1e-12:
            q = q * factor
        starts = [0] * batch if begins is None else [int(x) for x in begins]
        # One call for the batch: outputs (batch, steps, heads, head_dim), cells (batch, heads, steps).
        out, cells = _witcert.attend_batch([row._c for row in self._rows], layer, q.contiguous().numpy(), pos0,
                                           starts, window)
        self._count(layer, cells, slice(max(0, self._decoding_from - pos0), steps))
        return torch.from_numpy(out).to(device=query.device, dtype=query.dtype)

    def _count(self, layer: int, cells: Dict[str, np.ndarray], decode: slice) -> None:
        """Adds the decode steps' cells of every row to the per-(layer, head) summary."""
        if decode.start >= decode.stop:
            return
        field = {f: cells[f][:, :, decode] for f in ("meter", "v_meter", "raw", "repaired")}
        s = self._stats
        s[0, layer] += field["meter"].shape[0] * field["meter"].shape[2]
        s[1, layer] += field["meter"].sum(axis=(0, 2))
        s[2, layer] += field["v_meter"].sum(axis=(0, 2))
        s[3, layer] = np.maximum(s[3, layer], field["raw"].max(axis=(0, 2)))
        s[4, layer] += field["repaired"].sum(axis=(0, 2))

    def report(self) -> Report:
        """Each row's ``witcert`` object and the per-(layer, head) summary of the decode steps."""
        cells, meter_sum, v_sum, raw_max, repaired = self._stats
        with np.errstate(invalid="ignore", divide="ignore"):
            meter_mean = np.where(cells > 0, meter_sum / cells, np.nan)
            v_mean = np.where(cells > 0, v_sum / cells, np.nan)
        return Report(rows=[row.report() for row in self._rows], cells=cells.astype(np.int64),
                      meter_mean=meter_mean, v_meter_mean=v_mean, raw_max=raw_max, repaired=repaired.astype(np.int64))

    def stats(self) -> List[Dict[str, int]]:
        """Each row's page-ins and bytes (:meth:`witcert.Cache.stats`)."""
        return [row.stats() for row in self._rows]

    def close(self) -> None:
        """Frees the rows' stores and gives the model back its previous attention."""
        for row in self._rows:
            row.close()
        self._rows = []
        if self._model is not None and self._previous_attn is not None:
            self._model.set_attn_implementation(self._previous_attn)
        self._model = None

    def __enter__(self) -> "CertifiedCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _left_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's count of leading masked positions; a mask with a hole after a real position is refused."""
    m = attention_mask.to(torch.int8)
    if bool((m[:, 1:] < m[:, :-1]).any()):
        raise ValueError("the attention mask has a masked position after a real one (right padding or a hole): "
                         "witcert attention takes left padding only (tokenizer.padding_side = 'left')")
    return (m == 0).sum(dim=1).to(torch.int64)


@dataclass(frozen=True)
class _Mask:
    """The mask as witcert attention takes it: each row's first real position (``None``: no padding)
    and the sliding window (0: none)."""

    begins: Optional[torch.Tensor]
    window: int


def _window_of(mask_function: Any, config: Any) -> int:
    """0 for the causal mask, W for the causal mask within a sliding window of W (the model's
    ``sliding_window``, checked on both sides of the window's edge); anything else is refused."""
    if mask_function is causal_mask_function:
        return 0
    window = int(getattr(config, "sliding_window", None) or 0) if config is not None else 0
    if window > 0:
        pairs = [(q, kv) for q in (0, 1, window - 1, window, window + 1, 3 * window + 2)
                 for kv in (q - window - 1, q - window, q - window + 1, q - 1, q, q + 1, q + 2) if kv >= 0]
        q = torch.tensor([p[0] for p in pairs])
        kv = torch.tensor([p[1] for p in pairs])
        want = (kv <= q) & (q - kv < window)
        try:
            got = torch.as_tensor(mask_function(torch.tensor(0), torch.tensor(0), q, kv)).to(torch.bool)
        except Exception:  # a mask function that cannot take index tensors is none we run
            got = None
        if got is not None and got.shape == want.shape and bool((got == want).all()):
            return window
    raise NotImplementedError("witcert attention runs causal masks, with or without the model's sliding window: "
                              f"this model or call asks for another ({getattr(mask_function, '__name__', mask_function)}"
                              ": packed sequences, a bidirectional or custom mask function)")


def witcert_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function: Any = causal_mask_function, attention_mask: Optional[torch.Tensor] = None,
                 **kwargs: Any) -> Optional[_Mask]:
    """The mask function of ``attn_implementation="witcert"``: the padding and the window, as
    :func:`witcert_attention` takes them; ``None`` for a causal mask without padding."""
    window = _window_of(mask_function, kwargs.get("config"))
    begins = None
    if attention_mask is not None:
        begins = _left_padding(attention_mask[:, -kv_length:])
        if not bool(begins.any()):
            begins = None
    return None if begins is None and window == 0 else _Mask(begins, window)


def witcert_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[_Mask], dropout: float = 0.0, scaling: Optional[float] = None,
                      **kwargs: Any):
    """The attention function of ``attn_implementation="witcert"``: the cache's certified attention
    for the layer whose keys were just stored. Returns ``(output (batch, steps, heads, head_dim), None)``."""
    step = getattr(_active, "step", None)
    layer = getattr(module, "layer_idx", None)
    if step is None or step[1] != layer:
        raise RuntimeError("attn_implementation='witcert' attends through a witcert.transformers.CertifiedCache: "
                           "pass one as cache=")
    cache, index, pos0 = step
    _active.step = None
    if dropout:
        raise NotImplementedError("witcert attention has no dropout (call model.eval())")
    for unsupported in ("softcap", "s_aux", "sinks"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"witcert attention does not run '{unsupported}'")
    if attention_mask is not None and not isinstance(attention_mask, _Mask):
        raise ValueError("witcert attention takes the mask its own mask function makes (padding and window); got "
                         f"{type(attention_mask).__name__}")
    mask = attention_mask or _Mask(None, 0)
    layer_window = int(kwargs.get("sliding_window") or getattr(module, "sliding_window", None) or 0)
    if layer_window != mask.window:
        raise ValueError(f"layer {layer} attends within a window of {layer_window or 'none'}, its mask within "
                         f"{mask.window or 'none'}")
    return cache._attend(index, pos0, query, mask.begins, mask.window, scaling), None


def register() -> None:
    """Registers ``attn_implementation="witcert"`` and its mask function with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, witcert_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, witcert_mask)
