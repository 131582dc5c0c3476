#!/usr/bin/env bash
# A new user's first command: installs every dependency, builds, and runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/fetch-model.sh
scripts/build.sh build
build/witcert selfcheck
