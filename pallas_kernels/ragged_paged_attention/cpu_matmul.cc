// A float32 matmul for XLA:CPU over weights packed once at load, as an XLA FFI custom call.
//
// XLA:CPU's dot (Eigen) packs both operands into its own panels on every call. In a decode step
// of 16-64 rows the weights are read from memory once per step anyway, and that repacking (a
// second read and a write of every weight) costs about as much as the multiply: smollm2-135m's
// 30 layers took 20.3 ms at 16 rows and 48.8 at 64 through XLA, 14.8 and 36.3 in this kernel
// (docs/benchmarks.md). The weights arrive packed as [N / 64, K, 64]: panel p holds output
// columns [64p, 64p + 64) for every k, contiguous, so the weights stream from memory in order.
// How a panel is cut along k depends on the core (the caller's k_block, cpu_ffi.matmul_k_block):
// on Intel's, a block of 64 k at a time that every row tile reads from L1 while the next is
// prefetched; on AMD's Zen 4, where that was slower, whole-K tiles that stream each row of x in
// order with the panel in L2.
//
// Each output element is one chain of fused multiply-adds over k in order, whatever the number
// of rows or how they are split into blocks and threads: a row's result does not depend on the
// batch it is in (batch invariance), and it is the same on every run.
//
// A grouped variant (GroupedPackedMatmul) runs a mixture of experts' rows, sorted by expert, each
// run of rows through the same row kernel against its own expert's panels.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::SplitByCost;

constexpr int64_t kLanes = 64;      // output columns per panel (four 16-float vectors)
constexpr int64_t kRowBlock = 6;    // rows per register tile: 6 x 4 accumulators
constexpr int64_t kGroupRows = 48;  // rows per work item (eight tiles), one panel each

#if defined(__AVX512F__)
// out[r, 0:64] (+)= sum_{k < K} a[r, k] * panel[k, 0:64] for MR rows (a: lda apart; out: ldc
// apart), from zero where first, else from what out holds (a k block of a longer sum); on the
// way, the pf_lines 64-byte lines from pf on are prefetched into L1, spread over the k steps.
template <int MR>
inline void Tile(const float* a, int64_t lda, const float* panel, int64_t K, float* out,
                 int64_t ldc, bool first, const char* pf, int64_t pf_lines) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < 4; ++i)
      acc[r][i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * ldc + 16 * i);
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t line = k; line < pf_lines; line += K) _mm_prefetch(pf + 64 * line, _MM_HINT_T0);
    const float* b = panel + k * kLanes;
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
    const __m512 b2 = _mm512_loadu_ps(b + 32), b3 = _mm512_loadu_ps(b + 48);
    for (int r = 0; r < MR; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + k]);
      acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(av, b2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(av, b3, acc[r][3]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + r * ldc + 16 * i, acc[r][i]);
}

// Rows [m0, m1) of x against one panel, in tiles of kRowBlock rows and one of the rest. With
// k_block > 0, a block of k_block k at a time, while the next block (the next panel's first,
// after the last; weights end at w_end) is prefetched a share per tile: a whole-K tile at a time
// left a Xeon's memory idle while the later tiles computed and the compute idle while the first
// waited on memory (at 6-64 rows, 64 k a block is 1.2-1.45x faster on one of its cores). With
// k_block 0, whole-K tiles and no prefetch: on a Zen 4 EPYC the blocks cost 1.1-1.2x at 64-256
// rows (docs/benchmarks.md). The float32 partial sums go through out unrounded, so each element
// is one chain of FMAs over k in order either way: the same bits.
void PanelRows(const float* x, int64_t m0, int64_t m1, int64_t K, const float* panel, float* out,
               int64_t N, const float* w_end, int64_t k_block) {
  const int64_t tiles = (m1 - m0 + kRowBlock - 1) / kRowBlock;
  const int64_t block = k_block > 0 ? k_block : K;
  for (int64_t k0 = 0; k0 < K; k0 += block) {
    const int64_t kb = std::min(block, K - k0);
    const float* p = panel + k0 * kLanes;
    const bool first = k0 == 0;
    const float* next = p + kb * kLanes;
    const int64_t lines =  // 16 floats a line
        k_block > 0 ? std::clamp<int64_t>((w_end - next) / 16, 0, k_block * 4) : 0;
    const int64_t share = (lines + tiles - 1) / tiles;
    const char* pf = reinterpret_cast<const char*>(next);
    int64_t m = m0, t = 0;
    for (; m + kRowBlock <= m1; m += kRowBlock, ++t) {
      const int64_t n = std::clamp<int64_t>(lines - t * share, 0, share);
      Tile<6>(x + m * K + k0, K, p, kb, out + m * N, N, first, pf + 64 * t * share, n);
    }
    const float* a = x + m * K + k0;
    float* o = out + m * N;
    const char* q = pf + 64 * t * share;
    const int64_t n = std::clamp<int64_t>(lines - t * share, 0, share);
    switch (m1 - m) {
      case 5: Tile<5>(a, K, p, kb, o, N, first, q, n); break;
      case 4: Tile<4>(a, K, p, kb, o, N, first, q, n); break;
      case 3: Tile<3>(a, K, p, kb, o, N, first, q, n); break;
      case 2: Tile<2>(a, K, p, kb, o, N, first, q, n); break;
      case 1: Tile<1>(a, K, p, kb, o, N, first, q, n); break;
      default: break;
    }
  }
}
#else
// The same sums without AVX-512, one fused multiply-add at a time (the model takes this call
// only where the CPU has AVX-512; this keeps the library buildable and exact elsewhere).
void PanelRows(const float* x, int64_t m0, int64_t m1, int64_t K, const float* panel, float* out,
               int64_t N, const float*, int64_t) {
  for (int64_t m = m0; m < m1; ++m) {
    float acc[kLanes] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float a = x[m * K + k];
      for (int64_t j = 0; j < kLanes; ++j) acc[j] = std::fma(a, panel[k * kLanes + j], acc[j]);
    }
    std::copy(acc, acc + kLanes, out + m * N);
  }
}
#endif

// "[2, 3]": an operand's dimensions, for the messages that refuse it.
std::string Dims(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

ffi::Error PackedMatmul(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> valid,
                        ffi::ResultBuffer<ffi::F32> out, int64_t k_block) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || od.size() != 2 || wd[2] != kLanes ||
      wd[1] != xd[1] || od[0] != xd[0] || od[1] != wd[0] * kLanes) {
    return ffi::Error::InvalidArgument(
        "jaxserve_packed_matmul takes x [M, K], packed weights [N / 64, K, 64] and out [M, N]; "
        "got x " + Dims(xd) + ", weights " + Dims(wd) + ", out " + Dims(od) + ".");
  }
  if (valid.element_count() != 1) {
    return ffi::Error::InvalidArgument("jaxserve_packed_matmul takes the number of real rows as "
                                       "one int32; got " + std::to_string(valid.element_count()) +
                                       " values.");
  }
  if (k_block < 0) {
    return ffi::Error::InvalidArgument("jaxserve_packed_matmul's k_block is 0 (whole-K tiles) or "
                                       "the k per block of a panel; got " +
                                       std::to_string(k_block) + ".");
  }
  const int64_t K = xd[1], panels = wd[0], N = panels * kLanes;
  // Rows past the step's real tokens are its bucket's padding: they come back zero, uncomputed.
  // At these sizes the multiply is bound by the arithmetic, so a decode step of 49 sequences in
  // the 64-row bucket no longer pays for 64.
  // With K = 0 every sum is empty: every row is 0 (PanelRows would write none of them).
  const int64_t M = K > 0 ? std::clamp<int64_t>(valid.typed_data()[0], 0, xd[0]) : 0;
  std::fill(out->typed_data() + M * N, out->typed_data() + xd[0] * N, 0.0f);
  if (M == 0 || panels == 0) return ffi::Error::Success();
  const int64_t groups = (M + kGroupRows - 1) / kGroupRows;
  // Item i: panel i / groups, row group i % groups; a thread's consecutive items share a panel.
  std::vector<int64_t> cost(panels * groups);
  for (int64_t i = 0; i < panels * groups; ++i) {
    const int64_t g = i % groups, rows = std::min(kGroupRows, M - g * kGroupRows);
    cost[i] = rows * K * kLanes / 1024;  // thousands of multiply-adds
  }
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* op = out->typed_data();
  // Below ~256K multiply-adds (a few microseconds) a second thread costs more than it saves.
  SplitByCost(pool_threads, cost, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i / groups, g = i % groups;
      const int64_t m0 = g * kGroupRows, m1 = std::min(M, m0 + kGroupRows);
      PanelRows(xp, m0, m1, K, wp + p * K * kLanes, op + p * kLanes, N, wp + panels * K * kLanes,
                k_block);
    }
  });
  return ffi::Error::Success();
}

// A mixture-of-experts layer's grouped matmul: x's rows sorted by expert, group g's run of
// group_sizes[g] rows times expert g's packed weights (w [G, N / 64, K, 64]). XLA:CPU lowers
// ragged_dot to a dense dot masked per group, G times the multiply-adds; here each row is
// multiplied by its own expert's weights alone, and an expert without rows (most of them, in a
// decode step) is never read. The sizes are data: a negative one is 0, and the runs stop at M;
// the rows after the last run (the bucket's padding) come back 0. Each element is PanelRows's
// chain of FMAs, so a row's bits are packed_matmul's of that row alone against its expert.
ffi::Error GroupedPackedMatmul(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> group_sizes,
                               ffi::ResultBuffer<ffi::F32> out, int64_t k_block) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  const auto gd = group_sizes.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || od.size() != 2 || gd.size() != 1 || wd[3] != kLanes ||
      wd[2] != xd[1] || od[0] != xd[0] || od[1] != wd[1] * kLanes || gd[0] != wd[0]) {
    return ffi::Error::InvalidArgument(
        "jaxserve_grouped_packed_matmul takes x [M, K], packed weights [G, N / 64, K, 64], "
        "group sizes [G] and out [M, N]; got x " + Dims(xd) + ", weights " + Dims(wd) +
        ", group sizes " + Dims(gd) + ", out " + Dims(od) + ".");
  }
  if (k_block < 0) {
    return ffi::Error::InvalidArgument("jaxserve_grouped_packed_matmul's k_block is 0 (whole-K "
                                       "tiles) or the k per block of a panel; got " +
                                       std::to_string(k_block) + ".");
  }
  const int64_t M = xd[0], K = xd[1], G = wd[0], panels = wd[1], N = panels * kLanes;
  const int32_t* sizes = group_sizes.typed_data();
  // starts[g]: group g's first row; in int64, so sizes near INT32_MAX do not overflow the sum.
  std::vector<int64_t> starts(G + 1, 0);
  for (int64_t g = 0; g < G; ++g)
    starts[g + 1] = std::min<int64_t>(M, starts[g] + std::max<int32_t>(sizes[g], 0));
  float* op = out->typed_data();
  const int64_t used = K > 0 ? starts[G] : 0;  // with K = 0 every sum is empty: 0
  std::fill(op + used * N, op + M * N, 0.0f);
  if (used == 0 || panels == 0) return ffi::Error::Success();
  // Items (group, panel, chunk of kGroupRows rows) in that order, so a thread's consecutive items
  // share a panel; a group without rows has none.
  struct Item {
    int64_t group, panel, m0, m1;
  };
  std::vector<Item> items;
  std::vector<int64_t> cost;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t p = 0; p < panels; ++p)
      for (int64_t m0 = starts[g]; m0 < starts[g + 1]; m0 += kGroupRows) {
        const int64_t m1 = std::min(starts[g + 1], m0 + kGroupRows);
        items.push_back({g, p, m0, m1});
        cost.push_back((m1 - m0) * K * kLanes / 1024);  // thousands of multiply-adds
      }
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  const int64_t expert = panels * K * kLanes;  // floats of one group's weights
  SplitByCost(pool_threads, cost, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const float* we = wp + it.group * expert;
      // The prefetch stops at the group's own weights: the next expert's may have no rows.
      PanelRows(xp, it.m0, it.m1, K, we + it.panel * K * kLanes, op + it.panel * kLanes, N,
                we + expert, k_block);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGroupedPackedMatmul, GroupedPackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K], sorted by group
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [G, N / 64, K, 64]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group sizes [G]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N]
                                  .Attr<int64_t>("k_block"));  // 0: whole-K tiles

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [N / 64, K, 64]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // real rows [] (the rest: 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N]
                                  .Attr<int64_t>("k_block"));  // 0: whole-K tiles
