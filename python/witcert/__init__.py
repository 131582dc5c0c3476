"""WitCert: a sound runtime meter for quantized KV caches.

Given an attention step's compressed logits and per-token bounds ``c_t >= |eps_t|`` on their
error, :func:`meter` returns upper bounds on the total variation between the attention over
exact and over compressed keys (Wei and Liu, "WitCert: Sound Runtime Risk Observability and
Gating for KV-Cache Quantization"). The certificates give ``c_t`` for black-box schemes
(:func:`witness`, :func:`tier_a_bounds`) and for dithered INT8 (:class:`DitherInt8`);
:class:`Cache` is the certified paged cache and :class:`Engine` runs a GGUF model over it.

Every function calls libwitcert's C API, so Python, C and ``witcert bound`` agree bit for bit.
Arrays are read in place: they must be C-contiguous and of the documented dtype (float64 for the
meter, float32 for keys, values and queries, float16 for witnesses and scales), otherwise a
``TypeError`` names the argument. Bad values raise ``ValueError``; positions beyond a cache or a
full pool raise ``IndexError``; a missing or malformed GGUF raises ``OSError``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _arrays, _witcert

__all__ = [
    "API_VERSION",
    "__version__",
    "meter",
    "meters",
    "Meters",
    "meter_tanh",
    "meter_log_domain",
    "true_tv",
    "witness",
    "tier_a_bounds",
    "delta_loc",
    "value_bound",
    "DitherInt8",
    "Cache",
    "Report",
    "Cells",
    "Engine",
    "register_scheme",
    "schemes",
]

API_VERSION: int = _witcert.API_VERSION
__version__: str = _witcert.__version__

Bounds = Dict[str, float]


def meter(z: Optional[np.ndarray] = None, c: Optional[np.ndarray] = None, *,
          p_tilde: Optional[np.ndarray] = None) -> Bounds:
    """Every bound shape on TV(p, p~) for one attention step, and the meter.

    ``meter(z, c)`` or ``meter(p_tilde=p, c=c)``. Give the compressed logits ``z`` (float64, any additive offset, ``-inf`` for a masked token)
    or the probabilities ``p_tilde`` (float64, summing to 1), and ``c`` (float64, ``c_t >= 0``,
    ``+inf`` allowed). Returns ``{"eform", "two_sided", "retention", "tanh", "tanh_half", "raw",
    "meter"}``: the shapes unclamped (``inf`` means no guarantee), ``raw`` the e-form risk score,
    ``meter`` the least of them clamped to [0, 1].
    """
    if (z is None) == (p_tilde is None):
        raise ValueError("give either z (logits) or p_tilde (probabilities)")
    if c is None:
        raise ValueError("c (the per-token bounds) is required")
    if z is not None:
        return _witcert.meter_logits(z, c)
    return _witcert.meter_probs(p_tilde, c)


@dataclass(frozen=True)
class Meters:
    """Every bound shape for a batch of attention steps: each field is a float64 array of the
    batch's shape (the input's shape without its last, token, dimension), as :func:`meter` gives
    them for one step."""

    eform: np.ndarray
    two_sided: np.ndarray
    retention: np.ndarray
    tanh: np.ndarray
    tanh_half: np.ndarray
    raw: np.ndarray
    meter: np.ndarray


def meters(z: Any = None, c: Any = None, *, p_tilde: Any = None, threads: int = 0) -> Meters:
    """The meter of many attention steps in one call: :func:`meter` on every row.

    ``z`` (logits) or ``p_tilde`` (probabilities) and ``c`` are numpy arrays or CPU torch tensors of
    the same shape ``(..., tokens)`` (e.g. ``[batch, heads, tokens]``), each float64, float32, float16
    or bfloat16, read in place (C-contiguous) and widened exactly to double. The GIL is released
    while it runs, on ``threads`` threads (0: one per core). Bad values raise ``ValueError`` naming
    the row and the entry.
    """
    if (z is None) == (p_tilde is None):
        raise ValueError("give either z (logits) or p_tilde (probabilities)")
    if c is None:
        raise ValueError("c (the per-token bounds) is required")
    name = "z" if z is not None else "p_tilde"
    x, x_code = _arrays.view(z if z is not None else p_tilde, name)
    cv, c_code = _arrays.view(c, "c")
    if x.shape != cv.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, c has {tuple(cv.shape)}: they must be equal")
    if x.ndim < 1:
        raise ValueError(f"{name} must have a token dimension")
    out = _witcert.meter_batch(x, x_code, cv, c_code, z is not None, int(threads))
    shape = x.shape[:-1]
    return Meters(*(np.ascontiguousarray(out[:, i]).reshape(shape) for i in range(7)))


def meter_tanh(c_max: float) -> Tuple[float, float]:
    """From ``c`` alone: ``(tanh(c_max), tanh(c_max / 2))``, both sound bounds on the TV."""
    return _witcert.meter_tanh(float(c_max))


def meter_log_domain(log_a: float, log_a_minus: float) -> Tuple[float, float]:
    """The e-form and two-sided bounds from ``log A`` and ``log A-`` an engine accumulated itself."""
    return _witcert.meter_log_domain(float(log_a), float(log_a_minus))


def true_tv(p_tilde: np.ndarray, eps: np.ndarray) -> float:
    """The exact TV(p, p~) for ``p ~ p~ * exp(-eps)``: what every bound must dominate."""
    return _witcert.true_tv(p_tilde, eps)


def witness(k_hat: Any, k: Any, bands: int = 16, layout: str = "interleaved") -> np.ndarray:
    """Tier-A witnesses of compressed keys ``k_hat`` against exact keys ``k``.

    ``k_hat`` and ``k`` have the same shape ``(..., d)`` (one key, or any batch of them), numpy or
    CPU torch, float32, float16 or bfloat16 (float64 is refused: it would be rounded); ``layout`` is the model's RoPE pairing,
    ``"interleaved"`` (GGUF llama) or ``"neox"`` (Hugging Face). Returns float16 of shape
    ``(..., bands)``, each at least its band's error norm.
    """
    kh, kh_code = _arrays.narrow(k_hat, "k_hat")
    kk, k_code = _arrays.narrow(k, "k")
    if kh.shape != kk.shape or kh.ndim < 1:
        raise ValueError(f"k_hat and k must have the same shape (..., d), got {tuple(kh.shape)} and {tuple(kk.shape)}")
    d = kh.shape[-1]
    w = _witcert.witness_batch(kh.reshape(-1, d), kh_code, kk.reshape(-1, d), k_code, int(bands), layout)
    return w.reshape(kh.shape[:-1] + (int(bands),))


def tier_a_bounds(q: Any, witnesses: np.ndarray, sm: Optional[float] = None,
                  layout: str = "interleaved", threads: int = 0) -> np.ndarray:
    """The per-token bounds ``c`` (float64) for queries from the keys' witnesses (float16), at softmax
    scale ``sm`` (default ``1/sqrt(d)``).

    One query ``q`` ``(d,)`` over witnesses ``(n, bands)`` gives ``(n,)``; a batch ``q`` ``(..., q_heads,
    d)`` over witnesses ``(..., kv_heads, n, bands)`` gives ``(..., q_heads, n)``, query head ``h``
    reading KV head ``h // (q_heads // kv_heads)``. ``q`` is numpy or CPU torch, float32, float16 or
    bfloat16.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm is None else float(sm)
    qv, q_code = _arrays.narrow(q, "q")
    if isinstance(witnesses, np.ndarray) and not witnesses.flags.c_contiguous:
        raise TypeError("witnesses must be C-contiguous")
    single = qv.ndim == 1
    if single:  # one query head over one KV head
        if not isinstance(witnesses, np.ndarray) or witnesses.ndim != 2:
            raise ValueError("a single q (d,) takes witnesses (n, bands)")
        qv, witnesses = qv[None], witnesses[None]
    if qv.ndim < 2 or not isinstance(witnesses, np.ndarray) or witnesses.ndim != qv.ndim + 1 \
            or witnesses.shape[:-3] != qv.shape[:-2]:
        raise ValueError("q (..., q_heads, d) takes witnesses (..., kv_heads, n, bands) with the same leading shape")
    lead = qv.shape[:-2]
    b = int(np.prod(lead)) if lead else 1
    c = _witcert.tier_a_batch(qv.reshape((b,) + qv.shape[-2:]), q_code,
                              witnesses.reshape((b,) + witnesses.shape[-3:]), scale, layout, int(threads))
    return c[0, 0] if single else c.reshape(lead + c.shape[1:])


def delta_loc(delta_req: float, layers: int, q_heads: int, steps: int) -> float:
    """The per-cell failure budget ``delta_req / (layers * q_heads * steps)`` of Tier B."""
    return _witcert.delta_loc(float(delta_req), int(layers), int(q_heads), int(steps))


def value_bound(tv_k: float, v_max_norm: float, weighted_rho: float) -> Tuple[float, float]:
    """The output bound ``2 tv_k max|v| + sum p~ rho`` and the V meter (its second term over
    ``max|v|``)."""
    return _witcert.value_bound(float(tv_k), float(v_max_norm), float(weighted_rho))


class DitherInt8:
    """The subtractively dithered INT8 quantizer of Tier B for keys of ``d`` channels.

    ``group`` channels share a scale; ``outliers`` lists channels kept exact (fp16); ``seed``
    keys the Philox dither, whose counter is (slot, channel / 4, kv_head, layer).
    """

    def __init__(self, d: int, group: int = 32, seed: int = 0x5EED, outliers: Optional[Sequence[int]] = None):
        self._q = _witcert.DitherInt8(int(d), int(group), int(seed), None if outliers is None else list(outliers))

    @property
    def d(self) -> int:
        return self._q.d

    @property
    def group(self) -> int:
        return self._q.group

    def dither(self, layer: int, kv_head: int, slot: int) -> np.ndarray:
        """The dither of one physical slot: float32 ``(d,)`` on the grid ``k * 2**-24 - 1/2``."""
        return self._q.dither(int(layer), int(kv_head), int(slot))

    def encode(self, x: np.ndarray, xi: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(codes int8 (d,), scales float16 (d/group,), outlier_values float16)`` of one token."""
        return self._q.encode(x, xi)

    def decode(self, codes: np.ndarray, scales: np.ndarray, xi: np.ndarray, outlier_values: np.ndarray) -> np.ndarray:
        """The decoded token, float32 ``(d,)``: within ``scale / 2`` of the input on every channel."""
        return self._q.decode(codes, scales, xi, outlier_values)

    def radius(self, q: np.ndarray, scales: np.ndarray, n_tokens: int, delta_loc: float,
               sm: Optional[float] = None) -> float:
        """The radius ``u_t >= |eps_t|`` (with probability ``>= 1 - delta_loc`` over ``n_tokens``)
        of one stored key for query ``q`` at scale ``sm`` (default ``1/sqrt(d)``)."""
        scale = 1.0 / math.sqrt(self.d) if sm is None else float(sm)
        return self._q.radius(q, scales, int(n_tokens), float(delta_loc), scale)


class _Closed:
    """Stands in for a closed handle: any use raises ``ValueError``."""

    def __init__(self, what: str):
        self._what = what

    def __getattr__(self, name: str) -> Any:
        raise ValueError(f"this {self._what} is closed")


Quantize = Callable[[Any], Any]
_SCHEMES: Dict[str, Quantize] = {}


def _library_format(name: str) -> bool:
    """Whether the library itself takes ``name`` as a format (``witcert schemes``, or ``external``):
    asked of the library, on a pool of one position."""
    try:
        _witcert.Cache(1, 1, 1, 64, 1, json.dumps({"kv": name}), 0, 1, "neox")
    except ValueError:
        return False
    return True


def register_scheme(name: str, quantize: Quantize) -> None:
    """Registers a KV-cache scheme written as one function: ``quantize`` maps the keys (or values) of
    one KV head, a ``(tokens, head_dim)`` float32 torch tensor or numpy array (whichever the cache was
    given), to their reconstruction of the same shape. A :class:`Cache` (or
    ``witcert.transformers.CertifiedCache``) made with ``kv=name`` (and ``kv_v=name``) stores what it
    returns; the Tier-A witness is computed from it and the exact keys at write time, so the scheme is
    metered and gated like the built-in ones. Registering a name again replaces its function."""
    if not isinstance(name, str) or not name or _library_format(name):
        raise ValueError(f"a registered scheme needs a new name, not {name!r}, which the library has (witcert schemes)")
    if not callable(quantize):
        raise TypeError("quantize must be callable: (tokens, head_dim) -> its reconstruction")
    _SCHEMES[name] = quantize


def schemes() -> List[str]:
    """The names :func:`register_scheme` registered."""
    return sorted(_SCHEMES)


class Cache:
    """One sequence of the certified paged cache, over its own pool.

    ``kv`` and ``kv_v`` name the key and value schemes (``"q4_0"``, ``"dither-int8"``, ..., or one
    :func:`register_scheme` registered; ``None``: the plain fp16 cache, which is exact); ``tau_k`` is
    the gate's τ_K (a gated cache keeps an exact tier and repairs pages until each served cell is
    within it); further keyword options (``tau_v``, ``granularity``, ``delta``, ``bound``,
    ``page_size``, ...) are those of ``witcert generate``. ``pool_bytes`` bounds the pool (0: room
    for ``capacity`` positions).
    """

    def __init__(self, layers: int, q_heads: int, kv_heads: int, head_dim: int, capacity: int, *,
                 kv: Optional[str] = None, kv_v: Optional[str] = None, tau_k: Optional[float] = None,
                 pool_bytes: int = 0, decode_budget: int = 256, layout: str = "interleaved", **options: Any):
        opts: Dict[str, Any] = dict(options)
        # A registered scheme is the library's "external" format, fed with the function's output.
        self._quantize: Dict[str, Quantize] = {}
        self._names: Dict[str, str] = {}
        for side, name in (("kv", kv), ("kv_v", kv if kv_v is None else kv_v)):
            if name is None:
                continue
            if name in _SCHEMES:
                self._quantize[side] = _SCHEMES[name]
                self._names[side] = name
                opts[side] = "external"
            else:
                opts[side] = name
        if tau_k is not None:
            opts["tau_k"] = tau_k
        self.group = q_heads // kv_heads if kv_heads > 0 else 0
        self._c = _witcert.Cache(int(layers), int(q_heads), int(kv_heads), int(head_dim), int(capacity),
                                 json.dumps(opts), int(pool_bytes), int(decode_budget), layout)

    def write(self, layer: int, kv_head: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        """Stores the post-RoPE key and value (float32 ``(head_dim,)``) of the next position."""
        if self._quantize:
            raise ValueError(f"a cache of the registered scheme {next(iter(self._names.values()))!r} is written with "
                             "write_rows (every KV head of a position at once)")
        self._c.write(int(layer), int(kv_head), int(pos), k, v)

    def attend(self, layer: int, kv_head: int, q: np.ndarray, n_ctx: int) -> Tuple[np.ndarray, List[Dict[str, Any]]]:
        """Attention of the ``(group, head_dim)`` float32 queries sharing ``kv_head`` over
        ``[0, n_ctx)``: the outputs and one meter cell per head (``raw``, ``meter``, ``v_meter``,
        ``output_bound``, ``repaired``, ...)."""
        return self._c.attend(int(layer), int(kv_head), q, int(n_ctx))

    def write_rows(self, layer: int, pos0: int, k: Any, v: Any) -> None:
        """Stores positions ``[pos0, pos0 + T)`` of every KV head of ``layer`` at once: ``k`` and ``v``
        are ``(kv_heads, T, head_dim)`` (numpy or torch; float32 is read in place, another float
        dtype is rounded to float32 first). Positions of each (layer, KV head) are written in order.
        A registered scheme's function runs here, once per KV head."""
        k32, v32 = _arrays.float32(k, "k"), _arrays.float32(v, "v")
        hats = {side: self._reconstruct(self._names[side], fn, k if side == "kv" else v, k32 if side == "kv" else v32)
                for side, fn in self._quantize.items()}
        self._c.write_rows(int(layer), int(pos0), k32, v32, hats.get("kv"), hats.get("kv_v"))

    @staticmethod
    def _reconstruct(name: str, fn: Quantize, given: Any, x: np.ndarray) -> np.ndarray:
        # The function sees what the caller gave, as float32: a torch tensor for torch, numpy otherwise.
        rows = []
        for h in range(x.shape[0]):
            head = _arrays.as_given(given, x[h])
            r = _arrays.float32(fn(head), f"scheme {name!r}'s reconstruction")
            if r.shape != x[h].shape:
                raise ValueError(f"scheme {name!r} returned shape {tuple(r.shape)} for keys {tuple(x[h].shape)}")
            rows.append(r)
        return np.ascontiguousarray(np.stack(rows))

    def attend_rows(self, layer: int, q: Any, pos0: int, begin: int = 0,
                    window: int = 0) -> Tuple[np.ndarray, "Cells"]:
        """Causal attention of the queries ``q`` ``(q_heads, T, head_dim)`` at positions ``[pos0,
        pos0 + T)``, each over ``[begin, its position]`` (``begin``: a left-padded row's padding; a
        query inside the padding attends to itself only, its output unused) and, with ``window > 0``,
        over the last ``window`` positions only (a sliding-window layer: key ``t`` is seen while
        ``position - t < window``), with the gate's repairs: the outputs ``(q_heads, T, head_dim)``
        float32 and the cells (:class:`Cells`, arrays ``(q_heads, T)``). The GIL is released while
        it runs."""
        if window < 0:
            raise ValueError(f"window must be >= 0 (0: none), got {window}")
        out, cells = self._c.attend_rows(int(layer), _arrays.float32(q, "q"), int(pos0), int(begin), int(window))
        return out, Cells(**cells)

    def report_start(self, first_pos: int) -> None:
        """Starts the report over: it summarises the cells at positions ``>= first_pos`` (the prompt's
        length, so that the report counts decode steps as a server response does)."""
        self._c.report_start(int(first_pos))

    def report(self) -> Dict[str, Any]:
        """The request's ``witcert`` object, the one a ``witcert serve`` response carries: formats,
        gate, cells, coverage, raw-score quantiles, worst cells, page-ins, verdict and reason."""
        report = json.loads(self._c.report())
        for side, key in (("kv", "kv"), ("kv_v", "kv_v")):
            if side in self._names and report.get(key) == "external":
                report[key] = self._names[side]
        return report

    def keep_cells(self, keep: bool = True) -> None:
        """From now on (``keep``) also keep every cell :meth:`report` counts, for :meth:`drain_cells`."""
        self._c.keep_cells(bool(keep))

    def drain_cells(self) -> np.ndarray:
        """The cells kept since :meth:`keep_cells` or the last drain, as a structured array (layer,
        q_head, pos, raw, meter, v_meter, output_bound, the values before the step's repair, tv and
        v_true under the soundness check, repaired), for a :class:`Report` kept elsewhere."""
        return self._c.drain_cells()

    def stats(self) -> Dict[str, int]:
        """Page-ins and their bytes, and the pool's pages and measured bytes."""
        return self._c.stats()

    def close(self) -> None:
        """Frees the cache and its pool now (also when the object is collected)."""
        self._c = _Closed("Cache")  # type: ignore[assignment]

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(frozen=True)
class Cells:
    """The meter cells of :meth:`Cache.attend_rows`: arrays ``(q_heads, T)``. ``raw`` is the e-form
    before repair (``inf``: no guarantee), ``meter`` the K meter and ``v_meter`` the V meter as
    served, ``output_bound`` the bound on the head's output error, ``repaired`` whether the gate
    repaired pages for the cell before serving it."""

    raw: np.ndarray
    meter: np.ndarray
    v_meter: np.ndarray
    output_bound: np.ndarray
    repaired: np.ndarray


class Report:
    """A request's report kept apart from its cache: cells drained from caches (another process's,
    or each tensor-parallel rank's, with the model's head numbers) counted into the ``witcert``
    object :meth:`Cache.report` writes. ``options`` are the caches' (``kv``, ``tau_k``, ...), for
    ``layers`` × ``q_heads`` cells a step at positions ≥ ``first_pos``."""

    def __init__(self, layers: int, q_heads: int, first_pos: int = 0, **options: Any):
        self._r = _witcert.Report(json.dumps(options), int(layers), int(q_heads), int(first_pos))

    def record(self, cells: np.ndarray) -> None:
        """Counts cells (:meth:`Cache.drain_cells`' array); a batch with an impossible cell raises
        ``ValueError`` naming it, and none of it is counted."""
        self._r.record(cells)

    def add_page_ins(self, page_ins: int, page_in_bytes: int) -> None:
        self._r.add_page_ins(int(page_ins), int(page_in_bytes))

    def object(self) -> Dict[str, Any]:
        """The ``witcert`` object of the cells counted."""
        return json.loads(self._r.json())


TokenCallback = Callable[[int, bytes, Optional[Dict[str, float]]], Optional[bool]]


class Engine:
    """A GGUF model (llama architecture) on the CPU, generating over a certified cache."""

    def __init__(self, path: str, threads: int = 2):
        self._e = _witcert.Engine(str(path), int(threads))

    def tokenize(self, text: str, chat: bool = False) -> List[int]:
        """The token ids of ``text`` (``chat``: wrapped as one user turn of the chat template)."""
        return self._e.tokenize(text, bool(chat))

    def generate(self, prompt: str, *, kv: Optional[str] = None, tau_k: Optional[float] = None,
                 max_tokens: int = 64, on_token: Optional[TokenCallback] = None, **options: Any) -> Dict[str, Any]:
        """Generates from ``prompt``. ``kv``/``tau_k`` and further options (``kv_v``, ``tau_v``,
        ``granularity``, ``chat``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``coverage_tau``, ...)
        are those of ``witcert generate``. ``on_token(token, piece, step_meter)`` sees each token;
        returning True cancels. Returns ``text``, ``tokens``, ``prompt_tokens``,
        ``completion_tokens``, ``finish_reason`` and ``meter`` (the request's summary: cells,
        coverage, raw-score median, p90 and max, page-ins; ``None`` for the plain cache)."""
        req: Dict[str, Any] = dict(options)
        req["max_tokens"] = int(max_tokens)
        if kv is not None:
            req["kv"] = kv
        if tau_k is not None:
            req["tau_k"] = tau_k
        return self._e.generate(prompt, json.dumps(req), on_token)
