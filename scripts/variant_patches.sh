#!/usr/bin/env bash
# Writes the patches scripts/gpu_variants.sh measures: variants/NAME.patch for each NAME=BRANCH[+BRANCH...]
# argument, the diffs of main...BRANCH in turn (each branch's own change; a later branch's diff must apply on top of
# the earlier ones'). Empties variants/ first and checks that each patch applies to the working tree.
#   bash scripts/variant_patches.sh B=wip/decode-bulk-rows BT=wip/decode-bulk-rows+wip/decode-merge-two-pass
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -gt 0 ]] || { echo "usage: $0 NAME=BRANCH[+BRANCH...] ..."; exit 2; }
rm -rf variants && mkdir -p variants
for spec in "$@"; do
  name=${spec%%=*} branches=${spec#*=}
  [[ $name != "$spec" && -n $name && -n $branches ]] || { echo "not NAME=BRANCH[+BRANCH...]: $spec"; exit 2; }
  : > "variants/$name.patch"
  IFS=+ read -ra list <<< "$branches"
  for branch in "${list[@]}"; do git diff "main...$branch" >> "variants/$name.patch"; done
  git apply --check "variants/$name.patch" || { echo "$name: does not apply to the working tree"; exit 1; }
  echo "$name: $(git apply --numstat "variants/$name.patch" | cut -f3 | sort -u | wc -l) files"
done
