// cpu_matmul.cc's matmul over packed weights with the weights in int8 (issue 43), as XLA FFI calls.
//
// A float32 decode step on the CPU is bound by streaming its weights from memory; int8 weights
// are a quarter of the bytes. The weights arrive packed as cpu_matmul.cc's are, [N / 64, K, 64],
// in int8, with one float32 scale per output column (symmetric: w[k, n] ~ wq[k, n] * scale[n]).
// Two ways to multiply by them:
//
// - Weight-only (the decode path): out = (x @ wq) * scale, each element one chain of fused
//   multiply-adds over k in order with the int8 weights widened to float32 in registers, the
//   scale applied once after the chain. It is cpu_matmul.cc's whole-K tile with the weights
//   widened on the way: its bits are packed_matmul's of x against float32(wq), times the scale.
//   A row's result does not depend on the rows beside it.
// - W8A8 (prefill, where the multiply rather than the memory is the bound): each row of x is
//   quantized on the way in, sx[r] = max_k |x[r, k]| / 127 and xq = round-half-even(x / sx),
//   and the sums are exact int32 dot products with AVX512-VNNI's vpdpbusd, which multiplies
//   unsigned by signed bytes: it gets xq + 128, and each column's sum starts at
//   -128 * sum_k wq[k, n] to take the offset back out. out = float32(acc) * sx[r] * scale[n].
//   The integers are exact, so the result is the same on every run, in any batch.
//
// vpdpbusd wants four consecutive k of a column in each 32-bit lane, [K / 4, 64, 4]; the panels
// stay [K, 64] (the weight-only path's layout, the one the loader packs), and each work item
// interleaves its panel once into a scratch buffer that then stays in L1/L2 for every row tile.
// Consecutive work items share a panel, so that costs about one pass over the weights per call.
//
// Rows past `valid` (a bucket's padding) come back 0, uncomputed, as in cpu_matmul.cc; grouped
// variants run a mixture of experts' rows sorted by expert against each expert's panels.
//
// The weight-only path also takes float8 e4m3 weights (the same panels, typed float8_e4m3fn), widened to float32 exactly in registers by bit arithmetic: XLA:CPU widens an
// e4m3 operand element by element into a float32 copy of the whole weight before its dot, which
// made fp8 decode 7-15x slower than float32 (docs/benchmarks.md).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

constexpr int64_t kLanes = 64;      // output columns per panel, as cpu_matmul.cc's
constexpr int64_t kRowBlock = 6;    // rows per register tile: 6 x 4 accumulators
constexpr int64_t kGroupRows = 48;  // rows per work item (eight tiles), one panel each

// Weight-only's vector path needs AVX-512F; W8A8's byte shuffles and vpdpbusd also BW and VNNI.
// Without them the same sums run scalar, the same bits (the integers are exact either way).
#if defined(__AVX512F__)
#define JAXSERVE_W8_VECTOR 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define JAXSERVE_W8A8_VECTOR 1
#endif

// ---- Weight-only: float32 rows times int8 panels. ----

#if JAXSERVE_W8_VECTOR
// out[r, 0:64] = (sum_{k < K} a[r, k] * float(panel[k, 0:64])) * scale[0:64] for MR rows
// (a: lda apart; out: ldc apart): cpu_matmul.cc's Tile from zero over the whole K, the 64 bytes
// of each k widened to four vectors of 16 floats (exact) once for all MR rows.
// 16 int8 weights as floats (exact).
inline __m512 WidenInt8(const __m128i* b) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b)));
}

// 32 e4m3 weights (bytes s eeee mmm, exponent bias 7, no infinities) as two vectors of 16
// floats, each 2^-8 times the weight's value, exactly: the byte's magnitude bits moved into a
// float16's exponent and mantissa (bias 15, so every e4m3 value, its subnormals included, is
// 2^-8 times a float16 that vcvtph2ps widens exactly, in hardware) and the sign into bit 15.
// The 2^8 goes into the column's scale after the chain (TileW8's `unit`), so the widening is
// integer shifts and one conversion per 16 weights: a float multiply here would meet the
// subnormal floats small bytes make, each a microcode assist. e4m3's NaN (s 1111 111) is never
// stored: quantization clips to +-448.
inline void WidenE4m3(const __m256i* b, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(b));
  const __m512i mag = _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x7F)), 7);
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8);
  const __m512i half = _mm512_or_si512(mag, sign);
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
}

template <int MR, bool FP8>
inline void TileW8(const float* a, int64_t lda, const int8_t* panel, int64_t K,
                   const float* scale, float* out, int64_t ldc) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 b0, b1, b2, b3;
    if constexpr (FP8) {
      const __m256i* b = reinterpret_cast<const __m256i*>(panel + k * kLanes);
      WidenE4m3(b, b0, b1);
      WidenE4m3(b + 1, b2, b3);
    } else {
      const __m128i* b = reinterpret_cast<const __m128i*>(panel + k * kLanes);
      b0 = WidenInt8(b);
      b1 = WidenInt8(b + 1);
      b2 = WidenInt8(b + 2);
      b3 = WidenInt8(b + 3);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + k]);
      acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(av, b2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(av, b3, acc[r][3]);
    }
  }
  // The e4m3 widening's 2^-8 (WidenE4m3), undone exactly on the way out.
  const __m512 unit = _mm512_set1_ps(FP8 ? 256.0f : 1.0f);
  for (int i = 0; i < 4; ++i) {
    const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(scale + 16 * i), unit);
    for (int r = 0; r < MR; ++r)
      _mm512_storeu_ps(out + r * ldc + 16 * i, _mm512_mul_ps(acc[r][i], s));
  }
}

// Rows [m0, m1) of x [., K] against one 8-bit panel, in tiles of kRowBlock rows and one of the
// rest.
template <bool FP8>
void PanelRowsW8(const float* x, int64_t m0, int64_t m1, int64_t K, const int8_t* panel,
                 const float* scale, float* out, int64_t N) {
  int64_t m = m0;
  for (; m + kRowBlock <= m1; m += kRowBlock)
    TileW8<6, FP8>(x + m * K, K, panel, K, scale, out + m * N, N);
  const float* a = x + m * K;
  float* o = out + m * N;
  switch (m1 - m) {
    case 5: TileW8<5, FP8>(a, K, panel, K, scale, o, N); break;
    case 4: TileW8<4, FP8>(a, K, panel, K, scale, o, N); break;
    case 3: TileW8<3, FP8>(a, K, panel, K, scale, o, N); break;
    case 2: TileW8<2, FP8>(a, K, panel, K, scale, o, N); break;
    case 1: TileW8<1, FP8>(a, K, panel, K, scale, o, N); break;
    default: break;
  }
}
#else
// An e4m3 byte's value (see WidenE4m3), for the scalar path.
inline float E4m3(int8_t byte) {
  const int v = static_cast<uint8_t>(byte), e = (v >> 3) & 0xF, m = v & 7;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                           : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (v & 0x80) ? -mag : mag;
}

// The same chains one fused multiply-add at a time (the model takes these calls only where the
// CPU has AVX-512; this keeps the library buildable and its bits the same elsewhere).
template <bool FP8>
void PanelRowsW8(const float* x, int64_t m0, int64_t m1, int64_t K, const int8_t* panel,
                 const float* scale, float* out, int64_t N) {
  for (int64_t m = m0; m < m1; ++m) {
    float acc[kLanes] = {};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < kLanes; ++j) {
        const int8_t w = panel[k * kLanes + j];
        acc[j] = std::fma(x[m * K + k], FP8 ? E4m3(w) : static_cast<float>(w), acc[j]);
      }
    for (int64_t j = 0; j < kLanes; ++j) out[m * N + j] = acc[j] * scale[j];
  }
}
#endif

// ---- W8A8: rows quantized on the way in, exact int32 sums. ----

// K rounded up to whole groups of 4 (vpdpbusd's k per lane); the extra k are zeros.
inline int64_t Quads(int64_t K) { return (K + 3) / 4; }

// Row x[0:K] as bytes xq + 128 in q[0:4 * Quads(K)] (the padding k: 128, i.e. xq = 0), and its
// scale: *sx = max |x| / 127, or 1 for a row of zeros; xq = round-half-even(x / sx), within
// [-127, 127]. Division rather than a multiply by 1 / sx: the reference (numpy's float32
// x / sx) rounds each quotient the same way.
void QuantizeRow(const float* x, int64_t K, uint8_t* q, float* sx) {
  float amax = 0.0f;
  int64_t k = 0;
#if JAXSERVE_W8A8_VECTOR
  __m512 vmax = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  amax = _mm512_reduce_max_ps(vmax);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  float s = amax / 127.0f;
  if (s == 0.0f) s = 1.0f;
  *sx = s;
  k = 0;
#if JAXSERVE_W8A8_VECTOR
  const __m512 vs = _mm512_set1_ps(s);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i off = _mm512_set1_epi32(128);
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + k), vs);
    __m512i i = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    i = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(i, lo), hi), off);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(i));
  }
#endif
  for (; k < K; ++k) {
    const float r = std::clamp(std::nearbyint(x[k] / s), -127.0f, 127.0f);  // half to even
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(r) + 128);
  }
  for (; k < 4 * Quads(K); ++k) q[k] = 128;
}

// Rows [0, M) of x [M, K] quantized into q [M, 4 * Quads(K)] and sx [M], split over the pool.
void QuantizeRows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, uint8_t* q,
                  float* sx) {
  const int64_t ld = 4 * Quads(K);
  std::vector<int64_t> cost(M, K);
  SplitByCost(pool, cost, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) QuantizeRow(x + m * K, K, q + m * ld, sx + m);
  });
}

// Panel [K, 64] interleaved as [Quads(K), 64, 4] (four consecutive k of a column per 32-bit
// lane, as vpdpbusd reads them; k past K zero) into quads, and each column's offset correction,
// corr[j] = -128 * sum_k panel[k, j], the value its int32 sum starts from.
void InterleavePanel(const int8_t* panel, int64_t K, int8_t* quads, int32_t* corr) {
  const int64_t Q = Quads(K);
#if JAXSERVE_W8A8_VECTOR
  alignas(64) int8_t tail[4 * kLanes];
  __m512i sums[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                     _mm512_setzero_si512()};
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t g = 0; g < Q; ++g) {
    const int8_t* src = panel + 4 * g * kLanes;
    if (4 * g + 4 > K) {  // the last, partial group of k: its missing rows are zeros
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, src, (K - 4 * g) * kLanes);
      src = tail;
    }
    const __m512i r0 = _mm512_loadu_si512(src), r1 = _mm512_loadu_si512(src + kLanes);
    const __m512i r2 = _mm512_loadu_si512(src + 2 * kLanes);
    const __m512i r3 = _mm512_loadu_si512(src + 3 * kLanes);
    // Within each 128-bit lane L (columns 16L..16L+15): bytes of k, k+1 paired, then with k+2, k+3:
    // u_m's lane L holds columns 16L + 4m + (0..3), each as its four k.
    const __m512i t0 = _mm512_unpacklo_epi8(r0, r1), t1 = _mm512_unpackhi_epi8(r0, r1);
    const __m512i t2 = _mm512_unpacklo_epi8(r2, r3), t3 = _mm512_unpackhi_epi8(r2, r3);
    const __m512i u0 = _mm512_unpacklo_epi16(t0, t2), u1 = _mm512_unpackhi_epi16(t0, t2);
    const __m512i u2 = _mm512_unpacklo_epi16(t1, t3), u3 = _mm512_unpackhi_epi16(t1, t3);
    // A 4 x 4 transpose of the 128-bit lanes puts columns 16L..16L+15 in v_L, in order.
    const __m512i a0 = _mm512_shuffle_i32x4(u0, u1, 0x44), a1 = _mm512_shuffle_i32x4(u0, u1, 0xEE);
    const __m512i a2 = _mm512_shuffle_i32x4(u2, u3, 0x44), a3 = _mm512_shuffle_i32x4(u2, u3, 0xEE);
    const __m512i v[4] = {_mm512_shuffle_i32x4(a0, a2, 0x88), _mm512_shuffle_i32x4(a0, a2, 0xDD),
                          _mm512_shuffle_i32x4(a1, a3, 0x88), _mm512_shuffle_i32x4(a1, a3, 0xDD)};
    for (int i = 0; i < 4; ++i) {
      _mm512_storeu_si512(quads + g * 4 * kLanes + 64 * i, v[i]);
      sums[i] = _mm512_dpbusd_epi32(sums[i], ones, v[i]);
    }
  }
  for (int i = 0; i < 4; ++i)
    _mm512_storeu_si512(corr + 16 * i, _mm512_sub_epi32(_mm512_setzero_si512(),
                                                        _mm512_slli_epi32(sums[i], 7)));
#else
  for (int64_t j = 0; j < kLanes; ++j) {
    int32_t sum = 0;
    for (int64_t g = 0; g < Q; ++g)
      for (int64_t t = 0; t < 4; ++t) {
        const int64_t k = 4 * g + t;
        const int8_t w = k < K ? panel[k * kLanes + j] : 0;
        quads[(g * kLanes + j) * 4 + t] = w;
        sum += w;
      }
    corr[j] = -128 * sum;
  }
#endif
}

#if JAXSERVE_W8A8_VECTOR
// out[r, 0:64] = float(corr + sum_g q[r, 4g:4g+4] . quads[g, 0:64, :]) * sx[r] * scale[0:64] for
// MR rows (q: ldq apart; out: ldc apart): vpdpbusd's exact int32 sums of (xq + 128) * wq, from
// the correction that takes the 128 back out.
template <int MR>
inline void TileW8A8(const uint8_t* q, int64_t ldq, const float* sx, const int8_t* quads,
                     int64_t Q, const int32_t* corr, const float* scale, float* out, int64_t ldc) {
  __m512i acc[MR][4];
  for (int i = 0; i < 4; ++i) {
    const __m512i c = _mm512_loadu_si512(corr + 16 * i);
    for (int r = 0; r < MR; ++r) acc[r][i] = c;
  }
  for (int64_t g = 0; g < Q; ++g) {
    const int8_t* b = quads + g * 4 * kLanes;
    const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 64);
    const __m512i b2 = _mm512_loadu_si512(b + 128), b3 = _mm512_loadu_si512(b + 192);
    for (int r = 0; r < MR; ++r) {
      int32_t four;
      std::memcpy(&four, q + r * ldq + 4 * g, 4);
      const __m512i av = _mm512_set1_epi32(four);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], av, b1);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], av, b2);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], av, b3);
    }
  }
  for (int i = 0; i < 4; ++i) {
    const __m512 s = _mm512_loadu_ps(scale + 16 * i);
    for (int r = 0; r < MR; ++r) {
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][i]), _mm512_set1_ps(sx[r]));
      _mm512_storeu_ps(out + r * ldc + 16 * i, _mm512_mul_ps(v, s));
    }
  }
}

// Quantized rows [m0, m1) against one interleaved panel, in tiles of kRowBlock rows.
void PanelRowsW8A8(const uint8_t* q, const float* sx, int64_t m0, int64_t m1, int64_t K,
                   const int8_t* quads, const int32_t* corr, const float* scale, float* out,
                   int64_t N) {
  const int64_t Q = Quads(K), ldq = 4 * Q;
  int64_t m = m0;
  for (; m + kRowBlock <= m1; m += kRowBlock)
    TileW8A8<6>(q + m * ldq, ldq, sx + m, quads, Q, corr, scale, out + m * N, N);
  const uint8_t* a = q + m * ldq;
  const float* s = sx + m;
  float* o = out + m * N;
  switch (m1 - m) {
    case 5: TileW8A8<5>(a, ldq, s, quads, Q, corr, scale, o, N); break;
    case 4: TileW8A8<4>(a, ldq, s, quads, Q, corr, scale, o, N); break;
    case 3: TileW8A8<3>(a, ldq, s, quads, Q, corr, scale, o, N); break;
    case 2: TileW8A8<2>(a, ldq, s, quads, Q, corr, scale, o, N); break;
    case 1: TileW8A8<1>(a, ldq, s, quads, Q, corr, scale, o, N); break;
    default: break;
  }
}
#else
void PanelRowsW8A8(const uint8_t* q, const float* sx, int64_t m0, int64_t m1, int64_t K,
                   const int8_t* quads, const int32_t* corr, const float* scale, float* out,
                   int64_t N) {
  const int64_t Q = Quads(K), ldq = 4 * Q;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t j = 0; j < kLanes; ++j) {
      int32_t acc = corr[j];
      for (int64_t k = 0; k < 4 * Q; ++k)
        acc += static_cast<int32_t>(q[m * ldq + k]) * quads[((k / 4) * kLanes + j) * 4 + k % 4];
      out[m * N + j] = static_cast<float>(acc) * sx[m] * scale[j];
    }
}
#endif

// ---- The calls. ----

// "[2, 3]": an operand's dimensions, for the messages that refuse it.
std::string Dims(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// The weights' type: int8, or e4m3 (weight-only: its bytes are widened, never multiplied as
// integers).
ffi::Error CheckWeights(const ffi::AnyBuffer& w, bool w8a8) {
  const ffi::DataType t = w.element_type();
  if (t != ffi::DataType::S8 && t != ffi::DataType::F8E4M3FN) {
    return ffi::Error::InvalidArgument(
        "jaxserve's 8-bit matmuls take int8 or float8_e4m3fn weights; got element type " +
        std::to_string(static_cast<int>(t)) + ".");
  }
  if (t == ffi::DataType::F8E4M3FN && w8a8) {
    return ffi::Error::InvalidArgument(
        "float8_e4m3fn weights run weight-only here: int8_activations must be 0.");
  }
  return ffi::Error::Success();
}

// One work item: rows [m0, m1) against panel `panel` of one matrix (an expert's, when grouped).
struct Item {
  int64_t matrix, panel, m0, m1;
};

// What every item of a call reads: x, its quantized rows (W8A8 only), the weights and scales,
// and where the results go.
struct Operands {
  const float* x;     // [M, K]
  const uint8_t* q;   // [M, 4 * Quads(K)] xq + 128 (W8A8), else null
  const float* sx;    // [M] row scales (W8A8), else null
  const int8_t* w;    // [matrices, panels, K, 64]
  const float* scale; // [matrices, panels * 64]
  float* out;         // [M, N]
  int64_t K, panels;
};

// Runs `items` over the pool. For W8A8 each chunk interleaves a panel into its scratch when the
// item's (matrix, panel) differs from the last one it interleaved: items come in panel order.
void RunItems(ffi::ThreadPool& pool, const Operands& o, const std::vector<Item>& items,
              bool w8a8, bool fp8) {
  const int64_t K = o.K, N = o.panels * kLanes;
  std::vector<int64_t> cost(items.size());
  for (size_t i = 0; i < items.size(); ++i)
    cost[i] = (items[i].m1 - items[i].m0) * K * kLanes / 1024;  // thousands of multiply-adds
  // Below ~256K multiply-adds (a few microseconds) a second thread costs more than it saves.
  SplitByCost(pool, cost, 256, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> quads(w8a8 ? Quads(K) * 4 * kLanes : 0);
    alignas(64) int32_t corr[kLanes];
    int64_t have = -1;  // the (matrix, panel) quads holds, as matrix * panels + panel
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const int64_t id = it.matrix * o.panels + it.panel;
      const int8_t* panel = o.w + id * K * kLanes;
      const float* scale = o.scale + id * kLanes;
      float* out = o.out + it.panel * kLanes;
      if (!w8a8) {
        if (fp8) {
          PanelRowsW8<true>(o.x, it.m0, it.m1, K, panel, scale, out, N);
        } else {
          PanelRowsW8<false>(o.x, it.m0, it.m1, K, panel, scale, out, N);
        }
        continue;
      }
      if (id != have) InterleavePanel(panel, K, quads.data(), corr);
      have = id;
      PanelRowsW8A8(o.q, o.sx, it.m0, it.m1, K, quads.data(), corr, scale, out, N);
    }
  });
}

// Rows [0, used) of x, quantized for W8A8 into q and sx (sized here), else left alone.
void Prepare(ffi::ThreadPool& pool, Operands& o, int64_t used, bool w8a8,
             std::vector<uint8_t>& q, std::vector<float>& sx) {
  if (!w8a8) return;
  q.resize(used * 4 * Quads(o.K));
  sx.resize(used);
  QuantizeRows(pool, o.x, used, o.K, q.data(), sx.data());
  o.q = q.data();
  o.sx = sx.data();
}

ffi::Error PackedMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> valid,
                            ffi::ResultBuffer<ffi::F32> out, int64_t int8_activations) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scales.dimensions();
  const auto od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 1 || od.size() != 2 || wd[2] != kLanes ||
      wd[1] != xd[1] || sd[0] != wd[0] * kLanes || od[0] != xd[0] || od[1] != wd[0] * kLanes) {
    return ffi::Error::InvalidArgument(
        "jaxserve_packed_matmul_int8 takes x [M, K], int8 weights [N / 64, K, 64], scales [N] "
        "and out [M, N]; got x " + Dims(xd) + ", weights " + Dims(wd) + ", scales " + Dims(sd) +
        ", out " + Dims(od) + ".");
  }
  if (valid.element_count() != 1) {
    return ffi::Error::InvalidArgument("jaxserve_packed_matmul_int8 takes the number of real "
                                       "rows as one int32; got " +
                                       std::to_string(valid.element_count()) + " values.");
  }
  const int64_t K = xd[1], panels = wd[0], N = panels * kLanes;
  // With K = 0 every sum is empty: every row is 0. Rows past `valid`: padding, 0, uncomputed.
  const int64_t M = K > 0 ? std::clamp<int64_t>(valid.typed_data()[0], 0, xd[0]) : 0;
  std::fill(out->typed_data() + M * N, out->typed_data() + xd[0] * N, 0.0f);
  if (M == 0 || panels == 0) return ffi::Error::Success();
  const bool w8a8 = int8_activations != 0, fp8 = w.element_type() == ffi::DataType::F8E4M3FN;
  if (ffi::Error e = CheckWeights(w, w8a8); e.failure()) return e;
  Operands o{x.typed_data(), nullptr, nullptr, static_cast<const int8_t*>(w.untyped_data()),
             scales.typed_data(), out->typed_data(), K, panels};
  std::vector<uint8_t> q;
  std::vector<float> sx;
  Prepare(pool, o, M, w8a8, q, sx);
  // Panel-major, row groups inside: a thread's consecutive items share a panel.
  std::vector<Item> items;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t m0 = 0; m0 < M; m0 += kGroupRows)
      items.push_back({0, p, m0, std::min(M, m0 + kGroupRows)});
  RunItems(pool, o, items, w8a8, fp8);
  return ffi::Error::Success();
}

// cpu_matmul.cc's GroupedPackedMatmul over int8 experts: x's rows sorted by expert, group g's
// run of group_sizes[g] rows times expert g's int8 panels (w [G, N / 64, K, 64]) and scales
// (scales [G, N]). A negative size is 0, the runs stop at M, the rows after them are 0; an
// expert without rows is never read. A row's bits are PackedMatmulInt8's of that row alone.
ffi::Error GroupedPackedMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                   ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scales,
                                   ffi::Buffer<ffi::S32> group_sizes,
                                   ffi::ResultBuffer<ffi::F32> out, int64_t int8_activations) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scales.dimensions();
  const auto gd = group_sizes.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || sd.size() != 2 || gd.size() != 1 || od.size() != 2 ||
      wd[3] != kLanes || wd[2] != xd[1] || sd[0] != wd[0] || sd[1] != wd[1] * kLanes ||
      gd[0] != wd[0] || od[0] != xd[0] || od[1] != wd[1] * kLanes) {
    return ffi::Error::InvalidArgument(
        "jaxserve_grouped_packed_matmul_int8 takes x [M, K], int8 weights [G, N / 64, K, 64], "
        "scales [G, N], group sizes [G] and out [M, N]; got x " + Dims(xd) + ", weights " +
        Dims(wd) + ", scales " + Dims(sd) + ", group sizes " + Dims(gd) + ", out " + Dims(od) +
        ".");
  }
  const int64_t M = xd[0], K = xd[1], G = wd[0], panels = wd[1], N = panels * kLanes;
  const int32_t* sizes = group_sizes.typed_data();
  // starts[g]: group g's first row; in int64, so sizes near INT32_MAX do not overflow the sum.
  std::vector<int64_t> starts(G + 1, 0);
  for (int64_t g = 0; g < G; ++g)
    starts[g + 1] = std::min<int64_t>(M, starts[g] + std::max<int32_t>(sizes[g], 0));
  const int64_t used = K > 0 ? starts[G] : 0;  // with K = 0 every sum is empty: 0
  std::fill(out->typed_data() + used * N, out->typed_data() + M * N, 0.0f);
  if (used == 0 || panels == 0) return ffi::Error::Success();
  const bool w8a8 = int8_activations != 0, fp8 = w.element_type() == ffi::DataType::F8E4M3FN;
  if (ffi::Error e = CheckWeights(w, w8a8); e.failure()) return e;
  Operands o{x.typed_data(), nullptr, nullptr, static_cast<const int8_t*>(w.untyped_data()),
             scales.typed_data(), out->typed_data(), K, panels};
  std::vector<uint8_t> q;
  std::vector<float> sx;
  Prepare(pool, o, used, w8a8, q, sx);
  // (group, panel, chunk of kGroupRows rows) in that order; a group without rows has none.
  std::vector<Item> items;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t p = 0; p < panels; ++p)
      for (int64_t m0 = starts[g]; m0 < starts[g + 1]; m0 += kGroupRows)
        items.push_back({g, p, m0, std::min(starts[g + 1], m0 + kGroupRows)});
  RunItems(pool, o, items, w8a8, fp8);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmulInt8, PackedMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // i8 | f8e4m3 weights [N / 64, K, 64]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // real rows [] (the rest: 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N]
                                  .Attr<int64_t>("int8_activations"));  // 1: W8A8

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGroupedPackedMatmulInt8, GroupedPackedMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K], sorted by group
                                  .Arg<ffi::AnyBuffer>()  // i8 | f8e4m3 weights [G, N / 64, K, 64]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [G, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group sizes [G]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N]
                                  .Attr<int64_t>("int8_activations"));  // 1: W8A8
