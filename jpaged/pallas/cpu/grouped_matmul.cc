// Products with group-quantized matrices on the CPU, as an XLA FFI custom call (see grouped_matmul.py for the
// layout): w[k, n] = scale[k / G, n] * code[k, n] + bias[k / G, n], the form GGUF's Q4_0, Q4_1 and Q8_0 blocks
// (and group-wise 4- and 8-bit checkpoints) share, held as panels of 16 columns: codes [L, P, K / 2, 16] bytes of two
// 4-bit codes (rows 2i and 2i + 1 of a column, low nibble first) or [L, P, K, 16] 8-bit ones (uint8 or int8), scale
// and bias [L, P, K / G, 16] (float16 or float32).
//
// Each work item's two panels are dequantised into a buffer of the thread's, in x's type, which the dense kernel's
// row blocks or tiles then multiply (panels.h): the weights stream from memory at their quantized size, and every
// row's sums are those of x @ dequantise(w) in x's type, whatever the number of rows (the XLA reference the tests
// hold it to).
//
// Built once per form, the code bits and the codes', scales', x's and the output's types defined on the command line
// (library.py, grouped_matmul.py): a form is a few of the instantiations, so a model's build waits only for its own.
#include <vector>

#include "panels.h"

namespace {

#if defined(JPAGED_MATMUL_AVX512)
// Sixteen codes (int32 lanes) scaled and shifted in float32, stored as T: float32, or bfloat16 rounded to nearest even.
inline void StoreRow(__m512i codes, __m512 s, __m512 b, float* out) {
  _mm512_storeu_ps(out, _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(codes), b));
}
inline void StoreRow(__m512i codes, __m512 s, __m512 b, uint16_t* out) {
  StoreSums(_mm512_fmadd_ps(s, _mm512_cvtepi32_ps(codes), b), out, 0xFFFF);
}
template <typename S>
inline __m512 Load16(const S* values) {
  if constexpr (std::is_same<S, float>::value) return _mm512_loadu_ps(values);
  else return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
}
inline __m512i Widen(const uint8_t* codes) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
}
inline __m512i Widen(const int8_t* codes) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
}

// Codes of one panel's rows [k0, k0 + count) scaled and shifted in float32, stored as T.
template <bool kPacked, typename Code, typename S, typename T>
inline void DequantiseGroup(const Code* codes, const S* scale, const S* bias, int k0, int count, T* out) {
  const __m512 s = Load16(scale), b = Load16(bias);
  for (int k = k0; k < k0 + count; k += kPacked ? 2 : 1) {
    if constexpr (kPacked) {
      const Code* pair = codes + (k / 2) * kPanel;
      __builtin_prefetch(pair + 64 * kPanel);
      const __m512i both = Widen(pair);
      StoreRow(_mm512_and_si512(both, _mm512_set1_epi32(15)), s, b, out + k * kPanel);
      StoreRow(_mm512_srli_epi32(both, 4), s, b, out + (k + 1) * kPanel);
    } else {
      const Code* row = codes + k * kPanel;
      __builtin_prefetch(row + 32 * kPanel);
      StoreRow(Widen(row), s, b, out + k * kPanel);
    }
  }
}

#if defined(__AVX512BF16__)
// Rows k and k + 1 of a panel's codes scaled and shifted in float32, as bfloat16 pairs (rows k and k + 1 of each
// column side by side, each rounded to nearest even), as PrePairedSteps and vdpbf16ps take them.
template <bool kPacked, typename Code>
inline __m512bh PairedRows(const Code* codes, int k, __m512 s, __m512 b) {
  __m512i first, second;
  if constexpr (kPacked) {
    const Code* pair = codes + (k / 2) * kPanel;
    __builtin_prefetch(pair + 64 * kPanel);
    const __m512i both = Widen(pair);
    first = _mm512_and_si512(both, _mm512_set1_epi32(15)), second = _mm512_srli_epi32(both, 4);
  } else {
    const Code* row = codes + k * kPanel;
    __builtin_prefetch(row + 32 * kPanel);
    first = Widen(row), second = Widen(row + kPanel);
  }
  const __m512bh rows = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(s, _mm512_cvtepi32_ps(second), b),
                                            _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(first), b));
  return (__m512bh)_mm512_permutexvar_epi16(PairIndex(), (__m512i)rows);
}

// A group's rows [k0, k0 + count) of a panel as PairedRows, stored from `out` on (count even).
template <bool kPacked, typename Code, typename S>
inline void DequantisePairs(const Code* codes, const S* scale, const S* bias, int k0, int count, uint16_t* out) {
  const __m512 s = Load16(scale), b = Load16(bias);
  for (int k = k0; k < k0 + count; k += 2)
    _mm512_storeu_si512(out + (k - k0) * kPanel, (__m512i)PairedRows<kPacked>(codes, k, s, b));
}
#endif
#else
// Codes of one panel's rows [k0, k0 + count) scaled and shifted in float32, stored as T (rounded to nearest even).
template <bool kPacked, typename Code, typename S, typename T>
inline void DequantiseGroup(const Code* codes, const S* scale, const S* bias, int k0, int count, T* out) {
  float s[kPanel], b[kPanel];
  for (int c = 0; c < kPanel; ++c) s[c] = static_cast<float>(scale[c]), b[c] = static_cast<float>(bias[c]);
  for (int k = k0; k < k0 + count; k += kPacked ? 2 : 1) {
    if constexpr (kPacked) {
      const Code* pair = codes + (k / 2) * kPanel;
      __builtin_prefetch(pair + 64 * kPanel);
      for (int c = 0; c < kPanel; ++c) {
        FromFloat(s[c] * static_cast<float>(pair[c] & 15) + b[c], out + k * kPanel + c);
        FromFloat(s[c] * static_cast<float>(pair[c] >> 4) + b[c], out + (k + 1) * kPanel + c);
      }
    } else {
      const Code* row = codes + k * kPanel;
      __builtin_prefetch(row + 32 * kPanel);
      for (int c = 0; c < kPanel; ++c) FromFloat(s[c] * static_cast<float>(row[c]) + b[c], out + k * kPanel + c);
    }
  }
}
#endif

// A group-quantized stack's layer: its panels' codes, scales and biases, and K and the group size.
template <typename Code, typename S>
struct Grouped {
  const Code* codes;
  const S* scale;
  const S* bias;
  int K, group;
  static constexpr bool packed = JPAGED_GROUPED_BITS == 4;  // two 4-bit codes a byte (the form's)

  // Whether bfloat16 panels are dequantised paired (panels.h's kTakesPairedPanels): every group an even number of
  // rows.
  bool Paired() const { return kTakesPairedPanels && group % 2 == 0; }

#if defined(JPAGED_MATMUL_AVX512) && defined(__AVX512BF16__)
  // Panel p's rows [k0, k0 + count) as bfloat16 pairs (DequantisePairs), whatever groups they span; count even.
  void PairsOf(int p, int k0, int count, uint16_t* out) const {
    const int64_t groups = K / group;
    const Code* panel_codes = codes + p * (packed ? K / 2 : K) * kPanel;
    for (int k = k0; k < k0 + count;) {
      const int g = k / group, end = std::min(k0 + count, (g + 1) * group);
      const S *group_scale = scale + (p * groups + g) * kPanel, *group_bias = bias + (p * groups + g) * kPanel;
      uint16_t* at = out + (k - k0) * kPanel;
      DequantisePairs<packed>(panel_codes, group_scale, group_bias, k, end - k, at);
      k = end;
    }
  }
#endif

  // Panels [first, first + count) dequantised into the thread's buffer (bfloat16 ones paired where Paired()).
  template <typename T>
  const T* Dequantised(int first, int count) const {
    thread_local std::vector<T> buffer;
    buffer.resize(static_cast<size_t>(count) * K * kPanel);
    const int64_t code_rows = packed ? K / 2 : K, groups = K / group;
    for (int p = 0; p < count; ++p) {
      const Code* panel_codes = codes + (first + p) * code_rows * kPanel;
      const S* panel_scale = scale + (first + p) * groups * kPanel;
      const S* panel_bias = bias + (first + p) * groups * kPanel;
      T* out = buffer.data() + static_cast<int64_t>(p) * K * kPanel;
      for (int g = 0; g < groups; ++g) {
#if defined(JPAGED_MATMUL_AVX512) && defined(__AVX512BF16__)
        if constexpr (std::is_same<T, uint16_t>::value) {
          if (Paired()) {
            const S *group_scale = panel_scale + g * kPanel, *group_bias = panel_bias + g * kPanel;
            PairsOf(first + p, g * group, group, out + g * group * kPanel);
            continue;
          }
        }
#endif
        DequantiseGroup<packed>(panel_codes, panel_scale + g * kPanel, panel_bias + g * kPanel, g * group, group,
                                out);
      }
    }
    return buffer.data();
  }
};

#if defined(JPAGED_MATMUL_AVX512) && defined(__AVX512BF16__)
// MR (<= 8) rows times an item's NP panels, each pair of rows of codes dequantised in registers as it is used: the
// operations of PrePairedSteps' row block over the dequantised buffer (the same sums in the same order, so the same
// bits), without the buffer's stores and loads. Decode-sized products, where dequantising dominates, take it.
template <int MR, int NP, bool kGated, bool kPacked, typename Code, typename S, typename Out>
void FusedBlock(const uint16_t* x, const Grouped<Code, S>& w, int first, Out* out, int64_t ldo, int width) {
  const int K = w.K, groups = K / w.group;
  const int64_t code_rows = kPacked ? K / 2 : K;
  __m512 acc[NP][MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[p][m] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    __m512 s[NP], b[NP];
    const Code* codes[NP];
    for (int p = 0; p < NP; ++p) {
      const int64_t at = (static_cast<int64_t>(first + p) * groups + g) * kPanel;
      s[p] = Load16(w.scale + at), b[p] = Load16(w.bias + at);
      codes[p] = w.codes + (first + p) * code_rows * kPanel;
    }
    for (int k = g * w.group; k < (g + 1) * w.group; k += 2) {
      __m512bh pairs[NP];
      for (int p = 0; p < NP; ++p) pairs[p] = PairedRows<kPacked>(codes[p], k, s[p], b[p]);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const __m512bh xs = PairSteps::Broadcast(x + m * K, k);
        for (int p = 0; p < NP; ++p) acc[p][m] = _mm512_dpbf16_ps(acc[p][m], pairs[p], xs);
      }
    }
  }
  StoreBlock<MR, NP, kGated>(acc, out, ldo, width);
}

// The product of at most kWideRowBlock rows by FusedBlock, an item of two panels each.
template <bool kGated, typename Out, typename Code, typename S>
void RunFused(ffi::ThreadPool& pool, const uint16_t* x, const Grouped<Code, S>& w, Out* out, int M, int rows, int N) {
  std::memset(out + static_cast<int64_t>(rows) * N, 0, sizeof(Out) * static_cast<int64_t>(M - rows) * N);
  const int num_panels = NumPanels<kGated>(N);
  const int num_items = (num_panels + kPanelsPerItem - 1) / kPanelsPerItem;
  ParallelFor(pool, num_items, [&](int item) {
    const int first = item * kPanelsPerItem, count = std::min(num_panels, first + kPanelsPerItem) - first;
    Out* at = out + (kGated ? item : first) * kPanel;
    const int width = kGated ? kPanel : std::min(kPanel, N - (first + count - 1) * kPanel);
    ForRowBlocks<kWideRowBlock>(rows, 0, [&](auto mr, int) {
      constexpr int MR = decltype(mr)::value;
      constexpr bool kPacked = Grouped<Code, S>::packed;
      if (count == 2) return FusedBlock<MR, 2, kGated, kPacked>(x, w, first, at, N, width);
      if constexpr (!kGated) FusedBlock<MR, 1, false, kPacked>(x, w, first, at, N, width);
    });
    return true;
  });
}
#endif

#if defined(JPAGED_MATMUL_AMX)
// bfloat16 products on the tiles, an item of two panels each, as the dense kernel's (panels.h TileRows): for up to
// two tiles of rows, each 32 rows of k of the panels dequantised as the tiles ask for them, into 2 KiB that stay in
// L1; for more, the item's panels dequantised once into the thread's buffer, which every row group reads. Taken
// for any number of rows, so that a row's sums are summed alike whatever the batch.
template <bool kGated, typename Out, typename Code, typename S>
void RunTiles(ffi::ThreadPool& pool, const uint16_t* x, const Grouped<Code, S>& w, Out* out, int M, int rows, int N) {
  std::memset(out + static_cast<int64_t>(rows) * N, 0, sizeof(Out) * static_cast<int64_t>(M - rows) * N);
  const int num_panels = NumPanels<kGated>(N), K = w.K;
  const int num_items = (num_panels + kPanelsPerItem - 1) / kPanelsPerItem;
  ParallelFor(pool, num_items, [&](int item) {
    if (rows == 0) return true;
    const int first = item * kPanelsPerItem, count = std::min(num_panels, first + kPanelsPerItem) - first;
    Out* at = out + (kGated ? item : first) * kPanel;
    const int width = kGated ? kPanel : std::min(kPanel, N - (first + count - 1) * kPanel);
    auto multiply = [&](auto paired_tile) {
      if (count == 2) return TileRows<2, kGated>(x, rows, K, paired_tile, at, N, width);
      if constexpr (!kGated) TileRows<1, false>(x, rows, K, paired_tile, at, N, width);
    };
    if (rows <= 2 * kTileRows) {
      alignas(64) uint16_t tile[kPanelsPerItem][kTileK * kPanel];
      multiply([&](int p, int k) {
        w.PairsOf(first + p, k, kTileK, tile[p]);
        return static_cast<const uint16_t*>(tile[p]);
      });
    } else {
      const uint16_t* paired = w.template Dequantised<uint16_t>(first, count);
      multiply([paired, K](int p, int k) { return paired + (static_cast<int64_t>(p) * K + k) * kPanel; });
    }
    return true;
  });
}
#endif

template <bool kGated, typename T, typename Out, typename Code, typename S>
void Run(ffi::ThreadPool& pool, const T* x, const Grouped<Code, S>& w, Out* out, int M, int rows, int N) {
  auto item_panels = [&](int item, int count) { return w.template Dequantised<T>(item * kPanelsPerItem, count); };
  auto no_ahead = [](int) { return static_cast<const T*>(nullptr); };
  if constexpr (std::is_same<T, uint16_t>::value) {
    if (w.Paired()) {
#if defined(JPAGED_MATMUL_AMX)
      if (OnTiles(w.K)) return RunTiles<kGated>(pool, x, w, out, M, rows, N);
#endif
#if defined(JPAGED_MATMUL_AVX512) && defined(__AVX512BF16__)
      if (rows <= kWideRowBlock) return RunFused<kGated>(pool, x, w, out, M, rows, N);
#endif
      return RunItems<kGated, kTakesPairedPanels>(pool, x, out, M, rows, w.K, N, item_panels, no_ahead);
    }
  }
  RunItems<kGated>(pool, x, out, M, rows, w.K, N, item_panels, no_ahead);
}

// The form this library is built for.
using FormCode = JPAGED_GROUPED_CODE;
using FormScale = JPAGED_GROUPED_SCALE;
using FormX = JPAGED_GROUPED_X;  // float, or uint16_t for bfloat16
using FormOut = JPAGED_GROUPED_OUT;

template <typename T>
constexpr ffi::DataType kDataType = ffi::DataType::INVALID;
template <>
constexpr ffi::DataType kDataType<uint8_t> = ffi::DataType::U8;
template <>
constexpr ffi::DataType kDataType<int8_t> = ffi::DataType::S8;
template <>
constexpr ffi::DataType kDataType<_Float16> = ffi::DataType::F16;
template <>
constexpr ffi::DataType kDataType<float> = ffi::DataType::F32;
template <>
constexpr ffi::DataType kDataType<uint16_t> = ffi::DataType::BF16;

template <typename Dims>
bool SameShape(const Dims& a, const Dims& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

template <bool kGated>
ffi::Error GroupedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer codes, ffi::AnyBuffer scale,
                         ffi::AnyBuffer bias, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                         ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || cd.size() != 4 || sd.size() != 4 || od.size() != 2 || cd[3] != kPanel || sd[3] != kPanel)
    return ffi::Error::InvalidArgument("expected x [M, K], codes [L, P, K', 16], scale [L, P, K / G, 16], out [M, N]");
  const int M = static_cast<int>(xd[0]), K = static_cast<int>(xd[1]), N = static_cast<int>(od[1]);
  const bool packed = Grouped<FormCode, FormScale>::packed;
  if (od[0] != M || cd[2] != (packed ? K / 2 : K) || cd[1] != NumPanels<kGated>(N) || sd[0] != cd[0] || sd[1] != cd[1] ||
      sd[2] == 0 || K % sd[2] != 0 || !SameShape(bias.dimensions(), sd))
    return ffi::Error::InvalidArgument("x, codes, scale, bias and out do not agree on M, K, N and the groups");
  const int group = K / static_cast<int>(sd[2]);
  if (packed && group % 2 != 0) return ffi::Error::InvalidArgument("packed 4-bit codes take an even group size");
  if (kGated && N % kPanel != 0) return ffi::Error::InvalidArgument("the gated form takes N a multiple of 16");
  if (scale.element_type() != bias.element_type())
    return ffi::Error::InvalidArgument("scale and bias must share one dtype");
  const int layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= cd[0]) return ffi::Error::InvalidArgument("layer out of range");
  const int live = std::clamp(rows.typed_data()[0], 0, M);
  const int64_t layer_offset = layer_index * cd[1] * cd[2] * kPanel, group_offset = layer_index * sd[1] * sd[2] * kPanel;
  if (codes.element_type() != kDataType<FormCode> || scale.element_type() != kDataType<FormScale> ||
      x.element_type() != kDataType<FormX> || out->element_type() != kDataType<FormOut>)
    return ffi::Error::InvalidArgument("codes, scale, x or out is not of the types this form of the kernel is built for");
  const Grouped<FormCode, FormScale> w{static_cast<const FormCode*>(codes.untyped_data()) + layer_offset,
                                       static_cast<const FormScale*>(scale.untyped_data()) + group_offset,
                                       static_cast<const FormScale*>(bias.untyped_data()) + group_offset,
                                       K,
                                       group};
  Run<kGated>(pool, static_cast<const FormX*>(x.untyped_data()), w, static_cast<FormOut*>(out->untyped_data()), M,
              live, N);
  return ffi::Error::Success();
}

}  // namespace

static auto GroupedBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()         // x
      .Arg<ffi::AnyBuffer>()         // codes
      .Arg<ffi::AnyBuffer>()         // scale
      .Arg<ffi::AnyBuffer>()         // bias
      .Arg<ffi::Buffer<ffi::S32>>()  // layer
      .Arg<ffi::Buffer<ffi::S32>>()  // rows
      .Ret<ffi::AnyBuffer>();        // out
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedGroupedMatmul, GroupedMatmul<false>, GroupedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedGroupedMatmulGated, GroupedMatmul<true>, GroupedBinding());
