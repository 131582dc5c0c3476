"""vLLM's CPU attention backend with WitCert's meter and gate (registered as ``CPU_ATTN``).

vLLM's attention runs first and unchanged. Then, while a WitCert connector is configured, each layer
writes its step's keys and values into the requests' WitCert caches: the exact ones the model
computed, and the ones vLLM stored, read back from its cache (witcert.vllm.layouts) so that the
witness bounds the error of the very bytes vLLM's kernel reads. The decode rows of the step are then
attended in one call into the C++ core (``attend_batch``), which gives every (request, layer, head)
cell its meter and, with a gate, repairs from the exact keys and values the cells above τ. A gated
mirror keeps the pages it promoted exact for later steps, so its outputs, which its meters describe,
replace vLLM's decode outputs before the next layer; ungated, vLLM's own outputs stand and the meter
bounds them (both attend over the same stored bytes). Prompt positions are written, not
metered: the report covers decode steps, as ``witcert serve``'s does.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from witcert import _witcert
from witcert.vllm.connector import WorkerState, active_worker
from witcert.vllm.layouts import element_dtype, read_slots

__all__ = ["WitCertCPUBackend", "WitCertCPUImpl"]


class WitCertCPUImpl(CPUAttentionBackendImpl):
    """CPUAttentionBackendImpl, then WitCert's mirror, meter and gate (module docstring)."""

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor, output_scale: Any = None,
                output_block_scale: Any = None) -> torch.Tensor:
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        state = active_worker()
        if state is not None and attn_metadata is not None and self.attn_type == AttentionType.DECODER:
            self._certify(state, layer, query, key, value, kv_cache, attn_metadata, output)
        return out

    def _certify(self, state: WorkerState, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kv_cache: torch.Tensor, meta: Any, output: torch.Tensor) -> None:
        if self.alibi_slopes is not None or self.logits_soft_cap or self.sinks is not None:
            raise NotImplementedError("witcert: attention with ALiBi, a logit soft cap or sinks is not metered")
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_size
        index = extract_layer_index(layer.layer_name)
        if state.geometry is None:
            state.geometry = (state.layers, h, kvh, d)
        n = meta.num_actual_tokens
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        block_size = kv_cache.shape[2]
        elem = element_dtype(self.kv_cache_dtype, query.dtype)
        k_hat, v_hat = read_slots(kv_cache, meta.slot_mapping[:n], layer.isa, elem, layer._k_scale_float,
                                  layer._v_scale_float)
        k = key[:n].reshape(n, kvh, d).to(torch.float32)
        v = value[:n].reshape(n, kvh, d).to(torch.float32)
        rows = len(seq_lens)
        table = meta.block_table[:rows]
        last_blocks = table[torch.arange(rows), (meta.seq_lens[:rows] - 1) // block_size].tolist()
        decode_caches, decode_tokens, decode_pos = [], [], []
        for r in range(rows):
            t0, t1 = starts[r], starts[r + 1]
            pos0 = seq_lens[r] - (t1 - t0)
            cache = state.cache(state.owner[last_blocks[r]], pos0)
            if t1 - t0 == 1:
                decode_caches.append(cache)
                decode_tokens.append(t0)
                decode_pos.append(pos0)
            else:
                rows_of = lambda x: np.ascontiguousarray(x[t0:t1].transpose(0, 1).numpy())  # noqa: E731
                cache.write_rows(index, pos0, rows_of(k), rows_of(v), rows_of(k_hat), rows_of(v_hat))
        if not decode_caches:
            return
        idx = torch.tensor(decode_tokens)
        per_token = lambda x: x[idx].unsqueeze(2).numpy()  # noqa: E731  (rows, kv_heads, 1, d)
        _witcert.write_batch(decode_caches, index, decode_pos, per_token(k), per_token(v), per_token(k_hat),
                             per_token(v_hat))
        q = query[:n].reshape(n, h, d)[idx].to(torch.float32)
        if not math.isclose(self.scale, 1.0 / math.sqrt(d), rel_tol=1e-6):
            q = q * (self.scale * math.sqrt(d))  # the cache's softmax scale is 1/sqrt(head_dim)
        window = self.sliding_window if self.sliding_window and self.sliding_window > 0 else 0
        served, cells = _witcert.attend_batch(decode_caches, index, q.unsqueeze(2).numpy(), decode_pos,
                                              [0] * len(decode_caches), window)
        if state.gated:
            # The mirror's pages the gate promoted stay exact in later steps, so every decode cell's
            # meter describes the mirror's output, not vLLM's: serve the mirror's.
            o = output[:n].view(n, h, d)
            o[idx] = torch.from_numpy(served[:, 0]).to(o.dtype)


class WitCertCPUBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend whose implementation also meters and gates (WitCertCPUImpl)."""

    @staticmethod
    def get_impl_cls() -> type:
        return WitCertCPUImpl
