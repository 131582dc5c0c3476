#!/usr/bin/env bash
# The vLLM plugin's tests (python/tests/vllm, all marked slow): builds .venv-vllm with this checkout's
# package (scripts/install-vllm.sh), writes SmolLM2 as a Hugging Face directory from the project's
# GGUF (vLLM's CPU build loads only that form), and runs pytest in .venv-vllm. About 3 minutes
# after the install.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${WITCERT_SETUP_DONE:-}" ]; then
  scripts/install-deps.sh
  scripts/fetch-model.sh
fi
scripts/install-transformers.sh  # tools/gguf_to_hf.py runs in .venv
scripts/install-vllm.sh
.venv/bin/python tools/gguf_to_hf.py models/SmolLM2-135M-Instruct.Q4_1.gguf models/SmolLM2-135M-Instruct-hf
WITCERT_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q -m slow python/tests/vllm
