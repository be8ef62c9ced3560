"""How far above the ideal a causal grid's block order finishes, without a GPU: a list-scheduling
model of the benchmark grid (DESIGN.md section 5: B * L = 16384 tokens, H * E = 2048).

    python scripts/grid_model.py [--sms 132] [--overhead 1.5]

Each block costs its tiles (backward: the query tiles its key tile walks; forward: the key tiles
its query tile sees) plus `overhead` tiles of start and finish; the GPU's S = SMs x blocks per SM
slots each take the next block in grid order when free. Printed per head dim and L: the time of
the plain order (tile fastest, heaviest first, then head) and of csrc/cuda/schedule/causal_order.cuh's
order (the last pairs for two waves, tile slowest, where a pair has at most S / 2 tiles), both over
the ideal (the total work spread evenly). The model ignores L2 and a block running faster alone
on its SM; docs/kernels/sm80_backward.md gives the measurements.
"""
import argparse
import heapq
import math

# (pass, head dim): (query rows per tile, keys per tile, blocks per SM) of the sm80 kernels' plain calls.
TILES = {("bwd", 64): (128, 128, 1), ("bwd", 128): (64, 128, 1), ("bwd", 256): (64, 64, 1),
         ("fwd", 64): (128, 128, 2), ("fwd", 128): (128, 128, 2), ("fwd", 256): (64, 64, 2)}


def finish_time(costs, slots):
    """When the last of `costs` (in grid order) ends on `slots` slots taking the next block when free."""
    free = [0.0] * slots
    end = 0.0
    for c in costs:
        t = heapq.heappop(free) + c
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def pair_tiles(pass_, length, rows, keys):
    """Work of one (batch, head) pair's blocks, heaviest first: tiles walked or seen."""
    if pass_ == "bwd":  # key tile j walks the query tiles from its diagonal on
        return [length // rows - (j * keys) // rows for j in range(length // keys)]
    return [(i + 1) * rows / keys for i in range(length // rows)][::-1]  # query tile i sees i + 1 tiles of keys


def orders(pass_, dim, length, sms, overhead):
    rows, keys, per_sm = TILES[(pass_, dim)]
    slots = sms * per_sm
    pairs = (2048 // dim) * (16384 // length)
    work = [w + overhead for w in pair_tiles(pass_, length, rows, keys)]
    tiles = len(work)
    plain = work * pairs
    ideal = sum(plain) / slots
    heavy = min(pairs, math.ceil(2 * slots / tiles)) if 2 * tiles <= slots else 0
    ordered = work * (pairs - heavy) + [w for w in work for _ in range(heavy)]
    return finish_time(plain, slots) / ideal, finish_time(ordered, slots) / ideal, heavy


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--overhead", type=float, default=1.5, help="a block's fixed cost, in tiles")
    args = ap.parse_args()
    print("pass  E      L  plain / ideal  ordered / ideal  pairs reordered")
    for pass_, dim in TILES:
        for length in (512, 1024, 2048, 4096, 8192, 16384):
            plain, ordered, heavy = orders(pass_, dim, length, args.sms, args.overhead)
            print(f"{pass_}  {dim:3d} {length:6d}  {plain:13.3f}  {ordered:15.3f}  {heavy:15d}")


if __name__ == "__main__":
    main()
