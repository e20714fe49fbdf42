#include "kernels.h"

/* ---- §5: decode attention, one request, on AVX-512 ----
 * The contract of paged_decode (attention.c), for head sizes 64 and 128 on CPUs with AVX-512.
 * Why a second loop nest: attention.c's 8-lane one spends most of its instructions widening
 * bf16 rows and summing each (head, token) dot product across lanes, and so reads the cache
 * at well under memory speed. Here, per KV head:
 *   - scores, 16 tokens at a time: 16 dot products (bf16: AVX512-BF16's vdpbf16ps on the raw
 *     bits, no widening), then all 16 summed across lanes by one transposing tree;
 *   - softmax: e^(s - max) 16 lanes at a time (exp16), the division by the sum left to out;
 *   - out = sum of p . v with every accumulator of up to 4 query heads in registers, so each
 *     V row is widened once for the heads that share it (GQA).
 * Each row part of the cache is still read once, in place, and prefetched ahead. */
#ifdef __AVX512F__
#include <immintrin.h>

/* Tokens ahead that each pass asks for, and the first that many asked for before it starts. A
 * layer's KV comes from memory or L3 while a group of 16 takes ~0.1 us to compute: one group
 * ahead (16) left each pass waiting on its first rows and then on most of the others. kernel_ab.py
 * on the Zen 4 VM (avx512_bf16), SmolLM2-135M bf16, one row at 240 tokens, step time against 16
 * ahead without the first rows asked for: 48 and the first rows 0.964-0.981 (read at 44-70
 * GB/s); 32: 0.981-0.983; 96: 0.993-0.998; the first rows alone 1.003-1.006. float32, 4000
 * tokens and 64 rows level (0.997-0.998). */
#define K_AHEAD 48
#define V_AHEAD 48

/* Lane n: the sum of v[n]'s 16 lanes. 15 adds in a transposing tree: summed alone, each
 * vector would take 4 shuffle-add pairs. */
static inline __m512 sum_lanes16(const __m512 v[16]) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) /* 128-bit quarters 0 + 2 and 1 + 3 of v[2i], v[2i+1] */
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i) /* quarter j: 4 partial sums of v[4i + j] */
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) /* quarter j: 2 partial sums each of v[8i + j], v[8i + 4 + j] */
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * i], u[2 * i + 1]),
                         _mm512_unpackhi_ps(u[2 * i], u[2 * i + 1]));
  /* lane 4j + c: the sum of v[j + (0, 8, 4, 12)[c]]; then put in order */
  const __m512 r = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15), r);
}

/* 16 values from element i of p as floats: bf16 = a float's top half */
static inline __m512 load16(const void* p, int64_t i, const int bf16) {
  if (!bf16) return _mm512_loadu_ps((const float*)p + i);
  const __m256i half = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

static inline void store16(void* p, int64_t i, __m512 x, const int bf16) {
  if (!bf16) return _mm512_storeu_ps((float*)p + i, x);
  _mm256_storeu_si256((__m256i*)((uint16_t*)p + i), bf16x16(x));
}

/* Into L2 (prefetcht1), not L1: a pass waits on the memory's latency with many rows in
 * flight, and L2 keeps more misses outstanding than L1. kernel_ab.py on a 2-core Zen 4 VM
 * (avx512_bf16), one row, step time against prefetcht0: SmolLM2-135M bf16
 * 0.955-0.970 at 240 tokens, 0.922 at 2048, 0.877 at 4096; float32 0.974 at 240, 0.805 at
 * 4096; Llama-3.2-1B shape bf16 0.989, float32 at 2048 0.984; 16 and 64 rows level
 * (0.998-1.010). prefetcht2: 0.981 (135M bf16, 240 tokens). */
static inline void prefetch_part(const void* cache, int64_t i, const int bytes, const int bf16) {
  const char* p = (const char*)cache + i * (bf16 ? 2 : 4);
  for (int byte = 0; byte < bytes; byte += 64) __builtin_prefetch(p + byte, 0, 2);
}

/* q . k over D lanes, 16 partial sums (q: one head's D values; k: element `at` of the cache) */
static inline __attribute__((always_inline)) __m512 dot16(const void* q, const void* k,
                                                          int64_t at, const int D, const int bf16) {
  __m512 s = _mm512_setzero_ps();
#ifdef __AVX512BF16__
  if (bf16) {
    for (int d = 0; d < D; d += 32)
      s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512((const uint16_t*)q + d),
                           (__m512bh)_mm512_loadu_si512((const uint16_t*)k + at + d));
    return s;
  }
#endif
  for (int d = 0; d < D; d += 16) s = _mm512_fmadd_ps(load16(q, d, bf16), load16(k, at + d, bf16), s);
  return s;
}

/* The K pass, 16 tokens at a time, whole rows front to back (the hardware prefetcher follows
 * them; the next 16 rows are asked for too): scores[h][t] = scale * q_h . k_t, and each head's
 * running maximum in top[h]. A group of 16 always computes 16 dot products (the last group's
 * extra ones on its first row, masked out of top and scores) so that the loop unrolls whole:
 * with a test per token it kept the compiler from unrolling, and the pass spent half its
 * instructions on loop and address arithmetic. kernel_ab.py on the 2-core Zen 4 VM
 * (avx512_bf16), SmolLM2-135M, one row at 2048 tokens: bf16 0.968, float32 0.972 of the step
 * before; 16 rows float32 0.993; one row at 240 tokens level (1.002). */
static inline __attribute__((always_inline)) void score_keys(
    const char* q, const void* k_cache, const int64_t* offsets, int L, int H, int group,
    const int D, const int bf16, float scale, float* scores, __m512* top) {
  const int esize = bf16 ? 2 : 4, row = H / group * D;
  for (int h = 0; h < H; ++h) top[h] = _mm512_set1_ps(-INFINITY);
  for (int i = 0; i < K_AHEAD && i < L; ++i) prefetch_part(k_cache, offsets[i], row * esize, bf16);
  for (int t0 = 0; t0 < L; t0 += 16) {
    const int n = L - t0 < 16 ? L - t0 : 16;
    const __mmask16 live = (__mmask16)((1u << n) - 1);
    int64_t at[16]; /* the group's rows; past L: the first again, computed, never kept */
    for (int i = 0; i < 16; ++i) at[i] = offsets[t0 + (i < n ? i : 0)];
    for (int h = 0; h < H; ++h) {
      /* this head's share of the rows K_AHEAD tokens on: spread out, not all in one burst */
      for (int i = t0 + K_AHEAD + h; i < t0 + K_AHEAD + 16 && i < L; i += H)
        prefetch_part(k_cache, offsets[i], row * esize, bf16);
      const int64_t part = (int64_t)(h / group) * D;
      __m512 s[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) s[i] = dot16(q + h * D * esize, k_cache, at[i] + part, D, bf16);
      const __m512 scores16 = _mm512_mul_ps(sum_lanes16(s), _mm512_set1_ps(scale));
      top[h] = _mm512_mask_max_ps(top[h], live, top[h], scores16);
      _mm512_mask_storeu_ps(scores + (int64_t)h * L + t0, live, scores16);
    }
  }
}

/* Scores -> e^(s - max), in place; returns their sum (the softmax's divisor, applied to out). */
static inline float exp_scores(float* s, int L, __m512 top) {
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (int t = 0; t < L; t += 16) {
    const __mmask16 live = (__mmask16)(L - t < 16 ? (1u << (L - t)) - 1 : 0xFFFF);
    const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), m));
    sum = _mm512_mask_add_ps(sum, live, sum, p);
    _mm512_mask_storeu_ps(s + t, live, p);
  }
  return _mm512_reduce_add_ps(sum);
}

/* acc[h] += sum over tokens t0 .. t0 + n - 1 of p[h][t] . v_t for the HN query heads from h0
 * (HN * D / 16 <= 16 accumulators, in registers while the tokens pass): each V row part
 * widened once for all of them. */
static inline __attribute__((always_inline)) void weigh_values(
    const float* p, const void* v_cache, const int64_t* offsets, int L, int t0, int n, int h0,
    const int HN, int64_t part, const int D, const int bf16, float* acc_rows) {
  __m512 acc[4][8];
  for (int h = 0; h < HN; ++h)
    for (int j = 0; j < D / 16; ++j) acc[h][j] = _mm512_loadu_ps(acc_rows + (h0 + h) * D + j * 16);
  for (int t = t0; t < t0 + n; ++t) {
    __m512 v[8];
    for (int j = 0; j < D / 16; ++j) v[j] = load16(v_cache, offsets[t] + part + j * 16, bf16);
    for (int h = 0; h < HN; ++h) {
      const __m512 w = _mm512_set1_ps(p[(int64_t)(h0 + h) * L + t]);
      for (int j = 0; j < D / 16; ++j) acc[h][j] = _mm512_fmadd_ps(w, v[j], acc[h][j]);
    }
  }
  for (int h = 0; h < HN; ++h)
    for (int j = 0; j < D / 16; ++j) _mm512_storeu_ps(acc_rows + (h0 + h) * D + j * 16, acc[h][j]);
}

static inline __attribute__((always_inline)) void decode_one(
    const char* q, const void* k_cache, const void* v_cache, const int64_t* offsets, int L,
    char* out, int H, int Hkv, const int D, float scale, const int bf16, float* scores,
    int out_bf16, float* lse) {
  const int group = H / Hkv, most = D == 64 ? 4 : 2; /* heads per V pass: 16 accumulators */
  __m512 top[H];
  float sums[H], acc[H * D];
  score_keys(q, k_cache, offsets, L, H, group, D, bf16, scale, scores, top);
  for (int i = 0; i < V_AHEAD && i < L; ++i) /* the V pass's first rows, during the softmax */
    prefetch_part(v_cache, offsets[i], Hkv * D * (bf16 ? 2 : 4), bf16);
  for (int h = 0; h < H; ++h) {
    sums[h] = exp_scores(scores + (int64_t)h * L, L, top[h]);
    if (lse) lse[h] = _mm512_reduce_max_ps(top[h]) + logf(sums[h]);
  }
  memset(acc, 0, sizeof acc);
  for (int t0 = 0; t0 < L; t0 += 16) { /* the V pass: rows front to back, as the K pass */
    const int n = L - t0 < 16 ? L - t0 : 16;
    for (int h = 0; h < H; h += most) { /* never past a KV head's group */
      const int g = h / group, hn = (g + 1) * group - h < most ? (g + 1) * group - h : most;
      for (int i = t0 + V_AHEAD + g; h == g * group && i < t0 + V_AHEAD + 16 && i < L; i += Hkv)
        prefetch_part(v_cache, offsets[i], Hkv * D * (bf16 ? 2 : 4), bf16);
      const int64_t part = (int64_t)g * D;
      if (hn == 4) weigh_values(scores, v_cache, offsets, L, t0, n, h, 4, part, D, bf16, acc);
      else if (hn == 3) weigh_values(scores, v_cache, offsets, L, t0, n, h, 3, part, D, bf16, acc);
      else if (hn == 2) weigh_values(scores, v_cache, offsets, L, t0, n, h, 2, part, D, bf16, acc);
      else weigh_values(scores, v_cache, offsets, L, t0, n, h, 1, part, D, bf16, acc);
      h -= most - hn; /* the next group starts at h + hn */
    }
  }
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < D / 16; ++j)
      store16(out, (int64_t)h * D + j * 16,
              _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + j * 16), _mm512_set1_ps(1.f / sums[h])),
              out_bf16);
}
#endif

/* Request b's attention if this build and head size take it (returns 1), else 0. q and out:
 * its [H, D] rows (out in bf16 or float32, out_bf16); offsets: where each of its L tokens'
 * rows starts in either cache; scores: room for [H, L] floats; lse: NULL, or room for each
 * head's log(sum of e^score). */
int decode_request_wide(const void* q, const void* k_cache, const void* v_cache,
                        const int64_t* offsets, int L, void* out, int H, int Hkv, int D,
                        float scale, int bf16, float* scores, int out_bf16, float* lse) {
#ifdef __AVX512F__
#define ONE(d, b) decode_one(q, k_cache, v_cache, offsets, L, out, H, Hkv, d, scale, b, scores, \
                             out_bf16, lse)
  if (D == 64 && bf16) ONE(64, 1);
  else if (D == 64) ONE(64, 0);
  else if (D == 128 && bf16) ONE(128, 1);
  else if (D == 128) ONE(128, 0);
  else return 0;
#undef ONE
  return 1;
#else
  (void)q, (void)k_cache, (void)v_cache, (void)offsets, (void)L, (void)out, (void)H, (void)Hkv;
  (void)D, (void)scale, (void)bf16, (void)scores, (void)out_bf16, (void)lse;
  return 0;
#endif
}
