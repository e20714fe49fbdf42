#include "kernels.h"

/* ---- §4's element-wise steps, float32 or bfloat16, one call each ----
 * RMSNorm, the split of the merged q|k|v rows with RoPE, and SiLU-and-multiply: one pass over
 * the rows where torch runs 3-10 small ops, each with its own pass over memory, its own output
 * and, in bf16, its own widening and rounding. In bf16 `rounded` rounds where torch's bf16 ops
 * round their results, so that both paths compute the same values. Work is split over threads
 * only when it is large enough to pay for waking them (prefill chunks, not decode rows). */
#define PARALLEL_ABOVE 16384 /* elements */
/* Each loop below dispatches on bf16 inside its parallel region: a region is outlined into its
 * own function before inlining, so a constant passed into it would arrive as a variable, and
 * the loop would not become vector code. */

/* x as one of torch's bf16 ops returns it (rounded to bf16), or x itself in float32. */
static inline float rounded(float x, const int bf16) {
  uint16_t half;
  if (!bf16) return x;
  store(&half, 0, x, 1);
  return load(&half, 0, 1);
}

/* out = weight * (x / sqrt(mean(x^2) + eps)) on one row, as HF's LlamaRMSNorm: the mean in
 * float32, the normalized row rounded to x's dtype before the weight multiplies it. */
static inline __attribute__((always_inline)) void rms_norm_row(
    const void* x, const void* weight, void* out, int64_t row, int dim, float eps,
    const int bf16) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int i = 0; i < dim; ++i) sq += load(x, row + i, bf16) * load(x, row + i, bf16);
  const float inv = 1.f / sqrtf(sq / dim + eps);
#pragma omp simd
  for (int i = 0; i < dim; ++i)
    store(out, row + i, load(weight, i, bf16) * rounded(load(x, row + i, bf16) * inv, bf16),
          bf16);
}

void rms_norm(const void* x, const void* weight, void* out, int rows, int dim, float eps,
              int bf16) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * dim > PARALLEL_ABOVE)
  for (int r = 0; r < rows; ++r) {
    if (bf16) rms_norm_row(x, weight, out, (int64_t)r * dim, dim, eps, 1);
    else rms_norm_row(x, weight, out, (int64_t)r * dim, dim, eps, 0);
  }
}

/* RoPE and SiLU-and-multiply: 16 lanes where the CPU has them (GCC's default is 8); they sum
 * nothing, so the width changes no result. */
#pragma GCC push_options
#pragma GCC target("prefer-vector-width=512")
/* One head of D values from element s of src to element d of dst, rotated by RoPE with its
 * token's cos and sin rows (element c): halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
 * HF's x * cos + rotate_half(x) * sin, each product rounded as torch's ops round it. */
static inline __attribute__((always_inline)) void rope_head(
    const void* src, int64_t s, void* dst, int64_t d, const void* cos, const void* sin,
    int64_t c, int D, const int bf16) {
  const int half = D / 2;
#pragma omp simd
  for (int i = 0; i < half; ++i) {
    const float x1 = load(src, s + i, bf16), x2 = load(src, s + i + half, bf16);
    store(dst, d + i, rounded(x1 * load(cos, c + i, bf16), bf16) -
                          rounded(x2 * load(sin, c + i, bf16), bf16), bf16);
    store(dst, d + i + half, rounded(x2 * load(cos, c + i + half, bf16), bf16) +
                                 rounded(x1 * load(sin, c + i + half, bf16), bf16), bf16);
  }
}

/* Token t's row of qkv [n, (H + 2 Hkv) D] (the merged projection's output: q | k | v) into
 * q [n, H, D] and k [n, Hkv, D], rotated, and v [n, Hkv, D], copied; cos, sin [n, D]. */
static inline __attribute__((always_inline)) void qkv_rope_token(
    const void* qkv, const void* cos, const void* sin, void* q, void* k, void* v, int64_t t,
    int H, int Hkv, int D, const int bf16) {
  const int64_t row = (int64_t)(H + 2 * Hkv) * D, c = t * D;
  for (int h = 0; h < H; ++h) rope_head(qkv, t * row + h * D, q, (t * H + h) * D, cos, sin, c, D, bf16);
  for (int h = 0; h < Hkv; ++h)
    rope_head(qkv, t * row + (H + h) * D, k, (t * Hkv + h) * D, cos, sin, c, D, bf16);
  const int esize = bf16 ? 2 : 4;
  memcpy((char*)v + t * Hkv * D * esize, (const char*)qkv + (t * row + (int64_t)(H + Hkv) * D) * esize,
         (size_t)Hkv * D * esize);
}

void qkv_rope(const void* qkv, const void* cos, const void* sin, void* q, void* k, void* v, int n,
              int H, int Hkv, int D, int bf16) {
#pragma omp parallel for schedule(static) if ((int64_t)n * (H + 2 * Hkv) * D > PARALLEL_ABOVE)
  for (int t = 0; t < n; ++t) {
    if (bf16) qkv_rope_token(qkv, cos, sin, q, k, v, t, H, Hkv, D, 1);
    else qkv_rope_token(qkv, cos, sin, q, k, v, t, H, Hkv, D, 0);
  }
}

/* out[t] = silu(gate) * up on token t's row of gate_up [n, 2I] (the merged projection's
 * output: gate | up), silu(g) = g / (1 + e^-g) from e^-|g|, which never overflows. */
static inline __attribute__((always_inline)) void silu_mul_row(
    const void* gate_up, void* out, int64_t t, int I, const int bf16) {
  const int64_t g0 = t * 2 * I, o0 = t * I;
#pragma omp simd
  for (int i = 0; i < I; ++i) {
    const float g = load(gate_up, g0 + i, bf16), e = exp_nonpositive(g < 0.f ? g : -g);
    store(out, o0 + i,
          rounded(g * ((g >= 0.f ? 1.f : e) / (1.f + e)), bf16) * load(gate_up, g0 + I + i, bf16),
          bf16);
  }
}

void silu_mul(const void* gate_up, void* out, int n, int I, int bf16) {
#pragma omp parallel for schedule(static) if ((int64_t)n * I > PARALLEL_ABOVE)
  for (int t = 0; t < n; ++t) {
    if (bf16) silu_mul_row(gate_up, out, t, I, 1);
    else silu_mul_row(gate_up, out, t, I, 0);
  }
}
#pragma GCC pop_options

/* ---- §4's greedy rows: each row's largest logit and the first index holding it ----
 * What the sampler asks of torch.max(dim=-1): the values in the logits' dtype (a NaN anywhere
 * makes the row's NaN, then its index is the first NaN's) and int64 indices. torch's reduction
 * took ~30 us for one bf16 row of SmolLM2's 49,152 logits on the Zen 4 VM (a tenth of a ms once
 * the step had evicted its code): here 8 lanes compare at a time, each keeping its first maximum,
 * and the lanes' ties go to the smallest index. */
/* 16 lanes (one AVX-512 register, two AVX2 ones): half the instructions of 8 per element */
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
enum { SETS = 2 }; /* independent (maximum, index) chains: a compare's latency, not its rate */

static inline f32x16 load16f(const void* p, int64_t i, const int bf16) {
  f32x16 v;
  if (!bf16) {
    memcpy(&v, (const float*)p + i, sizeof v);
    return v;
  }
  u16x16 half;
  memcpy(&half, (const uint16_t*)p + i, sizeof half);
  const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
  memcpy(&v, &bits, sizeof v);
  return v;
}

static inline __attribute__((always_inline)) void row_max_row(
    const void* logits, int64_t first, int64_t vocab, float* top, int64_t* index, const int bf16) {
  f32x16 best[SETS];
  i32x16 at[SETS], nan = {0};
  const i32x16 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int j = 0; j < SETS; ++j) { /* set j: elements 16j .. 16j + 15 of every 16 SETS */
    best[j] = (f32x16){0} - INFINITY, at[j] = lanes + 16 * j;
  }
  int64_t i = 0;
  for (; i + 16 * SETS <= vocab; i += 16 * SETS)
#pragma GCC unroll 4
    for (int j = 0; j < SETS; ++j) {
      const f32x16 v = load16f(logits, first + i + 16 * j, bf16);
      const i32x16 greater = v > best[j]; /* all ones where v is the lane's new maximum */
      best[j] = (f32x16)(((i32x16)v & greater) | ((i32x16)best[j] & ~greater));
      at[j] = ((lanes + (int32_t)(i + 16 * j)) & greater) | (at[j] & ~greater);
      nan |= v != v;
    }
  float m = -INFINITY;
  int64_t k = 0;
  for (int j = 0; j < SETS; ++j) /* the lanes' ties: the smallest index */
    for (int l = 0; l < 16; ++l)
      if (best[j][l] > m || (best[j][l] == m && at[j][l] < k)) m = best[j][l], k = at[j][l];
  for (; i < vocab; ++i) { /* the last few, after every lane's index */
    const float v = load(logits, first + i, bf16);
    nan[0] |= v != v;
    if (v > m) m = v, k = i;
  }
  int any_nan = 0;
  for (int l = 0; l < 16; ++l) any_nan |= nan[l];
  if (any_nan) { /* the first NaN */
    m = NAN, k = 0;
    while (load(logits, first + k, bf16) == load(logits, first + k, bf16)) ++k;
  }
  *top = m, *index = k;
}

/* logits [rows, vocab] -> top [rows] (their dtype), index [rows] (int64) */
void row_max(const void* logits, void* top, int64_t* index, int rows, int64_t vocab, int bf16) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * vocab > 8 * PARALLEL_ABOVE)
  for (int r = 0; r < rows; ++r) {
    float m;
    if (bf16) row_max_row(logits, r * vocab, vocab, &m, index + r, 1);
    else row_max_row(logits, r * vocab, vocab, &m, index + r, 0);
    store(top, r, m, bf16);
  }
}
