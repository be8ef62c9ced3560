#!/usr/bin/env bash
# Compile-only check of every .cu file for each target architecture, with no GPU and no CUDA
# build of torch: kernels include no torch header, so plain nvcc suffices. Fails on any error.
set -euo pipefail
cd "$(dirname "$0")/.."
export NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
if [ ! -x "$NVCC" ]; then echo "compile_cuda: nvcc not found" >&2; exit 1; fi
ARCHS=${ARCHS:-"75 80 86 89 90a 100 120"}  # sm_90a: the wgmma kernels (setup.py)
GENCODE=""
for a in $ARCHS; do GENCODE+=" -gencode=arch=compute_$a,code=sm_$a"; done
export GENCODE
export OBJDIR=$(mktemp -d)
trap 'rm -rf "$OBJDIR"' EXIT
# DEVICE_OPT=1: the device code optimized at -O1 (NVVM), not -O3: the same front end and the same PTX
# checked by ptxas for every architecture in half the time (the check compiles, nothing runs); ptxas's
# performance notes on that less optimized code (C75xx: setmaxnreg ignored, wgmma serialized) are dropped.
compile_one() {
  # The half/bfloat16 switches torch's extension build passes, so code that compiles here
  # compiles there.
  local opt="" log rc
  [ "${DEVICE_OPT:-3}" = 1 ] && opt="-Xcicc -O1"
  # shellcheck disable=SC2086
  log=$("$NVCC" -std=c++17 -O3 $opt --expt-relaxed-constexpr -Icsrc -D__CUDA_NO_HALF_OPERATORS__ \
    -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ $GENCODE \
    -c "$1" -o "$OBJDIR/$(echo "$1" | tr / _).o" 2>&1)
  rc=$?
  if [ -n "$opt" ]; then log=$(printf '%s\n' "$log" | grep -v "^ptxas info *: (C75[0-9][0-9])"); fi
  [ -z "$log" ] || printf '%s\n' "$1:" "$log"
  return $rc
}
export -f compile_one
files=$(find csrc/cuda -name '*.cu' | sort)
[ -n "$files" ] || { echo "compile_cuda: no .cu files"; exit 0; }
echo "compile_cuda: $(echo "$files" | wc -l) files for sm_[$ARCHS], ${MAX_JOBS:-$(nproc)} jobs"
start=$(date +%s)
echo "$files" | xargs -P "${MAX_JOBS:-$(nproc)}" -I{} bash -c 'compile_one "$1" || exit 255' _ {}
# Every flashattn function the objects call is defined by one of them or by the backend's plain C++ (plan.cpp,
# compiled here too): an instantiation missing from generate_kernels.py's table shows here, not when the
# extension is loaded on a GPU machine.
for cpp in csrc/cuda/*.cpp; do "${CXX:-c++}" -std=c++17 -Icsrc -c "$cpp" -o "$OBJDIR/$(echo "$cpp" | tr / _).o"; done
symbols() { nm -C "$@" "$OBJDIR"/*.o | sed -n 's/^[0-9a-f ]* [A-Za-z] //p' | grep 'flashattn::' | sort -u; }
missing=$(comm -23 <(symbols --undefined-only) <(symbols --defined-only))
if [ -n "$missing" ]; then printf 'compile_cuda: called, never defined:\n%s\n' "$missing"; exit 1; fi
echo "compile_cuda: ok in $(( $(date +%s) - start )) s"
