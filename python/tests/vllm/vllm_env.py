"""What the vLLM plugin's test modules share: vLLM itself (a module is skipped without it, unless
WITCERT_REQUIRE_VLLM, which scripts/vllm-test.sh sets, makes its absence a failure), the model
directory scripts/vllm-test.sh writes, and whether this CPU runs vLLM's fp8 cache."""
import os
from pathlib import Path

import pytest

if not os.environ.get("WITCERT_REQUIRE_VLLM"):
    pytest.importorskip("vllm")
import torch  # noqa: E402

MODEL = Path(os.environ.get("WITCERT_VLLM_MODEL", Path(__file__).resolve().parents[3] / "models" /
                            "SmolLM2-135M-Instruct-hf"))
# vLLM's fp8 KV cache on the CPU needs AVX-512 or AMX (its own check, at engine start).
FP8 = bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())
needs_fp8 = pytest.mark.skipif(not FP8, reason="vLLM's fp8 KV cache on the CPU needs AVX-512 or AMX")
