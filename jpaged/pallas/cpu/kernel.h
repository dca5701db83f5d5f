// What the CPU kernels (paged_attention.cc, matmul.cc) share: eight-float vectors, bfloat16 conversion, vector exp,
// the AVX-512 word pairing for vdpbf16ps and a parallel loop over XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace jpaged {

namespace ffi = xla::ffi;

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t x) {  // bfloat16 bits
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void FromFloat(float x, float* out) { *out = x; }
inline void FromFloat(float x, uint16_t* out) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  *out = static_cast<uint16_t>(bits >> 16);
}

// v as it is, through an empty asm the compiler cannot see into: the kernels' fast-math flags let it reassociate
// and fold floating-point expressions, and where a result must round as XLA's does, an operand goes through this
// (a register constraint for SSE/AVX values on x86; elsewhere memory, through a volatile copy).
template <typename T>
inline T Opaque(T v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));
  return v;
#else
  volatile T copy = v;
  return copy;
#endif
}

// Eight floats, loaded and stored unaligned; GCC and Clang lower it to the machine's SIMD (AVX, NEON...).
typedef float V8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint16_t U16x8 __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

inline V8 Load(const float* x) { return *reinterpret_cast<const V8*>(x); }
inline V8 Load(const uint16_t* x) {  // eight bfloat16 widened to float32
  const U32x8 bits = __builtin_convertvector(*reinterpret_cast<const U16x8*>(x), U32x8) << 16;
  V8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline void Store(float* x, V8 v) { *reinterpret_cast<V8*>(x) = v; }
inline float Sum(V8 v) { return (v[0] + v[4]) + (v[1] + v[5]) + ((v[2] + v[6]) + (v[3] + v[7])); }

// exp on every lane: glibc's vector math library (libmvec, -DJPAGED_LIBMVEC) where it is linked, else lane by lane.
#if defined(JPAGED_LIBMVEC) && defined(__AVX2__)
extern "C" __m256 _ZGVdN8v_expf(__m256);
inline V8 Exp(V8 x) { return reinterpret_cast<V8>(_ZGVdN8v_expf(reinterpret_cast<__m256>(x))); }
#else
inline V8 Exp(V8 x) {
  for (int i = 0; i < 8; ++i) x[i] = std::exp(x[i]);
  return x;
}
#endif
#if defined(__AVX512F__) && defined(JPAGED_LIBMVEC)
extern "C" __m512 _ZGVeN16v_expf(__m512);
inline __m512 Exp(__m512 x) { return _ZGVeN16v_expf(x); }
#elif defined(__AVX512F__)
inline __m512 Exp(__m512 x) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, x);
  for (float& lane : lanes) lane = std::exp(lane);
  return _mm512_load_ps(lanes);
}
#endif

// Every lane rounded to bfloat16 (nearest even, as FromFloat) and widened back: a float32 vector (V8, __m512).
template <typename V>
inline V RoundedToBfloat16(V v) {
  typedef uint32_t Bits __attribute__((vector_size(sizeof(V))));
  Bits bits;
  std::memcpy(&bits, &v, sizeof v);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

#if defined(__AVX512BW__)
// Word indices for _mm512_permutexvar_epi16 that interleave a register's two halves, (w[i], w[16 + i]) for i < 16:
// rows k and k + 1 of a 16-column panel, or two rows of sixteen bfloat16 weights, as the column pairs vdpbf16ps
// takes.
inline __m512i PairIndex() {
  alignas(64) static constexpr uint16_t kIndex[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_load_si512(kIndex);
}
#endif

// Runs work(i) for i in [0, count) on the calling thread and the pool's. Items are claimed one at a time; the caller
// waits only for items already claimed, so a helper that starts after all are taken finds nothing (and touches only
// the shared counters, which it co-owns), and no deadlock is possible. Returns false if any work(i) did.
// With kClaimAhead, each thread claims its next item as it starts one and calls work(i, next) (next -1 if none), so
// a kernel can ask for that item's memory while it computes; a thread then holds one item the others cannot take.
template <bool kClaimAhead = false, typename Work>
bool ParallelFor(ffi::ThreadPool& pool, int count, Work work) {
  struct Progress {
    std::atomic<int> next{0}, done{0};
    std::atomic<bool> failed{false};
  };
  auto progress = std::make_shared<Progress>();
  auto run = [progress, count, work]() {
    auto claim = [&progress] { return progress->next.fetch_add(1); };
    for (int i = claim(); i < count;) {
      const int following = kClaimAhead ? claim() : count;
      bool ok;
      if constexpr (kClaimAhead) ok = work(i, following < count ? following : -1);
      else ok = work(i);
      if (!ok) progress->failed = true;
      progress->done.fetch_add(1, std::memory_order_release);
      i = kClaimAhead ? following : claim();
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(run)(run));  // Schedule takes its own copy
  run();
  while (progress->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
  return !progress->failed;
}

}  // namespace jpaged
