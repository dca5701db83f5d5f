// Ragged paged attention for the CPU, as an XLA FFI custom call (see attention.py for the build and the
// contract, which is the same as reference.py's).
//
// Why it exists: in XLA the attention of a decode step gathers every sequence's pages into a fresh array and
// transposes it before the dots, reading and writing the KV data several times over. Here each page is read once,
// in place, with an online softmax per block of keys. Work items are (sequence, tile of query rows), shared among
// XLA's CPU threads; each item's arithmetic depends only on its own sequence, so a row's output does not depend on what
// else is in the batch.
//
// Pages hold q's dtype (float32, or bfloat16 as its 16-bit words) or float8_e4m3fn (`--kv-cache-dtype fp8`, under
// float32 or bfloat16 queries), widened to float as they are read. The K scale is folded into the scores' scale and
// the V scale into the output's normalisation, so no page element is multiplied by one.
//
// Sinks (gpt-oss), when given, are a logit a query head that joins each row's softmax denominator and has no value:
// every path starts a row's softmax from its head's sink (running maximum the sink, running sum 1).
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernel.h"

namespace {

using namespace jpaged;

constexpr float kNeg = -1e30f;  // finite "minus infinity", as in reference.py
constexpr int kRowTile = 16;    // query rows per work item: a tile's keys stay in cache across its rows
// Blocks whose K and V take at most this many bytes together are streamed in whole (see Touch). Bigger ones are
// not: their lines leave L1 before the heads use them, which measured slower (scripts/KERNELS.md).
constexpr int64_t kStreamBytes = 64 * 1024;

struct Problem {
  int num_kv_heads, group, head_dim, block_size, table_width, num_blocks;
  float scale, soft_cap;  // scale: sm_scale * k_scale; soft_cap 0: none
  float v_scale;          // multiplies every output (what the V pages hold, times it, is what they mean)
  int window;             // <= 0: none (read from the window operand at run time: one program serves every layer)
  const float* sinks;     // [Hq], head h * group + g's at that index, finite (common.sinks_operand); nullptr: none
  const int32_t* kv_lens;
  const int32_t* block_tables;
  const int32_t* query_start;
};

struct Item {
  int seq, row0, rows;
};

// A float8_e4m3fn page element: sign, four exponent bits (bias 7), three mantissa bits; no infinities, and S.1111.111
// is NaN. A type of its own, so its loads never mix with other 8-bit data's.
struct E4M3 {
  uint8_t bits;
};

// Every e4m3 value as a float, indexed by its bits: a page row is widened by lookups.
const std::array<float, 256> kE4M3 = [] {
  std::array<float, 256> table{};
  for (int x = 0; x < 256; ++x) {
    const int e = (x >> 3) & 15, m = x & 7;
    float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(8 + m), e - 10);
    if ((x & 0x7F) == 0x7F) v = std::numeric_limits<float>::quiet_NaN();
    table[x] = x & 0x80 ? -v : v;
  }
  return table;
}();

using jpaged::Load;  // beside the overloads below, which would otherwise hide kernel.h's
using jpaged::ToFloat;
inline float ToFloat(E4M3 x) { return kE4M3[x.bits]; }
inline V8 Load(const E4M3* x) {
  V8 v;
  for (int i = 0; i < 8; ++i) v[i] = kE4M3[x[i].bits];
  return v;
}

// s[0:count] = exp(s[0:count] - shift), returning their sum. Vectors of eight: a decode step takes one exp per cached
// token and query head, which one by one was a large part of its attention (scripts/KERNELS.md).
inline float ExpShifted(float* s, int count, float shift) {
  V8 sum = {};
  int j = 0;
  for (; j + 8 <= count; j += 8) {
    const V8 e = Exp(Load(s + j) - shift);
    Store(s + j, e);
    sum += e;
  }
  float total = Sum(sum);
  for (; j < count; ++j) {
    s[j] = std::exp(s[j] - shift);
    total += s[j];
  }
  return total;
}

// A page row of one head as floats: in place for float32, converted into `buffer` for bfloat16 and e4m3.
inline const float* Row(const float* src, float*, int) { return src; }
template <typename P>
inline const float* Row(const P* src, float* buffer, int D) {
  for (int d = 0; d < D; ++d) buffer[d] = ToFloat(src[d]);
  return buffer;
}

// Loads every cache line of two arrays of `bytes` in address order (the two interleaved), discarding the values.
// The heads' passes over a block read it strided (one head's slice of each token row); reading K and V front to
// back first lets the memory system stream them.
inline void Touch(const void* a, const void* b, int64_t bytes) {
  typedef uint32_t Bits8 __attribute__((vector_size(32), aligned(4), may_alias));  // integers: no float assists
  const char* a_bytes = static_cast<const char*>(a);
  const char* b_bytes = static_cast<const char*>(b);
  Bits8 sink = {};
  for (int64_t offset = 0; offset + 32 <= bytes; offset += 64)
    sink |= *reinterpret_cast<const Bits8*>(a_bytes + offset) | *reinterpret_cast<const Bits8*>(b_bytes + offset);
  asm volatile("" : "+m"(sink));  // the loads are kept though the result is never used
}

// Asks for the cache lines of bytes [begin, end) of two arrays ahead of their use: into L1 (kLocality 3) or L2 (1).
template <int kLocality>
inline void Prefetch(const char* a, const char* b, int64_t begin, int64_t end) {
  for (int64_t offset = begin / 64 * 64; offset < end; offset += 64) {
    __builtin_prefetch(a + offset, 0, kLocality);
    __builtin_prefetch(b + offset, 0, kLocality);
  }
}

// Query vectors whose dots and P.V are taken together (AttendItem says where): three queries' 32-float chunks of
// P.V fill AVX2's sixteen registers.
constexpr int kGroup = 3;

// scores[j] = q . keys[j] for `count` keys, eight at a time: independent accumulators keep the FMA units busy
// (one dot alone waits on its own chain of additions).
template <typename R>
inline void Dots(const float* q, const R* const* keys, int count, int D, float* scores) {
  int j = 0;
  for (; j + 8 <= count; j += 8) {
    V8 a[8] = {};
    for (int d = 0; d < D; d += 8) {
      const V8 qv = Load(q + d);
      for (int k = 0; k < 8; ++k) a[k] += qv * Load(keys[j + k] + d);
    }
    for (int k = 0; k < 8; ++k) scores[j + k] = Sum(a[k]);
  }
  for (; j < count; ++j) {
    V8 a = {};
    for (int d = 0; d < D; d += 8) a += Load(q + d) * Load(keys[j] + d);
    scores[j] = Sum(a);
  }
}

// The sums of four vectors, a's first, each added in Sum's order: shuffles pair the four vectors' lanes, so four
// vector additions replace four horizontal sums.
inline void Sum4(V8 a, V8 b, V8 c, V8 d, float* sums) {
  const V8 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);  // a0+a4..a3+a7, b0+b4..b3+b7
  const V8 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
  const V8 pairs = __builtin_shufflevector(ab, cd, 0, 2, 4, 6, 8, 10, 12, 14) +
                   __builtin_shufflevector(ab, cd, 1, 3, 5, 7, 9, 11, 13, 15);  // (0+4)+(1+5), (2+6)+(3+7) of each
  const V8 total = __builtin_shufflevector(pairs, pairs, 0, 2, 4, 6, 0, 2, 4, 6) +
                   __builtin_shufflevector(pairs, pairs, 1, 3, 5, 7, 1, 3, 5, 7);
  std::memcpy(sums, &total, 4 * sizeof(float));
}

// scores[g * stride + j] = queries_g . keys[j] for kGroup queries (`queries` [kGroup][D]), four keys at a time.
// Each key vector is loaded once for the three queries (widened in registers, for bfloat16 page rows), twelve
// chains keep the FMA units busy, and the sums are taken four at a time. A short last four repeats its last key.
template <typename R>
inline void DotsOfGroup(const float* queries, const R* const* keys, int count, int D, float* scores, int stride) {
  constexpr int J = 4;
  for (int j0 = 0; j0 < count; j0 += J) {
    const int last = std::min(J, count - j0) - 1;
    const R* k[J];
    for (int t = 0; t < J; ++t) k[t] = keys[j0 + std::min(t, last)];
    V8 a[kGroup][J] = {};
    for (int d = 0; d < D; d += 8) {
      V8 q[kGroup];
      for (int g = 0; g < kGroup; ++g) q[g] = Load(queries + g * D + d);
      for (int t = 0; t < J; ++t) {
        const V8 key = Load(k[t] + d);
        for (int g = 0; g < kGroup; ++g) a[g][t] += q[g] * key;
      }
    }
    for (int g = 0; g < kGroup; ++g) {
      float sums[J];  // a full four's go straight to `scores` (a copy of them compiled to a slow `rep movs`)
      float* dst = last == J - 1 ? scores + g * stride + j0 : sums;
      Sum4(a[g][0], a[g][1], a[g][2], a[g][3], dst);
      if (dst == sums)
        for (int t = 0; t <= last; ++t) scores[g * stride + j0 + t] = sums[t];
    }
  }
}

// The dots of `nq` queries: together where they are a group, else one by one.
template <typename R>
inline void GroupDots(int nq, const float* queries, const R* const* keys, int count, int D, float* scores,
                      int stride) {
  if (nq == kGroup) return DotsOfGroup(queries, keys, count, D, scores, stride);
  for (int g = 0; g < nq; ++g) Dots(queries + g * D, keys, count, D, scores + g * stride);
}

// Whether DotsOnWords takes this cache's dots: bfloat16 words on a CPU with AVX-512-BF16, head dims of 32 words.
template <typename T>
inline bool OnWords(const T*, int) {
  return false;
}
#if defined(__AVX512BF16__)
inline bool OnWords(const uint16_t*, int D) { return D % 32 == 0; }

// scores[j] = scale * q . keys[j * stride] on the bfloat16 words by vdpbf16ps, 32 at a time, float32 sums: no
// widening of the keys into a float buffer first. (Products of two bfloat16 are exact in float32, as widened.)
inline void DotsOnWords(const uint16_t* q, const uint16_t* keys, int64_t stride, int count, int D, float scale,
                        float* scores) {
  for (int j = 0; j < count; ++j) {
    const uint16_t* key = keys + j * stride;
    __m512 sum = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32)
      sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(key + d), (__m512bh)_mm512_loadu_si512(q + d));
    scores[j] = _mm512_reduce_add_ps(sum) * scale;
  }
}
#endif
// The other caches' stand-in, for AttendItem to compile: OnWords is false for them, so it is never called.
template <typename T, typename P>
inline void DotsOnWords(const T*, const P*, int64_t, int, int, float, float*) {}

// scores[r * stride + j] = q_r . keys[j] for eight queries given transposed (`queries_t` [D][8]): each key row
// element is broadcast against eight queries at once, so no horizontal sums; eight keys keep eight chains going.
inline void Dots8(const float* queries_t, const float* const* keys, int count, int D, float* scores, int stride) {
  for (int j0 = 0; j0 < count; j0 += 8) {
    const int last = std::min(8, count - j0) - 1;  // a short group repeats its last key
    const float *k0 = keys[j0], *k1 = keys[j0 + std::min(1, last)], *k2 = keys[j0 + std::min(2, last)],
                *k3 = keys[j0 + std::min(3, last)], *k4 = keys[j0 + std::min(4, last)],
                *k5 = keys[j0 + std::min(5, last)], *k6 = keys[j0 + std::min(6, last)], *k7 = keys[j0 + last];
    V8 a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {}, a5 = {}, a6 = {}, a7 = {};
    for (int d = 0; d < D; ++d) {  // named accumulators: GCC spills an array of them to the stack
      const V8 qv = Load(queries_t + 8 * d);
      a0 += qv * k0[d];
      a1 += qv * k1[d];
      a2 += qv * k2[d];
      a3 += qv * k3[d];
      a4 += qv * k4[d];
      a5 += qv * k5[d];
      a6 += qv * k6[d];
      a7 += qv * k7[d];
    }
    const V8 a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int k = 0; k <= last; ++k)
      for (int r = 0; r < 8; ++r) scores[r * stride + j0 + k] = a[k][r];
  }
}

// acc[0:8*NV] += sum_j weights[j] * values[j][offset : offset + 8*NV], the accumulator held in registers across the
// keys.
template <int NV, typename R>
inline void AccumulateChunk(float* acc, const float* weights, const R* const* values, int count, int offset) {
  V8 a[NV];
  for (int c = 0; c < NV; ++c) a[c] = Load(acc + 8 * c);
  for (int j = 0; j < count; ++j) {
    const V8 w = V8{} + weights[j];
    const R* v = values[j] + offset;
    for (int c = 0; c < NV; ++c) a[c] += w * Load(v + 8 * c);
  }
  for (int c = 0; c < NV; ++c) Store(acc + 8 * c, a[c]);
}

template <typename R>
inline void Accumulate(float* acc, const float* weights, const R* const* values, int count, int D) {
  int d = 0;
  for (; d + 64 <= D; d += 64) AccumulateChunk<8>(acc + d, weights, values, count, d);
  switch ((D - d) / 8) {  // head dims that are not a multiple of 64 (80, 96...)
    case 1: return AccumulateChunk<1>(acc + d, weights, values, count, d);
    case 2: return AccumulateChunk<2>(acc + d, weights, values, count, d);
    case 3: return AccumulateChunk<3>(acc + d, weights, values, count, d);
    case 4: return AccumulateChunk<4>(acc + d, weights, values, count, d);
    case 5: return AccumulateChunk<5>(acc + d, weights, values, count, d);
    case 6: return AccumulateChunk<6>(acc + d, weights, values, count, d);
    case 7: return AccumulateChunk<7>(acc + d, weights, values, count, d);
  }
}

// The same for kGroup queries at once, query g's accumulator at acc + g * D, its weights at weights + g * stride,
// each first scaled by correction[g]: a value vector is loaded (widened, for bfloat16 page rows) once for the
// three. 32 floats at a time: AVX2's sixteen registers hold the 12 accumulators, the weights and a value vector.
template <int NV, typename R>
inline void AccumulateGroupChunk(float* acc, const float* correction, const float* weights, int stride,
                                 const R* const* values, int count, int D, int offset) {
  V8 a[kGroup][NV];
  for (int g = 0; g < kGroup; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = Load(acc + g * D + offset + 8 * c) * correction[g];
  for (int j = 0; j < count; ++j) {
    V8 w[kGroup];
    for (int g = 0; g < kGroup; ++g) w[g] = V8{} + weights[g * stride + j];
    const R* v = values[j] + offset;
    for (int c = 0; c < NV; ++c) {
      const V8 x = Load(v + 8 * c);
      for (int g = 0; g < kGroup; ++g) a[g][c] += w[g] * x;
    }
  }
  for (int g = 0; g < kGroup; ++g)
    for (int c = 0; c < NV; ++c) Store(acc + g * D + offset + 8 * c, a[g][c]);
}

// P.V of `nq` queries: together where they are a group, else one by one.
template <typename R>
inline void GroupAccumulate(int nq, float* acc, const float* correction, const float* weights, int stride,
                            const R* const* values, int count, int D) {
  if (nq == kGroup) {
    int d = 0;
    for (; d + 32 <= D; d += 32) AccumulateGroupChunk<4>(acc, correction, weights, stride, values, count, D, d);
    for (; d < D; d += 8) AccumulateGroupChunk<1>(acc, correction, weights, stride, values, count, D, d);
    return;
  }
  for (int g = 0; g < nq; ++g) {
    float* a = acc + g * D;
    if (correction[g] != 1.0f)
      for (int d = 0; d < D; ++d) a[d] *= correction[g];
    Accumulate(a, weights + g * stride, values, count, D);
  }
}

#if defined(__AVX512BF16__)
// The sixteen sums of v[0..15]'s lanes as one vector (lane j: v[j]'s), by shuffles pairing the vectors: three
// operations a sum instead of _mm512_reduce_add_ps's eight.
inline __m512 Sums16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Word indices that interleave two rows of 32 words (a, b) column by column: (a[i], b[i]) for i in [16h, 16h + 16).
inline __m512i InterleaveIndex(int half) {
  alignas(64) uint16_t index[32];
  for (int i = 0; i < 16; ++i) {
    index[2 * i] = static_cast<uint16_t>(16 * half + i);
    index[2 * i + 1] = static_cast<uint16_t>(32 + 16 * half + i);
  }
  return _mm512_load_si512(index);
}

// Value rows j and j + 1 (D = 32 * DW words each; `row1` is row0 again for an odd last key, whose pair weighs
// zero) as D 32-bit words, (row0[d], row1[d]) for each column d, in 2 * DW registers: the pairs vdpbf16ps takes
// against a (weight j, weight j + 1) pair.
template <int DW>
inline void InterleaveRows(const uint16_t* row0, const uint16_t* row1, __m512i low, __m512i high, __m512i* pairs) {
  for (int c = 0; c < DW; ++c) {
    const __m512i a = _mm512_loadu_si512(row0 + 32 * c), r = _mm512_loadu_si512(row1 + 32 * c);
    pairs[2 * c] = _mm512_permutex2var_epi16(a, low, r);
    pairs[2 * c + 1] = _mm512_permutex2var_epi16(a, high, r);
  }
}

// One query row that sees every key up to its own (a decode row, or a prefill tile's lone last row), with no window
// or soft cap, over bfloat16 pages on a CPU with AVX-512-BF16. Two passes instead of an online softmax: every key's
// score first (vdpbf16ps dots, sixteen keys' sums at a time), one softmax over the whole row, then P.V by vdpbf16ps
// on pairs of value rows against the weights rounded to bfloat16 (as a GPU's attention rounds them for its P.V
// matmul). That is fewer operations a key than AttendItem's online softmax (its per-block maxima, rescaling and
// scalar exps, a horizontal sum a dot, float32 P.V on widened rows): scripts/KERNELS.md has the A/B. DW is D / 32;
// NG query heads of a group share each loaded pair of value rows.
template <int DW, int NG>
bool AttendRowOnWords(const Problem& p, const uint16_t* q_row, const uint16_t* k_layer, const uint16_t* v_layer,
                      uint16_t* out_row, int seq, int num_keys, std::vector<float>& scratch) {
  constexpr int D = 32 * DW;
  const int G = p.group, Hk = p.num_kv_heads, B = p.block_size, Q = Hk * G;
  const int padded = (num_keys + 31) / 32 * 32;  // a row's scores and weights: whole vectors and key pairs
  const int64_t stride = static_cast<int64_t>(Hk) * D;  // words between a page's tokens
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.table_width;
  const int num_blocks = (num_keys + B - 1) / B;
  for (int b = 0; b < num_blocks; ++b)
    if (table[b] < 0 || table[b] >= p.num_blocks) return false;
  scratch.resize(static_cast<size_t>(Q) * (padded * 3 / 2 + 1));
  float* scores = scratch.data();                                       // [Q][padded]
  float* inverse = scores + static_cast<size_t>(Q) * padded;            // [Q]: 1 / the sum of a row's weights
  uint16_t* weights = reinterpret_cast<uint16_t*>(inverse + Q);         // [Q][padded]
  auto page = [&](const uint16_t* layer, int b) { return layer + static_cast<int64_t>(table[b]) * B * stride; };
  auto keys_in = [&](int b) { return std::min(B, num_keys - b * B); };
  const int64_t block_bytes = static_cast<int64_t>(B) * stride * 2;
  const bool stream = 2 * block_bytes <= kStreamBytes;
  // Each block's K and V are read front to back before its dots (Touch), the next block's asked for into L1 and the
  // one after's into L2 meanwhile, a head's share at a time, as AttendItem does (and, as there, only for blocks it
  // streams); the values wait in L2 for pass 2.
  auto prefetch = [&](int b, int h) {
    if (!stream) return;
    const int64_t begin = block_bytes * h / Hk, end = block_bytes * (h + 1) / Hk;
    for (int a = 1; a <= 2 && b + a < num_blocks; ++a) {
      const char* k = reinterpret_cast<const char*>(page(k_layer, b + a));
      const char* v = reinterpret_cast<const char*>(page(v_layer, b + a));
      if (a == 1) Prefetch<3>(k, v, begin, end);
      else Prefetch<1>(k, v, begin, end);
    }
  };

  // Pass 1: scores[h * G + g][key] = scale * q . key.
  for (int b = 0; b < num_blocks; ++b) {
    const uint16_t* k_block = page(k_layer, b);
    const int count = keys_in(b);
    if (stream) Touch(k_block, page(v_layer, b), block_bytes);
    for (int h = 0; h < Hk; ++h) {
      prefetch(b, h);
      for (int g = 0; g < G; ++g) {
        const uint16_t* q = q_row + (h * G + g) * D;
        __m512bh qv[DW];
        for (int c = 0; c < DW; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
        float* s = scores + static_cast<size_t>(h * G + g) * padded + b * B;
        for (int j0 = 0; j0 < count; j0 += 16) {
          const int n = std::min(16, count - j0);
          __m512 sums[16];
          for (int t = 0; t < 16; ++t) {
            sums[t] = _mm512_setzero_ps();
            if (t >= n) continue;
            const uint16_t* key = k_block + (j0 + t) * stride + h * D;
            for (int c = 0; c < DW; ++c)
              sums[t] = _mm512_dpbf16_ps(sums[t], (__m512bh)_mm512_loadu_si512(key + 32 * c), qv[c]);
          }
          _mm512_mask_storeu_ps(s + j0, static_cast<__mmask16>((1u << n) - 1),
                                _mm512_mul_ps(Sums16(sums), _mm512_set1_ps(p.scale)));
        }
      }
    }
  }

  // The softmax of each query's row: weights rounded to bfloat16 (zero past the last key), and their float sum.
  for (int i = 0; i < Q; ++i) {
    const float* s = scores + static_cast<size_t>(i) * padded;
    auto valid = [&](int j) {  // the lanes of keys [j, j + 16) that exist
      return static_cast<__mmask16>(j + 16 <= num_keys ? 0xFFFF : (1u << std::max(0, num_keys - j)) - 1);
    };
    __m512 top = _mm512_set1_ps(kNeg);
    for (int j = 0; j < num_keys; j += 16) top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, valid(j), s + j));
    float peak = _mm512_reduce_max_ps(top);
    if (p.sinks) peak = std::max(peak, p.sinks[i]);  // query head i's sink joins the row's softmax
    const __m512 shift = _mm512_set1_ps(peak);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < padded; j += 16) {
      const __mmask16 mask = valid(j);
      const __m512 e = _mm512_maskz_mov_ps(mask, Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), shift)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + static_cast<size_t>(i) * padded + j),
                          (__m256i)_mm512_cvtneps_pbh(e));
    }
    const float total = _mm512_reduce_add_ps(sum) + (p.sinks ? std::exp(p.sinks[i] - peak) : 0.0f);
    inverse[i] = p.v_scale / std::max(total, 1e-30f);
  }

  // Pass 2: P.V, two keys a step: their value rows interleaved column by column against their weights' pair.
  const __m512i low = InterleaveIndex(0), high = InterleaveIndex(1);
  for (int h = 0; h < Hk; ++h)
    for (int g0 = 0; g0 < G; g0 += NG) {
      __m512 acc[NG][2 * DW];
      for (int g = 0; g < NG; ++g)
        for (int c = 0; c < 2 * DW; ++c) acc[g][c] = _mm512_setzero_ps();
      for (int b = 0; b < num_blocks; ++b) {
        const uint16_t* v_block = page(v_layer, b) + h * D;
        const int count = keys_in(b);
        for (int j = 0; j < count; j += 2) {
          const uint16_t* row0 = v_block + j * stride;
          __m512i pairs[2 * DW];
          InterleaveRows<DW>(row0, j + 1 < count ? row0 + stride : row0, low, high, pairs);
          const int key = b * B + j;
          for (int g = 0; g < NG; ++g) {
            uint32_t pair;
            std::memcpy(&pair, weights + static_cast<size_t>(h * G + g0 + g) * padded + key, sizeof pair);
            const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
            for (int c = 0; c < 2 * DW; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], (__m512bh)pairs[c], w);
          }
        }
      }
      for (int g = 0; g < NG; ++g) {
        const int i = h * G + g0 + g;
        alignas(64) float row[D];
        for (int c = 0; c < 2 * DW; ++c)
          _mm512_store_ps(row + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inverse[i])));
        for (int d = 0; d < D; ++d) FromFloat(row[d], out_row + i * D + d);
      }
    }
  return true;
}

// A prefill tile's query rows (more than one) with no window or soft cap, over bfloat16 pages on a CPU with
// AVX-512-BF16, as the matmul kernel multiplies: sixteen query vectors a register. Their (d, d + 1) word pairs are
// laid out once per KV head as panels (`panel`, [NG][D/2][16] words), and each key's pairs are broadcast straight
// from its page against them, so a vdpbf16ps gives sixteen queries' partial dots and no block is transposed or
// widened. The online softmax then runs across sixteen queries a register (a key's masks, maxima and exps for all of
// them at once), and P.V is a product of the weights, rounded to bfloat16 in (key, key + 1) pairs, against the
// value rows interleaved in pairs and broadcast a word at a time. `base` is the pass's first query vector of this
// KV head (query i: the tile's row i / G, head h * G + i % G); NG registers of queries at a time.
template <int DW, int NG>
void AttendQueriesOnWords(const Problem& p, const uint16_t* q_rows, const uint16_t* k_layer, const uint16_t* v_layer,
                          uint16_t* out_rows, int h, int base, int n, int first_pos, const int32_t* table,
                          int num_blocks, float* scratch) {
  constexpr int D = 32 * DW, kPairs = D / 2, kLanes = 16;
  const int G = p.group, Hk = p.num_kv_heads, B = p.block_size;
  const int64_t stride = static_cast<int64_t>(Hk) * D;  // words between a page's tokens, and between query rows' heads
  uint32_t* panel = reinterpret_cast<uint32_t*>(scratch);             // [NG][kPairs][16]
  float* acc = scratch + NG * kPairs * kLanes;                        // [D][NG][16]
  float* scores = acc + D * NG * kLanes;                              // [B][NG][16]
  uint32_t* weights = reinterpret_cast<uint32_t*>(scores + B * NG * kLanes);  // [B / 2][NG][16]
  uint32_t* values = weights + B / 2 * NG * kLanes;                  // [B / 2][D]
  __m512i pos[NG];  // each lane's query position; -1 for lanes past the tile's queries, which then see nothing
  for (int g = 0; g < NG; ++g) {
    alignas(64) int32_t lanes[kLanes];
    for (int lane = 0; lane < kLanes; ++lane) {
      const int i = base + g * kLanes + lane;
      lanes[lane] = i < n ? first_pos + i / G : -1;
      for (int t = 0; t < kPairs; ++t) {
        uint32_t word = 0;
        if (i < n) std::memcpy(&word, q_rows + (i / G) * Hk * G * D + (h * G + i % G) * D + 2 * t, sizeof word);
        panel[(g * kPairs + t) * kLanes + lane] = word;
      }
    }
    pos[g] = _mm512_load_si512(lanes);
  }
  std::fill(acc, acc + D * NG * kLanes, 0.0f);
  __m512 max[NG], sum[NG], correction[NG];
  for (int g = 0; g < NG; ++g) max[g] = _mm512_set1_ps(kNeg), sum[g] = _mm512_setzero_ps();
  if (p.sinks)  // each query's softmax starts from its head's sink: maximum the sink, sum 1
    for (int g = 0; g < NG; ++g) {
      alignas(64) float sinks[kLanes];
      for (int lane = 0; lane < kLanes; ++lane) sinks[lane] = p.sinks[h * G + (base + g * kLanes + lane) % G];
      max[g] = _mm512_load_ps(sinks), sum[g] = _mm512_set1_ps(1.0f);
    }
  const __m512i low = InterleaveIndex(0), high = InterleaveIndex(1), pair_lanes = PairIndex();
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int b = 0; b < num_blocks; ++b) {
    const int key0 = b * B, count = std::min(B, first_pos + (n - 1) / G + 1 - key0);
    const uint16_t* k_block = k_layer + static_cast<int64_t>(table[b]) * B * stride + h * D;
    const uint16_t* v_block = v_layer + static_cast<int64_t>(table[b]) * B * stride + h * D;
    // Scores of four keys at a time (a short last four repeats its last key).
    for (int j0 = 0; j0 < count; j0 += 4) {
      __m512 s[4][NG];
      for (int t = 0; t < 4; ++t)
        for (int g = 0; g < NG; ++g) s[t][g] = _mm512_setzero_ps();
      const uint16_t* key[4];
      for (int t = 0; t < 4; ++t) key[t] = k_block + std::min(j0 + t, count - 1) * stride;
      for (int c = 0; c < kPairs; ++c) {
        __m512bh qv[NG];
        for (int g = 0; g < NG; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(panel + (g * kPairs + c) * kLanes);
        for (int t = 0; t < 4; ++t) {
          uint32_t word;
          std::memcpy(&word, key[t] + 2 * c, sizeof word);
          const __m512bh kv = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
          for (int g = 0; g < NG; ++g) s[t][g] = _mm512_dpbf16_ps(s[t][g], qv[g], kv);
        }
      }
      for (int t = 0; t < 4 && j0 + t < count; ++t)
        for (int g = 0; g < NG; ++g)
          _mm512_storeu_ps(scores + ((j0 + t) * NG + g) * kLanes, _mm512_mul_ps(s[t][g], scale));
    }
    // The online softmax, sixteen queries a register: keys past a query's position are masked out.
    for (int g = 0; g < NG; ++g) {
      __m512 block_max = _mm512_set1_ps(kNeg);
      for (int j = 0; j < count; ++j) {
        const __mmask16 visible = _mm512_cmpge_epi32_mask(pos[g], _mm512_set1_epi32(key0 + j));
        float* s = scores + (j * NG + g) * kLanes;
        block_max = _mm512_mask_max_ps(block_max, visible, block_max, _mm512_loadu_ps(s));
      }
      const __m512 new_max = _mm512_max_ps(max[g], block_max);
      correction[g] = Exp(_mm512_sub_ps(max[g], new_max));
      max[g] = new_max;
      __m512 block_sum = _mm512_setzero_ps();
      for (int j = 0; j < count; ++j) {
        const __mmask16 visible = _mm512_cmpge_epi32_mask(pos[g], _mm512_set1_epi32(key0 + j));
        float* s = scores + (j * NG + g) * kLanes;
        const __m512 e = _mm512_maskz_mov_ps(visible, Exp(_mm512_sub_ps(_mm512_loadu_ps(s), new_max)));
        block_sum = _mm512_add_ps(block_sum, e);
        _mm512_storeu_ps(s, e);
      }
      sum[g] = _mm512_add_ps(_mm512_mul_ps(sum[g], correction[g]), block_sum);
      for (int j = 0; j < count; j += 2) {  // (key j, key j + 1) weight pairs; an odd last key's partner weighs 0
        const __m512 a = _mm512_loadu_ps(scores + (j * NG + g) * kLanes);
        const __m512 r = j + 1 < count ? _mm512_loadu_ps(scores + ((j + 1) * NG + g) * kLanes) : _mm512_setzero_ps();
        const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(r, a);  // a's sixteen words, then r's
        _mm512_storeu_si512(weights + (j / 2 * NG + g) * kLanes, _mm512_permutexvar_epi16(pair_lanes, words));
      }
    }
    // The value rows in (key j, key j + 1) word pairs, column by column.
    for (int j = 0; j < count; j += 2) {
      const uint16_t* row0 = v_block + j * stride;
      __m512i pairs[2 * DW];
      InterleaveRows<DW>(row0, j + 1 < count ? row0 + stride : row0, low, high, pairs);
      for (int c = 0; c < 2 * DW; ++c) _mm512_storeu_si512(values + j / 2 * D + 16 * c, pairs[c]);
    }
    // P.V, eight columns at a time: acc[d] = acc[d] * correction + sum over key pairs of weights . values[d].
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m512 a[8][NG];
      for (int dd = 0; dd < 8; ++dd)
        for (int g = 0; g < NG; ++g)
          a[dd][g] = _mm512_mul_ps(_mm512_loadu_ps(acc + ((d0 + dd) * NG + g) * kLanes), correction[g]);
      for (int j = 0; j < count; j += 2) {
        __m512bh w[NG];
        for (int g = 0; g < NG; ++g) w[g] = (__m512bh)_mm512_loadu_si512(weights + (j / 2 * NG + g) * kLanes);
        for (int dd = 0; dd < 8; ++dd) {
          const __m512bh v = (__m512bh)_mm512_set1_epi32(static_cast<int>(values[j / 2 * D + d0 + dd]));
          for (int g = 0; g < NG; ++g) a[dd][g] = _mm512_dpbf16_ps(a[dd][g], w[g], v);
        }
      }
      for (int dd = 0; dd < 8; ++dd)
        for (int g = 0; g < NG; ++g) _mm512_storeu_ps(acc + ((d0 + dd) * NG + g) * kLanes, a[dd][g]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    alignas(64) float inverse[kLanes];
    _mm512_store_ps(inverse,
                    _mm512_div_ps(_mm512_set1_ps(p.v_scale), _mm512_max_ps(sum[g], _mm512_set1_ps(1e-30f))));
    for (int lane = 0; lane < kLanes; ++lane) {
      const int i = base + g * kLanes + lane;
      if (i >= n) break;
      uint16_t* dst = out_rows + (i / G) * Hk * G * D + (h * G + i % G) * D;
      for (int d = 0; d < D; ++d) FromFloat(acc[(d * NG + g) * kLanes + lane] * inverse[lane], dst + d);
    }
  }
}

// A tile's rows by AttendQueriesOnWords, each KV head's query vectors in passes of up to three registers.
template <int DW>
bool TileOnWords(const Problem& p, const uint16_t* q_rows, const uint16_t* k_layer, const uint16_t* v_layer,
                 uint16_t* out_rows, int seq, int rows, int first_pos, std::vector<float>& scratch) {
  constexpr int kMaxRegisters = 3, kLanes = 16, D = 32 * DW;
  const int n = rows * p.group, B = p.block_size;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.table_width;
  const int num_blocks = (first_pos + rows - 1) / B + 1;
  for (int b = 0; b < num_blocks; ++b)
    if (table[b] < 0 || table[b] >= p.num_blocks) return false;
  scratch.resize(static_cast<size_t>(kMaxRegisters) * kLanes * (D / 2 + D + B + B / 2) +
                 static_cast<size_t>(B / 2) * D);
  for (int h = 0; h < p.num_kv_heads; ++h)
    for (int base = 0; base < n; base += kMaxRegisters * kLanes) {
      auto pass = [&](auto ng) {
        AttendQueriesOnWords<DW, decltype(ng)::value>(p, q_rows, k_layer, v_layer, out_rows, h, base, n, first_pos,
                                                      table, num_blocks, scratch.data());
      };
      switch (std::min(kMaxRegisters, (n - base + kLanes - 1) / kLanes)) {
        case 1: pass(std::integral_constant<int, 1>{}); break;
        case 2: pass(std::integral_constant<int, 2>{}); break;
        default: pass(std::integral_constant<int, 3>{});
      }
    }
  return true;
}

// AttendRowOnWords for this problem's head dim and group, where it takes them.
template <int DW>
bool RowOnWords(const Problem& p, const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int seq,
                int num_keys, std::vector<float>& scratch) {
  if (p.group % 3 == 0 && DW <= 2) return AttendRowOnWords<DW, 3>(p, q, k, v, out, seq, num_keys, scratch);
  // Two heads' accumulators of D = 256 (2 x 16 registers) and the value pairs (16) would not fit in 32 registers.
  if (p.group % 2 == 0 && DW <= 4) return AttendRowOnWords<DW, 2>(p, q, k, v, out, seq, num_keys, scratch);
  return AttendRowOnWords<DW, 1>(p, q, k, v, out, seq, num_keys, scratch);
}
#endif

// Attention of one item's rows (all heads) over its sequence's pages; returns false on a bad block id.
// T: q's and the output's element (float, or bfloat16 words); P: the pages' (T, or E4M3).
template <typename T, typename P>
bool AttendItem(const Problem& p, const T* q, const P* k_layer, const P* v_layer, T* out, const Item& item,
                std::vector<float>& scratch) {
  const int G = p.group, D = p.head_dim, Hk = p.num_kv_heads, B = p.block_size;
  const int n = item.rows * G;  // query vectors per KV head
  const int q_start = p.query_start[item.seq];
  const int q_len = p.query_start[item.seq + 1] - q_start;
  const int first_pos = p.kv_lens[item.seq] - q_len + item.row0;
  const int last_pos = first_pos + item.rows - 1;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<T, uint16_t>::value && std::is_same<P, uint16_t>::value) {
    // D of 32 to 128 words, and 256 (Gemma's heads); 160 to 224 take the float path.
    if (p.window <= 0 && p.soft_cap == 0.0f && B % 2 == 0 && D % 32 == 0 && (D <= 128 || D == 256)) {
      const int64_t at = static_cast<int64_t>(q_start + item.row0) * Hk * G * D;
      auto row = [&](auto dw) {
        constexpr int DW = decltype(dw)::value;
        if (item.rows > 1)
          return TileOnWords<DW>(p, q + at, k_layer, v_layer, out + at, item.seq, item.rows, first_pos, scratch);
        return RowOnWords<DW>(p, q + at, k_layer, v_layer, out + at, item.seq, last_pos + 1, scratch);
      };
      switch (D / 32) {
        case 1: return row(std::integral_constant<int, 1>{});
        case 2: return row(std::integral_constant<int, 2>{});
        case 3: return row(std::integral_constant<int, 3>{});
        case 4: return row(std::integral_constant<int, 4>{});
        default: return row(std::integral_constant<int, 8>{});
      }
    }
  }
#endif
  const int64_t row_stride = static_cast<int64_t>(Hk) * D;  // between tokens of a page

  const int n8 = n / 8 * 8;  // query vectors taken eight at a time (prefill tiles); the rest in small groups
  // bfloat16 rows in threes where threes divide the rest (SmolLM2's decode rows), else one by one: twos measured
  // slower (four query heads a KV head), and so did threes of float32 rows, which need no widening to share.
  const int group = !std::is_same<P, float>::value && (n - n8) % kGroup == 0 ? kGroup : 1;
  const bool shared = n > kGroup;  // rows that several groups use are widened once, into float buffers
  scratch.resize(static_cast<size_t>(Hk) * n * (3 * D + 2) + static_cast<size_t>(n) * B + 2 * B * D);
  float* queries = scratch.data();                         // [Hk][n][D], scaled
  float* acc = queries + static_cast<size_t>(Hk) * n * D;  // [Hk][n][D]
  float* max = acc + static_cast<size_t>(Hk) * n * D;      // [Hk][n]
  float* denom = max + static_cast<size_t>(Hk) * n;        // [Hk][n]
  float* scores = denom + static_cast<size_t>(Hk) * n;     // [n][B]
  float* key_buffer = scores + static_cast<size_t>(n) * B;  // [B][D]: bfloat16 rows converted
  float* value_buffer = key_buffer + static_cast<size_t>(B) * D;
  float* queries_t = value_buffer + static_cast<size_t>(B) * D;  // [Hk][n/8][D][8] (of the first n8)
  std::vector<const float*> keys(B), values(B);        // rows as floats, where they are `shared`
  std::vector<const P*> page_keys(B), page_values(B);  // the page's own rows

  for (int r = 0; r < item.rows; ++r) {
    const T* row = q + static_cast<int64_t>(q_start + item.row0 + r) * Hk * G * D;
    for (int h = 0; h < Hk; ++h)
      for (int g = 0; g < G; ++g) {
        float* dst = queries + (static_cast<size_t>(h) * n + r * G + g) * D;
        const T* src = row + (h * G + g) * D;
        for (int d = 0; d < D; ++d) dst[d] = ToFloat(src[d]) * p.scale;
      }
  }
  for (int h = 0; h < Hk; ++h)
    for (int i = 0; i < n8; ++i)
      for (int d = 0; d < D; ++d)
        queries_t[(static_cast<size_t>(h) * n + i / 8 * 8) * D + 8 * d + i % 8] =
            queries[(static_cast<size_t>(h) * n + i) * D + d];
  std::fill(acc, acc + static_cast<size_t>(Hk) * n * D, 0.0f);
  std::fill(max, max + static_cast<size_t>(Hk) * n, kNeg);
  std::fill(denom, denom + static_cast<size_t>(Hk) * n, 0.0f);
  if (p.sinks)  // each query's softmax starts from its head's sink: maximum the sink, sum 1
    for (int h = 0; h < Hk; ++h)
      for (int i = 0; i < n; ++i) {
        max[static_cast<size_t>(h) * n + i] = p.sinks[h * G + i % G];
        denom[static_cast<size_t>(h) * n + i] = 1.0f;
      }

  const int first_key = p.window > 0 ? std::max(0, first_pos - p.window + 1) : 0;
  const int32_t* table = p.block_tables + static_cast<int64_t>(item.seq) * p.table_width;
  const int64_t block_bytes = B * row_stride * static_cast<int64_t>(sizeof(P));
  const bool stream = 2 * block_bytes <= kStreamBytes;
  for (int b = first_key / B; b <= last_pos / B; ++b) {
    const int block = table[b];
    if (block < 0 || block >= p.num_blocks) return false;
    const int key0 = b * B;
    const int num_keys = std::min(B, last_pos + 1 - key0);
    // Every row sees every key of the block: no mask to apply (always so for a decode row).
    const bool all_visible = key0 + num_keys - 1 <= first_pos && (p.window <= 0 || key0 > last_pos - p.window);
    const P* k_block = k_layer + static_cast<int64_t>(block) * B * row_stride;
    const P* v_block = v_layer + static_cast<int64_t>(block) * B * row_stride;
    if (stream) Touch(k_block, v_block, block_bytes);
    // Meanwhile the next block is requested into L1 and the one after into L2, a head's share at a time: the heads'
    // strided passes then find them in cache, and more of the pages are on their way at once (scripts/KERNELS.md
    // has the A/Bs by scripts/ab_cpu_kernels.py).
    const char* ahead_k[2];
    const char* ahead_v[2];
    bool prefetch[2];
    for (int a = 0; a < 2; ++a) {
      const int ahead = b + a < last_pos / B ? table[b + 1 + a] : -1;
      prefetch[a] = stream && ahead >= 0 && ahead < p.num_blocks;
      const int64_t offset = static_cast<int64_t>(prefetch[a] ? ahead : 0) * B * row_stride;
      ahead_k[a] = reinterpret_cast<const char*>(k_layer + offset);
      ahead_v[a] = reinterpret_cast<const char*>(v_layer + offset);
    }
    for (int h = 0; h < Hk; ++h) {
      const int64_t begin = block_bytes * h / Hk, end = block_bytes * (h + 1) / Hk;
      if (prefetch[0]) Prefetch<3>(ahead_k[0], ahead_v[0], begin, end);
      if (prefetch[1]) Prefetch<1>(ahead_k[1], ahead_v[1], begin, end);
      const bool on_words = OnWords(k_block, D);  // the other queries' dots straight on bfloat16 words
      for (int j = 0; j < num_keys; ++j) {
        page_keys[j] = k_block + j * row_stride + h * D;
        page_values[j] = v_block + j * row_stride + h * D;
        if (!shared) continue;  // widened in registers where they are used
        if (n8 > 0 || !on_words) keys[j] = Row(page_keys[j], key_buffer + j * D, D);
        values[j] = Row(page_values[j], value_buffer + j * D, D);
      }
      const float* qh = queries + static_cast<size_t>(h) * n * D;
      float* acc_h = acc + static_cast<size_t>(h) * n * D;
      for (int i = 0; i < n8; i += 8)
        Dots8(queries_t + (static_cast<size_t>(h) * n + i) * D, keys.data(), num_keys, D, scores + i * B, B);
      for (int i = n8; i < n; i += group) {
        if (on_words) {
          for (int g = i; g < std::min(n, i + group); ++g) {
            const T* query =
                q + static_cast<int64_t>(q_start + item.row0 + g / G) * Hk * G * D + (h * G + g % G) * D;
            DotsOnWords(query, k_block + h * D, row_stride, num_keys, D, p.scale, scores + g * B);
          }
        } else {
          const int nq = std::min(group, n - i);
          if (shared)
            GroupDots(nq, qh + static_cast<size_t>(i) * D, keys.data(), num_keys, D, scores + i * B, B);
          else
            GroupDots(nq, qh + static_cast<size_t>(i) * D, page_keys.data(), num_keys, D, scores + i * B, B);
        }
      }
      for (int i0 = 0; i0 < n; i0 += group) {
        const int nq = std::min(group, n - i0);
        float correction[kGroup];  // of each query's accumulator, for the new maximum
        for (int i = i0; i < i0 + nq; ++i) {
          const int pos = first_pos + i / G;
          float* s = scores + static_cast<size_t>(i) * B;
          if (p.soft_cap > 0.0f)  // a loop of its own: inside the next one, tanh would run (vectorised) always
            for (int j = 0; j < num_keys; ++j) s[j] = p.soft_cap * std::tanh(s[j] / p.soft_cap);
          float block_max = kNeg;
          if (all_visible) {
            for (int j = 0; j < num_keys; ++j) block_max = std::max(block_max, s[j]);
          } else {
            for (int j = 0; j < num_keys; ++j) {
              const int key = key0 + j;
              const bool visible = key <= pos && (p.window <= 0 || key > pos - p.window);
              s[j] = visible ? s[j] : kNeg;
              block_max = std::max(block_max, s[j]);
            }
          }
          if (block_max == kNeg) {  // nothing visible to this row in this block: it adds nothing
            std::fill(s, s + num_keys, 0.0f);
            correction[i - i0] = 1.0f;
            continue;
          }
          float& m = max[static_cast<size_t>(h) * n + i];
          float& l = denom[static_cast<size_t>(h) * n + i];
          const float m_new = std::max(m, block_max);
          correction[i - i0] = std::exp(m - m_new);
          l = l * correction[i - i0] + ExpShifted(s, num_keys, m_new);
          m = m_new;
        }
        float* group_acc = acc_h + static_cast<size_t>(i0) * D;
        const float* group_weights = scores + static_cast<size_t>(i0) * B;
        if (shared)
          GroupAccumulate(nq, group_acc, correction, group_weights, B, values.data(), num_keys, D);
        else
          GroupAccumulate(nq, group_acc, correction, group_weights, B, page_values.data(), num_keys, D);
      }
    }
  }

  for (int r = 0; r < item.rows; ++r) {
    T* row = out + static_cast<int64_t>(q_start + item.row0 + r) * Hk * G * D;
    for (int h = 0; h < Hk; ++h)
      for (int g = 0; g < G; ++g) {
        const size_t i = static_cast<size_t>(h) * n + r * G + g;
        const float inv = p.v_scale / std::max(denom[i], 1e-30f);
        const float* a = acc + i * D;
        T* dst = row + (h * G + g) * D;
        for (int d = 0; d < D; ++d) FromFloat(a[d] * inv, dst + d);
      }
  }
  return true;
}

template <typename T, typename P>
ffi::Error Run(ffi::ThreadPool& pool, const Problem& p, const T* q, const P* k_layer, const P* v_layer, T* out,
               int num_seqs, int64_t num_tokens) {
  std::memset(out, 0, static_cast<size_t>(num_tokens) * p.num_kv_heads * p.group * p.head_dim * sizeof(T));
  std::vector<Item> items;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = p.query_start[s + 1] - p.query_start[s];
    if (q_len <= 0) continue;
    if (p.query_start[s] < 0 || p.query_start[s + 1] > num_tokens || p.kv_lens[s] < q_len)
      return ffi::Error::InvalidArgument("query_start/kv_lens out of range");
    for (int r = 0; r < q_len; r += kRowTile) items.push_back({s, r, std::min(kRowTile, q_len - r)});
  }
  const bool ok = ParallelFor(pool, static_cast<int>(items.size()), [&](int i) {
    thread_local std::vector<float> scratch;
    return AttendItem(p, q, k_layer, v_layer, out, items[i], scratch);
  });
  if (!ok) return ffi::Error::InvalidArgument("block table entry out of range");
  return ffi::Error::Success();
}

// The form this library is built for (attention.py's `kernel`): q's type, and whether the pages are e4m3 bytes.
using FormQ = JPAGED_ATTENTION_Q;  // float, or uint16_t for bfloat16
constexpr bool kFormFp8 = JPAGED_ATTENTION_FP8;

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> query_start,
                          ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window,
                          ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                          std::optional<ffi::Buffer<ffi::F32>> sinks, ffi::Result<ffi::AnyBuffer> out, float sm_scale,
                          float soft_cap) {
  auto qd = q.dimensions();    // [T, Hq, D]
  auto kd = k_cache.dimensions();  // [L, N, B, Hk, D]
  if (qd.size() != 3 || kd.size() != 5) return ffi::Error::InvalidArgument("expected q [T,Hq,D], cache [L,N,B,Hk,D]");
  const auto dtype = q.element_type();
  // A bfloat16 pool may also come as its raw 16-bit words (U16), an e4m3 one as its bytes (U8): the runner stores
  // them so on CPU, where XLA writes those in place (model_runner.py). Any pool may be float8_e4m3fn.
  const auto pages = k_cache.element_type();
  const bool fp8 = pages == ffi::DataType::F8E4M3FN || pages == ffi::DataType::U8;
  const bool same = pages == dtype || (dtype == ffi::DataType::BF16 && pages == ffi::DataType::U16);
  if (!(fp8 || same) || v_cache.element_type() != pages || out->element_type() != dtype)
    return ffi::Error::InvalidArgument("q and the output must share one dtype, the caches q's or float8_e4m3fn");
  const int num_layers = static_cast<int>(kd[0]);
  const int layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= num_layers) return ffi::Error::InvalidArgument("layer out of range");
  Problem p;
  p.num_kv_heads = static_cast<int>(kd[3]);
  p.group = static_cast<int>(qd[1]) / p.num_kv_heads;
  p.head_dim = static_cast<int>(qd[2]);
  p.block_size = static_cast<int>(kd[2]);
  p.num_blocks = static_cast<int>(kd[1]);
  p.table_width = static_cast<int>(block_tables.dimensions()[1]);
  p.scale = sm_scale * k_scale.typed_data()[0];
  p.v_scale = v_scale.typed_data()[0];
  p.soft_cap = soft_cap;
  p.window = window.typed_data()[0];
  p.sinks = nullptr;
  if (sinks) {
    if (static_cast<int64_t>(sinks->element_count()) != qd[1])
      return ffi::Error::InvalidArgument("sinks must be [Hq]");
    p.sinks = sinks->typed_data();
  }
  p.kv_lens = kv_lens.typed_data();
  p.block_tables = block_tables.typed_data();
  p.query_start = query_start.typed_data();
  const int num_seq_slots = static_cast<int>(kv_lens.dimensions()[0]);
  const int live = std::clamp(num_seqs.typed_data()[0], 0, num_seq_slots);
  const int64_t layer_offset = static_cast<int64_t>(layer_index) * kd[1] * kd[2] * kd[3] * kd[4];
  if (fp8 != kFormFp8 || dtype != (std::is_same<FormQ, float>::value ? ffi::DataType::F32 : ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("q or the caches are not of the types this form of the kernel is built for");
  using Pages = std::conditional<kFormFp8, E4M3, FormQ>::type;
  return Run(pool, p, static_cast<const FormQ*>(q.untyped_data()),
             static_cast<const Pages*>(k_cache.untyped_data()) + layer_offset,
             static_cast<const Pages*>(v_cache.untyped_data()) + layer_offset, static_cast<FormQ*>(out->untyped_data()),
             live, qd[0]);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // q
                                  .Arg<ffi::AnyBuffer>()           // k_cache
                                  .Arg<ffi::AnyBuffer>()           // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()    // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()    // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()    // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()    // query_start
                                  .Arg<ffi::Buffer<ffi::S32>>()    // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()    // window [1], <= 0: none
                                  .Arg<ffi::Buffer<ffi::F32>>()    // k_scale [1]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // v_scale [1]
                                  .OptionalArg<ffi::Buffer<ffi::F32>>()  // sinks [Hq], only where there are some
                                  .Ret<ffi::AnyBuffer>()           // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap"));
