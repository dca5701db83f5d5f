// A model of the AMX tile instructions that jpaged/pallas/cpu/panels.h multiplies bfloat16 with (and int8_matmul.cc
// int8), so that its tile
// code (the panels' pairing, the tiles' shapes, the loops over k and row groups, the stores) runs and is checked on
// CPUs without AMX: tests/test_cpu_matmul.py builds the kernel with -DJPAGED_AMX_MODEL and this folder on the
// include path. Eight tile registers a thread; LDTILECFG's and the instructions' shape rules as Intel's manual
// states them, a broken one ending the process as the CPU would fault; TDPBF16PS's sums as its operation defines
// them (each pair's two products added in turn, in float32).
#pragma once

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace jpaged::tiles {

struct Registers {
  Config config;
  bool configured = false;
  alignas(64) uint8_t data[8][16][64];
};

inline Registers& Thread() {
  thread_local Registers registers;
  return registers;
}

[[noreturn]] inline void Fault(const char* what, int tile) {
  std::fprintf(stderr, "AMX model: %s (tile %d)\n", what, tile);
  std::abort();
}

inline std::atomic<int64_t> dots{0};  // TDPBF16PS run, for the tests to see the tiles taken

inline bool Permitted() { return true; }

inline void Configure(const Config& config) {
  if (config.palette != 1 || config.start_row != 0) Fault("palette 1 from row 0 expected", -1);
  for (int t = 0; t < 16; ++t) {
    const bool used = config.rows[t] != 0 || config.colsb[t] != 0;
    if (t >= 8 && used) Fault("palette 1 has eight tiles", t);
    if (used && (config.rows[t] == 0 || config.rows[t] > 16 || config.colsb[t] == 0 || config.colsb[t] > 64 ||
                 config.colsb[t] % 4 != 0))
      Fault("a tile's shape out of bounds", t);
  }
  Registers& registers = Thread();
  registers.config = config;
  registers.configured = true;
  std::memset(registers.data, 0, sizeof registers.data);
}

inline void Loaded(Config* config) {
  if (Thread().configured) *config = Thread().config;
  else std::memset(config, 0, sizeof *config);
}

// A configured tile's registers (rows, bytes a row), faulting on one that is not.
inline Registers& Tile(int t) {
  Registers& registers = Thread();
  if (!registers.configured || registers.config.rows[t] == 0) Fault("tile used while not configured", t);
  return registers;
}

template <int T>
inline void Zero() {
  std::memset(Tile(T).data[T], 0, sizeof Thread().data[T]);
}

template <int T>
inline void Load(const void* base, int64_t stride) {
  Registers& registers = Tile(T);
  for (int r = 0; r < registers.config.rows[T]; ++r)
    std::memcpy(registers.data[T][r], static_cast<const uint8_t*>(base) + r * stride, registers.config.colsb[T]);
}

template <int T>
inline void Store(void* base, int64_t stride) {
  Registers& registers = Tile(T);
  for (int r = 0; r < registers.config.rows[T]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, registers.data[T][r], registers.config.colsb[T]);
}

template <int C, int A, int B>
inline void Dot() {
  static_assert(C != A && C != B && A != B, "TDPBF16PS takes three different tiles");
  dots.fetch_add(1, std::memory_order_relaxed);
  Registers& registers = Tile(C);
  Tile(A), Tile(B);
  const Config& shape = registers.config;
  if (shape.rows[C] != shape.rows[A]) Fault("sums and x differ in rows", C);
  if (shape.colsb[A] != 4 * shape.rows[B]) Fault("x's pairs a row differ from the panel tile's rows", A);
  if (shape.colsb[C] != shape.colsb[B]) Fault("sums and panel tile differ in columns", C);
  auto word = [&](int t, int row, int i) {
    uint16_t bits;
    std::memcpy(&bits, registers.data[t][row] + 2 * i, sizeof bits);
    return ToFloat(bits);
  };
  for (int m = 0; m < shape.rows[C]; ++m)
    for (int n = 0; n < shape.colsb[C] / 4; ++n) {
      float sum;
      std::memcpy(&sum, registers.data[C][m] + 4 * n, sizeof sum);
      for (int k = 0; k < shape.colsb[A] / 4; ++k) {
        sum += word(A, m, 2 * k) * word(B, k, 2 * n);
        sum += word(A, m, 2 * k + 1) * word(B, k, 2 * n + 1);
      }
      std::memcpy(registers.data[C][m] + 4 * n, &sum, sizeof sum);
    }
}

// TDPBSSD's int32 sums of int8 products, four k a 32-bit element of A and of B, for int8_matmul.cc.
template <int C, int A, int B>
inline void DotInt8() {
  static_assert(C != A && C != B && A != B, "TDPBSSD takes three different tiles");
  dots.fetch_add(1, std::memory_order_relaxed);
  Registers& registers = Tile(C);
  Tile(A), Tile(B);
  const Config& shape = registers.config;
  if (shape.rows[C] != shape.rows[A]) Fault("sums and x differ in rows", C);
  if (shape.colsb[A] != 4 * shape.rows[B]) Fault("x's groups of four a row differ from the panel tile's rows", A);
  if (shape.colsb[C] != shape.colsb[B]) Fault("sums and panel tile differ in columns", C);
  for (int m = 0; m < shape.rows[C]; ++m)
    for (int n = 0; n < shape.colsb[C] / 4; ++n) {
      int32_t sum;
      std::memcpy(&sum, registers.data[C][m] + 4 * n, sizeof sum);
      for (int k = 0; k < shape.colsb[A]; ++k)
        sum += int32_t{static_cast<int8_t>(registers.data[A][m][k])} *
               int32_t{static_cast<int8_t>(registers.data[B][k / 4][4 * n + k % 4])};
      std::memcpy(registers.data[C][m] + 4 * n, &sum, sizeof sum);
    }
}

}  // namespace jpaged::tiles

extern "C" int64_t JpagedAmxModelDots() { return jpaged::tiles::dots.load(); }
