// cpu_int4's own kernels: y = x @ W^T for bf16 rows x with W in 4-bit groups (decode, many
// streams, and on the AVX-512 BF16 path short prefills too), the dequantize for the dense path,
// and the quantizer's min/max quantize.
//
// Runtime layout (built by native_layout.pack_native from the checkpoint's row-major nibbles; nothing
// on disk changes):
//   packed  int32 [N/16][K/8][16]     lane j of step c: the 8 codes q[16b+j][8c .. 8c+7]; nibble
//                                     slot s (bits 4s..4s+3) holds k = 8c + kSlotK[s]
//   sz      bf16  [N/16][K/g][2][16]  scale, then zero, of rows 16b..16b+15 in group g
// One SIMD lane per output row, so a block streams its bytes front to back and no horizontal
// sum is ever needed. Per group and row: y += s * sum(x*q) + (z - 8s) * sum(x), which is
// w = (q - 8) * s + z (docs/format.md) with the zero folded out of the inner loop.
//
// The slot order puts codes k and k+1 in bits 4t and 16+4t, so one shift gives a lane with the
// two codes in its two 16-bit halves. Two ways to multiply them:
// - int16 (AVX2, AVX-512F): x is cut into blocks of 8 that share a power of two, each value an
//   integer below 2^15, so one vpmaddwd gives q[k] x[k] + q[k+1] x[k+1] per lane exactly in
//   int32, four of them sum a step's 8 codes, and one convert and one FMA per step apply the
//   power of two. bf16 holds 8 significant bits, so every value within 2^7 of its block's
//   largest is exact; what smaller ones lose is kept as a second int16 block 2^15 finer, which
//   the kernel adds for just the steps that have one (6% of blocks of Gaussian x, 28% of
//   silu(g) * u): products exact to 2^-30 of the block's largest. AVX-512F runs AVX2's
//   operations on 16 lanes instead of 8: the same bits.
// - bf16 (AVX-512 BF16): one vpermw maps the code pair to the bf16 pair (q - 8, q' - 8), and one
//   vdpbf16ps per row multiplies it by x's own bf16 pair, exact products summed in fp32. The
//   unpack is shared by up to 6 rows in registers, or by every row once a panel of it is kept
//   in L1, so a row costs 4 dot products per 128 weights where int16 costs ~9 operations: on 2
//   Zen 5 cores 4-32 rows ran 1.5x the int16 path's speed, and 64-512 rows at 570-740 GFLOPS
//   (vLLM's oneDNN bf16 GEMM: 680-935). At 1-2 rows both read DRAM at the same rate there.
//   (An earlier bf16 route, 128 + q by OR and a broadcast operand per dot product, took 4x
//   vpmaddwd's time in a probe on Sapphire Rapids; this one is not yet measured there.)
//
// Measured against the alternatives: masking each nibble to fp32 (a mask, a convert and an FMA
// per 8 weights) computed 11.7 GB/s on a Zen 3 core with the layer in cache, under the core's
// DRAM read; int16 computes 16.
//
// Every row is computed with the same operations in the same order whatever M is, so a
// sequence's logits do not depend on what else is in the batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <tuple>
#include <cstdint>
#include <cstring>
#include <vector>

// Only these functions use the wider instructions; the rest of the library runs anywhere.
#define AVX512_BF16 __attribute__((target("avx512f,avx512bf16")))
#define AVX512 __attribute__((target("avx512f,avx512bw")))
#define AVX2 __attribute__((target("avx2,fma")))

namespace {

// The kernel paths; the values are those of native.Isa on the Python side.
enum class Isa : int64_t { kAvx2 = 1, kAvx512Bf16 = 2, kAvx512 = 3 };

constexpr int kBlock = 16;         // output rows per block, one per lane of a 512-bit vector
constexpr int kStep = 8;           // codes per lane per int32
constexpr int kMaxRowsAtOnce = 6;  // input rows sharing one unpack (see Kernel below)
// Adjacent blocks per unit of parallel work, streamed side by side (see Kernel below).
constexpr int kMaxBlocksAtOnce = 4;
// Steps (64 bytes each) to prefetch ahead: 2 KiB ahead took the 4-layer 7B-shaped model from
// 41.6 to 26.9 ms a token on 2 cores (14 -> 22 GB/s, what bf16's GEMV streams).
constexpr int kPrefetchSteps = 32;
constexpr int kSlotK[kStep] = {0, 2, 4, 6, 1, 3, 5, 7};  // k offset held in nibble slot s

// The line kPrefetchSteps ahead of step c in block wb (of `steps` steps). Past the block's end
// it continues in the block NB on, where the next unit of work starts: a unit's NB streams then
// start warm instead of each waiting on DRAM.
template <int NB>
inline const char* ahead(const int32_t* wb, int64_t c, int64_t steps) {
  int64_t at = c + kPrefetchSteps;
  if (at >= steps) at += (NB - 1) * steps;
  return reinterpret_cast<const char*>(wb + at * kBlock);
}

struct Problem {
  const int32_t* xw;   // [M][K/2] x as int16, pairs (k, k+1) in the halves of an int32
  const int32_t* xlo;  // [M][K/2] what xw rounded off, in units 2^15 finer
  const float* xunit;  // [M][K/8] the power of two of each block of 8: x = (xw + xlo / 2^15) * unit
  const uint32_t* xfix;  // [M][G] per group, bit i: step i has a nonzero xlo
  const float* xsum;   // [M][G] per-group sums of x
  const int32_t* packed;
  const uint16_t* sz;
  int64_t M, K, N, G, g;
};

AVX512 inline __m512 load_bf16x16(const uint16_t* p) {
  __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

// ------------------------------------------------ AVX2 + FMA: codes as int16 pairs, x as int16
AVX2 inline __m256 load_bf16x8(const uint16_t* p) {
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// sum over the step's 8 codes of q[k] * words[k], exact in int32 (at most 8 * 15 * 32640 < 2^24,
// so its conversion to fp32 is exact too). Codes k = 8c + 2t and 8c + 2t + 1 sit in slots t and
// t + 4: one shift and mask give both as the two int16 of a lane.
AVX2 inline __m256i step_dot(__m256i codes, const int32_t* words) {
  const __m256i low_pair = _mm256_set1_epi32(0x000F000F);
  __m256i dot[4];
  for (int t = 0; t < 4; ++t) {
    const __m256i pair = _mm256_and_si256(t == 0 ? codes : _mm256_srli_epi32(codes, 4 * t), low_pair);
    dot[t] = _mm256_madd_epi16(pair, _mm256_set1_epi32(words[t]));
  }
  return _mm256_add_epi32(_mm256_add_epi32(dot[0], dot[1]), _mm256_add_epi32(dot[2], dot[3]));
}

// Half h (lanes 8h .. 8h + 7) of a block's step c.
AVX2 inline __m256i load_codes8(const int32_t* wb, int64_t c, int h) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * kBlock + 8 * h));
}

// A block is two 8-lane halves, both taken from each 64-byte step in one pass; NB adjacent
// blocks go side by side. y: the output's row m0, column 0 (row stride P.N). The unroll pragmas
// matter: without them GCC 12 kept the sums in stack slots, stored every step.
template <int MR, int NB>
AVX2 void block_avx2(const Problem& P, int64_t blk, int64_t m0, float* y) {
  const int64_t steps = P.g / kStep;
  for (int m = 0; m < MR; ++m) std::fill(y + m * P.N + blk * kBlock, y + m * P.N + (blk + NB) * kBlock, 0.0f);
  for (int64_t gi = 0; gi < P.G; ++gi) {
    __m256 acc[MR][NB][2];
    _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m)
      _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_ps();
    for (int64_t c = gi * steps; c < (gi + 1) * steps; ++c) {
      _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) {
        const int32_t* wb = P.packed + (blk + b) * (P.K / kStep) * kBlock;
        _mm_prefetch(ahead<NB>(wb, c, P.K / kStep), _MM_HINT_T0);
        const __m256i codes[2] = {load_codes8(wb, c, 0), load_codes8(wb, c, 1)};
        _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
          const int64_t row = m0 + m;
          const __m256 unit = _mm256_broadcast_ss(P.xunit + row * (P.K / kStep) + c);
          _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h) {
            const __m256i dot = step_dot(codes[h], P.xw + row * (P.K / 2) + 4 * c);
            acc[m][b][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), unit, acc[m][b][h]);
          }
        }
      }
    }
    // The few steps whose x lost bits in its int16 block, with what it lost.
    _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
      const int64_t row = m0 + m;
      for (uint32_t fix = P.xfix[row * P.G + gi]; fix != 0; fix &= fix - 1) {
        const int64_t c = gi * steps + __builtin_ctz(fix);
        const __m256 unit = _mm256_mul_ps(_mm256_broadcast_ss(P.xunit + row * (P.K / kStep) + c),
                                          _mm256_set1_ps(1.0f / 32768));
        _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) {
          const int32_t* wb = P.packed + (blk + b) * (P.K / kStep) * kBlock;
          _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h) {
            const __m256i dot = step_dot(load_codes8(wb, c, h), P.xlo + row * (P.K / 2) + 4 * c);
            acc[m][b][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), unit, acc[m][b][h]);
          }
        }
      }
    }
    _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) {
      const uint16_t* szg = P.sz + ((blk + b) * P.G + gi) * 2 * kBlock;
      _Pragma("GCC unroll 8") for (int h = 0; h < 2; ++h) {
        const __m256 s = load_bf16x8(szg + 8 * h);
        const __m256 z = load_bf16x8(szg + kBlock + 8 * h);
        const __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, z);
        _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
          const __m256 xs = _mm256_set1_ps(P.xsum[(m0 + m) * P.G + gi]);
          float* ym = y + m * P.N + (blk + b) * kBlock + 8 * h;
          _mm256_storeu_ps(ym, _mm256_add_ps(_mm256_loadu_ps(ym), _mm256_fmadd_ps(s, acc[m][b][h], _mm256_mul_ps(offset, xs))));
        }
      }
    }
  }
}

// ------------------------------------------------ AVX-512 (F + BW): the same at 16 lanes
AVX512 inline __m512i step_dot_avx512(__m512i codes, const int32_t* words) {
  const __m512i low_pair = _mm512_set1_epi32(0x000F000F);
  __m512i dot[4];
  for (int t = 0; t < 4; ++t) {
    const __m512i pair = _mm512_and_si512(t == 0 ? codes : _mm512_srli_epi32(codes, 4 * t), low_pair);
    dot[t] = _mm512_madd_epi16(pair, _mm512_set1_epi32(words[t]));
  }
  return _mm512_add_epi32(_mm512_add_epi32(dot[0], dot[1]), _mm512_add_epi32(dot[2], dot[3]));
}

// block_avx2 on whole 64-byte steps: the same operations per lane, in the same order.
template <int MR, int NB>
AVX512 void block_avx512(const Problem& P, int64_t blk, int64_t m0, float* y) {
  const int64_t steps = P.g / kStep;
  __m512 out[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) out[m][b] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < P.G; ++gi) {
    __m512 acc[MR][NB];
    for (int m = 0; m < MR; ++m)
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
    for (int64_t c = gi * steps; c < (gi + 1) * steps; ++c) {
      for (int b = 0; b < NB; ++b) {
        const int32_t* wb = P.packed + (blk + b) * (P.K / kStep) * kBlock;
        _mm_prefetch(ahead<NB>(wb, c, P.K / kStep), _MM_HINT_T0);
        const __m512i codes = _mm512_loadu_si512(wb + c * kBlock);
        for (int m = 0; m < MR; ++m) {
          const int64_t row = m0 + m;
          const __m512 unit = _mm512_set1_ps(P.xunit[row * (P.K / kStep) + c]);
          const __m512i dot = step_dot_avx512(codes, P.xw + row * (P.K / 2) + 4 * c);
          acc[m][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), unit, acc[m][b]);
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      const int64_t row = m0 + m;
      for (uint32_t fix = P.xfix[row * P.G + gi]; fix != 0; fix &= fix - 1) {
        const int64_t c = gi * steps + __builtin_ctz(fix);
        const __m512 unit = _mm512_set1_ps(P.xunit[row * (P.K / kStep) + c] * (1.0f / 32768));
        for (int b = 0; b < NB; ++b) {
          const int32_t* wb = P.packed + (blk + b) * (P.K / kStep) * kBlock;
          const __m512i dot = step_dot_avx512(_mm512_loadu_si512(wb + c * kBlock), P.xlo + row * (P.K / 2) + 4 * c);
          acc[m][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), unit, acc[m][b]);
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const uint16_t* szg = P.sz + ((blk + b) * P.G + gi) * 2 * kBlock;
      const __m512 s = load_bf16x16(szg);
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, load_bf16x16(szg + kBlock));
      for (int m = 0; m < MR; ++m) {
        const __m512 xs = _mm512_set1_ps(P.xsum[(m0 + m) * P.G + gi]);
        out[m][b] = _mm512_add_ps(out[m][b], _mm512_fmadd_ps(s, acc[m][b], _mm512_mul_ps(offset, xs)));
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(y + m * P.N + (blk + b) * kBlock, out[m][b]);
}

// ------------------------------------------------ AVX-512 BF16: x stays bf16, codes become bf16
// One vpermw turns a lane's code pair into the bf16 pair (q - 8, q' - 8), exact, and one vdpbf16ps
// per row multiplies it by x's pair (exact products, fp32 sums): the unpack is shared by every
// row, so a row costs 4 dot products per 128 weights where the int16 route costs ~9 operations.
// Per group: y += s * sum(x (q - 8)) + z * sum(x), which is w = (q - 8) * s + z.
alignas(64) constexpr uint16_t kCentredBf16[32] = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,  // -8 .. -1
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,  // 0 .. 7
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,  // again: index bit 4 is the next code's
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};

AVX512_BF16 inline __m512bh centred_pair(__m512i codes, int t, __m512i table) {
  // vpermw reads 5 bits of each index and the table repeats at 16: no mask is needed.
  return (__m512bh)_mm512_permutexvar_epi16(t == 0 ? codes : _mm512_srli_epi32(codes, 4 * t), table);
}

constexpr int64_t kPanelSteps = 32;  // steps of K in a panel: 4 blocks' pairs are 32 KiB, in L1
constexpr int kPanelRows = 6;        // 24 sums, 4 weights, a pair of x: 29 of 32 registers

// Groups [g0, g1) of rows [m0, m0 + MR) by blocks [blk, blk + NB), added to y (the output of row
// m0 at block blk's first column, rows `ystride` floats apart). P.xw is x itself here: bf16
// [M][K], the pair (k, k+1) in the halves of an int32. Weights and x come from the codes and
// P.xw, or with kFromPanel the weights from `panel`, where unpack_panel put them for groups from
// g0 on ([step][pair t][kMaxBlocksAtOnce][16 lanes]). Either way each row sees the same
// operations in the same order, whatever M: the same bits.
template <int MR, int NB, bool kFromPanel>
AVX512_BF16 void bf16_groups(const Problem& P, const __m512i* panel, int64_t blk, int64_t m0, int64_t g0, int64_t g1, float* y,
                             int64_t ystride) {
  const int64_t steps = P.g / kStep, pairs = P.K / 2;
  const __m512i table = _mm512_load_si512(kCentredBf16);
  for (int64_t gi = g0; gi < g1; ++gi) {
    __m512 acc[MR][NB];
    for (int m = 0; m < MR; ++m)
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
    for (int64_t c = gi * steps; c < (gi + 1) * steps; ++c) {
      if constexpr (!kFromPanel)
        for (int b = 0; b < NB; ++b)
          _mm_prefetch(ahead<NB>(P.packed + (blk + b) * (P.K / kStep) * kBlock, c, P.K / kStep), _MM_HINT_T0);
      // Each x pair is broadcast once and meets the NB blocks' weights in registers: a broadcast
      // operand on every vdpbf16ps ran at half the rate.
      for (int t = 0; t < 4; ++t) {
        __m512bh w[NB];
        for (int b = 0; b < NB; ++b) {
          if constexpr (kFromPanel)
            w[b] = (__m512bh)_mm512_load_si512(panel + ((c - g0 * steps) * 4 + t) * kMaxBlocksAtOnce + b);
          else
            w[b] = centred_pair(_mm512_loadu_si512(P.packed + ((blk + b) * (P.K / kStep) + c) * kBlock), t, table);
        }
        for (int m = 0; m < MR; ++m) {
          const int32_t pair = P.xw[(m0 + m) * pairs + 4 * c + t];
          const __m512bh xp = (__m512bh)_mm512_set1_epi32(pair);
          for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], w[b], xp);
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const uint16_t* szg = P.sz + ((blk + b) * P.G + gi) * 2 * kBlock;
      const __m512 s = load_bf16x16(szg), z = load_bf16x16(szg + kBlock);
      for (int m = 0; m < MR; ++m) {
        const __m512 xs = _mm512_set1_ps(P.xsum[(m0 + m) * P.G + gi]);
        float* ym = y + m * ystride + b * kBlock;
        _mm512_storeu_ps(ym, _mm512_add_ps(_mm512_loadu_ps(ym), _mm512_fmadd_ps(s, acc[m][b], _mm512_mul_ps(z, xs))));
      }
    }
  }
}

template <int MR, int NB>
AVX512_BF16 void block_bf16(const Problem& P, int64_t blk, int64_t m0, float* y) {
  bf16_groups<MR, NB, false>(P, nullptr, blk, m0, 0, P.G, y + blk * kBlock, P.N);
}

// Steps [c0, c1) of blocks [blk, blk + nb) as bf16 pairs, in bf16_groups' panel layout.
AVX512_BF16 void unpack_panel(const Problem& P, int64_t blk, int nb, int64_t c0, int64_t c1, __m512i* panel) {
  const __m512i table = _mm512_load_si512(kCentredBf16);
  for (int64_t c = c0; c < c1; ++c)
    for (int b = 0; b < nb; ++b) {
      const int32_t* wb = P.packed + (blk + b) * (P.K / kStep) * kBlock;
      _mm_prefetch(ahead<kMaxBlocksAtOnce>(wb, c, P.K / kStep), _MM_HINT_T0);  // the next panel's
      const __m512i codes = _mm512_loadu_si512(wb + c * kBlock);
      for (int t = 0; t < 4; ++t)
        _mm512_store_si512(panel + ((c - c0) * 4 + t) * kMaxBlocksAtOnce + b, (__m512i)centred_pair(codes, t, table));
    }
}

using PanelFn = void (*)(const Problem&, const __m512i*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
const PanelFn kPanelWide[kPanelRows] = {bf16_groups<1, 4, true>, bf16_groups<2, 4, true>, bf16_groups<3, 4, true>,
                                        bf16_groups<4, 4, true>, bf16_groups<5, 4, true>, bf16_groups<6, 4, true>};
const PanelFn kPanelOne[kPanelRows] = {bf16_groups<1, 1, true>, bf16_groups<2, 1, true>, bf16_groups<3, 1, true>,
                                       bf16_groups<4, 1, true>, bf16_groups<5, 1, true>, bf16_groups<6, 1, true>};

// Rows [0, P.M) of y for blocks [b0, b0 + kMaxBlocksAtOnce) on the AVX-512 BF16 path with the
// weights unpacked once per panel of K for every row, not once per kPanelRows rows. The sums
// build up in rows of 64 floats side by side (y's own rows, 16 KiB apart for N = 4096, shared
// L1 sets), copied into y at the end.
void bf16_panels(const Problem& P, int64_t b0, float* y) {
  const int nb = static_cast<int>(std::min<int64_t>(kMaxBlocksAtOnce, P.N / kBlock - b0));
  const int64_t steps = P.g / kStep, groups = std::max<int64_t>(1, kPanelSteps / steps);
  constexpr int64_t width = kMaxBlocksAtOnce * kBlock;
  alignas(64) __m512i panel[kPanelSteps * 4 * kMaxBlocksAtOnce];
  thread_local std::vector<float> sums;  // [M][width]: row m's outputs for the blocks from b0 on
  sums.assign(P.M * width, 0.0f);
  // Chunks of near-equal size: a last chunk of one row is one dependency chain per block, and
  // took as long as six rows (7 rows cost 1.6x 6 rows, 4 + 3 cost 1.2x).
  const int64_t chunks = (P.M + kPanelRows - 1) / kPanelRows;
  for (int64_t g0 = 0; g0 < P.G; g0 += groups) {
    const int64_t g1 = std::min(P.G, g0 + groups);
    unpack_panel(P, b0, nb, g0 * steps, g1 * steps, panel);
    for (int64_t i = 0, m0 = 0; i < chunks; ++i) {
      const int mr = static_cast<int>((P.M - m0) / (chunks - i));
      float* const ym = sums.data() + m0 * width;
      if (nb == kMaxBlocksAtOnce)
        kPanelWide[mr - 1](P, panel, b0, m0, g0, g1, ym, width);
      else
        for (int b = 0; b < nb; ++b)
          kPanelOne[mr - 1](P, panel + b, b0 + b, m0, g0, g1, ym + b * kBlock, width);
      m0 += mr;
    }
  }
  for (int64_t m = 0; m < P.M; ++m)
    std::memcpy(y + m * P.N + b0 * kBlock, sums.data() + m * width, nb * kBlock * sizeof(float));
}

// Rows [m0, m0 + MR) by blocks [blk, blk + NB) into y (the output's row m0, row stride P.N).
using BlockFn = void (*)(const Problem&, int64_t, int64_t, float*);

// A path's routines for 1, 2, ... `rows` input rows at once (index MR-1), as many as its sums
// fit in registers (32 zmm; 16 ymm, where 3 rows spilled and ran at a third of 2 rows' speed per
// row): `wide` on `wide_blocks` adjacent blocks, `one` on a single block (a layer's last few).
// Adjacent blocks side by side keep that many streams of weights in flight: 1 row x 11008 x 4096
// on a Sapphire Rapids core read DRAM at 71% of a plain read one block at a time, 83% two at a
// time, 88% four (8: no better), and 2 rows at 64% -> 78% (an interleaved A/B, same process).
struct Kernel {
  BlockFn wide[kMaxRowsAtOnce];
  int wide_blocks[kMaxRowsAtOnce];
  BlockFn one[kMaxRowsAtOnce];
  int rows;
};
const Kernel kAvx512{{block_avx512<1, 4>, block_avx512<2, 4>, block_avx512<3, 4>},
                     {4, 4, 4},
                     {block_avx512<1, 1>, block_avx512<2, 1>, block_avx512<3, 1>},
                     3};
const Kernel kAvx2{{block_avx2<1, 4>, block_avx2<2, 2>}, {4, 2}, {block_avx2<1, 1>, block_avx2<2, 1>}, 2};
// 6 rows by 4 blocks: 24 sums, 4 weights, the table and a pair of x in 32 registers.
const Kernel kBf16{{block_bf16<1, 4>, block_bf16<2, 4>, block_bf16<3, 4>, block_bf16<4, 4>, block_bf16<5, 4>,
                    block_bf16<6, 4>},
                   {4, 4, 4, 4, 4, 4},
                   {block_bf16<1, 1>, block_bf16<2, 1>, block_bf16<3, 1>, block_bf16<4, 1>, block_bf16<5, 1>,
                    block_bf16<6, 1>},
                   6};

void check_weights(const at::Tensor& packed, const at::Tensor& sz, int64_t group_size) {
  TORCH_CHECK(packed.dtype() == at::kInt && packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous(),
              "cpu_int4 native: packed must be contiguous int32 [N/16, K/8, 16]");
  TORCH_CHECK(sz.dtype() == at::kBFloat16 && sz.dim() == 4 && sz.size(0) == packed.size(0) && sz.size(2) == 2 &&
                  sz.size(3) == kBlock && sz.is_contiguous(),
              "cpu_int4 native: scales must be contiguous bf16 [N/16, K/g, 2, 16]");
  TORCH_CHECK(group_size > 0 && group_size % kStep == 0, "cpu_int4 native: group size ", group_size,
              " is not a multiple of ", kStep);
  // The kernels mark a group's steps in 32 bits.
  TORCH_CHECK(group_size <= 32 * kStep, "cpu_int4 native: group size ", group_size, " is over ", 32 * kStep);
  TORCH_CHECK(sz.size(1) * group_size == packed.size(1) * kStep, "cpu_int4 native: group size ", group_size,
              " does not match the tensors");
}

// The path asked for, refused when unknown or when this CPU cannot run its instructions.
Isa checked_isa(int64_t isa) {
  switch (static_cast<Isa>(isa)) {
    case Isa::kAvx2:
      TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
                  "cpu_int4 native: this CPU has no AVX2 and FMA instructions");
      break;
    case Isa::kAvx512:
      TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"),
                  "cpu_int4 native: this CPU has no AVX-512F and AVX-512BW instructions");
      break;
    case Isa::kAvx512Bf16:
      TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512bf16"),
                  "cpu_int4 native: this CPU has no AVX-512 BF16 instructions");
      break;
    default:
      TORCH_CHECK(false, "cpu_int4 native: isa must be 1 (AVX2), 2 (AVX-512 BF16) or 3 (AVX-512), got ", isa);
  }
  return static_cast<Isa>(isa);
}

// Threads of the GEMV's own parallel region; 0: torch's intra-op threads (at::parallel_for).
std::atomic<int64_t> gemv_threads{0};

void set_gemv_threads(int64_t threads) {
  TORCH_CHECK(threads >= 0, "cpu_int4 native: threads must be >= 0");
  gemv_threads = threads;
}

// x as the kernels read it: int16 blocks and group sums.
struct Inputs {
  at::Tensor xsum, xw, xlo, xunit, xfix;
};

// round(m / 2^right) per lane for right >= 1: 0 from right = 9, as m < 2^8 (and a count of 32 or
// more shifts everything out).
AVX2 inline __m256i rounded_shift(__m256i m, __m256i right) {
  const __m256i one = _mm256_set1_epi32(1);
  return _mm256_srlv_epi32(_mm256_add_epi32(m, _mm256_sllv_epi32(one, _mm256_sub_epi32(right, one))), right);
}

// x [M, K] bf16 as int16 in blocks of 8 with a shared power of two, straight from the bits: a
// value's significand m (8 bits with the implicit one) shifted to the block's largest exponent
// E, m << 7 when the exponents match, so the largest is in [2^14, 2^15) and unit = 2^(E - 141).
// A value more than 7 binades below E is rounded to nearest; the remainder goes to xlo, exact
// up to 22 binades below E, rounded beyond. NaN and Inf come out finite here but reach y
// through the group sums. A block per iteration, a value per 32-bit lane: a value at a time took
// 3.5 ns a value (AMD EPYC, Zen 3), ~15 us of a 4096-column decode GEMV's ~35 on one core.
AVX2 void int16_blocks(const at::Tensor& xb, int64_t group_size, Inputs& in) {
  const int64_t M = xb.size(0), K = xb.size(1);
  in.xw = at::empty({M, K / 2}, xb.options().dtype(at::kInt));
  in.xlo = at::empty({M, K / 2}, xb.options().dtype(at::kInt));
  in.xunit = at::empty({M, K / kStep}, xb.options().dtype(at::kFloat));
  in.xfix = at::zeros({M, K / group_size}, xb.options().dtype(at::kInt));
  const uint16_t* x = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  int16_t* w = reinterpret_cast<int16_t*>(in.xw.data_ptr<int32_t>());
  int16_t* lo = reinterpret_cast<int16_t*>(in.xlo.data_ptr<int32_t>());
  float* unit = in.xunit.data_ptr<float>();
  uint32_t* fix = reinterpret_cast<uint32_t*>(in.xfix.data_ptr<int32_t>());
  const int64_t steps = group_size / kStep;
  const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1), fifteen = _mm256_set1_epi32(15);
  for (int64_t b = 0; b < M * K / kStep; ++b) {
    const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + kStep * b)));
    // Subnormals: exponent 1, no implicit one.
    const __m256i exponent = _mm256_max_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 7), _mm256_set1_epi32(0xFF)), one);
    __m256i top = _mm256_max_epi32(exponent, _mm256_permute2x128_si256(exponent, exponent, 1));
    top = _mm256_max_epi32(top, _mm256_shuffle_epi32(top, _MM_SHUFFLE(1, 0, 3, 2)));
    top = _mm256_max_epi32(top, _mm256_shuffle_epi32(top, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m256i normal = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7F80)), zero);
    const __m256i m = _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x7F)),
                                      _mm256_and_si256(normal, _mm256_set1_epi32(0x80)));
    const __m256i drop = _mm256_sub_epi32(_mm256_sub_epi32(top, exponent), _mm256_set1_epi32(7));  // bits below the unit
    const __m256i exact = _mm256_cmpgt_epi32(one, drop);  // drop <= 0: m << -drop, nothing left over
    __m256i v = _mm256_blendv_epi8(rounded_shift(m, drop), _mm256_sllv_epi32(m, _mm256_sub_epi32(zero, drop)), exact);
    // What rounding left: exact to 15 bits below the unit, rounded beyond.
    const __m256i near = _mm256_sub_epi32(_mm256_sllv_epi32(m, _mm256_sub_epi32(fifteen, drop)), _mm256_slli_epi32(v, 15));
    const __m256i far = rounded_shift(m, _mm256_sub_epi32(drop, fifteen));
    __m256i rest = _mm256_andnot_si256(exact, _mm256_blendv_epi8(near, far, _mm256_cmpgt_epi32(drop, fifteen)));
    const __m256i negative = _mm256_srai_epi32(_mm256_slli_epi32(bits, 16), 31);
    v = _mm256_sub_epi32(_mm256_xor_si256(v, negative), negative);
    rest = _mm256_sub_epi32(_mm256_xor_si256(rest, negative), negative);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w + kStep * b),
                     _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + kStep * b),
                     _mm_packs_epi32(_mm256_castsi256_si128(rest), _mm256_extracti128_si256(rest, 1)));
    if (!_mm256_testz_si256(rest, rest)) fix[b / steps] |= 1u << (b % steps);  // b / steps: row * G + group
    // 2^(top - 141): a normal float from top = 15, a subnormal below.
    const int32_t t = _mm256_cvtsi256_si32(top);
    const uint32_t unit_bits = t >= 15 ? static_cast<uint32_t>(t - 14) << 23 : 1u << (t + 8);
    std::memcpy(unit + b, &unit_bits, sizeof(float));
  }
}

// Sums r in [r0, r1) (r = row * G + group) of bf16 x in groups of g, in fp32, 16 values at a
// time in the same order for every row.
AVX512_BF16 void group_sums(const uint16_t* x, int64_t g, int64_t r0, int64_t r1, float* out) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* xg = x + r * g;
    __m512 acc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= g; k += 16) acc = _mm512_add_ps(acc, load_bf16x16(xg + k));
    if (k < g) {  // 8 left (group sizes are multiples of 8)
      const __m128i rest = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xg + k));
      const __m512i wide = _mm512_maskz_cvtepu16_epi32(0x00FF, _mm256_castsi128_si256(rest));
      acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
    out[r] = _mm512_reduce_add_ps(acc);
  }
}

// The AVX-512 BF16 path reads x as it is (its pairs as int32); the others read int16 blocks.
Inputs gemv_inputs(const at::Tensor& x, int64_t K, int64_t group_size, Isa path) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.dtype() == at::kBFloat16, "cpu_int4 native: x must be bf16 [M, K]");
  const at::Tensor xb = x.contiguous();
  Inputs in;
  if (path == Isa::kAvx512Bf16) {
    // Without the fp32 copy of x that at::sum needed (22 MB a call for 512 rows of K = 11008).
    in.xsum = at::empty({xb.size(0), K / group_size}, xb.options().dtype(at::kFloat));
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
    float* sums = in.xsum.data_ptr<float>();
    at::parallel_for(0, in.xsum.numel(), 1024, [&](int64_t r0, int64_t r1) { group_sums(xp, group_size, r0, r1, sums); });
    in.xw = xb.view(at::kInt);
  } else {
    in.xsum = xb.to(at::kFloat).view({xb.size(0), K / group_size, group_size}).sum(-1).contiguous();
    int16_blocks(xb, group_size, in);
  }
  return in;
}

Problem problem_of(const Inputs& in, const at::Tensor& packed, const at::Tensor& sz, int64_t group_size) {
  const bool blocks = in.xlo.defined();  // int16 blocks, not bf16 x
  return {in.xw.data_ptr<int32_t>(),
          blocks ? in.xlo.data_ptr<int32_t>() : nullptr,
          blocks ? in.xunit.data_ptr<float>() : nullptr,
          blocks ? reinterpret_cast<const uint32_t*>(in.xfix.data_ptr<int32_t>()) : nullptr,
          in.xsum.data_ptr<float>(),
          packed.data_ptr<int32_t>(),
          reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>()),
          in.xsum.size(0), packed.size(-2) * kStep, packed.size(-3) * kBlock, sz.size(-3), group_size};
}

// Whether the AVX-512 BF16 path takes M rows through bf16_panels rather than in registers.
bool in_panels(int64_t M) { return M > kBf16.rows; }

const Kernel& kernel_of(Isa path) {
  return path == Isa::kAvx2 ? kAvx2 : path == Isa::kAvx512 ? kAvx512 : kBf16;
}

// The output the kernels write: block_bf16 adds to it; bf16_panels and the int16 routines
// overwrite it, so only the former needs zeros (45 MB for 512 rows of N = 22016).
at::Tensor gemv_output(const Inputs& in, int64_t N, Isa path, bool panels) {
  const auto options = in.xsum.options();
  const bool adds = path == Isa::kAvx512Bf16 && !panels;
  return adds ? at::zeros({in.xsum.size(0), N}, options) : at::empty({in.xsum.size(0), N}, options);
}

// Rows [0, P.M) of y (row stride P.N) for blocks [b0, b0 + kMaxBlocksAtOnce) of W's rows
// (fewer at the layer's end).
void gemv_blocks(const Kernel& kernel, const Problem& P, int64_t b0, float* y) {
  if (&kernel == &kBf16 && in_panels(P.M)) return bf16_panels(P, b0, y);
  const int64_t b1 = std::min(b0 + kMaxBlocksAtOnce, P.N / kBlock);
  for (int64_t m0 = 0; m0 < P.M; m0 += kernel.rows) {
    const int mr = static_cast<int>(std::min<int64_t>(kernel.rows, P.M - m0));
    const int nb = kernel.wide_blocks[mr - 1];
    int64_t blk = b0;
    for (; blk + nb <= b1; blk += nb) kernel.wide[mr - 1](P, blk, m0, y + m0 * P.N);
    for (; blk < b1; ++blk) kernel.one[mr - 1](P, blk, m0, y + m0 * P.N);
  }
}

// work(i) for i in [0, items), on the GEMV's own threads, or torch's when that count is 0.
template <typename Work>
void parallel_items(int64_t items, const Work& work) {
  const int threads = std::min<int64_t>(gemv_threads.load(), items);
  if (threads > 0) {
    // Dynamic: inside vLLM a core is shared with the engine process's polling, and the thread
    // on it must not be handed an equal share.
    const int64_t chunk = std::max<int64_t>(1, items / (8 * threads));
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t b = 0; b < items; b += chunk)
      for (int64_t i = b; i < std::min(items, b + chunk); ++i) work(i);
  } else {
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) work(i);
    });
  }
}

// y [M, N] fp32 = x [M, K] @ W^T on the path `isa` (an Isa value).
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t group_size,
                     int64_t isa) {
  check_weights(packed, sz, group_size);
  const Isa path = checked_isa(isa);
  const Inputs in = gemv_inputs(x, packed.size(1) * kStep, group_size, path);
  const Problem P = problem_of(in, packed, sz, group_size);
  at::Tensor y = gemv_output(in, P.N, path, in_panels(P.M));
  float* yp = y.data_ptr<float>();
  const int64_t units = (packed.size(0) + kMaxBlocksAtOnce - 1) / kMaxBlocksAtOnce;
  parallel_items(units, [&](int64_t u) { gemv_blocks(kernel_of(path), P, u * kMaxBlocksAtOnce, yp); });
  return y;
}

// Mixture-of-experts: for each (expert, start, count) of `groups` (n of them, 3 int64 each), rows
// [start, start + count) of y [M, N] fp32 = those rows of x times expert `expert`'s W^T, from all
// experts' weights stacked (packed [E, N/16, K/8, 16], sz [E, N/16, K/g, 2, 16]). Rows outside
// every group are left unwritten. One call and one parallel region for all the experts a batch
// uses: a call per expert cost ~0.2 ms of dispatch a decode step per expert (Qwen3-30B-A3B
// shapes, 2 cores).
at::Tensor grouped_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, const int64_t* gp,
                        int64_t n, int64_t group_size, Isa path) {
  TORCH_CHECK(packed.dim() == 4 && sz.dim() == 5 && packed.size(0) == sz.size(0),
              "cpu_int4 native: experts' packed [E, N/16, K/8, 16] and sz [E, N/16, K/g, 2, 16] expected");
  check_weights(packed[0], sz[0], group_size);
  TORCH_CHECK(packed.is_contiguous() && sz.is_contiguous(), "cpu_int4 native: experts' tensors must be contiguous");
  const Inputs in = gemv_inputs(x, packed.size(2) * kStep, group_size, path);
  const Problem whole = problem_of(in, packed, sz, group_size);
  at::Tensor y = gemv_output(in, whole.N, path, false);  // parts of a few rows add
  const int64_t blocks = packed.size(1), expert_stride = packed[0].numel(), sz_stride = sz[0].numel();
  struct Part {
    Problem P;
    float* y;
  };
  std::vector<Part> parts;
  float* yp = y.data_ptr<float>();
  for (int64_t a = 0; a < n; ++a) {
    const int64_t expert = gp[3 * a], start = gp[3 * a + 1], count = gp[3 * a + 2];
    TORCH_CHECK(expert >= 0 && expert < packed.size(0) && start >= 0 && count >= 0 && start + count <= whole.M,
                "cpu_int4 native: group (", expert, ", ", start, ", ", count, ") is out of range");
    Problem P = whole;
    P.xw += start * P.K / 2;
    if (P.xlo != nullptr) {
      P.xlo += start * P.K / 2;
      P.xunit += start * P.K / kStep;
      P.xfix += start * P.G;
    }
    P.xsum += start * P.G;
    P.packed += expert * expert_stride;
    P.sz += expert * sz_stride;
    P.M = count;
    parts.push_back({P, yp + start * P.N});
  }
  const int64_t units = (blocks + kMaxBlocksAtOnce - 1) / kMaxBlocksAtOnce;
  parallel_items(static_cast<int64_t>(parts.size()) * units, [&](int64_t item) {
    const Part& part = parts[item / units];
    gemv_blocks(kernel_of(path), part.P, item % units * kMaxBlocksAtOnce, part.y);
  });
  return y;
}

// grouped_gemv with the groups as an int64 [A, 3] tensor.
at::Tensor int4_gemv_experts(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                             const at::Tensor& groups, int64_t group_size, int64_t isa) {
  TORCH_CHECK(groups.dtype() == at::kLong && groups.dim() == 2 && groups.size(1) == 3,
              "cpu_int4 native: groups must be int64 [A, 3] rows of (expert, start, count)");
  const at::Tensor g = groups.contiguous();
  return grouped_gemv(x, packed, sz, g.data_ptr<int64_t>(), g.size(0), group_size, checked_isa(isa));
}

// The routed experts of a few tokens with SiLU-gated experts, all of it in one call: x [T, H]
// bf16, topk_weights/topk_ids [T, k], w13 the experts' stacked gate and up (2I rows), w2 their
// down projection; bf16 [T, H] out. The same math as moe.run_experts: (token, k) pairs sorted by
// expert, w13's products rounded to bf16, silu(gate) * up in fp32 rounded to bf16 (vLLM's
// silu_and_mul), w2, then per token the k products weighted and summed in fp32, in k order.
// For decode's batches, whose experts each get under 64 rows: it replaces ~15 PyTorch ops and
// their Python, 7% of a token on the 4-layer Qwen3-30B-A3B-shaped model (bench/alternate.py).
at::Tensor int4_silu_experts(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                             const at::Tensor& w13_packed, const at::Tensor& w13_sz, const at::Tensor& w2_packed,
                             const at::Tensor& w2_sz, int64_t group_size, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "cpu_int4 native: x [T, H], topk_weights and topk_ids [T, k] expected");
  const Isa path = checked_isa(isa);
  const int64_t tokens = topk_ids.size(0), top_k = topk_ids.size(1), pairs = tokens * top_k;
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  std::vector<int64_t> order(pairs), where(pairs), groups;  // where[pair]: its row among the sorted
  for (int64_t i = 0; i < pairs; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return idp[a] < idp[b]; });
  at::Tensor token_of = at::empty({pairs}, ids.options());
  int64_t* tp = token_of.data_ptr<int64_t>();
  for (int64_t i = 0; i < pairs; ++i) {
    where[order[i]] = i;
    tp[i] = order[i] / top_k;
    if (i == 0 || idp[order[i]] != idp[order[i - 1]]) groups.insert(groups.end(), {idp[order[i]], i, 0});
    ++groups.back();
  }
  const int64_t n = static_cast<int64_t>(groups.size()) / 3;
  const at::Tensor hidden = grouped_gemv(x.index_select(0, token_of), w13_packed, w13_sz, groups.data(), n,
                                         group_size, path).to(at::kBFloat16).to(at::kFloat);
  const int64_t width = hidden.size(1) / 2;
  const at::Tensor act = (at::silu(hidden.narrow(1, 0, width)) * hidden.narrow(1, width, width)).to(at::kBFloat16);
  const at::Tensor product = grouped_gemv(act, w2_packed, w2_sz, groups.data(), n, group_size, path);
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const float* wp = weights.data_ptr<float>();
  const float* pp = product.data_ptr<float>();
  const int64_t H = product.size(1);
  at::Tensor out = at::zeros({tokens, H}, product.options());
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < top_k; ++j) {
      const float w = wp[t * top_k + j];
      const float* row = pp + where[t * top_k + j] * H;
      for (int64_t h = 0; h < H; ++h) op[t * H + h] += w * row[h];
    }
  return out.to(x.scalar_type());
}

// ------------------------------------------------ dequantize: W^T [K, N] for the prefill GEMM
// w = q * s + (z - 8s) in fp32, the kernel's own terms. One block's 16 rows are 16 adjacent
// columns of W^T, so each code slot becomes one contiguous 16-wide store.

constexpr int64_t kDequantTile = 16;  // blocks

struct Dequant {
  const int32_t* packed;
  const uint16_t* sz;
  int64_t K, N, G, g;
  float* out32;         // W^T fp32, or
  uint16_t* out16;      // W^T bf16 bits
};

AVX512_BF16 void dequant_step_avx512(const Dequant& D, int64_t blk, int64_t c) {
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  const int32_t* wb = D.packed + blk * (D.K / kStep) * kBlock;
  {
    const uint16_t* szg = D.sz + (blk * D.G + c * kStep / D.g) * 2 * kBlock;
    const __m512 s = load_bf16x16(szg);
    const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, load_bf16x16(szg + kBlock));
    const __m512i codes = _mm512_loadu_si512(wb + c * kBlock);
    for (int slot = 0; slot < kStep; ++slot) {
      const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(codes, 4 * slot), low4));
      const __m512 w = _mm512_fmadd_ps(q, s, offset);
      const int64_t at = (c * kStep + kSlotK[slot]) * D.N + blk * kBlock;
      if (D.out32 != nullptr)
        _mm512_storeu_ps(D.out32 + at, w);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(D.out16 + at), (__m256i)_mm512_cvtneps_pbh(w));
    }
  }
}

// fp32 -> bf16 bits, rounding to nearest even as at::BFloat16 does for finite values.
AVX2 inline __m128i to_bf16_avx2(__m256 w) {
  const __m256i bits = _mm256_castps_si256(w);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

// Also the AVX-512 path's: the AVX-512 routine above rounds to bf16 with an AVX512_BF16 instruction.
AVX2 void dequant_step_avx2(const Dequant& D, int64_t blk, int64_t c) {
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  const int32_t* wb = D.packed + blk * (D.K / kStep) * kBlock;
  const uint16_t* szg = D.sz + (blk * D.G + c * kStep / D.g) * 2 * kBlock;
  for (int h = 0; h < 2; ++h) {
    const __m256 s = load_bf16x8(szg + 8 * h);
    const __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, load_bf16x8(szg + kBlock + 8 * h));
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * kBlock + 8 * h));
    for (int slot = 0; slot < kStep; ++slot) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(codes, 4 * slot), low4));
      const __m256 w = _mm256_fmadd_ps(q, s, offset);
      const int64_t at = (c * kStep + kSlotK[slot]) * D.N + blk * kBlock + 8 * h;
      if (D.out32 != nullptr)
        _mm256_storeu_ps(D.out32 + at, w);
      else
        _mm_storeu_si128(reinterpret_cast<__m128i*>(D.out16 + at), to_bf16_avx2(w));
    }
  }
}

// Into `out` (W^T [K, N], fp32 or bf16, contiguous): the caller reuses one buffer, as a
// fresh 32 MiB W^T each call cost more in first-touch page faults than the dequantize itself.
void int4_dequantize_t(const at::Tensor& packed, const at::Tensor& sz, int64_t group_size, int64_t isa,
                       at::Tensor& wt) {
  check_weights(packed, sz, group_size);
  const Isa path = checked_isa(isa);
  const int64_t blocks = packed.size(0), K = packed.size(1) * kStep, N = blocks * kBlock;
  const at::ScalarType dtype = wt.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "cpu_int4 native: dequantize to fp32 or bf16");
  TORCH_CHECK(wt.dim() == 2 && wt.size(0) == K && wt.size(1) == N && wt.is_contiguous(),
              "cpu_int4 native: out must be contiguous [K, N]");
  const Dequant D{packed.data_ptr<int32_t>(),
                  reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>()),
                  K, N, sz.size(1), group_size,
                  dtype == at::kFloat ? wt.data_ptr<float>() : nullptr,
                  dtype == at::kBFloat16 ? reinterpret_cast<uint16_t*>(wt.data_ptr<at::BFloat16>()) : nullptr};
  const auto step_fn = path == Isa::kAvx512Bf16 ? dequant_step_avx512 : dequant_step_avx2;
  // A tile of blocks at a time, steps outermost: each row of W^T then gets kDequantTile * 16
  // adjacent columns in one go. Block by block, every 32-byte store landed on another page and
  // the bf16 dequantize ran at 2 GB/s.
  at::parallel_for(0, blocks, kDequantTile, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; tile += kDequantTile) {
      for (int64_t c = 0; c < K / kStep; ++c)
        for (int64_t blk = tile; blk < std::min(end, tile + kDequantTile); ++blk) step_fn(D, blk, c);
    }
  });
}

// ------------------------------------------------ AMX: large batches, weights never in DRAM as bf16
// x [M, K] bf16 @ W^T with bf16 products and fp32 sums, as vLLM's bf16 GEMM computes them, on
// weights dequantized exactly as dequantize_t does (w = q * s + (z - 8s), rounded to bf16 once).
// The weights are dequantized a panel at a time into AMX's tile layout in a per-thread buffer
// that stays in L2. Dequantizing into a W^T slice for oneDNN cost 10.5 ms of 31.7 for 512 rows
// x 11008 x 4096 on 2 Sapphire Rapids cores (oneDNN on prepacked bf16: 23.4).

#define AMX_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileK = 32;            // bf16 values of x per tile row: 64 bytes
constexpr int64_t kTileElems = 512;       // bf16 values in one 16 x 64-byte tile
constexpr int64_t kPanelBlocks = 16;      // 256 columns of W^T per panel
constexpr int64_t kPanelK = 512;          // K per dequantized panel: 256 KiB of bf16 tiles, in L2
constexpr int64_t kRowChunk = 512;        // rows of fp32 sums a thread holds for one panel
// Chunks ahead whose weight tiles are prefetched into L1: AMX stalls on tile loads from L2
// (512 rows x 11008 x 4096 on 2 cores: 27.3 ms without, 24.1 with 2 ahead, 25.2 with 1).
constexpr int64_t kAhead = 2;

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 hold sums (rows 0-15 and 16-31 by columns 0-15 and 16-31), 4-5 rows of x, 6-7 weights.
AMX_BF16 void amx_configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Block `blk`, k in [k0, k0 + kn), as weight tiles [kn/32][16 pairs (k, k+1)][16 columns][2].
// `lane >> 4t & 0x000F000F` is already such a pair for each of the 16 columns (native_layout.py).
AMX_BF16 void dequant_tiles(const Dequant& D, int64_t blk, int64_t k0, int64_t kn, uint16_t* dst) {
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  // cvtne2ps puts the even k's 16 bf16 values below the odd k's; this interleaves them.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int32_t* wb = D.packed + blk * (D.K / kStep) * kBlock;
  __m512 s, offset;
  for (int64_t c = k0 / kStep; c < (k0 + kn) / kStep; ++c) {
    if (c * kStep % D.g == 0) {
      const uint16_t* szg = D.sz + (blk * D.G + c * kStep / D.g) * 2 * kBlock;
      s = load_bf16x16(szg);
      offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, load_bf16x16(szg + kBlock));
    }
    // The next block's line: a block's 512 k are one 4 KiB page, which the hardware prefetcher
    // does not cross (dequantizing 11008 x 4096 on 2 cores: 4.4 ms without, 3.5 with).
    _mm_prefetch(reinterpret_cast<const char*>(wb + D.K / kStep * kBlock + c * kBlock), _MM_HINT_T0);
    const __m512i codes = _mm512_loadu_si512(wb + c * kBlock);
    for (int t = 0; t < 4; ++t) {
      const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(codes, 4 * t), low4));
      const __m512 odd = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(codes, 4 * t + 16), low4));
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(odd, s, offset), _mm512_fmadd_ps(even, s, offset));
      _mm512_storeu_si512(dst + ((c - k0 / kStep) * 4 + t) * 2 * kBlock,
                          _mm512_permutexvar_epi16(interleave, (__m512i)both));
    }
  }
}

// Tiles of 16 x 16 sums (+)= x tiles times weight tiles w0 (and w1, the next 16 columns), over
// `chunks` steps of 32 k. x: [chunks][2 row tiles][16][32]; sums: [2 row tiles][blocks][16][16].
template <bool kTwo>
AMX_BF16 void tile_pass(const uint16_t* x, const uint16_t* w0, const uint16_t* w1, int64_t chunks, float* sums,
                        int64_t row_tile_stride, bool accumulate) {
  constexpr int64_t ss = kBlock * 4;
  float* s1 = sums + row_tile_stride;
  if (accumulate) {
    _tile_loadd(0, sums, ss);
    _tile_loadd(2, s1, ss);
    if (kTwo) {
      _tile_loadd(1, sums + kTileRows * kBlock, ss);
      _tile_loadd(3, s1 + kTileRows * kBlock, ss);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kc = 0; kc < chunks; ++kc) {
    for (int line = 0; line < kTileRows; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(w0 + (kc + kAhead) * kTileElems + line * kTileK), _MM_HINT_T0);
      if (kTwo) _mm_prefetch(reinterpret_cast<const char*>(w1 + (kc + kAhead) * kTileElems + line * kTileK), _MM_HINT_T0);
    }
    _tile_loadd(4, x + kc * 2 * kTileElems, 64);
    _tile_loadd(5, x + kc * 2 * kTileElems + kTileElems, 64);
    _tile_loadd(6, w0 + kc * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (kTwo) {
      _tile_loadd(7, w1 + kc * kTileElems, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, ss);
  _tile_stored(2, s1, ss);
  if (kTwo) {
    _tile_stored(1, sums + kTileRows * kBlock, ss);
    _tile_stored(3, s1 + kTileRows * kBlock, ss);
  }
}

// One panel (blocks [b0, b0 + nb)) of out, from x packed as tiles (pack_row_tiles).
AMX_BF16 void amx_panel(const Dequant& D, const uint16_t* xt, int64_t M, int64_t out_rows, int64_t b0, int64_t nb) {
  thread_local std::vector<uint16_t> tiles(kPanelBlocks * kPanelK * kBlock);
  thread_local std::vector<float> sums(kRowChunk * kPanelBlocks * kBlock);
  constexpr int64_t row_tile_stride = kPanelBlocks * kTileRows * kBlock;  // sums of one row tile
  const int64_t all_chunks = D.K / kTileK;
  amx_configure();
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, M - m0);
    for (int64_t k0 = 0; k0 < D.K; k0 += kPanelK) {
      const int64_t kn = std::min(kPanelK, D.K - k0), chunks = kn / kTileK;
      for (int64_t b = 0; b < nb; ++b) dequant_tiles(D, b0 + b, k0, kn, tiles.data() + b * chunks * kTileElems);
      for (int64_t r = 0; r < rows; r += 2 * kTileRows) {
        const uint16_t* x = xt + ((m0 + r) / (2 * kTileRows) * all_chunks + k0 / kTileK) * 2 * kTileElems;
        float* s = sums.data() + r / kTileRows * row_tile_stride;
        for (int64_t b = 0; b < nb; b += 2) {
          const uint16_t* w0 = tiles.data() + b * chunks * kTileElems;
          if (b + 1 < nb)
            tile_pass<true>(x, w0, w0 + chunks * kTileElems, chunks, s + b * kTileRows * kBlock, row_tile_stride, k0 > 0);
          else
            tile_pass<false>(x, w0, nullptr, chunks, s + b * kTileRows * kBlock, row_tile_stride, k0 > 0);
        }
      }
    }
    for (int64_t r = 0; r < std::min(rows, out_rows - m0); ++r) {
      const float* src = sums.data() + r / kTileRows * row_tile_stride + r % kTileRows * kBlock;
      const int64_t at = (m0 + r) * D.N + b0 * kBlock;
      for (int64_t b = 0; b < nb; ++b) {
        const __m512 v = _mm512_loadu_ps(src + b * kTileRows * kBlock);
        if (D.out32 != nullptr)
          _mm512_storeu_ps(D.out32 + at + b * kBlock, v);
        else
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(D.out16 + at + b * kBlock), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
  _tile_release();
}

// x [M, K] bf16 as AMX reads it: [M/32][K/32][2 row tiles][16 rows][32 k], rows past M zero.
// Row-major rows K * 2 bytes apart put a tile's 16 rows in the same L1 sets (4 KiB aliasing).
at::Tensor pack_row_tiles(const at::Tensor& x, int64_t padded) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xp = x.contiguous();
  if (padded != M) xp = at::constant_pad_nd(xp, {0, 0, 0, padded - M});
  return xp.view({padded / (2 * kTileRows), 2, kTileRows, K / kTileK, kTileK}).permute({0, 3, 1, 2, 4}).contiguous();
}

// out [M, N] (fp32 or bf16, contiguous) = x [M, K] bf16 @ W^T, on AMX; the GEMV's threads.
// The process must have asked Linux for AMX tile state first (native.request_amx).
void int4_amx_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t group_size,
                     at::Tensor& out) {
  check_weights(packed, sz, group_size);
  TORCH_CHECK(__builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("avx512bf16"),
              "cpu_int4 native: this CPU has no AMX-BF16 instructions");
  const int64_t blocks = packed.size(0), K = packed.size(1) * kStep, N = blocks * kBlock, M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16,
              "cpu_int4 native: x must be bf16 [M, ", K, "]");
  TORCH_CHECK(K % kTileK == 0, "cpu_int4 native: K=", K, " is not a multiple of ", kTileK);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "cpu_int4 native: out must be contiguous fp32 or bf16 [M, N]");
  const int64_t padded = (M + 2 * kTileRows - 1) / (2 * kTileRows) * (2 * kTileRows);
  const at::Tensor xt = pack_row_tiles(x, padded);
  const Dequant D{packed.data_ptr<int32_t>(), reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>()),
                  K, N, sz.size(1), group_size,
                  out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr,
                  out.scalar_type() == at::kBFloat16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr};
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(xt.data_ptr<at::BFloat16>());
  const int64_t panels = (blocks + kPanelBlocks - 1) / kPanelBlocks;
  parallel_items(panels, [&](int64_t p) {
    const int64_t b0 = p * kPanelBlocks;
    amx_panel(D, xb, padded, M, b0, std::min(kPanelBlocks, blocks - b0));
  });
}

// ------------------------------------------------ min/max quantize (the quantizer's hot loop)
// Bit for bit what format.quantize_minmax computes in PyTorch, one pass per group instead of a
// dozen whole-tensor passes (0.2 GB/s of bf16 input on 2 cores). Operation by operation with
// the same roundings: no FMA contraction (-ffp-contract=off), x/15 divided, not multiplied by
// a reciprocal, round half to even.

// One group of g bf16 weights -> g/2 packed bytes, scale and zero (bf16 bits). False if a
// weight is NaN or infinite.
AVX2 bool quantize_group(const uint16_t* w, int64_t g, uint8_t* packed, uint16_t* scale_out, uint16_t* zero_out) {
  const __m256i exponent = _mm256_set1_epi32(0x7F800000);
  __m256 lo = _mm256_set1_ps(INFINITY), hi = _mm256_set1_ps(-INFINITY);
  __m256i special = _mm256_setzero_si256();
  for (int64_t i = 0; i < g; i += 8) {
    const __m256 v = load_bf16x8(w + i);
    special = _mm256_or_si256(special, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent), exponent));
    lo = _mm256_min_ps(lo, v);
    hi = _mm256_max_ps(hi, v);
  }
  if (!_mm256_testz_si256(special, special)) return false;
  float lows[8], highs[8];
  _mm256_storeu_ps(lows, lo);
  _mm256_storeu_ps(highs, hi);
  float low = lows[0], high = highs[0];
  for (int j = 1; j < 8; ++j) {
    low = std::min(low, lows[j]);
    high = std::max(high, highs[j]);
  }
  const float scale = std::max(high / 15.0f - low / 15.0f, std::numeric_limits<float>::min());
  const float zero = low + 8.0f * scale;
  const c10::BFloat16 scale16(scale), zero16(zero);  // round to nearest even, as .to(bfloat16)
  *scale_out = scale16.x;
  *zero_out = zero16.x;
  const float inv = 1.0f / static_cast<float>(scale16);
  const float shift = 8.0f - static_cast<float>(zero16) * inv;
  const __m256 vinv = _mm256_set1_ps(inv), vshift = _mm256_set1_ps(shift);
  const __m256 vmax = _mm256_set1_ps(15.0f), vmid = _mm256_set1_ps(8.0f);
  for (int64_t i = 0; i < g; i += 8) {
    __m256 steps = _mm256_add_ps(_mm256_mul_ps(load_bf16x8(w + i), vinv), vshift);
    steps = _mm256_blendv_ps(steps, vmid, _mm256_cmp_ps(steps, steps, _CMP_UNORD_Q));  // inf - inf -> 8
    steps = _mm256_round_ps(steps, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i codes = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(steps, _mm256_setzero_ps()), vmax));
    // Pair lanes (2j, 2j+1) into one byte, low nibble first.
    const __m256i pairs = _mm256_or_si256(codes, _mm256_srli_epi64(codes, 28));
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), pairs);
    for (int j = 0; j < 4; ++j) packed[i / 2 + j] = static_cast<uint8_t>(lanes[2 * j]);
  }
  return true;
}

// (packed uint8 [N, K/2], scale bf16 [N, K/g], zero bf16 [N, K/g]) of bf16 weights [N, K].
std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_quantize_minmax(const at::Tensor& weight, int64_t group_size) {
  TORCH_CHECK(weight.dtype() == at::kBFloat16 && weight.dim() == 2, "cpu_int4 native: quantize takes bf16 [N, K]");
  TORCH_CHECK(group_size % 8 == 0 && group_size > 0 && weight.size(1) % group_size == 0,
              "cpu_int4 native: K=", weight.size(1), " is not a multiple of group size ", group_size);
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), G = K / group_size;
  at::Tensor packed = at::empty({N, K / 2}, w.options().dtype(at::kByte));
  at::Tensor scale = at::empty({N, G}, w.options());
  at::Tensor zero = at::empty({N, G}, w.options());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint8_t* pp = packed.data_ptr<uint8_t>();
  uint16_t* sp = reinterpret_cast<uint16_t*>(scale.data_ptr<at::BFloat16>());
  uint16_t* zp = reinterpret_cast<uint16_t*>(zero.data_ptr<at::BFloat16>());
  std::atomic<bool> finite{true};
  at::parallel_for(0, N * G, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (!quantize_group(wp + i * group_size, group_size, pp + i * group_size / 2, sp + i, zp + i)) finite = false;
    }
  });
  TORCH_CHECK_VALUE(finite.load(), "cpu_int4 native: weight contains NaN or Inf");
  return {packed, scale, zero};
}

}  // namespace

TORCH_LIBRARY(cpu_int4_native, m) {
  m.def("gemv(Tensor x, Tensor packed, Tensor sz, int group_size, int isa) -> Tensor");
  m.def("gemv_experts(Tensor x, Tensor packed, Tensor sz, Tensor groups, int group_size, int isa) -> Tensor");
  m.def(
      "silu_experts(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13_packed, Tensor w13_sz, "
      "Tensor w2_packed, Tensor w2_sz, int group_size, int isa) -> Tensor");
  m.def("dequantize_t(Tensor packed, Tensor sz, int group_size, int isa, Tensor(a!) out) -> ()");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor sz, int group_size, Tensor(a!) out) -> ()");
  m.def("quantize_minmax(Tensor weight, int group_size) -> (Tensor, Tensor, Tensor)");
  m.def("set_gemv_threads(int threads) -> ()");
}

TORCH_LIBRARY_FRAGMENT(cpu_int4_native, m) { m.impl("set_gemv_threads", set_gemv_threads); }

TORCH_LIBRARY_IMPL(cpu_int4_native, CPU, m) {
  m.impl("gemv", int4_gemv);
  m.impl("gemv_experts", int4_gemv_experts);
  m.impl("silu_experts", int4_silu_experts);
  m.impl("dequantize_t", int4_dequantize_t);
  m.impl("amx_linear", int4_amx_linear);
  m.impl("quantize_minmax", int4_quantize_minmax);
}
