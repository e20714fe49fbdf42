#include "kernels.h"

/* ---- §1 on CPUs with AVX512-BF16: the bf16 linears' GEMM for a few rows ----
 * y [M, N] = x [M, K] W^T (+ bias), all bf16, W the plain nn.Linear weight [N, K]: no packed
 * copy. Each output column is a dot product of two contiguous bf16 rows, 32 k at a time with
 * one dpbf16 (16 pairs multiplied exactly, summed into 16 fp32 lanes), so W streams front to
 * back, one load of 64 bytes serving every row of the block. oneDNN's small-batch bf16 path
 * streamed the same weights well below memory speed. Built only where the compiler targets
 * AVX512-BF16 (-march=native); elsewhere only has_dpbf16 is here, and answers 0. */

#ifdef __AVX512BF16__
#include <immintrin.h>
#include <omp.h>

int has_dpbf16(void) { return 1; }

/* Up to 8 rows x 2 columns a block: 16 accumulators (of 32 registers), 8 + 2 loads per 16
 * dpbf16. dpbf16 issues at a quarter of the FMA's rate on the AMX VM, so from ~8 rows on the
 * kernel is bound by it, not by memory; 8 x 2 measured a little faster than 4 x 4 or 6 x 4. */
enum { MAX_ROWS = 8, COLS = 2 };
/* The hardware prefetcher alone streamed W at ~2/3 of memory speed: each load also asks for the
 * same k of the column 2 groups ahead (4.6 to 12 KB ahead for these K), into L2. */
enum { PREFETCH_COLS = 4 };

/* Rows m0 .. m0 + ROWS - 1 times columns n0 .. n0 + COLS - 1 (n0 + COLS <= N). Each (row,
 * column) sums its own k in one fixed order whatever ROWS is: a row's result does not depend
 * on the rows beside it. Always inlined: ROWS is then a constant and `acc` stays in registers. */
static inline __attribute__((always_inline)) void dot_block(
    const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int N, int K,
    int m0, int n0, const int ROWS) {
  __m512 acc[MAX_ROWS][COLS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint16_t* xr = x + (int64_t)m0 * K;
  const uint16_t* wc = w + (int64_t)n0 * K;
  for (int k = 0; k < K; k += 32) {
    /* The tail (K not a multiple of 32, odd K too) loads zeros past K: masked-off lanes are
     * neither read nor faulted on. */
    const __mmask32 mask = K - k >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << (K - k)) - 1;
    __m512bh xv[MAX_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
      xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr + (int64_t)r * K + k);
#pragma GCC unroll 8
    for (int c = 0; c < COLS; ++c) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wc + (int64_t)c * K + k);
      /* As an integer: the last groups' addresses lie past W (a prefetch never faults). */
      __builtin_prefetch((const void*)((uintptr_t)(wc + (int64_t)c * K + k) +
                                       (uintptr_t)PREFETCH_COLS * K * sizeof *w), 0, 2);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv[r], wv);
    }
  }
  /* Unrolled, as the loops above: a loop here would keep `acc` in memory all along. */
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < COLS; ++c)
      store(y, (int64_t)(m0 + r) * N + n0 + c,
            _mm512_reduce_add_ps(acc[r][c]) + (bias ? load(bias, n0 + c, 1) : 0.f), 1);
}

/* One column, every row: the last N % COLS columns (a plain loop; a handful per layer). */
static void dot_column(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                       int N, int M, int K, int n) {
  for (int m = 0; m < M; ++m) {
    __m512 acc = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
      const __mmask32 mask = K - k >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << (K - k)) - 1;
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (int64_t)m * K + k);
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (int64_t)n * K + k);
      acc = _mm512_dpbf16_ps(acc, xv, wv); /* the order dot_block sums in */
    }
    store(y, (int64_t)m * N + n,
          _mm512_reduce_add_ps(acc) + (bias ? load(bias, n, 1) : 0.f), 1);
  }
}

/* One task per group of COLS adjacent columns (COLS rows of W, contiguous); within it, blocks
 * of up to MAX_ROWS rows, the group's weights read again from L1 for each block after the
 * first. "guided" hands out runs of adjacent groups, as linear_panels() does. */
void linear_dpbf16(const void* x, const void* w, const void* bias, void* y, int N, int M,
                   int K) {
  const int groups = N / COLS;
#pragma omp parallel for schedule(guided)
  for (int g = 0; g < groups; ++g)
    for (int m0 = 0; m0 < M; m0 += MAX_ROWS) {
      const int rows = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
#define DOT_BLOCK(R) dot_block(x, w, bias, y, N, K, m0, g * COLS, R)
      BY_ROWS(rows, MAX_ROWS, DOT_BLOCK);
#undef DOT_BLOCK
    }
  for (int n = groups * COLS; n < N; ++n) dot_column(x, w, bias, y, N, M, K, n);
}
/* ---- The same GEMM on oneDNN's blocked weight ----
 * Where oneDNN takes the rows beyond the plan's limit, W is kept once, in oneDNN's reordered
 * layout (linear.py checks it is this one): [N / 64][K / 2][64 columns][2 k], VNNI pairs of 64
 * columns, each column block contiguous. One dpbf16 per 16 columns and 2 k multiplies a row's
 * k pair (broadcast) by the pairs of 16 columns, so each lane sums one column over k in order:
 * no reduction at the end, and a row's result does not depend on the rows beside it.
 * Why a kernel of ours: on a Zen 4 VM (avx512_bf16, no AMX), the four GEMMs of one Llama-3.2-1B
 * layer take 2.34 / 2.49 / 2.95 ms at 1 / 4 / 7 rows here, against 3.06 / 3.30 / 3.68 for
 * linear_dpbf16 on the plain weight (which a second, reordered copy for oneDNN had to sit
 * beside), and oneDNN on the plain bf16 weight took 1.51x its reordered time at 16 rows. */
enum { BLOCK_COLS = 64, BLOCKED_ROWS = 7 };  /* 7 rows x 4 vectors: 28 accumulators of 32 */
/* A lone row also asks, at each k pair, for the line 4 KB ahead in its column block (past its
 * end: the next block, which a run of "guided" tasks reads next), into L2. On 2 MB pages
 * (hugepages.py) the hardware prefetcher alone had measured level with or ahead of 8 KB ahead
 * non-temporal (the step 0.953 / 0.976 of it); but a core of the Zen 4 VM (avx512_bf16) keeps
 * only a few KB of misses in flight, and each block started cold. kernel_ab.py, SmolLM2-135M
 * bf16, one row, the step against none: 4 KB ahead 0.970, 0.976 (read at 33 GB/s), 0.961 (57
 * GB/s); 6 KB 0.961; 2 KB 0.980; 8 KB 1.010; non-temporal 1.046-1.064 of 4 KB into L2;
 * Llama-3.2-1B shape 0.994. From 2 rows on the kernel computes more per byte and the same
 * prefetches cost: 2 rows 1.07, 4 rows 1.23 of none. */
enum { AHEAD = 4096 };

static inline __attribute__((always_inline)) void blocked_rows(
    const uint16_t* x, const uint16_t* wb, const uint16_t* bias, uint16_t* y, int N, int K,
    int m0, int n0, const int ROWS) {
  __m512 acc[BLOCKED_ROWS][4];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const int pairs = K / 2;
  /* Row r's k pair i, as one 32-bit word: xp[r * pairs + i]. */
  const uint32_t* xp = (const uint32_t*)(x + (int64_t)m0 * K);
  for (int i = 0; i < pairs; ++i) {
    const uint16_t* wk = wb + (int64_t)i * 2 * BLOCK_COLS;
#pragma GCC unroll 4
    for (int c = 0; c < 4 && ROWS == 1; ++c)
      __builtin_prefetch((const char*)(wk + 32 * c) + AHEAD, 0, 2);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wk + 32 * c);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r)
        acc[r][c] = _mm512_dpbf16_ps(
            acc[r][c], (__m512bh)_mm512_set1_epi32((int)xp[(int64_t)r * pairs + i]), wv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512 v = acc[r][c];
      if (bias)
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + n0 + 16 * c))),
                16)));
      _mm256_storeu_si256((__m256i*)(y + (int64_t)(m0 + r) * N + n0 + 16 * c), bf16x16(v));
    }
}

/* A lone row's blocks in equal runs (kernels.h's first_block); a thread done with its run asks
 * for its run of `next` (this layout, [next_n, next_k]; or NULL) while the other computes
 * (ask_for_run), NEXT_MOST bytes at most. The linears of SmolLM2-135M with 9 and 15 blocks, o_proj
 * and down_proj, had taken 1.27 and 1.12 of their read where the Zen 5 VM's memory read at ~80
 * GB/s. kernel_ab.py, 135M bf16, one row, the step over `guided` without, where the memory read
 * at 78-82 GB/s: 0.972, 0.982, 0.985, 0.989, 1.016 (a scratch build of the same: 0.944, 0.953,
 * 0.981, 0.995); level at 48-52 GB/s, where one thread alone takes more of it (0.996-1.005).
 * 512 KB at most 0.963, 128 KB 0.994 beside 256 KB's 0.995; `static` without asking 0.999-1.002.
 * The sums are blocked_rows', in the same order: the same bits. */
static void lone_row(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                     int N, int K, const uint16_t* next, int next_n, int next_k) {
  const int blocks = N / BLOCK_COLS;
  int done = 0; /* threads done with their run */
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    for (int b = first_block(blocks, t, T); b < first_block(blocks, t + 1, T); ++b)
      blocked_rows(x, w + (int64_t)b * BLOCK_COLS * K, bias, y, N, K, 0, b * BLOCK_COLS, 1);
    __atomic_add_fetch(&done, 1, __ATOMIC_RELAXED);
    if (next)
      ask_for_run(next, next_n / BLOCK_COLS, (int64_t)BLOCK_COLS * next_k * sizeof *next, t, T,
                  &done);
  }
}

/* N % 64 == 0 and K % 2 == 0 (the caller checks; next_n and next_k too). One task per column
 * block, its rows in blocks of up to 7 (the plan's rows: one block, W read once); a lone row as
 * lone_row() says. */
void linear_dpbf16_blocked_then(const void* x, const void* w, const void* bias, void* y, int N,
                                int M, int K, const void* next, int next_n, int next_k) {
  if (M == 1) {
    lone_row(x, w, bias, y, N, K, next, next_n, next_k);
    return;
  }
  const int blocks = N / BLOCK_COLS;
#pragma omp parallel for schedule(guided)
  for (int b = 0; b < blocks; ++b) {
    const uint16_t* wb = (const uint16_t*)w + (int64_t)b * BLOCK_COLS * K;
    for (int m0 = 0; m0 < M; m0 += BLOCKED_ROWS) {
      const int rows = M - m0 < BLOCKED_ROWS ? M - m0 : BLOCKED_ROWS;
#define BLOCKED(R) blocked_rows(x, wb, bias, y, N, K, m0, b * BLOCK_COLS, R)
      BY_ROWS(rows, BLOCKED_ROWS, BLOCKED);
#undef BLOCKED
    }
  }
}

void linear_dpbf16_blocked(const void* x, const void* w, const void* bias, void* y, int N, int M,
                           int K) {
  linear_dpbf16_blocked_then(x, w, bias, y, N, M, K, NULL, 0, 0);
}
#else
int has_dpbf16(void) { return 0; }
#endif
