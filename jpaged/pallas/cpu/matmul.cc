// The model's matrix products on the CPU, as an XLA FFI custom call (see matmul.py for the layout and the
// contract): out[m, n] = sum_k x[m, k] * w[k, n] for the first `rows` rows of x, with w given as panels of 16
// columns, [L, P, K, 16], one layer of a stack picked by index and read in place (panels.h multiplies). Its gated
// form (JpagedMatmulGated) computes an MLP's activation in the same pass.
#include "panels.h"

namespace {

// The product of a stack's layer, its items' panels read where they are.
template <bool kGated, typename T, typename Out>
void Run(ffi::ThreadPool& pool, const T* x, const T* panels, Out* out, int M, int rows, int K, int N) {
  auto item_panels = [&](int item, int = 0) {
    return panels + static_cast<int64_t>(item) * kPanelsPerItem * K * kPanel;
  };
  RunStoredItems<kGated>(pool, x, out, M, rows, K, N, item_panels, item_panels);
}

template <bool kGated>
ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer panels, ffi::Buffer<ffi::S32> layer,
                  ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions(), pd = panels.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 4 || od.size() != 2 || pd[3] != kPanel)
    return ffi::Error::InvalidArgument("expected x [M, K], panels [L, P, K, 16], out [M, N]");
  const int M = static_cast<int>(xd[0]), K = static_cast<int>(xd[1]), N = static_cast<int>(od[1]);
  if (od[0] != M || pd[2] != K || pd[1] != NumPanels<kGated>(N))
    return ffi::Error::InvalidArgument("x, panels and out do not agree on M, K and N");
  if (kGated && N % kPanel != 0) return ffi::Error::InvalidArgument("the gated form takes N a multiple of 16");
  const auto dtype = x.element_type(), out_dtype = out->element_type();
  if (panels.element_type() != dtype || (out_dtype != dtype && out_dtype != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("x and the panels must share one dtype, the output be it or float32");
  const int layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= pd[0]) return ffi::Error::InvalidArgument("layer out of range");
  const int live = std::clamp(rows.typed_data()[0], 0, M);
  const int64_t offset = static_cast<int64_t>(layer_index) * pd[1] * K * kPanel;
  if (dtype == ffi::DataType::F32) {
    Run<kGated>(pool, static_cast<const float*>(x.untyped_data()),
                static_cast<const float*>(panels.untyped_data()) + offset, static_cast<float*>(out->untyped_data()), M,
                live, K, N);
    return ffi::Error::Success();
  }
  if (dtype == ffi::DataType::BF16) {
    auto* xp = static_cast<const uint16_t*>(x.untyped_data());
    auto* pp = static_cast<const uint16_t*>(panels.untyped_data()) + offset;
    if (out_dtype == ffi::DataType::F32)
      Run<kGated>(pool, xp, pp, static_cast<float*>(out->untyped_data()), M, live, K, N);
    else
      Run<kGated>(pool, xp, pp, static_cast<uint16_t*>(out->untyped_data()), M, live, K, N);
    return ffi::Error::Success();
  }
  return ffi::Error::InvalidArgument("only float32 and bfloat16 are supported");
}

}  // namespace

// What both forms are called with: x, panels, layer, rows -> out.
static auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()         // x
      .Arg<ffi::AnyBuffer>()         // panels
      .Arg<ffi::Buffer<ffi::S32>>()  // layer
      .Arg<ffi::Buffer<ffi::S32>>()  // rows
      .Ret<ffi::AnyBuffer>();        // out
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedMatmul, Matmul<false>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedMatmulGated, Matmul<true>, Binding());
