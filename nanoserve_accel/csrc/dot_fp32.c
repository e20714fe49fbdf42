#include "kernels.h"

/* ---- §1 on CPUs with AVX-512: the float32 linears' GEMM below oneDNN's handover ----
 * y [M, N] = x [M, K] W^T (+ bias), all float32, W the plain nn.Linear weight [N, K]: no packed
 * copy. dpbf16.c's float32 sibling: each output is a dot product of two contiguous rows, 16 k at
 * a time with one FMA, so W streams front to back, one 64-byte load serving every row of the
 * block. linear.c's packed GEMM (8-wide vectors, 16-column panels) streamed the weights well
 * below memory speed at a few rows. Built only where the compiler targets AVX-512F
 * (-march=native); elsewhere only has_dot_fp32 is here, and answers 0. */

#ifdef __AVX512F__
#include <immintrin.h>
#include <omp.h>

int has_dot_fp32(void) { return 1; }

/* Up to 6 rows x 4 columns a block: 24 accumulators + 6 rows of x + 1 weight vector in the 32
 * registers, 10 loads per 24 FMAs. At a few rows the kernel is bound by memory, from ~8 rows
 * on by the FMAs; 6 x 4 measured as fast as the best shape of each row count (8 x 2, 8 x 3,
 * 4 x 4, 5 x 4, 4 x 6; 8-wide vectors were slower), so there is one shape for all. */
enum { MAX_ROWS = 6, COLS = 4 };
/* The hardware prefetcher alone streamed W well below memory speed: each load also asks for the
 * same k of the column one group ahead, into L2 (two or four groups ahead measured no faster). */
enum { PREFETCH_COLS = 4 };

/* A lone row's stream (below) asks for each line this many bytes ahead, into L2, on Intel (an
 * AMX build): there a core keeps few misses in flight of its own (one thread read ~16.5 GB/s
 * where two read 33) and the hardware prefetcher alone left the stream short of that. AMX Xeon
 * VM, kernel_ab.py, SmolLM2-135M float32 one row, the step against none: 4 KB 0.977, 0.982,
 * 0.979 (the read at 31.5-34 GB/s); 2 KB 0.984, 8 KB 0.985, 16 KB 0.987, 4 KB into L1 0.988;
 * the layers' GEMMs alone 0.998, the lm_head's alone 0.986. Elsewhere none: on the Zen 4 VM
 * (avx512_bf16) the lone row's stream was slower 8 KB ahead than without (ONE_ROW_COLUMNS). */
#if defined(__AMX_TILE__)
enum { ONE_ROW_AHEAD = 4096 };
#else
enum { ONE_ROW_AHEAD = 0 };
#endif

/* Rows m0 .. m0 + ROWS - 1 times columns n0 .. n0 + NC - 1 (NC <= COLS). Each (row, column)
 * sums its k in one fixed order (16 lanes, k ascending, then the lanes' sum) whatever ROWS and
 * NC are: a row's result does not depend on the rows beside it. Each load asks for the line
 * `ahead` bytes on (0: none); only the first block of rows asks: the next ones find the group in
 * L1. Always inlined: ROWS and NC are then constants and `acc` stays in registers. */
static inline __attribute__((always_inline)) void dot_block(
    const float* x, const float* w, const float* bias, float* y, int N, int K, int m0, int n0,
    const int ROWS, const int NC, const int64_t ahead) {
  __m512 acc[MAX_ROWS][COLS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* xr = x + (int64_t)m0 * K;
  const float* wc = w + (int64_t)n0 * K;
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[MAX_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) xv[r] = _mm512_loadu_ps(xr + (int64_t)r * K + k);
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      const float* wp = wc + (int64_t)c * K + k;
      const __m512 wv = _mm512_loadu_ps(wp);
      /* As an integer: the last group's addresses lie past W (a prefetch never faults). */
      if (ahead) __builtin_prefetch((const void*)((uintptr_t)wp + (uintptr_t)ahead), 0, 2);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  if (k < K) {
    /* The tail (K not a multiple of 16) loads zeros past K: masked-off lanes are neither read
     * nor faulted on. Its own step, not a mask in every step: masked loads in the main loop
     * measured slower from ~16 rows on, where the FMAs bound the kernel. */
    const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
    __m512 xv[MAX_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) xv[r] = _mm512_maskz_loadu_ps(mask, xr + (int64_t)r * K + k);
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      const __m512 wv = _mm512_maskz_loadu_ps(mask, wc + (int64_t)c * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  /* Unrolled, as the loops above: a loop here would keep `acc` in memory all along. */
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c)
      y[(int64_t)(m0 + r) * N + n0 + c] =
          _mm512_reduce_add_ps(acc[r][c]) + (bias ? bias[n0 + c] : 0.f);
}

/* Columns n0 .. n0 + NC - 1, every row: M in ceil(M / MAX_ROWS) blocks of as even a size as
 * can be (16 = 6 + 5 + 5, not 6 + 6 + 4), the group's weights read again from L1 for each block
 * after the first. One branch per row count: ROWS a constant in each inlined copy. */
static inline __attribute__((always_inline)) void dot_columns(
    const float* x, const float* w, const float* bias, float* y, int N, int M, int K, int n0,
    const int NC) {
  const int blocks = (M + MAX_ROWS - 1) / MAX_ROWS;
  for (int b = 0, m0 = 0, rows; b < blocks; ++b, m0 += rows) {
    rows = M / blocks + (b < M % blocks);
    const int64_t ahead = b == 0 ? (int64_t)PREFETCH_COLS * K * 4 : 0;
#define DOT_BLOCK(R) dot_block(x, w, bias, y, N, K, m0, n0, R, NC, ahead)
    BY_ROWS(rows, MAX_ROWS, DOT_BLOCK);
#undef DOT_BLOCK
  }
}

/* A lone row (a tied lm_head's plain table at one decode row) takes each column whole, one after
 * another, 16 a task, without prefetches but ONE_ROW_AHEAD's: W is then read as one front-to-back
 * stream a thread, and the core overlaps the columns' chains of FMAs itself. In a group's COLS
 * columns at once, its COLS rows of W were streams of their own, read a line at a time in turn,
 * which the hardware prefetcher followed below memory speed. Zen 4 VM (avx512_bf16),
 * SmolLM2-135M's [49152, 576] in float32 against torch's sum of 256 MB (2 MB pages), 3 runs:
 * groups 1.19 / 1.15 / 1.57x the read, whole columns 0.99 / 1.02 / 1.25x (8 KB ahead 1.09 / 1.04 /
 * 1.42x); the engine's step (kernel_ab.py) 0.980 of the groups'. The same sums in dot_block's
 * order: the same bits. */
enum { ONE_ROW_COLUMNS = 16 };

/* One task per group of COLS adjacent columns (COLS rows of W, contiguous); "guided" hands out
 * runs of adjacent groups, as linear_panels() does. The last N % COLS columns one at a time (a handful
 * per layer, and only where N is not a multiple of 4). */
void linear_dot_fp32(const float* x, const float* w, const float* bias, float* y, int N, int M,
                     int K) {
  if (M == 1) { /* a lone row: whole columns one after another (ONE_ROW_COLUMNS) */
#pragma omp parallel for schedule(guided)
    for (int n0 = 0; n0 < N; n0 += ONE_ROW_COLUMNS)
      for (int n = n0; n < N && n < n0 + ONE_ROW_COLUMNS; ++n)
        dot_block(x, w, bias, y, N, K, 0, n, 1, 1, ONE_ROW_AHEAD);
    return;
  }
  const int groups = N / COLS;
#pragma omp parallel for schedule(guided)
  for (int g = 0; g < groups; ++g) dot_columns(x, w, bias, y, N, M, K, g * COLS, COLS);
  for (int n = groups * COLS; n < N; ++n) dot_columns(x, w, bias, y, N, M, K, n, 1);
}
/* ---- The float32 GEMM on oneDNN's blocked weight ----
 * Where oneDNN takes the rows beyond the plan's limit, W is kept once, in oneDNN's reordered
 * float32 layout (linear.py checks it is this one): [N / 64][K][64], each k's 64 columns of a
 * column block contiguous. One FMA multiplies a row's x[k] (broadcast) by 16 columns, so each
 * lane sums one column over k in order: no reduction at the end. K is taken in chunks (from 8
 * rows on), the partial sums kept in y between them (float32, so exact): a chunk's weights stay
 * in L2 for every block of rows, and a row's sums are the same bits whatever the rows beside it.
 * Why a kernel of ours: on a Zen 4 VM (2 cores, avx512_bf16, no AMX) oneDNN on its reordered
 * fp32 weight beat linear_dot_fp32 from 32 rows at a Llama-3.2-1B shape (16 rows on one
 * thread) but is far slower at a few rows; the plain weight beside the reordered one would hold
 * the weights twice. */
enum { FB_COLS = 64, FB_ROWS = 7, FB_CHUNK = 256 };
/* Bytes ahead in the column block's stream: 8 k where the weights' chunk is read again for more
 * blocks of rows (it should stay in L2); 16 k into L2 where the rows are one block and W is read
 * once. A lone row (the engine's step, kernel_ab.py, Zen 4 VM): 0.975 of 32 k non-temporal, at 2
 * and 4 rows level with it. Non-temporal is the one hint not to give here: on an AMX Xeon VM
 * (2 cores, Intel's L1-only NTA fill) 2-6 rows took 2.3x this (kernel_ab.py, SmolLM2-135M
 * fp32: 2 rows 46.7 -> 20.2 ms, 4 rows 52.9 -> 23.2, 6 rows 49.0 -> 23.4). On 4 KB pages ahead
 * of none (a C harness, Zen 4: 0.922 / 0.877 against 0.962 / 0.926). */
enum { FB_PREFETCH = 2048, FB_PREFETCH_ONCE = 4096 };

/* Rows m0 .. m0 + ROWS - 1 of the column block at wb (its column n0, 4 vectors of 16), k in
 * [k0, k1); `first`: the sums start at 0, else at y; `last`: add the bias. Always inlined: ROWS
 * is then a constant and `acc` stays in registers. */
enum { NV = FB_COLS / 16 };
static inline __attribute__((always_inline)) void blocked_rows(
    const float* x, const float* wb, const float* bias, float* y, int N, int K, int m0, int n0,
    int k0, int k1, int first, int last, const int ROWS, const int once) {
  __m512 acc[FB_ROWS][NV];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c)
      acc[r][c] = first ? _mm512_setzero_ps()
                        : _mm512_loadu_ps(y + (int64_t)(m0 + r) * N + n0 + 16 * c);
  const float* xr = x + (int64_t)m0 * K;
  for (int k = k0; k < k1; ++k) {
    const float* wk = wb + (int64_t)k * FB_COLS;
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      if (once) __builtin_prefetch((const char*)(wk + 16 * c) + FB_PREFETCH_ONCE, 0, 2);
      else __builtin_prefetch((const char*)(wk + 16 * c) + FB_PREFETCH, 0, 3);
    }
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      const __m512 wv = _mm512_loadu_ps(wk + 16 * c);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r)
        acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(xr[(int64_t)r * K + k]), wv, acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      const int n = n0 + 16 * c;
      __m512 v = acc[r][c];
      if (last && bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
      _mm512_storeu_ps(y + (int64_t)(m0 + r) * N + n, v);
    }
}

/* The column block at wb, every row: a lone block of rows reads K at once, more blocks read it
 * chunk by chunk, each block of rows in turn. */
static void blocked_task(const float* x, const float* wb, const float* bias, float* y, int N,
                         int M, int K, int n0) {
  const int chunk = M <= FB_ROWS ? K : FB_CHUNK;
  for (int k0 = 0; k0 < K; k0 += chunk) {
    const int k1 = K - k0 < chunk ? K : k0 + chunk;
    for (int m0 = 0; m0 < M; m0 += FB_ROWS) {
      const int rows = M - m0 < FB_ROWS ? M - m0 : FB_ROWS;
#define BLOCKED(R) blocked_rows(x, wb, bias, y, N, K, m0, n0, k0, k1, k0 == 0, k1 == K, R, 0)
#define ONCE(R) blocked_rows(x, wb, bias, y, N, K, m0, n0, 0, K, 1, 1, R, 1)
      if (M <= FB_ROWS) BY_ROWS(rows, FB_ROWS, ONCE); /* one block of rows: W read once */
      else BY_ROWS(rows, FB_ROWS, BLOCKED);
#undef ONCE
#undef BLOCKED
    }
  }
}

/* N % 64 == 0 (the caller checks; next_n too). A task is a column block; "guided" hands out runs
 * of adjacent ones, as linear_dot_fp32() does. (Half blocks, where there are under 16, evened
 * out the two threads' share of SmolLM2-135M's 9-block linears but measured slower: 1-row step
 * 14.4-14.8 -> 10.6-13.8 ms without them, 16 rows 27.4-28.6 -> 24.3-25.4, Zen 4 VM, alternating
 * runs.) A lone row as dpbf16.c's lone_row: its blocks in equal runs, and a thread done with its
 * run asks for its run of `next` (this layout, [next_n, next_k]; or NULL) while the other
 * computes, 256 KB at most. Zen 5 VM, kernel_ab.py, 135M fp32, one row, the step over `guided`
 * without, where the memory read at 77-80 GB/s: 0.978, 0.984, 0.992, 1.006, 1.009 (fp32's
 * o_proj had taken 1.22 of its read there, qkv_proj 1.13, down_proj 1.14); level at 43-51 GB/s
 * (0.994-1.005, eight runs). The same sums in the same order: the same bits. */
void linear_fp32_blocked_then(const float* x, const float* w, const float* bias, float* y, int N,
                              int M, int K, const float* next, int next_n, int next_k) {
  const int blocks = N / FB_COLS;
  if (M == 1) {
    int done = 0; /* threads done with their run */
#pragma omp parallel
    {
      const int t = omp_get_thread_num(), T = omp_get_num_threads();
      for (int b = first_block(blocks, t, T); b < first_block(blocks, t + 1, T); ++b)
        blocked_task(x, w + (int64_t)b * FB_COLS * K, bias, y, N, 1, K, b * FB_COLS);
      __atomic_add_fetch(&done, 1, __ATOMIC_RELAXED);
      if (next)
        ask_for_run(next, next_n / FB_COLS, (int64_t)FB_COLS * next_k * sizeof *next, t, T,
                    &done);
    }
    return;
  }
#pragma omp parallel for schedule(guided)
  for (int b = 0; b < blocks; ++b)
    blocked_task(x, w + (int64_t)b * FB_COLS * K, bias, y, N, M, K, b * FB_COLS);
}

void linear_fp32_blocked(const float* x, const float* w, const float* bias, float* y, int N,
                         int M, int K) {
  linear_fp32_blocked_then(x, w, bias, y, N, M, K, NULL, 0, 0);
}
#else
int has_dot_fp32(void) { return 0; }
#endif
