#include "kernels.h"

/* ---- §1 on CPUs with AMX: the bf16 linears' GEMM at decode batch sizes ----
 * y [M, N] = x [M, K] W^T (+ bias), all bf16, on AMX tiles. W is held in the layout oneDNN
 * gives a bf16 weight on an AMX CPU (linear.py's AmxLinear keeps oneDNN's reordered weight, or
 * packs its own the same way where oneDNN lays a shape out otherwise): [N / 32][K / 32][16
 * k-pairs][32 columns][2], a 2 KB chunk per 32 columns and 32 k, a block's chunks front to back,
 * so W streams contiguously. A chunk holds two W tiles side by side (16 columns each, a row of
 * 64 bytes every 128). Each tile is loaded once per call and serves up to 64 rows (4 accumulator
 * tiles of 16 rows), x read from the cache for each; more rows go to oneDNN on the same weight.
 * oneDNN's small-batch bf16 path streamed the same weights well below memory speed, with a large
 * fixed cost per call; from 64 rows it is the faster (AMX Xeon VM, one thread, SmolLM2-135M's
 * linears at 136 rows: 0.57-0.93 of this kernel's time in passes of 64; a served prefill step
 * of 128 tokens 90.7 -> 78.4 ms). Needs N % 32 == 0 and K % 32 == 0 (the caller checks). Built
 * only where the compiler targets AMX-BF16 (-march=native); elsewhere only has_amx is here, and
 * answers 0. */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

int has_amx(void) { return 1; }

/* Linux hands out the tiles' 8 KB of register state only to a process that asks, once: 1 if
 * granted (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), 0 if not (then AMX must not be used). */
int amx_init(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

/* Tiles: 0-2 sums of 16 full rows each, 3 the sums of the pass's last (maybe partial) block, 4 the
 * W tile, 5-6 x for the full blocks, 7 x for the last block. A pass is up to 64 rows; the last
 * block's tiles are configured with its row count, so x is never read past its last row and no
 * padded copy is needed. */
enum { PASS_ROWS = 64, CHUNK_BYTES = 2048, ROW_BYTES = 128 };
/* A block's first tile also asks for the chunk this many bytes ahead in the packed weight (its
 * block's next chunks, or the next block's, which the same thread takes next under "guided" but
 * for its last one). On the AMX VM this measured about level with the hardware prefetcher alone
 * (and with other distances and hints): it is a guard against the tile loads waiting on memory. */
enum { PREFETCH_BYTES = 8192 };

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((aligned(64))) tile_config;

static tile_config config_for(int last_rows) {
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64; /* 16 floats, 16 column pairs of bf16, or 32 k of bf16 */
    cfg.rows[t] = t == 3 || t == 7 ? last_rows : 16;
  }
  return cfg;
}

/* One column group's sums for one pass (wg: its first tile row, every ROW_BYTES in a chunk):
 * FULL blocks of 16 rows (0..3) and a last block, over all of K in one order (chunk by chunk,
 * each chunk's 32 products summed by the tile unit), the same for a row whatever rows are beside
 * it. `ahead`: ask for the chunk PREFETCH_BYTES on (the block's first group). Always inlined:
 * FULL is then a constant. */
static inline __attribute__((always_inline)) void group_sums(
    const uint8_t* x, const uint8_t* wg, int64_t x_stride, int chunks, float* sums,
    const int FULL, int ahead) {
  if (FULL > 0) _tile_zero(0);
  if (FULL > 1) _tile_zero(1);
  if (FULL > 2) _tile_zero(2);
  _tile_zero(3);
  const uint8_t* last = x + FULL * 16 * x_stride;
  for (int c = 0; c < chunks; ++c) {
    const uint8_t* b = wg + (int64_t)c * CHUNK_BYTES;
    /* As an integer: the last chunks' targets lie past W (a prefetch never faults). */
    const uintptr_t next = (uintptr_t)b + PREFETCH_BYTES;
    if (ahead)
      for (int line = 0; line < CHUNK_BYTES; line += 64)
        _mm_prefetch((const char*)(next + line), _MM_HINT_T0);
    _tile_loadd(4, b, ROW_BYTES);
    const uint8_t* a = x + (int64_t)c * 64;
    if (FULL > 0) {
      _tile_loadd(5, a, x_stride);
      _tile_dpbf16ps(0, 5, 4);
    }
    if (FULL > 1) {
      _tile_loadd(6, a + 16 * x_stride, x_stride);
      _tile_dpbf16ps(1, 6, 4);
    }
    if (FULL > 2) {
      _tile_loadd(5, a + 32 * x_stride, x_stride);
      _tile_dpbf16ps(2, 5, 4);
    }
    _tile_loadd(7, last + (int64_t)c * 64, x_stride);
    _tile_dpbf16ps(3, 7, 4);
  }
  if (FULL > 0) _tile_stored(0, sums, 64);
  if (FULL > 1) _tile_stored(1, sums + 256, 64);
  if (FULL > 2) _tile_stored(2, sums + 512, 64);
  _tile_stored(3, sums + FULL * 256, 64);
}

/* sums + bias, rounded to nearest even as store() does (vcvtneps2bf16 would flush subnormals). */
static inline void store_row(uint16_t* y, const float* sums, __m512 bias) {
  _mm256_storeu_si256((__m256i*)y, bf16x16(_mm512_add_ps(_mm512_loadu_ps(sums), bias)));
}

#ifdef __AVX512BF16__
/* A lone row (a one-request decode step) is not worth the tile unit: the tiles then multiply one
 * row by each 1 KB of W, and the weight stream went below memory speed. AVX512-BF16 dot products
 * on the same W read it faster: a chunk's row is one k pair of 32 columns (128 bytes), so a block
 * is one contiguous stream, each pair multiplied by the row's pair (broadcast) and summed into 16
 * lanes a group, each group in two sums (even and odd pairs): four chains of dpbf16 in flight,
 * each line asked for ROW_AHEAD bytes ahead into L2. kernel_ab.py on the AMX Xeon VM (2 cores),
 * SmolLM2-135M bf16 one row, the step against the tiles' (then on 16-column groups, one stream
 * each): one group a task 0.948-0.973 (2 KB ahead 0.981, 6 KB 1.014, 8 KB 1.024, none 1.165), two
 * groups 0.941-0.957, four 0.973; at 2 rows level with the tiles (0.993), at 4 worse (1.08). Its
 * float sums are in another order than the tile unit's: a lone row's bf16 output can differ in its
 * last bit from the same row's among others (the tiles' rows alike whatever is beside). Those
 * distances were measured with "guided" handing out the blocks; since each thread takes one run of
 * them (linear_amx), 6 KB ahead against 4 KB: 0.975, 0.979, 0.980 (135M, the read at 32.9-33 GB/s;
 * 5 KB 0.982, 7 KB 0.980, 8 KB 0.986-0.990, 12 KB 0.985, 2 KB 1.039), the Llama-3.2-1B shape
 * 0.990. */
enum { ROW_AHEAD = 6144 };

static inline void row_dots(const uint16_t* x, const uint16_t* wb, const uint16_t* bias,
                            uint16_t* y, int K, int n0) {
  __m512 acc[2][2] = {{_mm512_setzero_ps(), _mm512_setzero_ps()},
                      {_mm512_setzero_ps(), _mm512_setzero_ps()}};
  const int pairs = K / 2; /* even: K % 32 == 0 */
  const uint32_t* xp = (const uint32_t*)x;
  for (int i = 0; i < pairs; i += 2)
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c)
#pragma GCC unroll 2
      for (int g = 0; g < 2; ++g) {
        const uint16_t* wk = wb + (int64_t)(i + c) * 64 + g * 32;
        __builtin_prefetch((const char*)wk + ROW_AHEAD, 0, 2);
        acc[g][c] = _mm512_dpbf16_ps(acc[g][c], (__m512bh)_mm512_set1_epi32((int)xp[i + c]),
                                     (__m512bh)_mm512_loadu_si512(wk));
      }
#pragma GCC unroll 2
  for (int g = 0; g < 2; ++g) {
    __m512 v = _mm512_add_ps(acc[g][0], acc[g][1]);
    if (bias)
      v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + n0 + 16 * g))),
              16)));
    _mm256_storeu_si256((__m256i*)(y + n0 + 16 * g), bf16x16(v));
  }
}
#endif

/* Passes of up to 64 rows (one pass at decode batch sizes: W read once per call); in each, one
 * task per block of 32 columns (its two groups in turn, the second finding the chunks in the
 * cache), "guided" handing out runs of adjacent blocks, as linear_panels() does. Each thread
 * configures its own tiles and releases them at the end (else the kernel saves 8 KB of tile
 * state at every context switch). */
void linear_amx(const void* x, const void* w, const void* bias, void* y, int N, int M, int K) {
  if (M <= 0) return;
  const int blocks = N / 32, chunks = K / 32;
#ifdef __AVX512BF16__
  /* A lone row: each thread one contiguous run, an equal share ("static"), so that row_dots'
   * asks ahead stay in the thread's own blocks (under "guided" a run's last asks reach a
   * block the other thread may take; which part of the gain that is was not measured apart).
   * kernel_ab.py, AMX Xeon VM, bf16 one row (4 KB ahead), against "guided": SmolLM2-135M 0.975,
   * 0.971, 0.978 (the read at 33.6-34.1 GB/s), the Llama-3.2-1B shape 0.972. The float32 lone
   * row's columns (dot_fp32.c) measured level either way (0.997, 0.998). */
  if (M == 1) {
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; ++b)
      row_dots(x, (const uint16_t*)w + (int64_t)b * K * 32, bias, y, K, b * 32);
    return;
  }
#endif
  const int64_t x_stride = (int64_t)K * 2;
#pragma omp parallel
  {
    float sums[PASS_ROWS * 16] __attribute__((aligned(64)));
    for (int m0 = 0; m0 < M; m0 += PASS_ROWS) {
      const int rows = M - m0 < PASS_ROWS ? M - m0 : PASS_ROWS;
      const int full = (rows - 1) / 16, last_rows = rows - 16 * full;
      const tile_config cfg = config_for(last_rows);
      _tile_loadconfig(&cfg);
      const uint8_t* xp = (const uint8_t*)x + m0 * x_stride;
#pragma omp for schedule(guided) nowait
      for (int b = 0; b < blocks; ++b)
        for (int half = 0; half < 2; ++half) {
          const uint8_t* wg = (const uint8_t*)w + (int64_t)b * chunks * CHUNK_BYTES + 64 * half;
          const int g = 2 * b + half, ahead = half == 0;
          /* One branch per block count: FULL a constant in each inlined copy. */
          if (full == 0) group_sums(xp, wg, x_stride, chunks, sums, 0, ahead);
          else if (full == 1) group_sums(xp, wg, x_stride, chunks, sums, 1, ahead);
          else if (full == 2) group_sums(xp, wg, x_stride, chunks, sums, 2, ahead);
          else group_sums(xp, wg, x_stride, chunks, sums, 3, ahead);
          __m512 bv = _mm512_setzero_ps();
          if (bias) /* bf16 widened: its bits in a float's top half */
            bv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)bias + g)), 16));
          for (int r = 0; r < rows; ++r)
            store_row((uint16_t*)y + (int64_t)(m0 + r) * N + g * 16, sums + r * 16, bv);
        }
    }
    _tile_release();
  }
}
#else
int has_amx(void) { return 0; }
#endif
