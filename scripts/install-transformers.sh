#!/usr/bin/env bash
# Installs what witcert.transformers and its tests need into the checkout's .venv, from PyPI:
# torch (PyPI's build carries CUDA libraries: about 5 GB, once), transformers and accelerate, pinned.
# Idempotent: nothing is downloaded when they import at these versions.
set -euo pipefail
cd "$(dirname "$0")/.."
readonly packages=("torch==2.15.0" "transformers==5.25.0" "accelerate==1.16.0")
[ -x .venv/bin/python ] || scripts/install-deps.sh
if .venv/bin/python - <<'PY' 2>/dev/null; then
import accelerate, torch, transformers
assert (torch.__version__.split("+")[0], transformers.__version__, accelerate.__version__) == ("2.15.0", "5.25.0", "1.16.0")
PY
  echo "install-transformers: ${packages[*]} present"
  exit 0
fi
echo "install-transformers: installing ${packages[*]} into .venv"
.venv/bin/pip install -q "${packages[@]}"
