// What every model on the CPU kernels needs, built first (in a second or two), so it is also the probe that the
// machine's compiler builds the kernels at all (library.py): the bfloat16 instructions the products multiply with,
// for the engine's choice of dtype, and the panels' layout they read, an array nothing writes, for the KV pool, and
// the deferred handlers the other kernels' FFI targets are registered to while they build.
#include <array>
#include <atomic>
#include <chrono>
#include <thread>
#include <utility>

#include "panels.h"

extern "C" const char* JpagedBfloat16Arithmetic() { return Bfloat16Arithmetic(); }
// Whether the products read bfloat16 panels paired (matmul.py lays them out by it).
extern "C" bool JpagedPairsBfloat16Panels() { return kTakesPairedPanels; }

// An array XLA allocates and nothing writes: the attention kernel never reads a KV slot no sequence owns, so its pool
// needs no zero-fill, and the OS maps pages in as blocks are first written.
static ffi::Error Uninitialized(ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedUninitialized, Uninitialized, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

// Deferred handlers, so that XLA compiles the step programs while the kernels they call still build: library.py
// registers a kernel's FFI targets to deferred handlers (one slot each) first, and points each slot at the kernel's
// handler once its library is loaded (JpagedSetDeferred). A call waits until its slot is set; a slot whose kernel
// failed to build is set to null's stand-in, kFailed, and the call fails with a message. Registration asks a handler
// for its metadata (API version, traits); a deferred one answers as every handler here would (JpagedUninitialized
// answers for it).
namespace {

constexpr int kDeferredSlots = 64;
XLA_FFI_Handler* const kFailed = reinterpret_cast<XLA_FFI_Handler*>(1);
std::atomic<XLA_FFI_Handler*> deferred[kDeferredSlots];

bool AsksForMetadata(const XLA_FFI_CallFrame* frame) {
  for (const XLA_FFI_Extension_Base* ext = frame->extension_start; ext != nullptr; ext = ext->next)
    if (ext->type == XLA_FFI_Extension_Metadata) return true;
  return false;
}

template <int kSlot>
XLA_FFI_Error* Deferred(XLA_FFI_CallFrame* frame) {
  if (AsksForMetadata(frame)) return JpagedUninitialized(frame);
  XLA_FFI_Handler* handler;
  while ((handler = deferred[kSlot].load(std::memory_order_acquire)) == nullptr)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (handler != kFailed) return handler(frame);
  XLA_FFI_Error_Create_Args args{XLA_FFI_Error_Create_Args_STRUCT_SIZE, nullptr,
                                 "the CPU kernel of this FFI target could not be built (see the warning logged)",
                                 XLA_FFI_Error_Code_FAILED_PRECONDITION};
  return frame->api->XLA_FFI_Error_Create(&args);
}

template <int... kSlots>
constexpr std::array<XLA_FFI_Handler*, sizeof...(kSlots)> DeferredTable(std::integer_sequence<int, kSlots...>) {
  return {&Deferred<kSlots>...};
}

}  // namespace

extern "C" {
int JpagedDeferredSlots() { return kDeferredSlots; }
XLA_FFI_Handler* JpagedDeferredHandler(int slot) {
  static constexpr auto table = DeferredTable(std::make_integer_sequence<int, kDeferredSlots>{});
  return table[slot];
}
// `handler` null: the kernel failed to build.
void JpagedSetDeferred(int slot, XLA_FFI_Handler* handler) {
  deferred[slot].store(handler != nullptr ? handler : kFailed, std::memory_order_release);
}
}
