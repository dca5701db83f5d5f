// What every model on the CPU kernels needs, built first (in a second or two), so it is also the probe that the
// machine's compiler builds the kernels at all (library.py): the bfloat16 instructions the products multiply with,
// for the engine's choice of dtype, and an array nothing writes, for the KV pool.
#include "panels.h"

extern "C" const char* JpagedBfloat16Arithmetic() { return Bfloat16Arithmetic(); }

// An array XLA allocates and nothing writes: the attention kernel never reads a KV slot no sequence owns, so its pool
// needs no zero-fill, and the OS maps pages in as blocks are first written.
static ffi::Error Uninitialized(ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedUninitialized, Uninitialized, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());
