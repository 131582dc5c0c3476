#!/usr/bin/env bash
# A new user's first command: installs every dependency, builds, and runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/fetch-model.sh
scripts/build.sh build
build/witcert selfcheck
echo
echo '$ build/witcert generate --chat --prompt "What is the capital of France?"'
build/witcert generate --chat --prompt "What is the capital of France?" --n 64
echo
echo '$ build/witcert demo'
build/witcert demo
