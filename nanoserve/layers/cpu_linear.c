#include "cpu_kernels.h"

/* ---- §1: the linear layers' GEMM ----
 * W [N, K] is packed once, at load time (cpu_linear.py), as [N / 16][K][16]: panel p holds
 * output columns 16p..16p+15, one 16-wide row per input index k. Each panel is then read
 * front to back, once per block of 6 (or 5) rows of x (a "pass"): for each k, the panel's
 * 16 weights meet 6 rows, 12 accumulators of 8 floats in registers. oneDNN's small-batch GEMM
 * read the weights at ~5 GB/s here, this at ~8-15. x [M, K], y [M, N]; N a multiple of 16. */
static inline __attribute__((always_inline)) void gemm_k(
    vec8 acc[6][2], const void* x, const void* w, const int64_t row[6], int64_t panel, int k,
    const int ROWS, const int bf16) {
  const vec8 w0 = load8(w, panel + k * 16, bf16), w1 = load8(w, panel + k * 16 + 8, bf16);
  for (int i = 0; i < ROWS; ++i) {
    const float xi = ((const float*)x)[row[i] + k]; /* x: float32 here, see linear() */
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
     * of stalling its own first pass (fp32 step: 0.91x at 16 rows, 0.93x at 64). */
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
            acc[i][j / 8][j % 8] + (bias ? load(bias, p * 16 + j, bf16) : 0.f), bf16);
}

/* Rows in the pass that starts with `left` rows to go: 5 until the rest is a multiple of 6
 * (64 = 5 + 5 + 9 x 6, 16 = 5 + 5 + 6), so that no row is computed twice: a last block of 4
 * rows in 6 computed 2 in vain (bit-identical either way; fp32 step 0.95x at 16 rows, 0.98x
 * at 64; bf16 0.96x at both). Under 5 rows left: one block, its rows past M repeated. */
static inline int block_rows(int left) { return left % 6 && left >= 5 ? 5 : 6; }

/* One task per panel of one or more linears of the same x (q, k and v; gate and up): linear i
 * has packed weight ws[i], bias biases[i] (or NULL) and output ys[i] [M, ns[i]]. Grouped, they
 * start the threads once, not once each, and no core waits out the end of a small one (k and
 * v have 12 panels each): 0.9x the time of q, k, v at 64 rows. (Rows per block, dtype) are
 * constants in each call below. A lone decode row takes the 1-row block: the 6-row one would
 * multiply it six times. "guided" hands out runs of adjacent panels, shrinking at the end: a
 * core that a VM's host slows for a while is not waited for (static: 1.04x the fp32 step). */
void linear(const void* x_in, const void* const* ws, const void* const* biases, void* const* ys,
            const int* ns, int count, int M, int K, int bf16) {
  int passes = 0;
  for (int m0 = 0; m0 < M; m0 += block_rows(M - m0)) ++passes;
  /* bf16: x widened to float32 once here, not once per panel (0.81x the bf16 step at 64 rows). */
  float* xf = bf16 ? malloc(sizeof(float) * M * K) : NULL;
  for (int64_t i = 0; bf16 && i < (int64_t)M * K; ++i) xf[i] = load(x_in, i, 1);
  const void* x = bf16 ? xf : x_in;
  int panels = 0;
  for (int i = 0; i < count; ++i) panels += ns[i] / 16;
#pragma omp parallel
  {
    /* bf16 with several passes: each panel widened to float32 once, into `wide`, and not in
     * every pass (the bf16 step at 64 rows: 0.85x). A lone pass reads the bf16 panel. */
    float* wide = bf16 && passes > 1 ? malloc(sizeof(float) * K * 16) : NULL;
#pragma omp for schedule(guided)
    for (int g = 0; g < panels; ++g) {
      int i = 0, p = g; /* global panel g is panel p of linear i */
      while (p >= ns[i] / 16) p -= ns[i++] / 16;
      const void *w = ws[i], *bias = biases[i];
      void* y = ys[i];
      const int N = ns[i];
      const int64_t panel = (int64_t)p * K * 16;
      for (int64_t j = 0; wide && j < (int64_t)K * 16; ++j) wide[j] = load(w, panel + j, 1);
      /* One branch per case, each passing ROWS and the dtypes as constants: gemm_block is
       * inlined into each and compiled as its own loop, accumulators in registers. */
      for (int m0 = 0, pass = 0, rows; m0 < M; m0 += rows, ++pass) {
        rows = block_rows(M - m0);
        if (M == 1 && bf16) gemm_block(x, w, panel, bias, y, M, N, K, p, m0, 1, 1, 1, 0, 1);
        else if (M == 1) gemm_block(x, w, panel, bias, y, M, N, K, p, m0, 1, 0, 0, 0, 1);
        else if (wide && rows == 5) gemm_block(x, wide, 0, bias, y, M, N, K, p, m0, 5, 0, 1,
                                               pass, passes);
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
