// The model's matrix products on the CPU, as an XLA FFI custom call (see matmul.py for the layout and the
// contract): out[m, n] = sum_k x[m, k] * w[k, n] for the first `rows` rows of x, with w given as panels of 16
// columns, [L, P, K, 16], one layer of a stack picked by index.
//
// Why it exists: XLA's CPU dots of a decode step (8-64 rows against thousands of weight columns) reach a fraction
// of the machine's memory bandwidth, and padded rows cost as much as real ones (README, bench_matmul.py). Here each panel streams through once
// per call with a 6-row x 16-column block of accumulators in registers, rows past `rows` are skipped, and a
// layer's matrix is read in place in the stack. Every output element is a sum over k in the same order whatever the
// number of rows, so a row's result does not depend on what else is in the batch.
#include <vector>

#include "kernel.h"

namespace {

using namespace jpaged;

constexpr int kPanel = 16;         // columns per panel: two vectors
constexpr int kRowBlock = 6;       // rows per block: 12 accumulators + 2 panel vectors + 1 broadcast <= 16 AVX regs
constexpr int kPanelsPerItem = 2;  // a work item's columns

inline void StoreRow(V8 lo, V8 hi, float* out, int width) {
  if (width == kPanel) {
    Store(out, lo);
    Store(out + 8, hi);
    return;
  }
  float row[kPanel];
  Store(row, lo);
  Store(row + 8, hi);
  std::memcpy(out, row, sizeof(float) * width);
}
inline void StoreRow(V8 lo, V8 hi, uint16_t* out, int width) {
  float row[kPanel];
  Store(row, lo);
  Store(row + 8, hi);
  for (int j = 0; j < width; ++j) FromFloat(row[j], out + j);
}

// out[m][0:width] = x[m] . panel for MR rows: each row's x[m][k] broadcast against the panel's 16 columns.
// The first block over a panel (kFirst) reads it from memory and asks for its rows kAhead steps early: the
// hardware prefetcher alone leaves decode-sized products waiting on memory (scripts/KERNELS.md); later blocks find
// the panel in cache. A first block given `widened` also stores the panel's rows there as float32.
template <int MR, bool kFirst, typename T, typename Out>
inline void Block(const float* x, int K, const T* panel, Out* out, int64_t ldo, int width, float* widened) {
  constexpr int kAhead = 16;
  V8 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = V8{};
  for (int k = 0; k < K; ++k) {
    if (kFirst) __builtin_prefetch(panel + (k + kAhead) * kPanel);
    const V8 w_lo = Load(panel + k * kPanel), w_hi = Load(panel + k * kPanel + 8);
    if (kFirst && widened) {
      Store(widened + k * kPanel, w_lo);
      Store(widened + k * kPanel + 8, w_hi);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const V8 b = V8{} + x[m * K + k];
      lo[m] += b * w_lo;
      hi[m] += b * w_hi;
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) StoreRow(lo[m], hi[m], out + m * ldo, width);
}

// Rows [m, m + MR) of a panel's product.
template <int MR, typename T, typename Out>
inline void RowBlock(const float* x, int K, const T* panel, Out* out, int N, int width, int m,
                     float* widened = nullptr) {
  if (m == 0) return Block<MR, true>(x, K, panel, out, N, width, widened);
  Block<MR, false>(x + m * K, K, panel, out + m * N, N, width, nullptr);
}

template <typename T, typename Out>
void Rows(const float* x, int rows, int K, const T* panel, Out* out, int N, int width, int m) {
  for (; m + kRowBlock <= rows; m += kRowBlock) RowBlock<kRowBlock>(x, K, panel, out, N, width, m);
  switch (rows - m) {
    case 1: return RowBlock<1>(x, K, panel, out, N, width, m);
    case 2: return RowBlock<2>(x, K, panel, out, N, width, m);
    case 3: return RowBlock<3>(x, K, panel, out, N, width, m);
    case 4: return RowBlock<4>(x, K, panel, out, N, width, m);
    case 5: return RowBlock<5>(x, K, panel, out, N, width, m);
  }
}

template <typename Out>
void Panel(const float* x, int rows, int K, const float* panel, Out* out, int N, int width) {
  Rows(x, rows, K, panel, out, N, width, 0);
}

// A bfloat16 panel is widened once, by its first row block, into a float32 copy (K x 64 bytes, cache-resident)
// that the later blocks read: widening costs two vector operations per load, which batches of many row blocks
// would otherwise pay for each block. Widening is exact, so every row's sums are those of a single block.
template <typename Out>
void Panel(const float* x, int rows, int K, const uint16_t* panel, Out* out, int N, int width) {
  if (rows <= kRowBlock) return Rows(x, rows, K, panel, out, N, width, 0);
  thread_local std::vector<float> widened;
  widened.resize(static_cast<size_t>(K) * kPanel);
  RowBlock<kRowBlock>(x, K, panel, out, N, width, 0, widened.data());
  Rows(x, rows, K, static_cast<const float*>(widened.data()), out, N, width, kRowBlock);
}

inline const float* AsFloat(const float* x, int64_t, std::vector<float>&) { return x; }
inline const float* AsFloat(const uint16_t* x, int64_t size, std::vector<float>& buffer) {
  buffer.resize(size);
  for (int64_t i = 0; i < size; ++i) buffer[i] = ToFloat(x[i]);
  return buffer.data();
}

template <typename T, typename Out>
void Run(ffi::ThreadPool& pool, const T* x_in, const T* panels, Out* out, int M, int rows, int K, int N) {
  std::memset(out + static_cast<int64_t>(rows) * N, 0, sizeof(Out) * static_cast<int64_t>(M - rows) * N);
  std::vector<float> buffer;
  const float* x = AsFloat(x_in, static_cast<int64_t>(rows) * K, buffer);
  const int num_panels = (N + kPanel - 1) / kPanel;
  const int num_items = (num_panels + kPanelsPerItem - 1) / kPanelsPerItem;
  ParallelFor(pool, num_items, [&](int item) {
    const int last = std::min(num_panels, (item + 1) * kPanelsPerItem);
    for (int p = item * kPanelsPerItem; p < last; ++p)
      Panel(x, rows, K, panels + static_cast<int64_t>(p) * K * kPanel, out + p * kPanel, N,
            std::min(kPanel, N - p * kPanel));
    return true;
  });
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer panels, ffi::Buffer<ffi::S32> layer,
                  ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions(), pd = panels.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 4 || od.size() != 2 || pd[3] != kPanel)
    return ffi::Error::InvalidArgument("expected x [M, K], panels [L, P, K, 16], out [M, N]");
  const int M = static_cast<int>(xd[0]), K = static_cast<int>(xd[1]), N = static_cast<int>(od[1]);
  if (od[0] != M || pd[2] != K || pd[1] != (N + kPanel - 1) / kPanel)
    return ffi::Error::InvalidArgument("x, panels and out do not agree on M, K and N");
  const auto dtype = x.element_type(), out_dtype = out->element_type();
  if (panels.element_type() != dtype || (out_dtype != dtype && out_dtype != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("x and the panels must share one dtype, the output be it or float32");
  const int layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= pd[0]) return ffi::Error::InvalidArgument("layer out of range");
  const int live = std::clamp(rows.typed_data()[0], 0, M);
  const int64_t offset = static_cast<int64_t>(layer_index) * pd[1] * K * kPanel;
  if (dtype == ffi::DataType::F32) {
    Run(pool, static_cast<const float*>(x.untyped_data()), static_cast<const float*>(panels.untyped_data()) + offset,
        static_cast<float*>(out->untyped_data()), M, live, K, N);
    return ffi::Error::Success();
  }
  if (dtype == ffi::DataType::BF16) {
    auto* xp = static_cast<const uint16_t*>(x.untyped_data());
    auto* pp = static_cast<const uint16_t*>(panels.untyped_data()) + offset;
    if (out_dtype == ffi::DataType::F32)
      Run(pool, xp, pp, static_cast<float*>(out->untyped_data()), M, live, K, N);
    else
      Run(pool, xp, pp, static_cast<uint16_t*>(out->untyped_data()), M, live, K, N);
    return ffi::Error::Success();
  }
  return ffi::Error::InvalidArgument("only float32 and bfloat16 are supported");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Arg<ffi::AnyBuffer>()         // panels
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows
                                  .Ret<ffi::AnyBuffer>());       // out
