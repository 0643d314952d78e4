// What the CPU kernels (cpu_decode.cc, cpu_matmul.cc) share: splitting a call's work over
// XLA's intra-op thread pool.
#ifndef JAXSERVE_CPU_POOL_H_
#define JAXSERVE_CPU_POOL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

namespace ffi = xla::ffi;

// Runs fn(begin, end) over [0, items) split into contiguous ranges of about equal cost on XLA's
// intra-op pool (this thread takes the first); cost[i] is item i's work, in any unit.
template <typename Fn>
void SplitByCost(ffi::ThreadPool& pool_threads, const std::vector<int64_t>& cost, int64_t min_cost,
                 Fn fn) {
  const int64_t items = static_cast<int64_t>(cost.size());
  int64_t total = 0;
  for (int64_t c : cost) total += c;
  int64_t workers = std::max<int64_t>(1, pool_threads.num_threads());
  workers = std::min<int64_t>({workers, std::max<int64_t>(1, total / min_cost), items});
  if (workers <= 1) {
    fn(0, items);
    return;
  }
  std::vector<int64_t> bounds(workers + 1, items);
  bounds[0] = 0;
  int64_t acc = 0, w = 1;
  for (int64_t i = 0; i < items && w < workers; ++i) {
    acc += cost[i];
    if (acc * workers >= total * w) bounds[w++] = i + 1;
  }
  std::atomic<int64_t> pending{workers - 1};
  for (int64_t k = 1; k < workers; ++k) {
    const int64_t b = bounds[k], e = bounds[k + 1];
    pool_threads.Schedule([&fn, &pending, b, e] {
      fn(b, e);
      pending.fetch_sub(1, std::memory_order_release);
    });
  }
  fn(bounds[0], bounds[1]);
  while (pending.load(std::memory_order_acquire) > 0) std::this_thread::yield();
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_POOL_H_
