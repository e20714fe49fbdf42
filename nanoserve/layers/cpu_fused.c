#include "cpu_kernels.h"

/* ---- §4's element-wise steps, float32 or bfloat16 ----
 * Each is one call and one pass over its rows where torch runs 2-7 small ops, each with its
 * own pass over memory and its own start of the threads. The loops are plain arithmetic that
 * the compiler turns into vector code; work is split over threads only when it is large
 * enough to pay for waking them. In bf16, `rounded` rounds where torch's bf16 ops round their
 * results, so that the optimized path computes what the eager one does. */
#define PARALLEL_ABOVE 16384 /* elements */
/* Each loop below dispatches on bf16 inside its parallel region: a region is outlined into
 * its own function before inlining, so a constant passed into it would arrive as a variable
 * (and the loop would not become vector code: 9x slower, measured). */

/* out = weight * (x / sqrt(mean(x^2) + eps)) on one row: HF's LlamaRMSNorm. */
static inline __attribute__((always_inline)) void rms_norm_row(
    const void* x, const void* weight, void* out, int64_t row, int dim, float eps,
    const int bf16) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int i = 0; i < dim; ++i) sq += load(x, row + i, bf16) * load(x, row + i, bf16);
  const float inv = 1.f / sqrtf(sq / dim + eps);
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

/* RoPE in place on one head xh of x, with its token's cos and sin rows c: the halves (x1, x2)
 * become (x1 cos - x2 sin, x2 cos + x1 sin), as HF's rotate_half computes. */
static inline __attribute__((always_inline)) void rotary_head(
    void* x, const void* cos, const void* sin, int64_t xh, int64_t c, int D, const int bf16) {
  const int half = D / 2;
  for (int i = 0; i < half; ++i) {
    const float x1 = load(x, xh + i, bf16), x2 = load(x, xh + i + half, bf16);
    store(x, xh + i, rounded(x1 * load(cos, c + i, bf16), bf16) -
                         rounded(x2 * load(sin, c + i, bf16), bf16), bf16);
    store(x, xh + i + half, rounded(x2 * load(cos, c + i + half, bf16), bf16) +
                                rounded(x1 * load(sin, c + i + half, bf16), bf16), bf16);
  }
}

/* x [n, heads, D] in place; cos and sin [n, D]: each token's position's row. */
void rotary(void* x, const void* cos, const void* sin, int n, int heads, int D, int bf16) {
#pragma omp parallel for schedule(static) if ((int64_t)n * heads * D > PARALLEL_ABOVE)
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < heads; ++h) {
      const int64_t xh = ((int64_t)t * heads + h) * D, c = (int64_t)t * D;
      if (bf16) rotary_head(x, cos, sin, xh, c, D, 1);
      else rotary_head(x, cos, sin, xh, c, D, 0);
    }
}

/* out = silu(gate) * up on elements [i0, i1), where silu(g) = g / (1 + e^-g), computed from
 * e^-|g| so that the exponential never overflows. */
static inline __attribute__((always_inline)) void silu_mul_range(
    const void* gate, const void* up, void* out, int64_t i0, int64_t i1, const int bf16) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) {
    const float g = load(gate, i, bf16), e = exp_nonpositive(g < 0.f ? g : -g);
    store(out, i, rounded(g * ((g >= 0.f ? 1.f : e) / (1.f + e)), bf16) * load(up, i, bf16),
          bf16);
  }
}

void silu_mul(const void* gate, const void* up, void* out, int64_t n, int bf16) {
  const int64_t chunk = 4096;
#pragma omp parallel for schedule(static) if (n > PARALLEL_ABOVE)
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t end = i + chunk < n ? i + chunk : n;
    if (bf16) silu_mul_range(gate, up, out, i, end, 1);
    else silu_mul_range(gate, up, out, i, end, 0);
  }
}

/* Each row's greedy token: the first index of its maximum, or of its first NaN, as
 * torch.argmax. Two vector passes: the maximum (and whether a NaN is there), then the
 * first block of 8 that holds it. */
typedef int32_t i32x8 __attribute__((vector_size(32)));
static inline int any8(i32x8 m) {
  return (m[0] | m[1] | m[2] | m[3] | m[4] | m[5] | m[6] | m[7]) != 0;
}

void argmax_rows(const float* x, int64_t* out, int rows, int64_t cols) {
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; ++r) {
    const float* row = x + (int64_t)r * cols;
    const int64_t vec_end = cols / 8 * 8;
    vec8 max8 = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
                 -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    i32x8 nan8 = {0};
    for (int64_t i = 0; i < vec_end; i += 8) {
      vec8 v;
      memcpy(&v, row + i, sizeof v);
      const i32x8 greater = v > max8;
      max8 = (vec8)(((i32x8)v & greater) | ((i32x8)max8 & ~greater));
      nan8 |= v != v;
    }
    float best = -INFINITY;
    int nan = any8(nan8);
    for (int j = 0; j < 8; ++j) best = max8[j] > best ? max8[j] : best;
    for (int64_t i = vec_end; i < cols; ++i) {
      best = row[i] > best ? row[i] : best;
      nan |= row[i] != row[i];
    }
    int64_t i = 0;
    for (; i < vec_end; i += 8) {
      vec8 v;
      memcpy(&v, row + i, sizeof v);
      if (any8(nan ? v != v : v == best)) break;
    }
    while (i < cols - 1 && !(nan ? row[i] != row[i] : row[i] == best)) ++i;
    out[r] = i;
  }
}
