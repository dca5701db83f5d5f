// The row-block and tile products over panels of 16 columns that the matmul kernels share (matmul.cc multiplies a
// stack of float panels in place, grouped_matmul.cc panels it dequantises): see matmul.py for the layout and the
// contract. out[m, n] = sum_k x[m, k] * w[k, n] for the first `rows` rows of x. The gated form's panels alternate
// gate and up columns, and each output column n is silu(x . gate[:, n]) * (x . up[:, n]), without the [M, 2N]
// product ever being stored.
//
// Why it exists: XLA's CPU dots of a decode step (8-64 rows against thousands of weight columns) reach a fraction
// of the machine's memory bandwidth, and padded rows cost as much as real ones (README, bench_matmul.py). Here each
// panel streams through once per call with a block of accumulators in registers, rows past `rows` are skipped, and
// a layer's matrix is read in place in the stack. Every output element is a sum over k in the same order whatever
// the number of rows, so a row's result does not depend on what else is in the batch.
//
// Built for a CPU with AVX-512 (-march=native defines __AVX512F__...): blocks of 8 rows x two panels, sixteen lanes
// a register; float32 panels by FMA, bfloat16 ones by vdpbf16ps, two k at a time on bfloat16 words with float32
// sums, where the CPU has AVX-512-BF16, else widened to float32 in registers. With AMX (Sapphire Rapids and later,
// where Linux grants the tile registers), bfloat16 products whose K is a multiple of 32 go through the tiles
// instead (TilePanels). Elsewhere (AVX2...): blocks of 6 rows x one panel, eight lanes a vector, bfloat16 panels
// widened once per item into a float32 copy.
#pragma once

#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define JPAGED_MATMUL_AVX512 1  // sixteen-lane blocks of row-broadcast products (DotBlock)
#include <immintrin.h>
#endif
#if defined(JPAGED_MATMUL_AVX512) && defined(__AVX512BF16__) && \
    (defined(JPAGED_AMX_MODEL) || (defined(__AMX_TILE__) && defined(__AMX_BF16__)))
#define JPAGED_MATMUL_AMX 1  // bfloat16 products on the tile registers (TilePanels)
#endif

#include "kernel.h"

#if defined(JPAGED_MATMUL_AMX)
namespace jpaged::tiles {
// LDTILECFG's 64-byte operand: palette 1, eight tiles of up to 16 rows x 64 bytes, each given its shape.
struct Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes a row
  uint8_t rows[16] = {};
};
}  // namespace jpaged::tiles
#if defined(JPAGED_AMX_MODEL)
// The tests' model of the tile instructions below (tests/amx_model.h), for CPUs without AMX.
#include "amx_model.h"
#else
#include <sys/syscall.h>
#include <unistd.h>
namespace jpaged::tiles {
// Linux hands a process the tiles' 8 KiB of register state only once asked (arch_prctl, Linux 5.16 and later);
// where it refuses, the products stay on vdpbf16ps.
inline bool Permitted() {
  constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}
inline void Configure(const Config& config) { _tile_loadconfig(&config); }
// The configuration loaded now (all zeros where none is): STTILECFG.
inline void Loaded(Config* config) { _tile_storeconfig(config); }
// The instructions on tile numbers given as template arguments (GCC's _tile_* macros paste their argument's
// spelling into the assembly, so they take only literal numbers).
template <int T>
inline void Zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}
template <int T>
inline void Load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void Store(void* base, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
// C += A . B: C's rows x 16 float32 sums, A's rows x 16 bfloat16 pairs of k, B 16 rows (pairs of k) x 16 columns
// of pairs.
template <int C, int A, int B>
inline void Dot() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}
#if defined(__AMX_INT8__)
// C += A . B in int32: A's rows x 16 groups of four int8 k, B 16 rows (groups of four k) x 16 columns of four.
template <int C, int A, int B>
inline void DotInt8() {
  asm volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}
#endif
}  // namespace jpaged::tiles
#endif
#endif

namespace {

using namespace jpaged;

constexpr int kPanel = 16;         // columns per panel
constexpr int kPanelsPerItem = 2;  // a work item's columns

// Calls block(MR, m) for the row blocks [m, m + MR) that cover rows [m, rows): full blocks of kRows, then one of
// the rows left (MR a compile-time constant, std::integral_constant).
template <int MR, typename Fn>
inline void LastBlock(int left, int m, Fn& block) {
  if constexpr (MR > 0) {
    if (left == MR) return block(std::integral_constant<int, MR>{}, m);
    LastBlock<MR - 1>(left, m, block);
  }
}
template <int kRows, typename Fn>
inline void ForRowBlocks(int rows, int m, Fn block) {
  for (; m + kRows <= rows; m += kRows) block(std::integral_constant<int, kRows>{}, m);
  LastBlock<kRows - 1>(rows - m, m, block);
}

// The gated form's output from a gate and an up sum (vectors of float32), as llama.py's GatedMLP computes it from
// an unfused product's output: both rounded to the output's type, SiLU in float32 (x / (1 + exp(-x)) as XLA expands
// it) rounded once, times up (rounded where it is stored).
template <typename Out, typename V>
inline V GatedSums(V gate, V up) {
  constexpr bool kBfloat16 = std::is_same<Out, uint16_t>::value;
  if constexpr (kBfloat16) gate = RoundedToBfloat16(gate), up = RoundedToBfloat16(up);
  V act = gate * (1.0f / (1.0f + Exp(-gate)));
  if constexpr (kBfloat16) act = RoundedToBfloat16(act);
  return act * up;
}

// Panels an N-column product reads: ceil(N / 16), or in the gated form a gate and an up panel for each 16 outputs.
template <bool kGated>
inline int NumPanels(int N) {
  return kGated ? 2 * N / kPanel : (N + kPanel - 1) / kPanel;
}

#if defined(JPAGED_MATMUL_AVX512)
constexpr int kWideRowBlock = 8;  // x two panels: 16 accumulators of 16 columns; AVX-512 has 32 registers
// How far ahead a first pass over a panel asks for its rows (the hardware prefetcher alone left decode-sized
// products waiting on memory: scripts/KERNELS.md), in bytes and in rows of k of a T panel.
constexpr int kAheadBytes = 2048;
template <typename T>
constexpr int RowsAhead() {
  return kAheadBytes / (kPanel * static_cast<int>(sizeof(T)));
}

// What a row block multiplies with, by the panels' and x's element types. Each gives the k a step takes (kStep),
// a panel's rows at k as an operand (Rows), x[m][k..] as the other (Broadcast), and the product added to an
// accumulator (Add).
// float32 panels: one k a step, sixteen columns of a row against x[m][k], FMA.
struct FloatSteps {
  static constexpr int kStep = 1;
  using Operand = __m512;
  static Operand Rows(const float* row) { return _mm512_loadu_ps(row); }
  static Operand Broadcast(const float* x_row, int k) { return _mm512_set1_ps(x_row[k]); }
  static __m512 Add(__m512 acc, Operand w, Operand b) { return _mm512_fmadd_ps(w, b, acc); }
};
#if defined(__AVX512BF16__)
// bfloat16 panels on a CPU with AVX-512-BF16: two k a step, rows k and k + 1 of a panel (32 consecutive words) as
// 16 (row k, row k + 1) pairs, one per column, against x[m][k], x[m][k + 1] (one 32-bit word), vdpbf16ps.
struct PairSteps {
  static constexpr int kStep = 2;
  using Operand = __m512bh;
  static Operand Rows(const uint16_t* rows) {
    return (__m512bh)_mm512_permutexvar_epi16(PairIndex(), _mm512_loadu_si512(rows));
  }
  static Operand LastRow(const uint16_t* row) {  // an odd K's last row, paired with zeros
    return (__m512bh)_mm512_permutexvar_epi16(PairIndex(), _mm512_maskz_loadu_epi16(0xFFFFu, row));
  }
  static Operand Broadcast(const uint16_t* x_row, int k) {
    uint32_t word;
    std::memcpy(&word, x_row + k, sizeof word);
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
  }
  static Operand BroadcastLast(const uint16_t* x_row, int k) { return (__m512bh)_mm512_set1_epi32(int{x_row[k]}); }
  static __m512 Add(__m512 acc, Operand w, Operand b) { return _mm512_dpbf16_ps(acc, w, b); }
};
// bfloat16 panels stored already paired (rows k and k + 1 of a column side by side: the grouped kernel dequantises
// them so), K even.
struct PrePairedSteps : PairSteps {
  static Operand Rows(const uint16_t* rows) { return (__m512bh)_mm512_loadu_si512(rows); }
};
#else
// bfloat16 panels elsewhere: one k a step, a row's sixteen words widened to float32 in registers (exact), FMA
// against x widened once (KernelRows).
struct WidenedSteps : FloatSteps {
  static Operand Rows(const uint16_t* row) {
    const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
  }
};
#endif

// Sixteen sums stored to the columns of `mask`: as they are, or rounded to bfloat16 as FromFloat rounds
// (RoundedToBfloat16: vector operations instead of sixteen scalar roundings).
inline void StoreSums(__m512 sums, float* out, __mmask16 mask) { _mm512_mask_storeu_ps(out, mask, sums); }
inline void StoreSums(__m512 sums, uint16_t* out, __mmask16 mask) {
  const __m512i rounded = _mm512_castps_si512(RoundedToBfloat16(sums));
  _mm256_mask_storeu_epi16(out, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// The columns of panel p of np side by side that hold outputs: all sixteen, but the first `width` of the last.
inline __mmask16 ColumnMask(int p, int np, int width) {
  return p + 1 < np ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1);
}

// A row block's NP x MR accumulators stored: NP panels' columns (the last `width` wide), or with kGated the gated
// form's one panel of outputs from a gate's and an up's sums.
template <int MR, int NP, bool kGated, typename Out>
inline void StoreBlock(const __m512 (&acc)[NP][MR], Out* out, int64_t ldo, int width) {
  if constexpr (kGated) {
    static_assert(NP == 2);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) StoreSums(GatedSums<Out>(acc[0][m], acc[1][m]), out + m * ldo, 0xFFFF);
    return;
  }
  for (int p = 0; p < NP; ++p) {
    const __mmask16 columns = ColumnMask(p, NP, width);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) StoreSums(acc[p][m], out + p * kPanel + m * ldo, columns);
  }
}

// NP adjacent panels (NP x 16 columns) at once: NP x MR accumulators of sixteen lanes, each broadcast of x feeding
// NP products, enough independent chains to cover the multiply's latency. A first block asks for the panels' rows
// kAheadBytes early. The later blocks, which find the panels in cache, ask for the thread's next item's panels
// (`ahead`) into L2, block `phase` of `period` every period-th step: without it that item's first block waits on
// memory, one block's arithmetic taking the panels in faster than one core's reads from memory bring them.
template <typename Steps, int MR, int NP, bool kFirst, bool kGated, typename X, typename T, typename Out>
inline void DotBlock(const X* x, int K, const T* panel, Out* out, int64_t ldo, int width, const T* ahead = nullptr,
                     int phase = 0, int period = 1) {
  constexpr int kStep = Steps::kStep, kAhead = RowsAhead<T>();
  const int64_t panel_elements = static_cast<int64_t>(K) * kPanel;
  __m512 acc[NP][MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[p][m] = _mm512_setzero_ps();
  auto step = [&](const typename Steps::Operand* w, auto broadcast) {
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const auto b = broadcast(x + m * K);
      for (int p = 0; p < NP; ++p) acc[p][m] = Steps::Add(acc[p][m], w[p], b);
    }
  };
  int k = 0, due = ahead ? kStep * phase : K;  // the next k whose rows of `ahead` this block asks for
  for (; k + kStep <= K; k += kStep) {
    const bool fetch_ahead = k == due;
    if (fetch_ahead) due += kStep * period;
    typename Steps::Operand w[NP];
    for (int p = 0; p < NP; ++p) {
      if (kFirst) __builtin_prefetch(panel + p * panel_elements + (k + kAhead) * kPanel);
      if (fetch_ahead) __builtin_prefetch(ahead + p * panel_elements + k * kPanel, 0, 1);
      w[p] = Steps::Rows(panel + p * panel_elements + k * kPanel);
    }
    step(w, [k](const X* x_row) { return Steps::Broadcast(x_row, k); });
  }
  if constexpr (kStep == 2) {
    if (k < K) {
      typename Steps::Operand w[NP];
      for (int p = 0; p < NP; ++p) w[p] = Steps::LastRow(panel + p * panel_elements + k * kPanel);
      step(w, [k](const X* x_row) { return Steps::BroadcastLast(x_row, k); });
    }
  }
  StoreBlock<MR, NP, kGated>(acc, out, ldo, width);
}

// NP panels side by side, the last one `width` columns wide (or a gate and an up panel, kGated); every row block
// reads the panels as they are.
template <typename Steps, int NP, bool kGated, typename X, typename T, typename Out>
void Panels(const X* x, int rows, int K, const T* panel, Out* out, int N, int width, const T* ahead) {
  ForRowBlocks<kWideRowBlock>(rows, 0, [&](auto mr, int m) {
    constexpr int MR = decltype(mr)::value;
    if (m == 0) return DotBlock<Steps, MR, NP, true, kGated>(x, K, panel, out, N, width);
    const int later = (rows - 1) / kWideRowBlock;  // the blocks after the first, which share `ahead`'s reads
    DotBlock<Steps, MR, NP, false, kGated>(x + m * K, K, panel, out + m * N, N, width, ahead, m / kWideRowBlock - 1,
                                           later);
  });
}

#if defined(JPAGED_MATMUL_AMX)
constexpr int kTileRows = 16, kTileK = 32;  // a tile of x: 16 rows x 32 bfloat16 (64 bytes)

// Whether a bfloat16 product of this K goes through the tiles: every tile of x is a whole 32 k wide (the model's
// K are), and the process may use them. Taken for any number of rows, so that a row's sums are summed alike
// whatever the batch.
inline bool OnTiles(int K) { return K % kTileK == 0 && tiles::Permitted(); }

// The tile loop of an item's NP panels (one or two), for every element type: rows in groups of up to two tiles of 16;
// tiles 0-3 hold a group's sums (C[g][p] = 2g + p), 4-5 its x (A[g]), 6-7 the panels' (B[p]); every x tile meets
// every panel tile. Groups of fewer rows configure tiles of fewer rows, so no row past `rows` is read. Each step
// covers `k_step` of K: `a_tile(m, k)` gives x's rows from m (`a_stride` bytes apart), `b_tile(p, k)` panel p's 16
// rows of 64 bytes (contiguous), `dot(C, A, B)` multiplies (integral constants). `finish(m, group, sums)` takes a
// group's sums, [2][NP][16][16] of 4 bytes.
template <int NP, typename Sum, typename ATile, typename BTile, typename DotOp, typename Finish>
void TileGroups(int rows, int K, int k_step, ATile a_tile, int64_t a_stride, BTile b_tile, DotOp dot, Finish finish) {
  using C0 = std::integral_constant<int, 0>;
  using C1 = std::integral_constant<int, 1>;
  using C2 = std::integral_constant<int, 2>;
  using C3 = std::integral_constant<int, 3>;
  using A0 = std::integral_constant<int, 4>;
  using A1 = std::integral_constant<int, 5>;
  using B0 = std::integral_constant<int, 6>;
  using B1 = std::integral_constant<int, 7>;
  constexpr int64_t kB = 64;  // bytes a B row
  alignas(64) Sum sums[2][NP][kTileRows][kPanel];
  // The tiles are configured only where they are shaped otherwise (LDTILECFG and TILERELEASE an item were 3-5% of a
  // bfloat16 product: scripts/KERNELS.md), never released (Linux releases them before a core idles). What is loaded
  // is read back, not remembered: another kernel's library may have shaped this thread's tiles since.
  tiles::Config config, loaded;
  tiles::Loaded(&loaded);
  for (int m = 0; m < rows; m += 2 * kTileRows) {
    const int group[2] = {std::min(kTileRows, rows - m), std::clamp(rows - m - kTileRows, 0, kTileRows)};
    if (m == 0 || group[0] != config.rows[4] || group[1] != config.rows[5]) {  // shaped for other rows
      for (int g = 0; g < 2; ++g) {
        for (int p = 0; p < NP; ++p) config.rows[2 * g + p] = group[g], config.colsb[2 * g + p] = group[g] ? 64 : 0;
        config.rows[4 + g] = group[g], config.colsb[4 + g] = group[g] ? 64 : 0;
      }
      for (int p = 0; p < NP; ++p) config.rows[6 + p] = 16, config.colsb[6 + p] = kB;
      if (std::memcmp(&config, &loaded, sizeof config) != 0) tiles::Configure(config), loaded = config;
    }
    const bool two = group[1] > 0;
    tiles::Zero<0>();
    if (NP == 2) tiles::Zero<1>();
    if (two) {
      tiles::Zero<2>();
      if (NP == 2) tiles::Zero<3>();
    }
    for (int k = 0; k < K; k += k_step) {
      tiles::Load<4>(a_tile(m, k), a_stride);
      if (two) tiles::Load<5>(a_tile(m + kTileRows, k), a_stride);
      tiles::Load<6>(b_tile(0, k), kB);
      if (NP == 2) tiles::Load<7>(b_tile(1, k), kB);
      dot(C0{}, A0{}, B0{});
      if (NP == 2) dot(C1{}, A0{}, B1{});
      if (two) {
        dot(C2{}, A1{}, B0{});
        if (NP == 2) dot(C3{}, A1{}, B1{});
      }
    }
    tiles::Store<0>(sums[0][0], sizeof sums[0][0][0]);
    if (NP == 2) tiles::Store<1>(sums[0][NP - 1], sizeof sums[0][0][0]);
    if (two) {
      tiles::Store<2>(sums[1][0], sizeof sums[0][0][0]);
      if (NP == 2) tiles::Store<3>(sums[1][NP - 1], sizeof sums[0][0][0]);
    }
    finish(m, group, sums);
  }
}

// An item's bfloat16 product on the tiles (TileGroups, tdpbf16ps, 32 k a step): `paired_tile(p, k)` gives panel
// p's rows [k, k + 32) as the B operand takes them (16 pairs of rows): read in place from panels stored paired
// (ItemPanels), or dequantised as they are asked for (grouped_matmul.cc).
template <int NP, bool kGated, typename Out, typename PairedTile>
void TileRows(const uint16_t* x, int rows, int K, PairedTile paired_tile, Out* out, int N, int width) {
  auto a_tile = [x, K](int m, int k) { return x + static_cast<int64_t>(m) * K + k; };
  auto dot = [](auto c, auto a, auto b) { tiles::Dot<decltype(c)::value, decltype(a)::value, decltype(b)::value>(); };
  auto finish = [&](int m, const int (&group)[2], const float (&sums)[2][NP][kTileRows][kPanel]) {
    for (int g = 0; g < 2; ++g)
      for (int r = 0; r < group[g]; ++r) {
        Out* row = out + static_cast<int64_t>(m + g * kTileRows + r) * N;
        if constexpr (kGated) {
          StoreSums(GatedSums<Out>(_mm512_load_ps(sums[g][0][r]), _mm512_load_ps(sums[g][NP - 1][r])), row, 0xFFFF);
          continue;
        }
        for (int p = 0; p < NP; ++p)
          StoreSums(_mm512_load_ps(sums[g][p][r]), row + p * kPanel, ColumnMask(p, NP, width));
      }
  };
  TileGroups<NP, float>(rows, K, kTileK, a_tile, static_cast<int64_t>(K) * sizeof(uint16_t), paired_tile, dot, finish);
}

#endif

// A work item's `count` adjacent panels (one or two), the last `width` columns wide; with kGated, its two panels are
// a gate's and an up's, `width` 16. kPaired: bfloat16 panels come paired (kTakesPairedPanels builds; matmul.py lays
// them out so, the grouped kernel dequantises them so), as vdpbf16ps and the tiles' B operand take them: on the
// tiles where K fills them (OnTiles), for any number of rows, else by vdpbf16ps.
template <bool kGated, bool kPaired = false, typename X, typename T, typename Out>
void ItemPanels(const X* x, int rows, int K, const T* panel, int count, Out* out, int N, int width, const T* ahead) {
#if defined(__AVX512BF16__)
  using Bfloat16Steps = std::conditional_t<kPaired, PrePairedSteps, PairSteps>;
  using Steps = std::conditional_t<std::is_same<T, float>::value, FloatSteps, Bfloat16Steps>;
#else
  using Steps = std::conditional_t<std::is_same<T, float>::value, FloatSteps, WidenedSteps>;
#endif
  static_assert(kPanelsPerItem == 2);
#if defined(JPAGED_MATMUL_AMX)
  if constexpr (kPaired) {
    if (OnTiles(K)) {
      if (rows == 0) return;  // nothing to configure the tiles for
      const int64_t panel_elements = static_cast<int64_t>(K) * kPanel;
      auto paired_tile = [panel, panel_elements](int p, int k) { return panel + p * panel_elements + k * kPanel; };
      if (count == 2) return TileRows<2, kGated>(x, rows, K, paired_tile, out, N, width);
      return TileRows<1, false>(x, rows, K, paired_tile, out, N, width);
    }
  }
#endif
  if (count == 2) return Panels<Steps, 2, kGated>(x, rows, K, panel, out, N, width, ahead);
  Panels<Steps, 1, false>(x, rows, K, panel, out, N, width, ahead);
}
#else
constexpr int kRowBlock = 6;  // rows per block: 12 accumulators + 2 panel vectors + 1 broadcast <= 16 AVX registers

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

// The thread's next item's panel as a later row block asks for it into L2: row k when k is phase + a multiple of
// period, so that the later blocks of a panel share its reads (DotBlock's look-ahead).
struct Ahead {
  const char* panel = nullptr;
  int row_bytes = 0, phase = 0, period = 1;
};

// out[m][0:width] = x[m] . panel for MR rows: each row's x[m][k] broadcast against the panel's 16 columns.
// The first block over a panel (kFirst) reads it from memory and asks for its rows kAhead steps early: the
// hardware prefetcher alone leaves decode-sized products waiting on memory (scripts/KERNELS.md); later blocks find
// the panel in cache, and ask for their share of `ahead`. A first block given `widened` also stores the panel's
// rows there as float32.
template <int MR, bool kFirst, typename T, typename Out>
inline void Block(const float* x, int K, const T* panel, Out* out, int64_t ldo, int width, float* widened,
                  Ahead ahead = {}) {
  constexpr int kAhead = 16;
  V8 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = V8{};
  int due = ahead.panel ? ahead.phase : K;
  for (int k = 0; k < K; ++k) {
    if (kFirst) __builtin_prefetch(panel + (k + kAhead) * kPanel);
    if (k == due) {
      __builtin_prefetch(ahead.panel + static_cast<int64_t>(k) * ahead.row_bytes, 0, 1);
      due += ahead.period;
    }
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

// Rows [m, m + MR) of a panel's product; a later block (m > 0) takes its share of the next item's `ahead`.
template <int MR, typename T, typename Out>
inline void RowBlock(const float* x, int K, const T* panel, Out* out, int N, int width, int m,
                     float* widened = nullptr, Ahead ahead = {}) {
  if (m == 0) return Block<MR, true>(x, K, panel, out, N, width, widened);
  Block<MR, false>(x + m * K, K, panel, out + m * N, N, width, nullptr, ahead);
}

// Rows [m, rows) of a panel's product; `ahead`, the next item's panel, shared among the blocks after the first.
template <typename T, typename Out>
void Rows(const float* x, int rows, int K, const T* panel, Out* out, int N, int width, int m, Ahead ahead) {
  ahead.period = std::max(1, (rows - 1) / kRowBlock);
  ForRowBlocks<kRowBlock>(rows, m, [&](auto mr, int at) {
    ahead.phase = at / kRowBlock - 1;
    RowBlock<decltype(mr)::value>(x, K, panel, out, N, width, at, nullptr, ahead);
  });
}

template <typename Out>
void Panel(const float* x, int rows, int K, const float* panel, Out* out, int N, int width, Ahead ahead) {
  Rows(x, rows, K, panel, out, N, width, 0, ahead);
}

// A bfloat16 panel is widened once, by its first row block, into a float32 copy (K x 64 bytes, cache-resident)
// that the later blocks read: widening costs two vector operations per load, which batches of many row blocks
// would otherwise pay for each block. Widening is exact, so every row's sums are those of a single block.
template <typename Out>
void Panel(const float* x, int rows, int K, const uint16_t* panel, Out* out, int N, int width, Ahead ahead) {
  if (rows <= kRowBlock) return Rows(x, rows, K, panel, out, N, width, 0, ahead);
  thread_local std::vector<float> widened;
  widened.resize(static_cast<size_t>(K) * kPanel);
  RowBlock<kRowBlock>(x, K, panel, out, N, width, 0, widened.data());
  Rows(x, rows, K, static_cast<const float*>(widened.data()), out, N, width, kRowBlock, ahead);
}

// A work item's `count` adjacent panels, the last `width` columns wide; with kGated, a gate's and an up's panel,
// whose float32 sums go through a buffer of the thread's (rows x 128 bytes) to be combined.
template <bool kGated, bool kPaired = false, typename X, typename T, typename Out>
void ItemPanels(const X* x, int rows, int K, const T* panel, int count, Out* out, int N, int width, const T* next) {
  static_assert(!kPaired, "this build takes panels as they are");
  const int64_t panel_elements = static_cast<int64_t>(K) * kPanel;
  auto ahead = [&](int p) {  // the next item's panel p (past the last item's one panel: a prefetch, never read)
    return Ahead{next ? reinterpret_cast<const char*>(next + p * panel_elements) : nullptr, kPanel * sizeof(T)};
  };
  if constexpr (kGated) {
    constexpr int kPair = 2 * kPanel;
    thread_local std::vector<float> sums;
    sums.resize(static_cast<size_t>(rows) * kPair);
    for (int p = 0; p < 2; ++p)
      Panel(x, rows, K, panel + p * panel_elements, sums.data() + p * kPanel, kPair, kPanel, ahead(p));
    for (int m = 0; m < rows; ++m) {
      const float* row = sums.data() + m * kPair;
      StoreRow(GatedSums<Out>(Load(row), Load(row + kPanel)), GatedSums<Out>(Load(row + 8), Load(row + kPanel + 8)),
               out + static_cast<int64_t>(m) * N, kPanel);
    }
    return;
  }
  for (int p = 0; p < count; ++p)
    Panel(x, rows, K, panel + p * panel_elements, out + p * kPanel, N, p + 1 < count ? kPanel : width, ahead(p));
}
#endif

// Whether ItemPanels takes bfloat16 panels paired (rows k and k + 1 of a column side by side), K even.
#if defined(JPAGED_MATMUL_AVX512) && defined(__AVX512BF16__)
constexpr bool kTakesPairedPanels = true;
#else
constexpr bool kTakesPairedPanels = false;
#endif

// The bfloat16 instructions this build multiplies with ("" for none), for the engine's choice of dtype.
inline const char* Bfloat16Arithmetic() {
#if defined(JPAGED_MATMUL_AMX)
  if (tiles::Permitted()) return "amx_bf16";
#endif
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#else
  return "";  // none: widened to float32
#endif
}

// x as the row blocks read it: float32, or for bfloat16 its words where the dot instructions take them.
inline const float* KernelRows(const float* x, int64_t, std::vector<float>&) { return x; }
#if defined(__AVX512BF16__)
inline const uint16_t* KernelRows(const uint16_t* x, int64_t, std::vector<float>&) { return x; }
#else
inline const float* KernelRows(const uint16_t* x, int64_t size, std::vector<float>& buffer) {
  buffer.resize(size);
  for (int64_t i = 0; i < size; ++i) buffer[i] = ToFloat(x[i]);
  return buffer.data();
}
#endif

// The product (kGated: the gated form; N a multiple of 16) on the pool's threads, an item of two panels each:
// `item_panels(item)` gives an item's panels as the row blocks read them (in place in a stack, or dequantised into a
// buffer of the calling thread's), `next_panels(item)` where the thread's next item may be asked for ahead
// (nullptr: nowhere).
template <bool kGated, bool kPaired = false, typename T, typename Out, typename Items, typename NextItems>
void RunItems(ffi::ThreadPool& pool, const T* x_in, Out* out, int M, int rows, int K, int N, Items item_panels,
              NextItems next_panels) {
  std::memset(out + static_cast<int64_t>(rows) * N, 0, sizeof(Out) * static_cast<int64_t>(M - rows) * N);
  std::vector<float> buffer;
  const auto* x = KernelRows(x_in, static_cast<int64_t>(rows) * K, buffer);
  const int num_panels = NumPanels<kGated>(N);
  const int num_items = (num_panels + kPanelsPerItem - 1) / kPanelsPerItem;
  ParallelFor</*kClaimAhead=*/true>(pool, num_items, [&](int item, int next) {
    const int last = std::min(num_panels, (item + 1) * kPanelsPerItem);
    const int first = item * kPanelsPerItem;
    const int column = (kGated ? item : first) * kPanel;
    const int width = kGated ? kPanel : std::min(kPanel, N - (last - 1) * kPanel);
    const T* ahead = next < 0 ? nullptr : next_panels(next);
    ItemPanels<kGated, kPaired>(x, rows, K, item_panels(item, last - first), last - first, out + column, N, width, ahead);
    return true;
  });
}

// The product of panels as matmul.py stores them (`item_panels`, `next_panels` as RunItems takes them): bfloat16
// ones of an even K paired where this build takes pairs (kTakesPairedPanels), any other as they are.
template <bool kGated, typename T, typename Out, typename Items, typename NextItems>
void RunStoredItems(ffi::ThreadPool& pool, const T* x, Out* out, int M, int rows, int K, int N, Items item_panels,
                    NextItems next_panels) {
  if constexpr (kTakesPairedPanels && std::is_same<T, uint16_t>::value) {
    if (K % 2 == 0) return RunItems<kGated, true>(pool, x, out, M, rows, K, N, item_panels, next_panels);
  }
  RunItems<kGated>(pool, x, out, M, rows, K, N, item_panels, next_panels);
}

}  // namespace
