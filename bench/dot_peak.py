"""The multiply rate one core can reach with each dot-product instruction a kernel could build on:
what bounds a GEMM once the weights stop being the limit (many streams, prefill).

    .venv/bin/python bench/dot_peak.py

Compiles a loop per instruction (24 independent 512-bit sums, 6 broadcast operands by 4
weight registers, as the AVX-512 BF16 kernel's inner loop) with g++, runs each on one core and
prints billions of instructions and of multiply-accumulates a second, with the CPU's model and
ISA flags. bf16 pairs (`vdpbf16ps`, 32 MACs) are what cpu_int4's AVX-512 BF16 path and oneDNN's
bf16 GEMM use; int8 quads (`vpdpbusd`, 64 MACs) are what an int8-activation kernel (llama.cpp's
route) would use; fp32 FMA (16 MACs) is the AVX2 route.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from kernel import cpu_description

SOURCE = r"""
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#define LOOP(T, ZERO, W, X, OP)                                                    \
  T acc[24];                                                                       \
  for (int i = 0; i < 24; i++) acc[i] = ZERO;                                      \
  T w[4];                                                                          \
  for (int b = 0; b < 4; b++) w[b] = W;                                            \
  for (long it = 0; it < iters; ++it)                                              \
    for (int m = 0; m < 6; m++) {                                                  \
      T xp = X;                                                                    \
      for (int b = 0; b < 4; b++) acc[m * 4 + b] = OP;                             \
    }                                                                              \
  for (int i = 1; i < 24; i++) sink[i] = acc[i];

__attribute__((target("avx512f,avx512bf16"))) void bf16(long iters, const int* x, __m512* sink) {
  LOOP(__m512, _mm512_setzero_ps(), _mm512_castsi512_ps(_mm512_set1_epi32(0x3f803f80 + b)),
       _mm512_castsi512_ps(_mm512_set1_epi32(x[(m * 7 + it) & 63])),
       _mm512_dpbf16_ps(acc[m * 4 + b], (__m512bh)w[b], (__m512bh)xp))
}
__attribute__((target("avx512f,avx512vnni"))) void int8(long iters, const int* x, __m512i* sink) {
  LOOP(__m512i, _mm512_setzero_si512(), _mm512_set1_epi32(0x01020304 + b),
       _mm512_set1_epi32(x[(m * 7 + it) & 63]), _mm512_dpbusd_epi32(acc[m * 4 + b], w[b], xp))
}
__attribute__((target("avx512f"))) void fp32(long iters, const int* x, __m512* sink) {
  LOOP(__m512, _mm512_setzero_ps(), _mm512_set1_ps(1.0f + b),
       _mm512_set1_ps((float)x[(m * 7 + it) & 63] * 1e-30f), _mm512_fmadd_ps(w[b], xp, acc[m * 4 + b]))
}
template <typename F, typename S> void time(const char* name, int macs, F f, S* sink, const int* x) {
  const long iters = 20000000;
  double best = 1e9;
  for (int r = 0; r < 3; ++r) {
    auto t = std::chrono::steady_clock::now();
    f(iters, x, sink);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
  }
  std::printf("| %s | %.2f | %.0f |\n", name, iters * 24 / best / 1e9, iters * 24.0 * macs / best / 1e9);
}
int main() {
  int x[64];
  for (int i = 0; i < 64; i++) x[i] = 0x01010101;
  __m512 fs[24];
  __m512i is[24];
  std::printf("| instruction (512-bit) | G instr/s | G MAC/s |\n|---|---|---|\n");
  if (__builtin_cpu_supports("avx512bf16")) time("vdpbf16ps (bf16 pairs)", 32, bf16, fs, x);
  if (__builtin_cpu_supports("avx512vnni")) time("vpdpbusd (int8 quads)", 64, int8, is, x);
  if (__builtin_cpu_supports("avx512f")) time("vfmadd231ps (fp32)", 16, fp32, fs, x);
}
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "dot_peak.cpp", Path(tmp) / "dot_peak"
        source.write_text(SOURCE)
        subprocess.run(["g++", "-O3", "-std=c++17", str(source), "-o", str(binary)], check=True)
        print(subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout)
    print(f"one core; {cpu_description()}")


if __name__ == "__main__":
    main()
