"""WitCert in vLLM: the meter and the gate on vLLM's own quantized KV cache, per request.

Turned on by naming the connector, with WitCert's options beside it (the names of ``witcert
generate``, the server and the C API)::

    vllm serve MODEL --kv-cache-dtype fp8 --no-enable-prefix-caching \\
      --kv-transfer-config '{"kv_connector": "WitCertConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": {"tau_k": 0.2}}'

The package's ``vllm.general_plugins`` entry point (:func:`register`) registers the connector and
wraps vLLM's CPU attention backend. With the connector on, every layer's attention also writes its
keys and values, exact and as vLLM stored them, into a WitCert cache per request, and meters each
decode step's (request, layer, head) cells in one call into the C++ core; with ``tau_k`` set, a cell
above τ is served from the exact keys and values instead (the gate). Each finished request carries
its ``witcert`` object, the one ``witcert serve`` returns, in ``kv_transfer_params["witcert"]``: on
``RequestOutput`` for the ``LLM`` API, in the JSON of an OpenAI response for ``vllm serve``. Without
the connector, the wrapped backend is vLLM's own. docs/vllm.md has the details and the limits.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["CONNECTOR", "register", "report", "kv_transfer_config"]

CONNECTOR = "WitCertConnector"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the connector by name and wraps the CPU
    attention backend (a pass-through while no WitCert connector is configured)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR, "witcert.vllm.connector", "WitCertConnector")
    register_backend(AttentionBackendEnum.CPU_ATTN, "witcert.vllm.backend.WitCertCPUBackend")


def kv_transfer_config(**options: Any) -> Dict[str, Any]:
    """The ``kv_transfer_config`` that turns WitCert on with ``options`` (``tau_k``, ``tau_v``,
    ``granularity``, ``check_soundness``, ...), for ``LLM(kv_transfer_config=...)``."""
    return {"kv_connector": CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": dict(options)}


def report(output: Any) -> Optional[Dict[str, Any]]:
    """The ``witcert`` object of a finished ``RequestOutput`` (None when WitCert was off)."""
    params = getattr(output, "kv_transfer_params", None) or {}
    return params.get("witcert")
