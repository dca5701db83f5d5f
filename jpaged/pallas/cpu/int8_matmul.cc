// int8 products on the CPU (W8A8: a layer's int8 matrix times its activations quantised to int8 per token), as an
// XLA FFI custom call (see int8_matmul.py). For the first `rows` rows of x (float32 or bfloat16): each row quantised
// as models/quantized.py's quantize_rows does it (its largest magnitude onto 127, rounded half to even), the int32
// sums with w, and out[m, n] = sum[m, n] * x_scale[m] * w_scale[n] in x's type (or float32); the gated form
// computes an MLP's activation from a gate and an up panel, as panels.h's does. w is int8 panels of 16 columns,
// each four consecutive k of a column side by side ([L, P, K / 4, 16, 4], the layout of the AMX tiles' B operand),
// its scales as panels [L, P, 1, 16], one layer of a stack picked by index; K a multiple of 64 (the wrapper pads).
//
// The sums are exact, so any order gives the same bits: XLA's int8 dot (models/quantized.py) and this kernel agree
// whatever the rows. With AMX-INT8, items of two panels go through the tiles (tdpbssd, 64 k a step, the panels read
// straight from the stack); elsewhere a loop the compiler vectorises.
#include <vector>

#include "panels.h"

#if defined(JPAGED_MATMUL_AMX) && (defined(JPAGED_AMX_MODEL) || defined(__AMX_INT8__))
#define JPAGED_INT8_AMX 1
#endif

namespace {

constexpr int kGroup = 4;         // k side by side in a panel's column
constexpr int kInt8TileK = 64;    // k a tile step
constexpr int kRowBytes = kPanel * kGroup;  // a panel's bytes for four k

// Rows [0, rows) of x against a panel, `width` of its columns stored (rows N apart).
void PanelRows(const int8_t* x, int rows, int K, const int8_t* panel, int32_t* out, int N, int width) {
  for (int m = 0; m < rows; ++m) {
    int32_t acc[kPanel] = {};
    const int8_t* x_row = x + static_cast<int64_t>(m) * K;
    for (int k = 0; k < K; k += kGroup) {
      const int8_t* w = panel + static_cast<int64_t>(k / kGroup) * kRowBytes;
      for (int c = 0; c < kPanel; ++c)
        for (int j = 0; j < kGroup; ++j) acc[c] += int32_t{x_row[k + j]} * int32_t{w[c * kGroup + j]};
    }
    std::memcpy(out + static_cast<int64_t>(m) * N, acc, sizeof(int32_t) * width);
  }
}

#if defined(JPAGED_INT8_AMX)
// An item's NP panels on the tiles (panels.h's TileGroups, tdpbssd, 64 k a step), the panels read where they are;
// `width` columns of the last stored (rows N apart).
template <int NP>
void TilePanelsInt8(const int8_t* x, int rows, int K, const int8_t* panel, int32_t* out, int N, int width) {
  const int64_t panel_bytes = static_cast<int64_t>(K / kGroup) * kRowBytes;
  auto a_tile = [x, K](int m, int k) { return x + static_cast<int64_t>(m) * K + k; };
  auto b_tile = [=](int p, int k) { return panel + p * panel_bytes + (k / kGroup) * kRowBytes; };
  auto dot = [](auto c, auto a, auto b) {
    tiles::DotInt8<decltype(c)::value, decltype(a)::value, decltype(b)::value>();
  };
  auto finish = [&](int m, const int (&group)[2], const int32_t (&sums)[2][NP][kTileRows][kPanel]) {
    for (int g = 0; g < 2; ++g)
      for (int r = 0; r < group[g]; ++r)
        for (int p = 0; p < NP; ++p)
          std::memcpy(out + static_cast<int64_t>(m + g * kTileRows + r) * N + p * kPanel, sums[g][p][r],
                      sizeof(int32_t) * (p + 1 < NP ? kPanel : width));
  };
  TileGroups<NP, int32_t>(rows, K, kInt8TileK, a_tile, K, b_tile, dot, finish);
}
#endif

// Row m of x quantised as XLA computes quantize_rows: the largest magnitude onto 127 (a scale of 1 for a row of
// zeros), each value times the scale's reciprocal, rounded half to even and clipped; zero-padded to Kp. XLA's
// simplifier turns both divisions into multiplications by reciprocals (the constant's folded: largest * (1 / 127);
// the row's taken once), and the kernel does as it does, so that the codes are the same.
template <typename X>
void QuantizeRow(const X* x, int m, int K, int Kp, int8_t* xq, float* scale) {
  const X* row = x + static_cast<int64_t>(m) * K;
  float largest = 0.0f;
  for (int k = 0; k < K; ++k) largest = std::max(largest, std::fabs(ToFloat(row[k])));
  const float s = Opaque(largest > 0.0f ? largest * (1.0f / 127.0f) : 1.0f);
  const float inverse = Opaque(1.0f / s);  // not folded with the scale's product under -freciprocal-math
  int8_t* q = xq + static_cast<int64_t>(m) * Kp;
  for (int k = 0; k < K; ++k)
    q[k] = static_cast<int8_t>(std::clamp(std::nearbyint(ToFloat(row[k]) * inverse), -127.0f, 127.0f));
  std::memset(q + K, 0, Kp - K);
  scale[m] = s;
}

// An item's int32 sums (`rows` x 32, one row of `count` panels each) scaled back and stored: float(sum) * x_scale *
// w_scale as Out (quantized.py's `rescaled`, multiplied in that order: reassociated, as -fassociative-math lets the
// compiler, they move the float32 result by an ulp), or in the gated form GatedSums of the gate's and the up's.
#if defined(JPAGED_MATMUL_AVX512)
// Sixteen columns a step, the first product kept from the second by kernel.h's Opaque (__builtin_assoc_barrier and
// separate loops did not keep the order), stored as StoreSums rounds.
template <bool kGated, typename Out>
void StoreRescaled(const int32_t* sums, int rows, const float* x_scale, const float* w_scale, int count, Out* out,
                   int N, int width) {
  constexpr int kItem = kPanelsPerItem * kPanel;
  for (int m = 0; m < rows; ++m) {
    __m512 scaled[kPanelsPerItem];
    for (int p = 0; p < count; ++p) {
      const __m512i row = _mm512_loadu_si512(sums + m * kItem + p * kPanel);
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(row), _mm512_set1_ps(x_scale[m]));
      scaled[p] = _mm512_mul_ps(Opaque(t), _mm512_loadu_ps(w_scale + p * kPanel));
    }
    Out* out_row = out + static_cast<int64_t>(m) * N;
    if constexpr (kGated) {
      StoreSums(GatedSums<Out>(scaled[0], scaled[1]), out_row, 0xFFFF);
    } else {
      for (int p = 0; p < count; ++p) StoreSums(scaled[p], out_row + p * kPanel, ColumnMask(p, count, width));
    }
  }
}
#else
// Eight columns a step, the first product kept from the second as above (kernel.h's Opaque).
template <bool kGated, typename Out>
void StoreRescaled(const int32_t* sums, int rows, const float* x_scale, const float* w_scale, int count, Out* out,
                   int N, int width) {
  constexpr int kItem = kPanelsPerItem * kPanel;
  typedef int32_t I32x8 __attribute__((vector_size(32), aligned(4), may_alias));
  for (int m = 0; m < rows; ++m) {
    alignas(32) float row[kItem];
    for (int c = 0; c < count * kPanel; c += 8) {
      const V8 t = __builtin_convertvector(*reinterpret_cast<const I32x8*>(sums + m * kItem + c), V8) * x_scale[m];
      Store(row + c, Opaque(t) * Load(w_scale + c));
    }
    Out* out_row = out + static_cast<int64_t>(m) * N;
    if constexpr (kGated) {
      for (int half = 0; half < kPanel; half += 8) {
        const V8 act = GatedSums<Out>(Load(row + half), Load(row + kPanel + half));
        for (int i = 0; i < 8; ++i) FromFloat(act[i], out_row + half + i);
      }
    } else {
      for (int c = 0; c < (count - 1) * kPanel + width; ++c) FromFloat(row[c], out_row + c);
    }
  }
}
#endif

template <bool kGated, typename X, typename Out>
void Run(ffi::ThreadPool& pool, const X* x, const int8_t* panels, const float* w_scale, Out* out, int M, int rows,
         int K, int Kp, int N) {
  std::memset(out + static_cast<int64_t>(rows) * N, 0, sizeof(Out) * static_cast<int64_t>(M - rows) * N);
  std::vector<int8_t> xq(static_cast<size_t>(rows) * Kp);
  std::vector<float> x_scale(rows);
  ParallelFor(pool, rows, [&](int m) {
    QuantizeRow(x, m, K, Kp, xq.data(), x_scale.data());
    return true;
  });
  const int num_panels = kGated ? 2 * N / kPanel : (N + kPanel - 1) / kPanel;
  const int num_items = (num_panels + kPanelsPerItem - 1) / kPanelsPerItem;
  const int64_t panel_bytes = static_cast<int64_t>(Kp / kGroup) * kRowBytes;
  ParallelFor(pool, num_items, [&](int item) {
    if (rows == 0) return true;
    const int first = item * kPanelsPerItem, count = std::min(num_panels, first + kPanelsPerItem) - first;
    const int width = kGated ? kPanel : std::min(kPanel, N - (first + count - 1) * kPanel);
    const int8_t* panel = panels + first * panel_bytes;
    thread_local std::vector<int32_t> sums;
    sums.resize(static_cast<size_t>(rows) * kPanelsPerItem * kPanel);
    constexpr int kItem = kPanelsPerItem * kPanel;
    bool tiled = false;
#if defined(JPAGED_INT8_AMX)
    if (tiles::Permitted()) {
      if (count == 2) TilePanelsInt8<2>(xq.data(), rows, Kp, panel, sums.data(), kItem, kPanel);
      else TilePanelsInt8<1>(xq.data(), rows, Kp, panel, sums.data(), kItem, kPanel);
      tiled = true;
    }
#endif
    if (!tiled)
      for (int p = 0; p < count; ++p)
        PanelRows(xq.data(), rows, Kp, panel + p * panel_bytes, sums.data() + p * kPanel, kItem, kPanel);
    Out* at = out + (kGated ? item : first) * kPanel;
    StoreRescaled<kGated>(sums.data(), rows, x_scale.data(), w_scale + first * kPanel, count, at, N, width);
    return true;
  });
}

template <bool kGated>
ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> panels,
                      ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                      ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions(), pd = panels.dimensions(), sd = scale.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 5 || sd.size() != 4 || od.size() != 2 || pd[3] != kPanel || pd[4] != kGroup)
    return ffi::Error::InvalidArgument("expected x [M, K], panels [L, P, K' / 4, 16, 4], scale [L, P, 1, 16]");
  const int M = static_cast<int>(xd[0]), K = static_cast<int>(xd[1]), N = static_cast<int>(od[1]);
  const int Kp = static_cast<int>(pd[2]) * kGroup, num_panels = kGated ? 2 * N / kPanel : (N + kPanel - 1) / kPanel;
  if (od[0] != M || Kp % kInt8TileK != 0 || K > Kp || Kp - K >= kInt8TileK || pd[1] != num_panels ||
      sd[0] != pd[0] || sd[1] != pd[1] || sd[2] != 1 || sd[3] != kPanel || (kGated && N % kPanel != 0))
    return ffi::Error::InvalidArgument("x, panels, scale and out do not agree on M, K and N");
  const int layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= pd[0]) return ffi::Error::InvalidArgument("layer out of range");
  const int live = std::clamp(rows.typed_data()[0], 0, M);
  const int8_t* layer_panels = panels.typed_data() + layer_index * pd[1] * pd[2] * kRowBytes;
  const float* layer_scale = scale.typed_data() + layer_index * pd[1] * kPanel;
  const auto dtype = x.element_type(), out_dtype = out->element_type();
  if (out_dtype != dtype && out_dtype != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("the output must be x's dtype or float32");
  auto run = [&](auto* xp, auto* op) {
    Run<kGated>(pool, xp, layer_panels, layer_scale, op, M, live, K, Kp, N);
    return ffi::Error::Success();
  };
  float* out_f32 = static_cast<float*>(out->untyped_data());
  if (dtype == ffi::DataType::F32) return run(static_cast<const float*>(x.untyped_data()), out_f32);
  if (dtype != ffi::DataType::BF16) return ffi::Error::InvalidArgument("x must be float32 or bfloat16");
  auto* xp = static_cast<const uint16_t*>(x.untyped_data());
  if (out_dtype == ffi::DataType::F32) return run(xp, out_f32);
  return run(xp, static_cast<uint16_t*>(out->untyped_data()));
}

}  // namespace

static auto Int8Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()         // x
      .Arg<ffi::Buffer<ffi::S8>>()   // panels
      .Arg<ffi::Buffer<ffi::F32>>()  // scale
      .Arg<ffi::Buffer<ffi::S32>>()  // layer
      .Arg<ffi::Buffer<ffi::S32>>()  // rows
      .Ret<ffi::AnyBuffer>();        // out
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedInt8Matmul, Int8Matmul<false>, Int8Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedInt8MatmulGated, Int8Matmul<true>, Int8Binding());
