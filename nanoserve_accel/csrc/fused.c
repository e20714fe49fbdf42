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

/* out = x + y, rounded as torch's add rounds it (a residual add) */
static inline __attribute__((always_inline)) void add_row(const void* x, const void* y, void* out,
                                                          int64_t row, int dim, const int bf16) {
#pragma omp simd
  for (int i = 0; i < dim; ++i)
    store(out, row + i, load(x, row + i, bf16) + load(y, row + i, bf16), bf16);
}

void add(const void* x, const void* y, void* out, int rows, int dim, int bf16) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * dim > PARALLEL_ABOVE)
  for (int r = 0; r < rows; ++r) {
    if (bf16) add_row(x, y, out, (int64_t)r * dim, dim, 1);
    else add_row(x, y, out, (int64_t)r * dim, dim, 0);
  }
}

/* sum = x + y, then out = rms_norm(sum), a row at a time: the residual add and the norm after
 * it in one pass over memory (vLLM's fused_add_rms_norm; the sum is still in L1 when the norm
 * reads it). The values are add's, then rms_norm's. out may be y. */
void add_rms_norm(const void* x, const void* y, const void* weight, void* sum, void* out,
                  int rows, int dim, float eps, int bf16) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * dim > PARALLEL_ABOVE)
  for (int r = 0; r < rows; ++r) {
    const int64_t row = (int64_t)r * dim;
    if (bf16) add_row(x, y, sum, row, dim, 1), rms_norm_row(sum, weight, out, row, dim, eps, 1);
    else add_row(x, y, sum, row, dim, 0), rms_norm_row(sum, weight, out, row, dim, eps, 0);
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

/* ---- §4's greedy pick: each row's largest logit and the first token that holds it ----
 * torch's max(dim=-1), which the sampler calls on every step's logits, is a scalar loop over each
 * row on a CPU. 2-core Zen 3 VM (AVX2), SmolLM2-135M's 49,152 logits, torch / this, alone: bf16
 * 131 / 31 us at one row, 3549 / 416 at 64 rows; float32 93 / 19 and 3434 / 341. top [rows]
 * (float32: NaN where the row holds a NaN, as torch's max propagates it), tokens [rows] (where
 * the row holds a NaN: any index; the sampler replaces it). */
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* Eight lanes, each the max of every eighth logit and where it first occurs (a later equal value
 * does not replace it); then the largest lane value and the first index among lanes holding it. */
static inline __attribute__((always_inline)) void largest_row(const void* logits, int64_t row,
                                                              int vocab, float* top,
                                                              int64_t* token, const int bf16) {
  vec8 m = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
            -INFINITY};
  i32x8 at = {0}, nan = {0}, i8 = {0, 1, 2, 3, 4, 5, 6, 7};
  int i = 0;
  for (; i + 8 <= vocab; i += 8, i8 += 8) {
    const vec8 x = load8(logits, row + i, bf16);
    const i32x8 more = x > m; /* -1 where x is larger (never for NaN) */
    m = (vec8)((more & (i32x8)x) | (~more & (i32x8)m));
    at = (more & i8) | (~more & at);
    nan |= x != x;
  }
  float best = -INFINITY;
  int first = 0, any_nan = 0;
  for (int lane = 0; lane < 8; ++lane) {
    any_nan |= nan[lane];
    if (m[lane] > best || (m[lane] == best && at[lane] < first)) best = m[lane], first = at[lane];
  }
  for (; i < vocab; ++i) { /* the last vocab % 8: after every lane's index */
    const float x = load(logits, row + i, bf16);
    any_nan |= x != x;
    if (x > best) best = x, first = i;
  }
  *top = any_nan ? NAN : best;
  *token = first;
}

#ifdef __AVX512BW__
/* largest_row for bf16 on AVX-512, on the raw bits: x ^ ((x >> 15) >>> 1) (arithmetic, then
 * logical shift) orders every bf16 that is not NaN as int16 does (-0 just below +0), so one
 * integer max an instruction over 32 logits finds the largest value, without widening them or
 * tracking where each lane's maximum lies; a second pass finds the first token equal to it as a
 * float (where it is a zero: either zero). NaN: an exponent of all ones, a mantissa not zero.
 * The 8-lane loop above spends ~12 instructions on 8 bf16 logits (float32 keeps it: nothing to
 * widen there). 2-core AMX Xeon VM, SmolLM2-135M bf16, `largest` inside a decode step of 64
 * rows (two alternated runs of 35 steps, medians): 1.06, 1.22 -> 0.57, 0.68 ms; alone on the
 * same logits, after a 256 MB read 1.04 -> 0.47-0.52 ms, repeated 0.31 -> 0.15. One row level
 * (0.09-0.11 ms in the step: mostly the cold torch calls around it). */
static void largest_row_bf16(const uint16_t* x, int vocab, float* top, int64_t* token) {
  const __m512i low = _mm512_set1_epi16((short)0xFF80), magnitude = _mm512_set1_epi16(0x7FFF),
                inf = _mm512_set1_epi16(0x7F80); /* low: -inf */
  __m512i best = _mm512_set1_epi16((short)(0xFF80 ^ 0x7FFF)); /* -inf's order */
  __mmask32 nan = 0, live = ~(__mmask32)0;
  for (int i = 0; i < vocab; i += 32) {
    if (vocab - i < 32) live = ((__mmask32)1 << (vocab - i)) - 1;
    const __m512i v = _mm512_mask_loadu_epi16(low, live, x + i);
    nan |= _mm512_cmpgt_epu16_mask(_mm512_and_si512(v, magnitude), inf);
    const __m512i order = _mm512_xor_si512(v, _mm512_srli_epi16(_mm512_srai_epi16(v, 15), 1));
    best = _mm512_max_epi16(best, order);
  }
  int16_t lanes[32];
  _mm512_storeu_si512(lanes, best);
  int16_t key = lanes[0];
  for (int l = 1; l < 32; ++l) key = lanes[l] > key ? lanes[l] : key;
  const uint16_t bits = key < 0 ? (uint16_t)(key ^ 0x7FFF) : (uint16_t)key;
  const int zero = !(bits & 0x7FFF);
  const __m512i want = _mm512_set1_epi16((short)(zero ? 0 : bits));
  int first = 0;
  live = ~(__mmask32)0;
  for (int i = 0; i < vocab && !nan; i += 32) {
    if (vocab - i < 32) live = ((__mmask32)1 << (vocab - i)) - 1;
    __m512i v = _mm512_maskz_loadu_epi16(live, x + i);
    if (zero) v = _mm512_and_si512(v, magnitude);
    const __mmask32 hit = _mm512_mask_cmpeq_epi16_mask(live, v, want);
    if (hit) {
      first = i + __builtin_ctz(hit);
      break;
    }
  }
  *top = nan ? NAN : load(x, first, 1);
  *token = first;
}
#endif

void largest(const void* logits, int rows, int vocab, float* top, int64_t* tokens, int bf16) {
#pragma omp parallel for if (rows > 1)
  for (int r = 0; r < rows; ++r) {
#ifdef __AVX512BW__
    if (bf16) largest_row_bf16((const uint16_t*)logits + (int64_t)r * vocab, vocab, top + r,
                               tokens + r);
#else
    if (bf16) largest_row(logits, (int64_t)r * vocab, vocab, top + r, tokens + r, 1);
#endif
    else largest_row(logits, (int64_t)r * vocab, vocab, top + r, tokens + r, 0);
  }
}
