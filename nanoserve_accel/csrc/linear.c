#include "kernels.h"

/* ---- §1: the linear layers' GEMM ----
 * W [N, K] is packed once, at load time (linear.py), as [N / 16][K][16]: panel p holds
 * output columns 16p..16p+15, one 16-wide row per input index k. Each panel is then read
 * front to back, once per block of 6 (or 5) rows of x (a "pass"): for each k, the panel's
 * 16 weights meet 6 rows, 12 accumulators of 8 floats in registers: the weights stream at
 * close to memory speed, where a general GEMM's small-batch path does not. x [M, K], y [M, N];
 * N a multiple of 16. */
/* A panel's 16 bf16 weights of one k as floats: w0 the even columns, w1 the odd ones. One load
 * and two integer ops, where widening 8 at a time in column order took two loads and four. */
static inline void pairs8(const void* w, int64_t i, vec8* w0, vec8* w1) {
  u32x8 bits;
  memcpy(&bits, (const uint16_t*)w + i, sizeof bits);
  const u32x8 even = bits << 16, odd = bits & 0xFFFF0000u;
  memcpy(w0, &even, sizeof *w0);
  memcpy(w1, &odd, sizeof *w1);
}

/* Column j of a panel's two accumulators: in column order, or as pairs8() loaded them (bf16). */
static inline float lane(const vec8 acc[2], int j, int pairs) {
  return pairs ? acc[j % 2][j / 2] : acc[j / 8][j % 8];
}

static inline __attribute__((always_inline)) void gemm_k(
    vec8 acc[6][2], const void* x, const void* w, const int64_t row[6], int64_t panel, int k,
    const int ROWS, const int bf16) {
  vec8 w0, w1;
  if (bf16) pairs8(w, panel + k * 16, &w0, &w1);
  else { w0 = load8(w, panel + k * 16, 0); w1 = load8(w, panel + k * 16 + 8, 0); }
  for (int i = 0; i < ROWS; ++i) {
    const float xi = ((const float*)x)[row[i] + k]; /* x: float32 here, see linear_panels() */
    acc[i][0] += xi * w0;
    acc[i][1] += xi * w1;
  }
}

/* Panel p's 16 columns for rows m0 .. m0 + ROWS - 1: pass `pass` of `passes`. The panel
 * starts at element `panel` of w, bf16 if w_bf16; bias and y are bf16 if bf16. Always
 * inlined: ROWS and the dtypes are then constants in each loop below, and `acc` stays in
 * registers. */
static inline __attribute__((always_inline)) void gemm_block(
    const void* x, const void* w, int64_t panel, const void* bias, void* y, int M, int N, int K,
    int p, int m0, const int ROWS, const int w_bf16, const int bf16, int pass, int passes) {
  int64_t row[6]; /* rows past M repeat the last one; their sums are not stored */
  for (int i = 0; i < ROWS; ++i) row[i] = (int64_t)(m0 + i < M ? m0 + i : M - 1) * K;
  vec8 acc[6][2] = {{{0}}}; /* ROWS <= 6 */
  if (bf16 || passes < 2 || p + 1 == N / 16) {
    /* bf16 (prefetching measured slower, and a `wide` panel has no next panel behind it),
     * one pass (the CPU's prefetcher keeps up), the last panel */
    for (int k = 0; k < K; ++k) gemm_k(acc, x, w, row, panel, k, ROWS, w_bf16);
  } else {
    /* Each pass also asks for its share of the next panel's K rows, one every `passes`
     * values of k: the next panel arrives from memory while this one is computed, instead
     * of stalling its own first pass. */
    const float* next = (const float*)w + panel + (int64_t)K * 16;
    const int share = (K + passes - 1) / passes;
    for (int k0 = 0, line = pass * share; k0 < K; k0 += passes, ++line) {
      if (line < K) __builtin_prefetch(next + (int64_t)line * 16, 0, 2);
      for (int k = k0; k < k0 + passes && k < K; ++k)
        gemm_k(acc, x, w, row, panel, k, ROWS, w_bf16);
    }
  }
  for (int i = 0; i < ROWS && m0 + i < M; ++i)
    for (int j = 0; j < 16; ++j)
      store(y, (int64_t)(m0 + i) * N + p * 16 + j,
            lane(acc[i], j, w_bf16) + (bias ? load(bias, p * 16 + j, bf16) : 0.f), bf16);
}

/* One row (a lone decode row) over panels p0 .. p0 + G - 1 at once: each column's sum is one
 * chain of FMAs over k, as in gemm_block (so the same bits), but G panels give the core 2G chains
 * at a time. One panel's two chains wait on each FMA's latency: a row then ran at ~16 bytes of
 * weight a cycle (half that in bf16), under the memory's rate on two cores. */
static inline __attribute__((always_inline)) void gemv_panels(
    const float* x, const void* w, const void* bias, void* y, int K, int p0, const int G,
    const int bf16) {
  vec8 acc[4][2] = {{{0}}}; /* G <= 4 */
  for (int k = 0; k < K; ++k)
    for (int g = 0; g < G; ++g) {
      const int64_t at = ((int64_t)(p0 + g) * K + k) * 16;
      vec8 w0, w1;
      if (bf16) pairs8(w, at, &w0, &w1);
      else { w0 = load8(w, at, 0); w1 = load8(w, at + 8, 0); }
      acc[g][0] += x[k] * w0;
      acc[g][1] += x[k] * w1;
    }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 16; ++j)
      store(y, (p0 + g) * 16 + j,
            lane(acc[g], j, bf16) + (bias ? load(bias, (p0 + g) * 16 + j, bf16) : 0.f), bf16);
}

/* Rows in the pass that starts with `left` rows to go: 5 until the rest is a multiple of 6
 * (64 = 5 + 5 + 9 x 6, 16 = 5 + 5 + 6), so that no row is computed twice: a last block of 4
 * rows in 6 computed 2 in vain (bit-identical either way). Under 5 rows left: one block, its
 * rows past M repeated. */
static inline int block_rows(int left) { return left % 6 && left >= 5 ? 5 : 6; }

/* One task per panel of w [N, K] (packed), bias (or NULL) and output y [M, N]; a lone decode row,
 * one task per four panels (gemv_panels: the 6-row block would multiply it six times). (Rows per
 * block or panels per task, dtype) are constants in each call below. "guided" hands out runs of
 * adjacent tasks, shrinking at the end, so a core that a VM's host slows for a while is not
 * waited for. */
void linear_panels(const void* x_in, const void* w, const void* bias, void* y, int N, int M, int K,
                   int bf16) {
  int passes = 0;
  for (int m0 = 0; m0 < M; m0 += block_rows(M - m0)) ++passes;
  /* bf16: x widened to float32 once here, not once per panel. */
  float* xf = bf16 ? malloc(sizeof(float) * M * K) : NULL;
  for (int64_t i = 0; bf16 && i < (int64_t)M * K; ++i) xf[i] = load(x_in, i, 1);
  const void* x = bf16 ? xf : x_in;
  const int panels = N / 16;
  if (M == 1) {
#pragma omp parallel for schedule(guided)
    for (int p0 = 0; p0 < panels; p0 += 4) {
#define GEMV(G) (bf16 ? gemv_panels(x, w, bias, y, K, p0, G, 1) \
                      : gemv_panels(x, w, bias, y, K, p0, G, 0))
      BY_ROWS(panels - p0, 4, GEMV); /* G = min(panels left, 4), a constant in each call */
#undef GEMV
    }
    free(xf);
    return;
  }
#pragma omp parallel
  {
    /* bf16 with several passes: each panel widened to float32 once, into `wide`, and not in
     * every pass. A lone pass reads the bf16 panel. */
    float* wide = bf16 && passes > 1 ? malloc(sizeof(float) * K * 16) : NULL;
#pragma omp for schedule(guided)
    for (int p = 0; p < panels; ++p) {
      const int64_t panel = (int64_t)p * K * 16;
      for (int64_t j = 0; wide && j < (int64_t)K * 16; ++j) wide[j] = load(w, panel + j, 1);
      /* One branch per case, each passing ROWS and the dtypes as constants: gemm_block is
       * inlined into each and compiled as its own loop, accumulators in registers. */
      for (int m0 = 0, pass = 0, rows; m0 < M; m0 += rows, ++pass) {
        rows = block_rows(M - m0);
        if (wide && rows == 5) gemm_block(x, wide, 0, bias, y, M, N, K, p, m0, 5, 0, 1, pass,
                                          passes);
        else if (wide) gemm_block(x, wide, 0, bias, y, M, N, K, p, m0, 6, 0, 1, pass, passes);
        else if (bf16 && rows == 5) gemm_block(x, w, panel, bias, y, M, N, K, p, m0, 5, 1, 1,
                                               pass, passes);
        else if (bf16) gemm_block(x, w, panel, bias, y, M, N, K, p, m0, 6, 1, 1, pass, passes);
        else if (rows == 5) gemm_block(x, w, panel, bias, y, M, N, K, p, m0, 5, 0, 0, pass,
                                       passes);
        else gemm_block(x, w, panel, bias, y, M, N, K, p, m0, 6, 0, 0, pass, passes);
      }
    }
    free(wide);
  }
  free(xf);
}
