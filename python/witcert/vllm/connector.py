"""The WitCert KV connector: vLLM's per-step channel between its scheduler and its workers.

Scheduler side: each step tells the workers which requests run, their blocks (to map the attention
batch's rows to requests), prompt lengths and capacities; it keeps each request's report
(``witcert.Report``) and counts into it the cells the workers send back; a finished request's
``kv_transfer_params["witcert"]`` is its ``witcert`` object.

Worker side (:class:`WorkerState`, one per worker process): a WitCert cache per request mirrors the
keys and values the attention writes (exact, and as vLLM stored them), meters and gates each decode
step (``witcert.vllm.backend``), and hands the step's cells to the scheduler through
``build_connector_worker_meta``; the ranks of a tensor-parallel model each send their own heads'
cells, merged by ``aggregate``.

vLLM finishes a request before it reads the step's worker output, so ``request_finished`` returns the
report so far and the same dict is completed, in place, when that step's cells arrive within the same
scheduler update (before the output leaves the engine).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole, KVConnectorWorkerMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from witcert import _witcert

__all__ = ["WitCertConnector", "WorkerState", "active_worker"]

# WitCert's options a connector takes (the names of `witcert generate`, the server and the C API).
OPTIONS = ("tau_k", "tau_v", "granularity", "delta", "bound", "check_soundness", "page_size")

def active_worker() -> Optional["WorkerState"]:
    """This worker's state, while its engine's KV connector is a WitCert connector."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    agent = get_kv_transfer_group()
    return agent.worker if isinstance(agent, WitCertConnector) else None


def cache_options(extra: Dict[str, Any]) -> Dict[str, Any]:
    """WitCert cache options from the connector's ``kv_connector_extra_config``: both sides are the
    "external" format, fed with what vLLM stored. Unknown names are refused."""
    unknown = sorted(set(extra) - set(OPTIONS))
    if unknown:
        raise ValueError(f"witcert: unknown option(s) {', '.join(unknown)} in kv_connector_extra_config "
                         f"(known: {', '.join(OPTIONS)})")
    return dict(extra, kv="external", kv_v="external")


@dataclass
class StepRequests(KVConnectorMetadata):
    """Scheduler → workers, each step: request → (prompt length, capacity, block ids), and the
    requests finished since the last step."""

    requests: Dict[str, Tuple[int, int, List[int]]] = field(default_factory=dict)
    finished: List[str] = field(default_factory=list)


@dataclass
class StepCells(KVConnectorWorkerMetadata):
    """Workers → scheduler, each step: per request the cells metered (a structured array per rank)
    and the gate's page-ins (count, bytes) since the last step."""

    cells: Dict[str, List[np.ndarray]] = field(default_factory=dict)
    page_ins: Dict[str, List[int]] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        assert isinstance(other, StepCells)
        for req, arrays in other.cells.items():
            self.cells.setdefault(req, []).extend(arrays)
        for req, (n, b) in other.page_ins.items():
            mine = self.page_ins.setdefault(req, [0, 0])
            mine[0] += n
            mine[1] += b
        return self


class FinishedStats(KVConnectorStats):
    """The scheduler's finished requests since vLLM last read its stats, summed for the frontend's
    Prometheus metrics: ``verdict`` counts, and per scheme ``cells``, ``certified_k``, ``certified_v``,
    ``overflow``, ``page_ins``, ``page_in_bytes``."""

    COUNTS = ("cells", "certified_k", "certified_v", "overflow", "page_ins", "page_in_bytes")

    def add(self, obj: Dict[str, Any]) -> None:
        """Counts one finished request's ``witcert`` object."""
        one: Dict[str, Any] = {"verdict": {obj["verdict"]: 1}}
        cells = obj.get("cells", 0)
        if cells:
            coverage = obj["coverage"]
            one["scheme"] = {obj["kv"]: {
                "cells": cells, "certified_k": round(coverage["k"] * cells),
                "certified_v": round(coverage["v"] * cells), "overflow": round(obj.get("overflow_fraction", 0) * cells),
                "page_ins": obj.get("page_ins", 0), "page_in_bytes": obj.get("page_in_bytes", 0)}}
        self.aggregate(FinishedStats(data=one))

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for verdict, n in other.data.get("verdict", {}).items():
            v = self.data.setdefault("verdict", {})
            v[verdict] = v.get(verdict, 0) + n
        for name, counts in other.data.get("scheme", {}).items():
            mine = self.data.setdefault("scheme", {}).setdefault(name, dict.fromkeys(self.COUNTS, 0))
            for k, n in counts.items():
                mine[k] += n
        return self

    def reduce(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {f"witcert_{v}": n for v, n in self.data.get("verdict", {}).items()}
        for counts in self.data.get("scheme", {}).values():
            for k, n in counts.items():
                out[f"witcert_{k}"] = out.get(f"witcert_{k}", 0) + n
        return out

    def is_empty(self) -> bool:
        return not self.data


class WitCertPromMetrics(KVConnectorPromMetrics):
    """``witcert_*`` counters beside vLLM's on ``/metrics``, named as ``witcert serve`` names them."""

    def __init__(self, vllm_config: Any, metric_types: Dict[Any, Any], labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls
        side = labelnames + ["side", "scheme"]
        self.verdicts = counter(name="witcert_requests_verdict_total", labelnames=labelnames + ["verdict"],
                                documentation="Finished requests by verdict (certified, repaired, at-risk, unmetered).")
        self.cells = counter(name="witcert_meter_cells_total", labelnames=side,
                             documentation="Metered (layer, query head, decode step) cells by side and scheme.")
        self.certified = counter(name="witcert_meter_certified_cells_total", labelnames=side,
                                 documentation="Cells whose served meter met tau (K: tau_k, V: tau_v).")
        self.overflow = counter(name="witcert_meter_overflow_cells_total", labelnames=labelnames + ["scheme"],
                                documentation="Cells whose raw score overflowed (no guarantee).")
        self.page_ins = counter(name="witcert_page_ins_total", labelnames=labelnames + ["scheme"],
                                documentation="Pages promoted to exact by the gate's repairs.")
        self.page_in_bytes = counter(name="witcert_page_in_bytes_total", labelnames=labelnames + ["scheme"],
                                     documentation="Bytes read from the exact tier by the gate's repairs.")

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for verdict, n in transfer_stats_data.get("verdict", {}).items():
            self.verdicts.labels(*labels, verdict).inc(n)
        for scheme, c in transfer_stats_data.get("scheme", {}).items():
            for s in ("K", "V"):
                self.cells.labels(*labels, s, scheme).inc(c["cells"])
            self.certified.labels(*labels, "K", scheme).inc(c["certified_k"])
            self.certified.labels(*labels, "V", scheme).inc(c["certified_v"])
            self.overflow.labels(*labels, scheme).inc(c["overflow"])
            self.page_ins.labels(*labels, scheme).inc(c["page_ins"])
            self.page_in_bytes.labels(*labels, scheme).inc(c["page_in_bytes"])


@dataclass
class _Mirror:
    """One running request's WitCert cache and what the worker keeps of it."""

    cache: Any
    made: int  # the step the cache was made in
    last_pos: int = 0  # the last position written
    page_ins: Tuple[int, int] = (0, 0)  # the cache's page-ins (count, bytes) already sent


class StepPlan:
    """The rows of one step's attention batch as every layer sees them (one metadata object): the
    decode rows' caches, positions, tokens and slots, and the prompt chunks (cache, first position,
    token range, slots). Made once per step, by the first layer."""

    def __init__(self, state: "WorkerState", meta: Any, block_size: int):
        self.meta = meta
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        rows = len(seq_lens)
        last_blocks = meta.block_table[torch.arange(rows), (meta.seq_lens[:rows] - 1) // block_size].tolist()
        slots = meta.slot_mapping.to(torch.int64)
        self.decode_caches: List[Any] = []
        self.decode_pos: List[int] = []
        decode_tokens: List[int] = []
        self.chunks: List[Tuple[Any, int, int, int, np.ndarray]] = []
        for r in range(rows):
            t0, t1 = starts[r], starts[r + 1]
            pos0 = seq_lens[r] - (t1 - t0)
            m = state.mirror(state.owner[last_blocks[r]], pos0)
            m.last_pos = seq_lens[r] - 1
            if t1 - t0 == 1:
                self.decode_caches.append(m.cache)
                self.decode_pos.append(pos0)
                decode_tokens.append(t0)
            else:
                self.chunks.append((m.cache, pos0, t0, t1, slots[t0:t1].numpy()))
        self.tokens = torch.tensor(decode_tokens, dtype=torch.long)
        self.slots = slots[self.tokens].numpy()


class WorkerState:
    """One worker's WitCert caches, one per running request (see witcert.vllm.backend)."""

    def __init__(self, options: Dict[str, Any], layers: int):
        self.options_json = json.dumps(options)
        self.gated = options.get("tau_k") is not None
        self.request_gate = self.gated and options.get("granularity") == "request"
        self.layers = layers
        self.geometry: Optional[Tuple[int, int, int, int]] = None  # layers, q_heads, kv_heads, head_dim
        self.rank: Optional[int] = None  # the tensor-parallel rank and size, read once the group exists
        self.ranks = 1
        self.step = 0
        self.mirrors: Dict[str, _Mirror] = {}
        self.scheduled: Dict[str, Tuple[int, int, List[int]]] = {}  # this step's (prompt length, capacity, blocks)
        self.owner: Dict[int, str] = {}  # block id → request, for this step
        self._plan: Optional[StepPlan] = None

    def begin_step(self, meta: StepRequests) -> None:
        self.step += 1
        for req in meta.finished:
            self.mirrors.pop(req, None)
        self.scheduled = meta.requests
        self.owner = {b: req for req, (_, _, blocks) in meta.requests.items() for b in blocks}

    def mirror(self, req: str, pos0: int) -> _Mirror:
        """The request's mirror, made at its first write; made anew when vLLM recomputes the request
        from its start (a preemption)."""
        m = self.mirrors.get(req)
        if m is not None and (pos0 > 0 or m.made == self.step):
            return m
        assert self.geometry is not None
        layers, q_heads, kv_heads, head_dim = self.geometry
        prompt_len, capacity, _ = self.scheduled[req]
        c = _witcert.Cache(layers, q_heads, kv_heads, head_dim, capacity, self.options_json, 0, capacity, "neox")
        c.report_start(prompt_len)
        c.keep_cells(True)
        m = self.mirrors[req] = _Mirror(c, self.step)
        return m

    def plan(self, meta: Any, block_size: int) -> StepPlan:
        """This step's plan: made by the step's first layer, read by the others."""
        if self._plan is None or self._plan.meta is not meta:
            self._plan = StepPlan(self, meta, block_size)
        return self._plan

    def repair_requests_across_ranks(self) -> None:
        """The request-granular gate over tensor-parallel ranks: a request some rank repaired this
        step (its heads asked for it) is repaired whole on every rank: one all-reduce (max) of a flag
        per request on the group's CPU communicator. Every rank runs the same requests, so the flags
        line up."""
        import torch.distributed as dist
        from vllm.distributed import get_tp_group

        reqs = sorted(self.mirrors)
        if not reqs:
            return
        local = [int(self.mirrors[r].cache.stats()["page_ins"] > self.mirrors[r].page_ins[0]) for r in reqs]
        flags = torch.tensor(local, dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
        for r, mine, anyone in zip(reqs, local, flags.tolist()):
            if anyone and not mine:
                self.mirrors[r].cache.promote_all(self.mirrors[r].last_pos)

    def end_step(self) -> Optional[StepCells]:
        if self.geometry is None:
            return None
        if self.rank is None:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            self.rank, self.ranks = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        if self.request_gate and self.ranks > 1:
            self.repair_requests_across_ranks()
        offset = self.rank * self.geometry[1]
        out = StepCells()
        for req, m in self.mirrors.items():
            cells = m.cache.drain_cells()
            stats = m.cache.stats()
            (n0, b0), (n1, b1) = m.page_ins, (stats["page_ins"], stats["page_in_bytes"])
            m.page_ins = (n1, b1)
            if len(cells) == 0 and n1 == n0:
                continue
            cells["q_head"] += offset  # this rank's heads within the model's
            out.cells[req] = [cells]
            out.page_ins[req] = [n1 - n0, b1 - b0]
        return out if out.cells or out.page_ins else None


class WitCertConnector(KVConnectorBase_V1):
    """Meters and gates vLLM's KV cache per request (module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.worker: Optional[WorkerState] = None
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.options = cache_options(extra)
        if vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("witcert: prefix caching shares blocks whose exact keys a request never computed, so "
                             "nothing could bound their error; start vLLM with enable_prefix_caching=False "
                             "(--no-enable-prefix-caching)")
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise ValueError("witcert: only vLLM's CPU attention is wrapped; on this platform nothing would be "
                             "metered (docs/vllm.md, Limits)")
        if vllm_config.speculative_config is not None:
            raise ValueError("witcert: speculative decoding is not metered; start vLLM without it")
        model = vllm_config.model_config
        self.layers = model.get_num_layers(vllm_config.parallel_config)
        self.q_heads = model.get_num_attention_heads(vllm_config.parallel_config) * \
            vllm_config.parallel_config.tensor_parallel_size
        self.kv_cache_dtype = vllm_config.cache_config.cache_dtype
        # Refuse impossible options now, with the library's message, rather than in a worker.
        _witcert.Report(json.dumps(self.options), self.layers, self.q_heads, 0)
        self._reports: Dict[str, Any] = {}
        self._shapes: Dict[str, Tuple[int, int]] = {}
        self._awaiting: Dict[str, Dict[str, Any]] = {}
        self._finished: List[str] = []
        self._stats = FinishedStats()
        if role == KVConnectorRole.WORKER:
            self.worker = WorkerState(self.options, self.layers)

    # ---- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return

    def on_new_request(self, request: Any) -> None:
        prompt_len = request.num_prompt_tokens
        # One position past the last token: an asynchronous scheduler may run one step more.
        self._shapes[request.request_id] = (prompt_len, prompt_len + request.max_tokens + 1)
        self._reports[request.request_id] = _witcert.Report(json.dumps(self.options), self.layers, self.q_heads,
                                                            prompt_len)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = StepRequests(finished=self._finished)
        self._finished = []
        for req in scheduler_output.num_scheduled_tokens:
            prompt_len, capacity = self._shapes[req]
            blocks = self._kv_cache_manager.get_block_ids(req)[0]
            meta.requests[req] = (prompt_len, capacity, list(blocks))
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        step = connector_output.kv_connector_worker_meta
        if isinstance(step, StepCells):
            for req, arrays in step.cells.items():
                r = self._reports.get(req)
                if r is not None:
                    for cells in arrays:
                        r.record(cells)
            for req, (n, b) in step.page_ins.items():
                r = self._reports.get(req)
                if r is not None:
                    r.add_page_ins(n, b)
        for req, params in self._awaiting.items():
            params.update(self._object(req))
            self._reports.pop(req, None)
            self._stats.add(params)
        self._awaiting = {}

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, FinishedStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> Optional[KVConnectorStats]:
        return FinishedStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Dict[Any, Any], labelnames: List[str],
                           per_engine_labelvalues: Dict[int, List[object]]) -> KVConnectorPromMetrics:
        return WitCertPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        req = request.request_id
        self._finished.append(req)
        self._shapes.pop(req, None)
        if req not in self._reports:
            return False, None
        params = self._object(req)
        self._awaiting[req] = params
        return False, {"witcert": params}

    def _object(self, req: str) -> Dict[str, Any]:
        obj = json.loads(self._reports[req].json())
        name = f"vllm-{self.kv_cache_dtype}"
        obj["kv"] = obj["kv_v"] = name
        return obj

    # ---- worker side ----------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, StepRequests):
            self.worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        return self.worker.end_step() if self.worker is not None else None
