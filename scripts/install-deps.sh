#!/usr/bin/env bash
# Installs every build and test dependency of WitCert from Debian's packages.
# Idempotent and non-interactive: packages already present are left as they are.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libgtest-dev libgmock-dev libbenchmark-dev
  libhwy-dev nlohmann-json3-dev libcli11-dev libfmt-dev libboost-dev libcpp-httplib-dev libssl-dev zlib1g-dev libbrotli-dev
  python3 python3-pip python3-venv curl unzip ca-certificates
  prometheus chromium
  coq
  clang-14 libclang-rt-14-dev
  ccache
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
else
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The Python packages the tests drive (the `openai` client against `witcert serve`, numpy and
# pytest for the `witcert` package), matplotlib for `witcert eval`'s plots and gguf for the
# synthetic models of every architecture and their numpy reference (tools/), from PyPI into a
# virtual environment of the checkout, .venv.
cd "$(dirname "$0")/.."
readonly python_packages=("openai==1.109.1" "numpy==2.2.6" "pytest==8.4.2" "matplotlib==3.10.7" "gguf==0.19.0")
if ! .venv/bin/python -c "import openai, numpy, pytest, matplotlib, gguf" 2>/dev/null; then
  echo "install-deps: creating .venv with ${python_packages[*]}"
  python3 -m venv .venv
  .venv/bin/pip install -q "${python_packages[@]}"
fi
