// int8 products on the CPU (W8A8: the layer's int8 matrix times its activations quantised to int8 per token), as an
// XLA FFI custom call (see int8_matmul.py): out[m, n] = sum_k x[m, k] * w[k, n] in int32 for the first `rows` rows
// of x, with w as panels of 16 columns, each four consecutive k of a column side by side ([L, P, K / 4, 16, 4], the
// layout of the AMX tiles' B operand and of vpdpbusd), one layer of a stack picked by index; K a multiple of 64.
//
// The sums are exact, so any order gives the same bits: XLA's int8 dot (models/quantized.py) and this kernel agree
// to the bit, whatever the rows. With AMX-INT8, items of two panels go through the tiles (tdpbssd, 64 k a step,
// the panels read straight from the stack); elsewhere a loop the compiler vectorises.
#include "panels.h"

#if defined(JPAGED_MATMUL_AMX) && (defined(JPAGED_AMX_MODEL) || defined(__AMX_INT8__))
#define JPAGED_INT8_AMX 1
#endif

namespace {

constexpr int kGroup = 4;         // k side by side in a panel's column
constexpr int kInt8TileK = 64;    // k a tile step
constexpr int kRowBytes = kPanel * kGroup;  // a panel's bytes for four k

// Rows [0, rows) of x against a panel, `width` of its columns stored.
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
// An item's NP panels on the tiles, as panels.h's TileRows does for bfloat16: rows in groups of up to two tiles of 16,
// tiles 0-3 the sums (C[g][p] = 2g + p), 4-5 x (A[g]), 6-7 the panels (B[p]).
template <int NP>
void TilePanelsInt8(const int8_t* x, int rows, int K, const int8_t* panel, int32_t* out, int N, int width) {
  const int64_t panel_bytes = static_cast<int64_t>(K / kGroup) * kRowBytes;
  alignas(64) int32_t sums[2][NP][kTileRows][kPanel];
  tiles::Config config;
  for (int m = 0; m < rows; m += 2 * kTileRows) {
    const int group[2] = {std::min(kTileRows, rows - m), std::clamp(rows - m - kTileRows, 0, kTileRows)};
    if (m == 0 || group[0] != config.rows[4] || group[1] != config.rows[5]) {
      for (int g = 0; g < 2; ++g) {
        for (int p = 0; p < NP; ++p) config.rows[2 * g + p] = group[g], config.colsb[2 * g + p] = group[g] ? 64 : 0;
        config.rows[4 + g] = group[g], config.colsb[4 + g] = group[g] ? 64 : 0;
      }
      for (int p = 0; p < NP; ++p) config.rows[6 + p] = kInt8TileK / kGroup, config.colsb[6 + p] = 64;
      tiles::Configure(config);
    }
    const bool two = group[1] > 0;
    tiles::Zero<0>();
    if (NP == 2) tiles::Zero<1>();
    if (two) {
      tiles::Zero<2>();
      if (NP == 2) tiles::Zero<3>();
    }
    for (int k = 0; k < K; k += kInt8TileK) {
      tiles::Load<4>(x + static_cast<int64_t>(m) * K + k, K);
      if (two) tiles::Load<5>(x + static_cast<int64_t>(m + kTileRows) * K + k, K);
      tiles::Load<6>(panel + (k / kGroup) * kRowBytes, kRowBytes);
      if (NP == 2) tiles::Load<7>(panel + panel_bytes + (k / kGroup) * kRowBytes, kRowBytes);
      tiles::DotInt8<0, 4, 6>();
      if (NP == 2) tiles::DotInt8<1, 4, 7>();
      if (two) {
        tiles::DotInt8<2, 5, 6>();
        if (NP == 2) tiles::DotInt8<3, 5, 7>();
      }
    }
    tiles::Store<0>(sums[0][0], sizeof sums[0][0][0]);
    if (NP == 2) tiles::Store<1>(sums[0][NP - 1], sizeof sums[0][0][0]);
    if (two) {
      tiles::Store<2>(sums[1][0], sizeof sums[0][0][0]);
      if (NP == 2) tiles::Store<3>(sums[1][NP - 1], sizeof sums[0][0][0]);
    }
    for (int g = 0; g < 2; ++g)
      for (int r = 0; r < group[g]; ++r)
        for (int p = 0; p < NP; ++p)
          std::memcpy(out + static_cast<int64_t>(m + g * kTileRows + r) * N + p * kPanel, sums[g][p][r],
                      sizeof(int32_t) * (p + 1 < NP ? kPanel : width));
  }
  tiles::Release();
}
#endif

void Run(ffi::ThreadPool& pool, const int8_t* x, const int8_t* panels, int32_t* out, int M, int rows, int K, int N) {
  std::memset(out + static_cast<int64_t>(rows) * N, 0, sizeof(int32_t) * static_cast<int64_t>(M - rows) * N);
  const int num_panels = (N + kPanel - 1) / kPanel;
  const int num_items = (num_panels + kPanelsPerItem - 1) / kPanelsPerItem;
  const int64_t panel_bytes = static_cast<int64_t>(K / kGroup) * kRowBytes;
  ParallelFor(pool, num_items, [&](int item) {
    const int first = item * kPanelsPerItem, count = std::min(num_panels, first + kPanelsPerItem) - first;
    const int width = std::min(kPanel, N - (first + count - 1) * kPanel);
    const int8_t* panel = panels + first * panel_bytes;
    int32_t* at = out + first * kPanel;
#if defined(JPAGED_INT8_AMX)
    if (tiles::Permitted()) {
      if (rows == 0) return true;
      if (count == 2) TilePanelsInt8<2>(x, rows, K, panel, at, N, width);
      else TilePanelsInt8<1>(x, rows, K, panel, at, N, width);
      return true;
    }
#endif
    for (int p = 0; p < count; ++p)
      PanelRows(x, rows, K, panel + p * panel_bytes, at + p * kPanel, N, p + 1 < count ? kPanel : width);
    return true;
  });
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> panels,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  auto xd = x.dimensions(), pd = panels.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 5 || od.size() != 2 || pd[3] != kPanel || pd[4] != kGroup)
    return ffi::Error::InvalidArgument("expected x [M, K], panels [L, P, K / 4, 16, 4], out [M, N]");
  const int M = static_cast<int>(xd[0]), K = static_cast<int>(xd[1]), N = static_cast<int>(od[1]);
  if (od[0] != M || K % kInt8TileK != 0 || pd[2] * kGroup != K || pd[1] != (N + kPanel - 1) / kPanel)
    return ffi::Error::InvalidArgument("x, panels and out do not agree on M, K (a multiple of 64) and N");
  const int layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= pd[0]) return ffi::Error::InvalidArgument("layer out of range");
  const int live = std::clamp(rows.typed_data()[0], 0, M);
  const int64_t offset = layer_index * pd[1] * pd[2] * kRowBytes;
  Run(pool, x.typed_data(), panels.typed_data() + offset, out->typed_data(), M, live, K, N);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()   // x
                                  .Arg<ffi::Buffer<ffi::S8>>()   // panels
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows
                                  .Ret<ffi::Buffer<ffi::S32>>());  // out
