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
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::SplitByCost;

struct Shape {
  int64_t num_slots, num_kv_heads, group, head_dim;  // q: [S, Hkv, g, d]
  int64_t num_layers, num_pages, page_size, lanes;   // pool: [L, P, page_size, lanes]
  int64_t pages_per_seq;                             // page_tables: [S, pages_per_seq]
};

#if defined(__AVX512F__)
// e^x for 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error < 2e-7, about 1.5 ulp), then scaled by 2^n (scalef: underflows to 0 below
// about -104, as e^x does in float32).
inline __m512 Exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2's high part, exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);      // and its low part
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The 16 sums of a[0..15]'s lanes as one vector (lane k: the sum of a[k]'s 16 lanes), by a
// transpose-and-add tree: 45 shuffles and adds where 16 horizontal sums take about 130.
inline __m512 Sum16(const __m512* a) {
  __m512 quad[4];  // quad[i], 128-bit block j: partial sums of a[4i..4i+3] over a's block j
  for (int i = 0; i < 4; ++i) {
    const __m512* b = a + 4 * i;
    const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
    const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
    const __m512d p = _mm512_castps_pd(x01), r = _mm512_castps_pd(x23);
    quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, r)),
                            _mm512_castpd_ps(_mm512_unpackhi_pd(p, r)));
  }
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x88),
                                   _mm512_shuffle_f32x4(quad[0], quad[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x88),
                                   _mm512_shuffle_f32x4(quad[2], quad[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// One slot's KV heads [h0, h1) for head_dim = 16 * NC, page by page: each page's rows are read
// from memory once for every query head of those KV heads (a page of 16 rows is a few tens of
// KiB, so the query heads after the first read it from L1/L2), with an online softmax carried
// from page to page. Reading a slot's heads together matters more than any arithmetic here:
// one KV head at a time over the whole context read each row from memory once per KV head, at
// a quarter to a third of the bandwidth (see the notes in cpu_ffi.py). The next page is
// prefetched while this one is worked on, since the page table hides it from the hardware.
template <int NC>
void AttendSlotVec(const Shape& s, const float* q, const float* layer_base, const int32_t* table,
                   int64_t lowest, int64_t kv_len, float sm_scale, int64_t h0, int64_t h1,
                   float* out, float* state) {
  const int64_t g = s.group, d = s.head_dim, ps = s.page_size, lanes = s.lanes;
  const int64_t heads = (h1 - h0) * g;  // query heads of this call, from h0 * g
  float* mx = state;                    // running max per query head
  float* den = state + heads;           // running denominator per query head
  for (int64_t i = 0; i < heads; ++i) mx[i] = -INFINITY, den[i] = 0.0f;
  std::fill(out + h0 * g * d, out + h1 * g * d, 0.0f);
  const int64_t row_bytes = (h1 - h0) * 2 * d * sizeof(float);
  alignas(64) float sc[16];
  for (int64_t pos = lowest; pos < kv_len;) {
    const int64_t off = pos % ps, run = std::min<int64_t>(ps - off, kv_len - pos);
    const float* base = layer_base + (table[pos / ps] * ps + off) * lanes;
    if (pos + run < kv_len) {  // the next page's rows of these heads
      const int64_t next_rows = std::min<int64_t>(ps, kv_len - pos - run);
      const char* nb = reinterpret_cast<const char*>(layer_base + table[(pos + run) / ps] * ps * lanes +
                                                     h0 * 2 * d);
      for (int64_t r = 0; r < next_rows; ++r)
        for (int64_t b = 0; b < row_bytes; b += 64)
          _mm_prefetch(nb + r * lanes * sizeof(float) + b, _MM_HINT_T0);
    }
    for (int64_t h = h0; h < h1; ++h) {
      const float* kb = base + h * 2 * d;
      const float* vb = kb + d;
      for (int64_t j = 0; j < g; ++j) {
        const int64_t head = h * g + j, local = head - h0 * g;
        __m512 qv[NC];
        for (int c = 0; c < NC; ++c)
          qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + head * d + 16 * c), _mm512_set1_ps(sm_scale));
        float* oh = out + head * d;
        for (int64_t k0 = 0; k0 < run; k0 += 16) {
          const int64_t n = std::min<int64_t>(16, run - k0);
          const float* row = kb + k0 * lanes;
          __m512 dots[16];
          for (int64_t k = 0; k < 16; ++k, row += lanes) {
            if (k >= n) {
              dots[k] = _mm512_setzero_ps();
              continue;
            }
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(row), qv[0]);
            for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(row + 16 * c), qv[c], acc);
            dots[k] = acc;
          }
          const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
          const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, Sum16(dots));
          const float m_new = std::max(mx[local], _mm512_reduce_max_ps(sv));
          const float rescale = std::exp(mx[local] - m_new);  // 0 at the first block
          const __m512 pv = _mm512_maskz_mov_ps(live, Exp16(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
          den[local] = den[local] * rescale + _mm512_reduce_add_ps(pv);
          mx[local] = m_new;
          _mm512_store_ps(sc, pv);
          __m512 ov[NC];
          const __m512 rs = _mm512_set1_ps(rescale);
          for (int c = 0; c < NC; ++c) ov[c] = _mm512_mul_ps(_mm512_loadu_ps(oh + 16 * c), rs);
          const float* vrow = vb + k0 * lanes;
          for (int64_t k = 0; k < n; ++k, vrow += lanes) {
            const __m512 p = _mm512_set1_ps(sc[k]);
            for (int c = 0; c < NC; ++c) ov[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vrow + 16 * c), ov[c]);
          }
          for (int c = 0; c < NC; ++c) _mm512_storeu_ps(oh + 16 * c, ov[c]);
        }
      }
    }
    pos += run;
  }
  for (int64_t head = h0 * g; head < h1 * g; ++head) {
    const __m512 inv = _mm512_set1_ps(1.0f / den[head - h0 * g]);
    float* oh = out + head * d;
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(oh + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(oh + 16 * c), inv));
  }
}

// AttendSlotVec's head sizes; false for the others, which AttendOne's scalar loops take.
bool AttendSlot(const Shape& s, const float* q, const float* layer_base, const int32_t* table,
                int64_t lowest, int64_t kv_len, float sm_scale, int64_t h0, int64_t h1, float* out,
                float* state) {
  switch (s.head_dim) {
    case 32: AttendSlotVec<2>(s, q, layer_base, table, lowest, kv_len, sm_scale, h0, h1, out, state); return true;
    case 64: AttendSlotVec<4>(s, q, layer_base, table, lowest, kv_len, sm_scale, h0, h1, out, state); return true;
    case 128: AttendSlotVec<8>(s, q, layer_base, table, lowest, kv_len, sm_scale, h0, h1, out, state); return true;
    case 256: AttendSlotVec<16>(s, q, layer_base, table, lowest, kv_len, sm_scale, h0, h1, out, state); return true;
    default: return false;
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

// The Shape of a call's q [rows, Hkv, g, d], pool [L, P, page, lanes] and page tables [S, P],
// or the reason they do not fit together. `vector_only`: the head sizes of the vector kernels.
ffi::Error ShapeOf(const char* what, ffi::Span<const int64_t> qd, ffi::Span<const int64_t> pd,
                   ffi::Span<const int64_t> td, bool vector_only, Shape* s) {
  const std::string name(what);
  if (qd.size() != 4 || pd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument(name + ": q must be 4-d, the pool 4-d, the page tables 2-d");
  }
  *s = Shape{qd[0], qd[1], qd[2], qd[3], pd[0], pd[1], pd[2], pd[3], td[1]};
  if (2 * s->num_kv_heads * s->head_dim > s->lanes) {
    return ffi::Error::InvalidArgument(name + ": the pool's lanes hold fewer than 2 * "
                                       "num_kv_heads * head_dim values");
  }
  if (!vector_only) return ffi::Error::Success();
#if !defined(__AVX512F__)
  return ffi::Error::InvalidArgument(name + ": built without AVX-512");
#else
  const int64_t d = s->head_dim;
  if (d != 32 && d != 64 && d != 128 && d != 256) {
    return ffi::Error::InvalidArgument(name + ": head_dim must be 32, 64, 128 or 256");
  }
  return ffi::Error::Success();
#endif
}

ffi::Error DecodeAttention(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> kv_pool, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> kv_lens,
                           ffi::Buffer<ffi::S32> lowest, float sm_scale,
                           ffi::ResultBuffer<ffi::F32> out) {
  Shape s;
  if (ffi::Error e = ShapeOf("decode attention", q.dimensions(), kv_pool.dimensions(),
                             page_tables.dimensions(), false, &s);
      e.failure()) {
    return e;
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
  // Items [begin, end) are (slot, KV head) pairs in order; a slot's run of them is one call,
  // which reads each key row of the slot once for all of its heads there.
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scores, state(2 * s.num_kv_heads * s.group);
    for (int64_t i = begin; i < end;) {
      const int64_t slot = i / s.num_kv_heads, h0 = i % s.num_kv_heads;
      const int64_t h1 = std::min<int64_t>(s.num_kv_heads, h0 + end - i);
      const int32_t kv_len = lens[slot];
      const float* q_slot = qp + slot * s.num_kv_heads * per;
      float* o_slot = op + slot * s.num_kv_heads * per;
#if defined(__AVX512F__)
      const int32_t lo = std::max<int32_t>(low[slot], 0);
      if (kv_len > lo) {
        const float* layer_base = pp + lyr * s.num_pages * s.page_size * s.lanes;
        if (AttendSlot(s, q_slot, layer_base, tp + slot * s.pages_per_seq, lo, kv_len, sm_scale,
                       h0, h1, o_slot, state.data())) {
          i += h1 - h0;
          continue;
        }
      }
#endif
      for (int64_t h = h0; h < h1; ++h) {
        AttendOne(s, q_slot + h * per, pp, lyr, tp + slot * s.pages_per_seq, kv_len, low[slot],
                  sm_scale, h, o_slot + h * per, scores);
      }
      i += h1 - h0;
    }
  };
  // Split by keys to read, not by items: rows' contexts differ by up to max_model_len. A worker
  // takes at least 1024 (slot, KV head, key) triples; fewer do not pay for a task.
  std::vector<int64_t> cost(items);
  for (int64_t i = 0; i < items; ++i) cost[i] = std::max(lens[i / s.num_kv_heads], 0);
  SplitByCost(pool_threads, cost, 1024, run);
  return ffi::Error::Success();
}

// Quantized pools (common.fuse_kv; docs/architecture.md, "Quantized KV cache"): keys and values
// in int8 or float8_e4m3fn, each (token, KV head) of keys and of values scaled by 2^e, e an
// integer stored in the pool's own type in the last 2 * num_kv_heads lanes of the row (head h's
// key exponent at lanes - 2 * Hkv + 2h, its value exponent after it). One table per format maps
// a byte to its value, for the 8-bit values and for the exponents alike.
struct Q8Table {
  float value[256];
};

float E4m3fnToFloat(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
  float x;
  if (exp == 15 && man == 7) {
    x = NAN;
  } else if (exp == 0) {
    x = std::ldexp(static_cast<float>(man), -9);  // subnormal: man / 8 * 2^-6
  } else {
    x = std::ldexp(1.0f + man / 8.0f, exp - 7);
  }
  return sign ? -x : x;
}

const Q8Table* Tables() {
  static const std::vector<Q8Table> tables = [] {
    std::vector<Q8Table> t(2);
    for (int b = 0; b < 256; ++b) {
      t[0].value[b] = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(b)));
      t[1].value[b] = E4m3fnToFloat(static_cast<uint8_t>(b));
    }
    return t;
  }();
  return tables.data();
}

// One (slot, KV head) of a quantized pool: AttendOne's arithmetic on the dequantized rows. Each
// key row is dequantized once (value times its scale) for the g query heads; a value row's scale
// is folded into each head's probability.
void AttendOneQ8(const Shape& s, const float* q, const uint8_t* pool, const Q8Table& t,
                 int64_t layer, const int32_t* table, int32_t kv_len, int32_t lowest,
                 float sm_scale, int64_t kv_head, float* out, std::vector<float>& scores,
                 std::vector<float>& row_buf) {
  const int64_t g = s.group, d = s.head_dim;
  if (kv_len <= 0) {
    std::fill(out, out + g * d, 0.0f);
    return;
  }
  lowest = std::max<int32_t>(lowest, 0);
  const int64_t n = kv_len - lowest;
  scores.resize(g * n);
  row_buf.resize(d);
  float* kd = row_buf.data();
  const uint8_t* layer_base = pool + layer * s.num_pages * s.page_size * s.lanes;
  const int64_t k_off = kv_head * 2 * d, v_off = k_off + d;
  const int64_t e_off = s.lanes - 2 * s.num_kv_heads + 2 * kv_head;  // key exponent; value: +1
  for (int64_t pos = lowest; pos < kv_len; ++pos) {
    const int64_t page = table[pos / s.page_size];
    const uint8_t* row = layer_base + (page * s.page_size + pos % s.page_size) * s.lanes;
    const float scale = std::ldexp(1.0f, static_cast<int>(t.value[row[e_off]]));
    for (int64_t j = 0; j < d; ++j) kd[j] = t.value[row[k_off + j]] * scale;
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = q + h * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < d; ++j) dot += qh[j] * kd[j];
      scores[h * n + (pos - lowest)] = dot * sm_scale;
    }
  }
  for (int64_t h = 0; h < g; ++h) {
    float* sh = scores.data() + h * n;
    float mx = sh[0];
    for (int64_t i = 1; i < n; ++i) mx = std::max(mx, sh[i]);
    float denom = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      sh[i] = std::exp(sh[i] - mx);
      denom += sh[i];
    }
    const float inv = 1.0f / denom;
    for (int64_t i = 0; i < n; ++i) sh[i] *= inv;
  }
  std::fill(out, out + g * d, 0.0f);
  for (int64_t pos = lowest; pos < kv_len; ++pos) {
    const int64_t page = table[pos / s.page_size];
    const uint8_t* row = layer_base + (page * s.page_size + pos % s.page_size) * s.lanes;
    const float scale = std::ldexp(1.0f, static_cast<int>(t.value[row[e_off + 1]]));
    for (int64_t j = 0; j < d; ++j) kd[j] = t.value[row[v_off + j]];
    for (int64_t h = 0; h < g; ++h) {
      const float p = scores[h * n + (pos - lowest)] * scale;
      float* oh = out + h * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) oh[j] += p * kd[j];
    }
  }
}

// DecodeAttention over a quantized pool (int8 or float8_e4m3fn; `AnyBuffer`, its type read here).
ffi::Error DecodeAttentionQ8(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> q,
                             ffi::AnyBuffer kv_pool, ffi::Buffer<ffi::S32> layer,
                             ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> kv_lens,
                             ffi::Buffer<ffi::S32> lowest, float sm_scale,
                             ffi::ResultBuffer<ffi::F32> out) {
  const ffi::DataType type = kv_pool.element_type();
  if (type != ffi::DataType::S8 && type != ffi::DataType::F8E4M3FN) {
    return ffi::Error::InvalidArgument("quantized decode attention: the pool must be int8 or "
                                       "float8_e4m3fn");
  }
  Shape s;
  if (ffi::Error e = ShapeOf("quantized decode attention", q.dimensions(), kv_pool.dimensions(),
                             page_tables.dimensions(), false, &s);
      e.failure()) {
    return e;
  }
  if (2 * s.num_kv_heads * s.head_dim + 2 * s.num_kv_heads > s.lanes) {
    return ffi::Error::InvalidArgument("quantized decode attention: the pool's lanes hold "
                                       "no scale exponents after the keys and values");
  }
  const Q8Table& t = Tables()[type == ffi::DataType::F8E4M3FN ? 1 : 0];
  const int64_t lyr = layer.typed_data()[0];
  const float* qp = q.typed_data();
  const uint8_t* pp = static_cast<const uint8_t*>(kv_pool.untyped_data());
  const int32_t* tp = page_tables.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* low = lowest.typed_data();
  float* op = out->typed_data();
  const int64_t items = s.num_slots * s.num_kv_heads;
  const int64_t per = s.group * s.head_dim;
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row_buf;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = i / s.num_kv_heads, h = i % s.num_kv_heads;
      AttendOneQ8(s, qp + slot * s.num_kv_heads * per + h * per, pp, t, lyr,
                  tp + slot * s.pages_per_seq, lens[slot], low[slot], sm_scale, h,
                  op + slot * s.num_kv_heads * per + h * per, scores, row_buf);
    }
  };
  std::vector<int64_t> cost(items);
  for (int64_t i = 0; i < items; ++i) cost[i] = std::max(lens[i / s.num_kv_heads], 0);
  SplitByCost(pool_threads, cost, 1024, run);
  return ffi::Error::Success();
}

#if defined(__AVX512F__)
// Query rows per prefill work item: each block of keys is transposed once for this many rows.
constexpr int64_t kPrefillRows = 16;

// Rows [t0, t1) of one prefill chunk against KV head h, for head_dim = 16 * NC. Row t sits at
// position first_pos + (t - t0) and sees keys [max(0, pos - window + 1), pos]. Keys come a page
// block of up to 16 at a time; the block's keys are transposed into kt[d][16] once, so each
// query row's 16 scores are d broadcast FMAs into one vector (no horizontal sums), then one
// vector exp, and the online softmax carries each row's max and denominator across blocks.
//
// A (row, query head) pair's arithmetic is one chain in a fixed order, as if it ran alone; what
// the tiles change is only how many chains run side by side: kTile pairs' scores share each load
// of the block's keys, and kPv pairs' weighted sums each load of its values. One pair at a time,
// each score was a 64-deep chain of dependent FMAs, the core waiting on each one's latency.
template <int NC>
void PrefillRowsVec(const Shape& s, const float* q, const float* layer_base, const int32_t* table,
                    int64_t first_pos, int64_t t0, int64_t t1, int64_t window, float sm_scale,
                    int64_t h, float* out, float* scratch) {
  constexpr int kTile = 8;                         // pairs whose scores run side by side
  constexpr int kPv = NC <= 2 ? 8 : 16 / NC;       // pairs whose sums do (kPv * NC accumulators)
  const int64_t g = s.group, d = s.head_dim, ps = s.page_size, lanes = s.lanes, hq = s.num_kv_heads * g;
  const int64_t rows = t1 - t0, units = rows * g;
  float* mx = scratch;             // [rows * g]
  float* den = mx + units;         // [rows * g]
  float* acc = den + units;        // [rows * g, d]
  alignas(64) float kt[16 * 256];  // [d][16] the block's keys, transposed (d <= 256)
  alignas(64) float pr[kTile][16];
  std::vector<int64_t> active(units);  // the block's (row, head) pairs that see some of its keys
  std::vector<__mmask16> live_of(rows);
  for (int64_t i = 0; i < units; ++i) mx[i] = -INFINITY, den[i] = 0.0f;
  std::fill(acc, acc + units * d, 0.0f);
  const int64_t last_pos = first_pos + rows - 1;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  for (int64_t pos = lo; pos <= last_pos;) {
    const int64_t off = pos % ps;
    const int64_t n = std::min<int64_t>({16, ps - off, last_pos + 1 - pos});
    const float* kb = layer_base + (table[pos / ps] * ps + off) * lanes + h * 2 * d;
    const float* vb = kb + d;
    for (int64_t k = 0; k < n; ++k)
      for (int64_t c = 0; c < d; ++c) kt[c * 16 + k] = kb[k * lanes + c];
    for (int64_t k = n; k < 16; ++k)
      for (int64_t c = 0; c < d; ++c) kt[c * 16 + k] = 0.0f;
    const __m512i key_pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(pos)),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                               11, 12, 13, 14, 15));
    int64_t num_active = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t qpos = first_pos + r;
      if (pos > qpos) continue;                              // the whole block is in its future
      if (window > 0 && pos + n - 1 < qpos - window + 1) continue;  // or before its window
      __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
      live &= _mm512_cmple_epi32_mask(key_pos, _mm512_set1_epi32(static_cast<int32_t>(qpos)));
      if (window > 0)
        live &= _mm512_cmpge_epi32_mask(key_pos,
                                        _mm512_set1_epi32(static_cast<int32_t>(qpos - window + 1)));
      live_of[r] = live;
      for (int64_t j = 0; j < g; ++j) active[num_active++] = r * g + j;
    }
    for (int64_t a0 = 0; a0 < num_active; a0 += kTile) {
      const int m = static_cast<int>(std::min<int64_t>(kTile, num_active - a0));
      const float* qh[kTile];  // past m: repeats of the last pair, computed and dropped
      for (int i = 0; i < kTile; ++i) {
        const int64_t u = active[a0 + std::min(i, m - 1)];
        qh[i] = q + (t0 + u / g) * hq * d + (h * g + u % g) * d;
      }
      __m512 sv[kTile];
      for (int i = 0; i < kTile; ++i) sv[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < d; ++c) {
        const __m512 kc = _mm512_load_ps(kt + c * 16);
        for (int i = 0; i < kTile; ++i) sv[i] = _mm512_fmadd_ps(_mm512_set1_ps(qh[i][c]), kc, sv[i]);
      }
      float rescale[kTile];
      __mmask16 mask[kTile];
      for (int i = 0; i < kTile; ++i) {
        if (i >= m) {
          rescale[i] = 1.0f, mask[i] = 0;
          continue;
        }
        const int64_t u = active[a0 + i];
        const __mmask16 live = live_of[u / g];
        const __m512 si = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live,
                                             _mm512_mul_ps(sv[i], _mm512_set1_ps(sm_scale)));
        const float m_new = std::max(mx[u], _mm512_reduce_max_ps(si));
        rescale[i] = std::exp(mx[u] - m_new);
        const __m512 pv = _mm512_maskz_mov_ps(live, Exp16(_mm512_sub_ps(si, _mm512_set1_ps(m_new))));
        den[u] = den[u] * rescale[i] + _mm512_reduce_add_ps(pv);
        mx[u] = m_new;
        mask[i] = live;
        _mm512_store_ps(pr[i], pv);
      }
      for (int p0 = 0; p0 < m; p0 += kPv) {
        __m512 ov[kPv][NC];
        float* au[kPv];
        for (int i = 0; i < kPv; ++i) {
          const int src = std::min(p0 + i, m - 1);  // past m: a repeat, masked off, not stored
          au[i] = acc + active[a0 + src] * d;
          const __m512 rs = _mm512_set1_ps(rescale[src]);
          for (int c = 0; c < NC; ++c) ov[i][c] = _mm512_mul_ps(_mm512_loadu_ps(au[i] + 16 * c), rs);
        }
        const float* vrow = vb;
        for (int64_t k = 0; k < n; ++k, vrow += lanes) {
          __m512 v[NC];
          for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_ps(vrow + 16 * c);
          for (int i = 0; i < kPv; ++i) {
            // a key the pair does not see leaves its sums as they are, as skipping it did
            const __mmask16 on = p0 + i < m && ((mask[p0 + i] >> k) & 1) ? 0xFFFF : 0;
            const __m512 p = _mm512_set1_ps(pr[std::min(p0 + i, kTile - 1)][k]);
            for (int c = 0; c < NC; ++c) ov[i][c] = _mm512_mask3_fmadd_ps(p, v[c], ov[i][c], on);
          }
        }
        for (int i = 0; i < kPv && p0 + i < m; ++i)
          for (int c = 0; c < NC; ++c) _mm512_storeu_ps(au[i] + 16 * c, ov[i][c]);
      }
    }
    pos += n;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t u = r * g + j;
      const __m512 inv = _mm512_set1_ps(1.0f / den[u]);  // den >= 1: the row's own key is live
      float* o = out + (t0 + r) * hq * d + (h * g + j) * d;
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + u * d + 16 * c), inv));
    }
}

bool PrefillRows(const Shape& s, const float* q, const float* layer_base, const int32_t* table,
                 int64_t first_pos, int64_t t0, int64_t t1, int64_t window, float sm_scale,
                 int64_t h, float* out, float* scratch) {
  switch (s.head_dim) {
    case 32: PrefillRowsVec<2>(s, q, layer_base, table, first_pos, t0, t1, window, sm_scale, h, out, scratch); return true;
    case 64: PrefillRowsVec<4>(s, q, layer_base, table, first_pos, t0, t1, window, sm_scale, h, out, scratch); return true;
    case 128: PrefillRowsVec<8>(s, q, layer_base, table, first_pos, t0, t1, window, sm_scale, h, out, scratch); return true;
    case 256: PrefillRowsVec<16>(s, q, layer_base, table, first_pos, t0, t1, window, sm_scale, h, out, scratch); return true;
    default: return false;
  }
}
#endif


// Every row of the step: decode rows (sequences with one query) through AttendSlot, the rows of
// prefill chunks through PrefillRows; padding rows are 0. One call per layer replaces the
// decode call, the prefill loop and the buffers that joined them (a zeroed [T, H, d] output
// copied and added to in every layer: ~13 ms of a 256-token step of smollm2-135m).
#if defined(__AVX512F__)
// The ragged attention's work over every row of a step (see RaggedAttention).
void RaggedCore(ffi::ThreadPool& pool_threads, const Shape& s, int64_t num_tokens, const float* qp,
                const float* layer_base, const int32_t* qs, const int32_t* lens,
                const int32_t* tables, int64_t n_seqs, float sm_scale, int32_t window, float* op) {
  const int64_t per_token = s.num_kv_heads * s.group * s.head_dim;
  std::fill(op, op + num_tokens * per_token, 0.0f);
  struct Item { int64_t seq, t0, t1, head; };  // t1 == t0 + 1 and a one-query sequence: decode
  std::vector<Item> work;
  std::vector<int64_t> cost;
  for (int64_t seq = 0; seq < n_seqs; ++seq) {
    const int64_t b = qs[seq], e = std::min<int64_t>(qs[seq + 1], num_tokens);
    if (e <= b || lens[seq] <= 0) continue;
    const int64_t step = e - b == 1 ? 1 : kPrefillRows;
    for (int64_t t0 = b; t0 < e; t0 += step) {
      const int64_t t1 = std::min(e, t0 + step);
      const int64_t keys = lens[seq] - (e - t1);  // keys the item's last row sees, at most
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        work.push_back({seq, t0, t1, h});
        cost.push_back((t1 - t0) * std::max<int64_t>(keys, 1));
      }
    }
  }
  if (work.empty()) return;
  // A worker takes at least 1024 (row, key) pairs of one KV head: fewer do not pay for a task
  // (the decode call's kMinKeysPerWorker).
  SplitByCost(pool_threads, cost, 1024, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kPrefillRows * s.group * (s.head_dim + 2));
    std::vector<float> state(2 * s.num_kv_heads * s.group);
    for (int64_t i = begin; i < end;) {
      const Item& it = work[i];
      const int64_t e = std::min<int64_t>(qs[it.seq + 1], num_tokens);
      const int32_t* table = tables + it.seq * s.pages_per_seq;
      if (e - qs[it.seq] == 1) {  // a decode row: this run of its KV heads in one pass
        int64_t h1 = it.head + 1;
        while (i + (h1 - it.head) < end && work[i + (h1 - it.head)].seq == it.seq) ++h1;
        const int64_t kv_len = lens[it.seq];
        const int64_t lo = window > 0 ? std::max<int64_t>(0, kv_len - window) : 0;
        AttendSlot(s, qp + it.t0 * per_token, layer_base, table, lo, kv_len, sm_scale, it.head,
                   h1, op + it.t0 * per_token, state.data());
        i += h1 - it.head;
        continue;
      }
      PrefillRows(s, qp, layer_base, table, lens[it.seq] - (e - it.t0), it.t0, it.t1, window,
                  sm_scale, it.head, op, scratch.data());
      ++i;
    }
  });
}
#endif

ffi::Error RaggedAttention(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> kv_pool, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> kv_lens,
                           ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> num_seqs,
                           float sm_scale, int32_t window, ffi::ResultBuffer<ffi::F32> out) {
  Shape s;  // its first field is q's rows, tokens here
  if (ffi::Error e = ShapeOf("ragged attention", q.dimensions(), kv_pool.dimensions(),
                             page_tables.dimensions(), true, &s);
      e.failure()) {
    return e;
  }
#if defined(__AVX512F__)
  RaggedCore(pool_threads, s, s.num_slots, q.typed_data(),
             kv_pool.typed_data() + layer.typed_data()[0] * s.num_pages * s.page_size * s.lanes,
             query_start.typed_data(), kv_lens.typed_data(), page_tables.typed_data(),
             std::min<int64_t>(num_seqs.typed_data()[0], page_tables.dimensions()[0]), sm_scale,
             window, out->typed_data());
#endif
  return ffi::Error::Success();  // without AVX-512, ShapeOf has refused the call
}

#if defined(__AVX512F__)
// Rotate-half RoPE of one head vector x[d] by cos/sin[d] (each repeating over its two halves),
// with the products and sums of x * cos + rotate_half(x) * sin, unfused (the flags turn off
// contraction into FMAs), so the values are the jnp path's bit for bit.
inline void Rope(const float* x, const float* cos, const float* sin, int64_t d, float* y) {
  const int64_t half = d / 2;
  for (int64_t c = 0; c < half; ++c) {
    y[c] = x[c] * cos[c] + (-x[c + half]) * sin[c];
    y[c + half] = x[c + half] * cos[c + half] + x[c] * sin[c + half];
  }
}
#endif

// RoPE on q and k, k and v written into the pool's rows (slot_mapping; out of range: padding,
// dropped), then RaggedAttention over the step: what Attention does between its projections,
// in one call instead of a rope fusion each for q and k, a fuse-and-scatter of the rows and the
// attention (on smollm2-135m's 256-token step ~0.65 ms of elementwise fusions a layer). The pool
// is updated in place: output 1 aliases input 7.
ffi::Error RopeWriteAttention(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                              ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                              ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<ffi::F32> kv_pool,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> query_start,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_tables,
                              ffi::Buffer<ffi::S32> num_seqs, float sm_scale, int32_t window,
                              ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> pool_out) {
  Shape s;  // its first field is q's rows, tokens here
  if (ffi::Error e = ShapeOf("rope-write-attention", q.dimensions(), kv_pool.dimensions(),
                             page_tables.dimensions(), true, &s);
      e.failure()) {
    return e;
  }
  if (k.dimensions().size() != 3 || v.dimensions().size() != 3) {
    return ffi::Error::InvalidArgument("rope-write-attention: k and v must be 3-d");
  }
  if (pool_out->typed_data() != kv_pool.typed_data()) {
    return ffi::Error::InvalidArgument("rope-write-attention: the pool must be updated in place "
                                       "(input_output_aliases)");
  }
#if defined(__AVX512F__)
  const int64_t T = s.num_slots, d = s.head_dim, hkv = s.num_kv_heads, hq = hkv * s.group;
  const float* cp = cos.typed_data();
  const float* sp = sin.typed_data();
  const int32_t* slots = slot_mapping.typed_data();
  float* layer_base = pool_out->typed_data() + layer.typed_data()[0] * s.num_pages * s.page_size * s.lanes;
  const int64_t rows_in_layer = s.num_pages * s.page_size;
  std::unique_ptr<float[]> q_roped(new float[T * hq * d]);  // every element written below
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  for (int64_t t = 0; t < T; ++t) {
    const float* ct = cp + t * d;
    const float* st = sp + t * d;
    for (int64_t h = 0; h < hq; ++h) Rope(qp + (t * hq + h) * d, ct, st, d, q_roped.get() + (t * hq + h) * d);
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= rows_in_layer) continue;  // a padding token
    float* row = layer_base + slot * s.lanes;
    for (int64_t h = 0; h < hkv; ++h) {
      Rope(kp + (t * hkv + h) * d, ct, st, d, row + h * 2 * d);
      std::copy(vp + (t * hkv + h) * d, vp + (t * hkv + h + 1) * d, row + h * 2 * d + d);
    }
  }
  RaggedCore(pool_threads, s, T, q_roped.get(), layer_base, query_start.typed_data(),
             kv_lens.typed_data(), page_tables.typed_data(),
             std::min<int64_t>(num_seqs.typed_data()[0], page_tables.dimensions()[0]), sm_scale,
             window, out->typed_data());
#endif
  return ffi::Error::Success();  // without AVX-512, ShapeOf has refused the call
}

}  // namespace

// Writes rows [T, lanes] of an 8-bit pool's dtype into slots of layer `layer`, in place (the
// pool is aliased to the output): slot = page * page_size + offset, out of range = dropped (a
// bucket's padding). XLA:CPU has no float8 scatter: it widened the whole e4m3 pool to float16
// and back around every layer's write (50x a float32 decode step on smollm2-135m). Bytes are
// copied as they are, so int8 and e4m3 pools share it.
ffi::Error WriteRows(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer rows,
                     ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> out) {
  const auto pd = pool.dimensions(), rd = rows.dimensions(), sd = slots.dimensions();
  if (pd.size() != 4 || rd.size() != 2 || sd.size() != 1 || rd[1] != pd[3] || rd[0] != sd[0] ||
      rows.element_type() != pool.element_type() || ffi::ByteWidth(pool.element_type()) != 1 ||
      layer.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "jaxserve_write_rows takes an 8-bit pool [L, P, page, lanes], the layer as one int32, "
        "rows [T, lanes] of the pool's dtype and slots [T]; got a pool of rank " +
        std::to_string(pd.size()) + ", rows of rank " + std::to_string(rd.size()) + ".");
  }
  const int64_t L = pd[0], P = pd[1], S = pd[2], lanes = pd[3], T = rd[0];
  uint8_t* dst = static_cast<uint8_t*>(out->untyped_data());
  if (dst != pool.untyped_data()) std::memcpy(dst, pool.untyped_data(), pool.size_bytes());
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::Success();
  const uint8_t* src = static_cast<const uint8_t*>(rows.untyped_data());
  const int32_t* slot = slots.typed_data();
  for (int64_t t = 0; t < T; ++t) {
    if (slot[t] < 0 || slot[t] >= P * S) continue;  // padding: dropped, as the scatter's "drop"
    std::memcpy(dst + ((l * P * S) + slot[t]) * lanes, src + t * lanes, lanes);
  }
  return ffi::Error::Success();
}

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDecodeAttentionQ8, DecodeAttentionQ8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [S, Hkv, g, d], unscaled
                                  .Arg<ffi::AnyBuffer>()         // pool [L, P, page, lanes], 8-bit
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page tables [S, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_len [S]; 0: not decoding
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lowest position [S]
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [S, Hkv, g, d]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedAttention, RaggedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hkv, g, d], unscaled
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool [L, P, page, lanes]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page tables [S, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs []
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("window")        // 0: no sliding window
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [T, Hkv, g, d]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRopeWriteAttention, RopeWriteAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hkv, g, d], before RoPE
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [T, Hkv, d], before RoPE
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v [T, Hkv, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [T, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin [T, d]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool [L, P, page, lanes]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page tables [S, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs []
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("window")        // 0: no sliding window
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [T, Hkv, g, d]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // the pool, in place

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteRows, WriteRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // pool [L, P, page, lanes], 8-bit
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::AnyBuffer>()         // rows [T, lanes], the pool's dtype
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [T]
                                  .Ret<ffi::AnyBuffer>());       // the pool, aliased
