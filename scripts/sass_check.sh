#!/usr/bin/env bash
# Counts, per tensor-core kernel of the built extension, the instructions that say whether the
# inner loops are what they should be: HMMA / DMMA (tensor cores), LDSM (ldmatrix), LDGSTS
# (cp.async), and LDL / STL (register spills). Needs cuobjdump (on the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
so=$(python3 -c 'import flashattn_ext._C as c; print(c.__file__)')
cuobjdump -sass "$so" | awk '
  /Function :/ { fn = $3; next }
  fn ~ /sm80/ {
    for (i = 1; i <= NF; ++i) {
      op = $i; sub(/\..*/, "", op)
      if (op ~ /^(HMMA|DMMA|LDSM|LDGSTS|LDL|STL)$/) count[fn " " op]++
    }
  }
  END { for (k in count) print k, count[k] }' | c++filt | sort
