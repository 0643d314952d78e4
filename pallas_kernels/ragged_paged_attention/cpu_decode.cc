// Decode attention over the paged KV pool for XLA:CPU, as an XLA FFI custom call.
//
// One query per sequence slot reads its own context's keys and values once, straight from the
// pool's pages: no gather into a block, no transpose into a matmul layout (in the jnp decode
// loop those two copies are most of the attention's time; see xla_blocked.py). Work is split
// over (sequence slot, KV head) pairs on XLA's intra-op thread pool.
//
// Built on first use by cpu_ffi.py (g++ -O3 -march=native); the jnp path stays the fallback.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Shape {
  int64_t num_slots, num_kv_heads, group, head_dim;  // q: [S, Hkv, g, d]
  int64_t num_layers, num_pages, page_size, lanes;   // pool: [L, P, page_size, lanes]
  int64_t pages_per_seq;                             // page_tables: [S, pages_per_seq]
};

#if defined(__AVX512F__)
// AttendOne for head_dim = 16 * NC: each query head's vectors and its output accumulator stay in
// registers, a key's dot product reduces independently of the next (no dependency chain).
template <int NC>
void AttendVec(const Shape& s, const float* q, const float* layer_base, const int32_t* table,
               int32_t lowest, int64_t n, float sm_scale, int64_t kv_head, float* out,
               float* scores) {
  const int64_t g = s.group, d = s.head_dim, ps = s.page_size, lanes = s.lanes;
  const int64_t k_off = kv_head * 2 * d, v_off = k_off + d;
  for (int64_t h = 0; h < g; ++h) {
    __m512 qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + h * d + 16 * c),
                                                      _mm512_set1_ps(sm_scale));
    float* sh = scores + h * n;
    float mx = -INFINITY;
    for (int64_t i = 0; i < n;) {
      const int64_t pos = lowest + i;
      const float* row = layer_base + (table[pos / ps] * ps + pos % ps) * lanes + k_off;
      const int64_t run = std::min<int64_t>(ps - pos % ps, n - i);  // keys left on this page
      for (int64_t k = 0; k < run; ++k, row += lanes) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(row), qv[0]);
        for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(row + 16 * c), qv[c], acc);
        const float sc = _mm512_reduce_add_ps(acc);
        sh[i + k] = sc;
        mx = std::max(mx, sc);
      }
      i += run;
    }
    float denom = 0.0f;
#pragma omp simd reduction(+ : denom)
    for (int64_t i = 0; i < n; ++i) {
      sh[i] = std::exp(sh[i] - mx);
      denom += sh[i];
    }
    __m512 ov[NC];
    for (int c = 0; c < NC; ++c) ov[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n;) {
      const int64_t pos = lowest + i;
      const float* row = layer_base + (table[pos / ps] * ps + pos % ps) * lanes + v_off;
      const int64_t run = std::min<int64_t>(ps - pos % ps, n - i);
      for (int64_t k = 0; k < run; ++k, row += lanes) {
        const __m512 p = _mm512_set1_ps(sh[i + k]);
        for (int c = 0; c < NC; ++c) ov[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(row + 16 * c), ov[c]);
      }
      i += run;
    }
    const __m512 inv = _mm512_set1_ps(1.0f / denom);
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + h * d + 16 * c, _mm512_mul_ps(ov[c], inv));
  }
}
#endif

// One (slot, KV head): the g queries of that head against keys [lowest, kv_len) of the slot.
void AttendOne(const Shape& s, const float* q, const float* pool, int64_t layer,
               const int32_t* table, int32_t kv_len, int32_t lowest, float sm_scale,
               int64_t kv_head, float* out, std::vector<float>& scores) {
  const int64_t g = s.group, d = s.head_dim;
  if (kv_len <= 0) {
    std::fill(out, out + g * d, 0.0f);
    return;
  }
  lowest = std::max<int32_t>(lowest, 0);
  const int64_t n = kv_len - lowest;
  scores.resize(g * n);
  const float* layer_base = pool + layer * s.num_pages * s.page_size * s.lanes;
#if defined(__AVX512F__)
  switch (d) {
    case 64: return AttendVec<4>(s, q, layer_base, table, lowest, n, sm_scale, kv_head, out, scores.data());
    case 128: return AttendVec<8>(s, q, layer_base, table, lowest, n, sm_scale, kv_head, out, scores.data());
    case 256: return AttendVec<16>(s, q, layer_base, table, lowest, n, sm_scale, kv_head, out, scores.data());
    default: break;
  }
#endif
  const int64_t k_off = kv_head * 2 * d, v_off = k_off + d;
  // Scores: every key of the context, for the g heads at once (the key row read once).
  for (int64_t pos = lowest; pos < kv_len; ++pos) {
    const int64_t page = table[pos / s.page_size];
    const float* row = layer_base + (page * s.page_size + pos % s.page_size) * s.lanes + k_off;
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = q + h * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < d; ++j) dot += qh[j] * row[j];
      scores[h * n + (pos - lowest)] = dot * sm_scale;
    }
  }
  for (int64_t h = 0; h < g; ++h) {
    float* sh = scores.data() + h * n;
    float mx = sh[0];
    for (int64_t i = 1; i < n; ++i) mx = std::max(mx, sh[i]);
    float denom = 0.0f;
#pragma omp simd reduction(+ : denom)
    for (int64_t i = 0; i < n; ++i) {
      sh[i] = std::exp(sh[i] - mx);
      denom += sh[i];
    }
    const float inv = 1.0f / denom;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) sh[i] *= inv;
  }
  std::fill(out, out + g * d, 0.0f);
  for (int64_t pos = lowest; pos < kv_len; ++pos) {
    const int64_t page = table[pos / s.page_size];
    const float* row = layer_base + (page * s.page_size + pos % s.page_size) * s.lanes + v_off;
    for (int64_t h = 0; h < g; ++h) {
      const float p = scores[h * n + (pos - lowest)];
      float* oh = out + h * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) oh[j] += p * row[j];
    }
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> kv_pool, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> kv_lens,
                           ffi::Buffer<ffi::S32> lowest, float sm_scale,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto pd = kv_pool.dimensions();
  if (qd.size() != 4 || pd.size() != 4 || page_tables.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("decode attention: q must be 4-d, the pool 4-d, the "
                                       "page tables 2-d");
  }
  Shape s{qd[0], qd[1], qd[2], qd[3], pd[0], pd[1], pd[2], pd[3], page_tables.dimensions()[1]};
  if (2 * s.num_kv_heads * s.head_dim > s.lanes) {
    return ffi::Error::InvalidArgument("decode attention: the pool's lanes hold fewer than 2 * "
                                       "num_kv_heads * head_dim values");
  }
  const int64_t lyr = layer.typed_data()[0];
  const float* qp = q.typed_data();
  const float* pp = kv_pool.typed_data();
  const int32_t* tp = page_tables.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* low = lowest.typed_data();
  float* op = out->typed_data();
  const int64_t items = s.num_slots * s.num_kv_heads;
  const int64_t per = s.group * s.head_dim;
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = i / s.num_kv_heads, head = i % s.num_kv_heads;
      AttendOne(s, qp + i * per, pp, lyr, tp + slot * s.pages_per_seq, lens[slot], low[slot],
                sm_scale, head, op + i * per, scores);
    }
  };
  // Split by keys to read, not by items: rows' contexts differ by up to max_model_len. A worker
  // takes at least kMinKeysPerWorker (slot, KV head, key) triples; fewer do not pay for a task.
  constexpr int64_t kMinKeysPerWorker = 1024;
  int64_t total = 0;
  for (int64_t slot = 0; slot < s.num_slots; ++slot) total += std::max(lens[slot], 0);
  int64_t workers = std::max<int64_t>(1, pool_threads.num_threads());
  workers = std::min<int64_t>(workers, std::max<int64_t>(1, total * s.num_kv_heads / kMinKeysPerWorker));
  workers = std::min(workers, items);
  if (workers <= 1) {
    run(0, items);
    return ffi::Error::Success();
  }
  std::vector<int64_t> bounds(workers + 1, items);
  bounds[0] = 0;
  int64_t acc = 0, w = 1;
  for (int64_t i = 0; i < items && w < workers; ++i) {
    acc += std::max(lens[i / s.num_kv_heads], 0);
    if (acc * workers >= total * s.num_kv_heads * w) bounds[w++] = i + 1;
  }
  std::atomic<int64_t> pending{workers - 1};
  for (int64_t k = 1; k < workers; ++k) {
    const int64_t b = bounds[k], e = bounds[k + 1];
    pool_threads.Schedule([&run, &pending, b, e] {
      run(b, e);
      pending.fetch_sub(1, std::memory_order_release);
    });
  }
  run(bounds[0], bounds[1]);
  while (pending.load(std::memory_order_acquire) > 0) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [S, Hkv, g, d], unscaled
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool [L, P, page, lanes]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page tables [S, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_len [S]; 0: not decoding
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lowest position [S]
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [S, Hkv, g, d]
