/* Which instructions share the pipes of AVX-512 VNNI's `vpdpbusd`: the arithmetic floor of an integer kernel.

       gcc -O2 -march=native benchmarks/vpdpbusd_pipes.c -o /tmp/vpdpbusd_pipes && /tmp/vpdpbusd_pipes

   Each line times a loop of independent chains (no chain waits on another): 8 `vpdpbusd` alone, then with
   the other work an integer kernel's inner loop holds per strip and row (multiply-adds, conversions, shifts,
   scalar loads and broadcasts). An instruction that adds its own time to the 8 shares their pipes; one that
   adds next to nothing runs beside them. The a16 8-row loop (`backends/cpu/gemm.py: _strip_dot`) is 128
   `vpdpbusd` an iteration: whatever else shares their pipes is added to that floor.
*/
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define N 100000000L
#define KEEP __asm__ volatile("" ::"v"(b), "v"(c), "v"(g), "v"(h))
#define DOT(k) a[k] = _mm512_dpbusd_epi32(a[k], b, c);
#define DOTS DOT(0) DOT(1) DOT(2) DOT(3) DOT(4) DOT(5) DOT(6) DOT(7)
#define FMA(k) f[k] = _mm512_fmadd_ps(f[k], g, h);
#define SHIFT_ADD(k) z[k] = _mm512_add_epi32(_mm512_slli_epi32(z[k], 1), one);
#define CONVERT(k) z[k] = _mm512_cvtps_epi32(_mm512_cvtepi32_ps(z[k]));
#define BROADCAST(k) f[k] = _mm512_add_ps(f[k], _mm512_set1_ps(mem[k] + mem[k + 8]));
#define TIME(label, body)                                  \
  t = now();                                               \
  for (long i = 0; i < N; i++) { body KEEP; }              \
  printf("%-50s %.3f ns an iteration\n", label, (now() - t) / N * 1e9);

int main(void) {
  __m512i a[8], z[4], b = _mm512_set1_epi8(3), c = _mm512_set1_epi8(5), one = _mm512_set1_epi32(1);
  __m512 f[6], g = _mm512_set1_ps(0.5f), h = _mm512_set1_ps(0.999f);
  volatile float mem[16];
  double t;
  for (int i = 0; i < 8; i++) a[i] = _mm512_set1_epi32(i);
  for (int i = 0; i < 6; i++) f[i] = _mm512_set1_ps((float)i);
  for (int i = 0; i < 4; i++) z[i] = _mm512_set1_epi32(i);
  for (int i = 0; i < 16; i++) mem[i] = (float)i;
  TIME("8 vpdpbusd", DOTS)
  TIME("6 vfmadd231ps", FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5))
  TIME("8 vpdpbusd + 2 vfmadd231ps", DOTS FMA(0) FMA(1))
  TIME("8 vpdpbusd + 6 vfmadd231ps", DOTS FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5))
  TIME("8 vpdpbusd + 4 (vpslld, vpaddd)", DOTS SHIFT_ADD(0) SHIFT_ADD(1) SHIFT_ADD(2) SHIFT_ADD(3))
  TIME("8 vpdpbusd + 2 (vcvtdq2ps, vcvtps2dq)", DOTS CONVERT(0) CONVERT(1))
  TIME("8 vpdpbusd + 2 (load, vaddss, broadcast, vaddps)", DOTS BROADCAST(0) BROADCAST(1))
  int s = 0;
  for (int i = 0; i < 8; i++) s += _mm512_reduce_add_epi32(a[i]);
  for (int i = 0; i < 4; i++) s += _mm512_reduce_add_epi32(z[i]);
  float q = 0;
  for (int i = 0; i < 6; i++) q += _mm512_reduce_add_ps(f[i]);
  printf("(checksums %d %g)\n", s, q);
  return 0;
}
