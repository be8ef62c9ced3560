#!/usr/bin/env bash
# Exports git refs as plain trees under snapshots/ (ignored by git), for scripts/gpu_compare.sh
# to build and measure side by side on the GPU machine (which gets the working tree, not the
# history). Usage: bash scripts/snapshot.sh NAME=REF [NAME=REF ...]; then `run` with
# carry ["snapshots"] and the command `bash scripts/gpu_compare.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf snapshots
for spec in "$@"; do
  name=${spec%%=*} ref=${spec#*=}
  mkdir -p "snapshots/$name"
  git archive "$ref" | tar -x -C "snapshots/$name"
  echo "snapshots/$name <- $(git rev-parse --short "$ref")"
done
du -sh snapshots | cut -f1
