// A mixture of experts' products on the CPU, as an XLA FFI custom call (see expert_matmul.py for the contract): the
// rows of x sorted by expert, group_sizes[e] of them expert e's, each run times its expert's matrix, read in place
// from a stack of panels [L, E, P, K, 16] (matmul.cc's layout with an experts axis; one layer picked by index).
// Rows past the groups come back zero. Its gated form (JpagedExpertMatmulGated) computes the MLP's activation in
// the same pass, as matmul.cc's does.
#include "panels.h"

namespace {

// Each expert's run of rows through panels.h's products, the experts one after the other (the pool's threads
// split each expert's panels, as they split a dense matrix's).
template <bool kGated, typename T, typename Out>
void RunGroups(ffi::ThreadPool& pool, const T* x, const T* panels, const int32_t* sizes, int E, Out* out, int M,
               int K, int N) {
  const int64_t expert_stride = static_cast<int64_t>(NumPanels<kGated>(N)) * K * kPanel;
  int offset = 0;
  for (int e = 0; e < E && offset < M; ++e) {
    const int rows = std::clamp(sizes[e], 0, M - offset);
    if (rows == 0) continue;
    const T* expert = panels + e * expert_stride;
    auto item_panels = [&](int item, int = 0) {
      return expert + static_cast<int64_t>(item) * kPanelsPerItem * K * kPanel;
    };
    RunStoredItems<kGated>(pool, x + static_cast<int64_t>(offset) * K, out + static_cast<int64_t>(offset) * N, rows,
                           rows, K, N, item_panels, item_panels);
    offset += rows;
  }
  std::memset(out + static_cast<int64_t>(offset) * N, 0, sizeof(Out) * static_cast<int64_t>(M - offset) * N);
}

template <bool kGated>
ffi::Error ExpertMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer panels,
                        ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S32> layer,
                        ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions(), pd = panels.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 5 || od.size() != 2 || pd[4] != kPanel)
    return ffi::Error::InvalidArgument("expected x [M, K], panels [L, E, P, K, 16], out [M, N]");
  const int M = static_cast<int>(xd[0]), K = static_cast<int>(xd[1]), N = static_cast<int>(od[1]);
  const int E = static_cast<int>(pd[1]);
  if (od[0] != M || pd[3] != K || pd[2] != NumPanels<kGated>(N) || group_sizes.element_count() != E)
    return ffi::Error::InvalidArgument("x, panels, group_sizes and out do not agree on M, K, N and E");
  if (kGated && N % kPanel != 0) return ffi::Error::InvalidArgument("the gated form takes N a multiple of 16");
  const auto dtype = x.element_type();
  if (panels.element_type() != dtype || out->element_type() != dtype)
    return ffi::Error::InvalidArgument("x, the panels and the output must share one dtype");
  const int layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= pd[0]) return ffi::Error::InvalidArgument("layer out of range");
  const int64_t offset = static_cast<int64_t>(layer_index) * E * pd[2] * K * kPanel;
  const int32_t* sizes = group_sizes.typed_data();
  if (dtype == ffi::DataType::F32) {
    RunGroups<kGated>(pool, static_cast<const float*>(x.untyped_data()),
                      static_cast<const float*>(panels.untyped_data()) + offset, sizes, E,
                      static_cast<float*>(out->untyped_data()), M, K, N);
    return ffi::Error::Success();
  }
  if (dtype == ffi::DataType::BF16) {
    RunGroups<kGated>(pool, static_cast<const uint16_t*>(x.untyped_data()),
                      static_cast<const uint16_t*>(panels.untyped_data()) + offset, sizes, E,
                      static_cast<uint16_t*>(out->untyped_data()), M, K, N);
    return ffi::Error::Success();
  }
  return ffi::Error::InvalidArgument("only float32 and bfloat16 are supported");
}

}  // namespace

// What both forms are called with: x, panels, group_sizes, layer -> out.
static auto ExpertBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()         // x
      .Arg<ffi::AnyBuffer>()         // panels
      .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes
      .Arg<ffi::Buffer<ffi::S32>>()  // layer
      .Ret<ffi::AnyBuffer>();        // out
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedExpertMatmul, ExpertMatmul<false>, ExpertBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedExpertMatmulGated, ExpertMatmul<true>, ExpertBinding());
