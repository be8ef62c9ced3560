// The write-out of the split walks' dK / dV (tail_split.cuh), compiled once for the build: every
// 2-D dK/dV tier launches the same two kernels (fp16, bf16).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tail_split.cuh"

namespace flashattn::cuda {

template <class Elem>
__global__ void store_tail_dkdv_kernel(const BwdParams p, const KeyTileRound round, int kBN) {
  const TailSplit& t = round.tail;
  const TileBlock blk = tile_block(round.groups, 1, p.heads_kv, /*heaviest_first=*/false, t.whole + blockIdx.x);
  const Seq sq = plain_sequence(p, blk.batch);
  const int64_t n0 = int64_t(round.first + blk.tile) * kBN;
  const int rows_k = sq.k_tile_rows(n0, kBN);
  const int E = int(p.head_dim), Ev = int(p.head_dim_v);
  const float* dk_t = t.dkdv + int64_t(blockIdx.x) * kBN * (E + Ev);
  const float* dv_t = dk_t + kBN * E;
  Elem* dk = sq.k_rows<Elem>(p.dk, p.dk_stride, blk.head, n0);
  Elem* dv = sq.k_rows<Elem>(p.dv, p.dv_stride, blk.head, n0);
  // Pairs of columns (head dims are even: the tile copies need 16-byte rows).
  for (int i = threadIdx.x; i < rows_k * E / 2; i += blockDim.x) {
    const int key = i / (E / 2), col = 2 * (i % (E / 2));
    Mma<Elem>::store_pair(dk + key * p.dk_stride.row + col, dk_t[key * E + col], dk_t[key * E + col + 1]);
  }
  for (int i = threadIdx.x; i < rows_k * Ev / 2; i += blockDim.x) {
    const int key = i / (Ev / 2), col = 2 * (i % (Ev / 2));
    Mma<Elem>::store_pair(dv + key * p.dv_stride.row + col, dv_t[key * Ev + col], dv_t[key * Ev + col + 1]);
  }
}

template <class Elem>
void store_tail_dkdv(const BwdParams& p, const KeyTileRound& round, int kBN, cudaStream_t stream) {
  store_tail_dkdv_kernel<Elem><<<round.tail.walks, 128, 0, stream>>>(p, round, kBN);
  check_launch("sm80::store_tail_dkdv_kernel");
}

template void store_tail_dkdv<__half>(const BwdParams&, const KeyTileRound&, int, cudaStream_t);
template void store_tail_dkdv<__nv_bfloat16>(const BwdParams&, const KeyTileRound&, int, cudaStream_t);

}  // namespace flashattn::cuda
