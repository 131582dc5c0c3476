#!/usr/bin/env bash
# The corpus of `witcert eval` (docs/EVALUATION.md), real text nobody in this project wrote, into
# data/eval/ with checksums; nothing is committed.
#   prose: licence texts from Debian's base-files (/usr/share/common-licenses), which permit
#          verbatim copies;
#   code:  the Python sources of requests 2.32.3 (Apache-2.0), its PyPI source distribution.
# Idempotent: files already there with the right checksum are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
out=data/eval
mkdir -p "$out/prose" "$out/code"

check() {  # file sha256
  echo "$2  $1" | sha256sum --quiet -c - || { echo "fetch-eval-data: $1 has the wrong SHA-256" >&2; exit 1; }
}

while read -r name sum; do
  dst=$out/prose/$name.txt
  [ -f "$dst" ] || cp "/usr/share/common-licenses/$name" "$dst"
  check "$dst" "$sum"
done <<'LIST'
GPL-3 3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986
GFDL-1.3 110535522396708cea37c72a802c5e7e81391139f5f7985631c93ef242b206a4
Apache-2.0 cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30
MPL-2.0 fab3dd6bdab226f1c08630b1dd917e11fcb4ec5e1e020e2c16f83a0a13863e85
LGPL-2.1 dc626520dcd53a22f727af3ee42c770e56c97a64fe3adb063799d8ab032fe551
Artistic b7fd9b73ea99602016a326e0b62e6646060d18febdd065ceca8bb482208c3d88
LIST

if [ ! -f "$out/code/.complete" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps --no-binary :all: requests==2.32.3 -d "$tmp"
  check "$tmp/requests-2.32.3.tar.gz" 55365417734eb18255590a9ff9eb97e9e1da868d4ccd6402399eaf68af20a760
  tar -xzf "$tmp/requests-2.32.3.tar.gz" -C "$tmp"
  for f in "$tmp"/requests-2.32.3/src/requests/*.py; do cp "$f" "$out/code/$(basename "$f" .py).py.txt"; done
  touch "$out/code/.complete"
fi
echo "fetch-eval-data: $(ls "$out/prose" | wc -l) prose and $(ls "$out/code" | wc -l) code files under $out"
