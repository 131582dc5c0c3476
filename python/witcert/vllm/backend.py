"""vLLM's CPU attention backend with WitCert's meter and gate (registered as ``CPU_ATTN``).

vLLM's attention runs first and unchanged. Then, while a WitCert connector is configured, each layer
writes its step's keys and values into the requests' WitCert caches: the exact ones the model
computed, and the ones vLLM stored, read back from its cache (by the C++ reader of its layout, whose
reference is witcert.vllm.layouts) so that the witness bounds the error of the very bytes vLLM's
kernel reads. A layer's decode rows take one call into the C++ core (``vllm_decode``: read, write,
attend), which gives every (request, layer, head) cell its meter and, with a gate, repairs from the
exact keys and values the cells above τ. A gated mirror keeps the pages it promoted exact for later
steps, so its outputs, which its meters describe, replace vLLM's decode outputs before the next
layer; ungated, vLLM's own outputs stand and the meter bounds them (both attend over the same
stored bytes). Prompt positions are written, not metered: the report covers decode steps, as
``witcert serve``'s does.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy as np
import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from witcert import _witcert
from witcert.vllm.connector import WorkerState, active_worker
from witcert.vllm.layouts import element_dtype

__all__ = ["WitCertCPUBackend", "WitCertCPUImpl"]


class WitCertCPUImpl(CPUAttentionBackendImpl):
    """CPUAttentionBackendImpl, then WitCert's mirror, meter and gate (module docstring)."""

    _index: Optional[int] = None
    _stored: Optional[Tuple[int, Tuple[Any, ...]]] = None

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor, output_scale: Any = None,
                output_block_scale: Any = None) -> torch.Tensor:
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        state = active_worker()
        if state is not None and attn_metadata is not None and self.attn_type == AttentionType.DECODER:
            self._certify(state, layer, query, key, value, kv_cache, attn_metadata, output)
        return out

    def _stored_cache(self, layer: Any, kv_cache: torch.Tensor, query_dtype: torch.dtype) -> Tuple[Any, ...]:
        """The layer's cache as bytes with its shape, element and layout, for the C++ reader of its
        layout (witcert.vllm.layouts is the reference it is tested against); kept while the cache
        tensor is the same."""
        if self._stored is None or self._stored[0] != kv_cache.data_ptr():
            elem = element_dtype(self.kv_cache_dtype, query_dtype)
            view = (kv_cache.view(torch.uint8).reshape(-1).numpy(), [*kv_cache.shape[:3], self.head_size],
                    str(elem).removeprefix("torch."), layer.isa)
            self._stored = (kv_cache.data_ptr(), view)
        return self._stored[1]

    def _certify(self, state: WorkerState, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kv_cache: torch.Tensor, meta: Any, output: torch.Tensor) -> None:
        if self.alibi_slopes is not None or self.logits_soft_cap or self.sinks is not None:
            raise NotImplementedError("witcert: attention with ALiBi, a logit soft cap or sinks is not metered")
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_size
        if self._index is None:
            self._index = extract_layer_index(layer.layer_name)
        index = self._index
        if state.geometry is None:
            state.geometry = (state.layers, h, kvh, d)
        plan = state.plan(meta, kv_cache.shape[2])
        stored = self._stored_cache(layer, kv_cache, query.dtype)
        scales = (layer._k_scale_float, layer._v_scale_float)
        for cache, pos0, t0, t1, slots in plan.chunks:  # a prompt's chunk: stored, not metered
            k_hat, v_hat = _witcert.read_stored(*stored, slots, *scales)
            exact = [x[t0:t1].reshape(-1, kvh, d).to(torch.float32).numpy() for x in (key, value)]
            cache.write_rows(index, pos0, *(np.ascontiguousarray(x.transpose(1, 0, 2)) for x in (*exact, k_hat, v_hat)))
        if not plan.decode_caches:
            return
        idx = plan.tokens
        k, v = (x[idx].reshape(-1, kvh, d).to(torch.float32).numpy() for x in (key, value))
        q = query[idx].reshape(-1, h, d).to(torch.float32)
        if not math.isclose(self.scale, 1.0 / math.sqrt(d), rel_tol=1e-6):
            q = q * (self.scale * math.sqrt(d))  # the cache's softmax scale is 1/sqrt(head_dim)
        window = self.sliding_window if self.sliding_window and self.sliding_window > 0 else 0
        # One call: each row's exact and stored key and value written, then its heads attended and metered.
        served, cells = _witcert.vllm_decode(plan.decode_caches, index, plan.decode_pos, k, v, q.numpy(), *stored,
                                             plan.slots, *scales, window)
        if state.gated:
            # The mirror's pages the gate promoted stay exact in later steps, so every decode cell's
            # meter describes the mirror's output, not vLLM's: serve the mirror's.
            n = meta.num_actual_tokens
            o = output[:n].view(n, h, d)
            o[idx] = torch.from_numpy(served).to(o.dtype)


class WitCertCPUBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend whose implementation also meters and gates (WitCertCPUImpl)."""

    @staticmethod
    def get_impl_cls() -> type:
        return WitCertCPUImpl
