// What the CPU kernels (cpu_decode.cc, cpu_matmul.cc) share: splitting a call's work over
// XLA's intra-op thread pool.
#ifndef JAXSERVE_CPU_POOL_H_
#define JAXSERVE_CPU_POOL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

namespace ffi = xla::ffi;

// Chunks a call's items are cut into, per worker. One per worker leaves the whole call waiting on
// a thread the OS has taken away (a served engine shares its cores with the HTTP front's Python
// threads); with several, the threads still running claim the descheduled one's chunks.
inline constexpr int64_t kChunksPerWorker = 4;

// Runs fn(begin, end) over [0, items) cut into contiguous chunks of about equal cost, which this
// thread and up to pool_threads.num_threads() - 1 pool tasks claim in order until none is left;
// cost[i] is item i's work, in any unit, and a worker is only added per min_cost of it. Returns
// once every chunk has run.
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
  const int64_t chunks = std::min<int64_t>(items, workers * kChunksPerWorker);
  std::vector<int64_t> bounds(chunks + 1, items);
  bounds[0] = 0;
  int64_t acc = 0, c = 1;
  for (int64_t i = 0; i < items && c < chunks; ++i) {
    acc += cost[i];
    if (acc * chunks >= total * c) bounds[c++] = i + 1;
  }
  // A pool task may start after the last chunk is done and this call has returned: the counters
  // it reads are shared, and it touches bounds and fn only for a chunk it claimed, which this
  // call waits for.
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto work = [counters, chunks, &bounds, &fn] {
    for (int64_t k; (k = counters->next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      fn(bounds[k], bounds[k + 1]);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t k = 1; k < workers; ++k) pool_threads.Schedule([work] { work(); });
  work();
  while (counters->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_POOL_H_
