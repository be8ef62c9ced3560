// Dynamic scheduling of independent tasks over torch's intra-op thread pool: one worker per
// thread pulls task indices from a shared counter, so uneven tasks (causal) balance out.
#pragma once
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

// make_worker() is called once per thread and returns a callable taking a task index; it
// owns that thread's scratch memory.
template <class MakeWorker>
void run_tasks(int64_t n_tasks, MakeWorker&& make_worker) {
  if (n_tasks <= 0) return;
  const int64_t n_workers = std::min<int64_t>(n_tasks, torch::stable::get_num_threads());
  std::atomic<int64_t> next{0};
  torch::stable::parallel_for(0, n_workers, 1, [&](int64_t begin, int64_t end) {
    if (begin >= end) return;
    auto work = make_worker();
    for (int64_t t = next++; t < n_tasks; t = next++) work(t);
  });
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
