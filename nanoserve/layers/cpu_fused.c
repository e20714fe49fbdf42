#include "cpu_kernels.h"

/* ---- §4's element-wise steps, float32 ----
 * Each is one call and one pass over its rows where torch runs 2-7 small ops, each with its
 * own pass over memory and its own start of the threads. The loops are plain arithmetic that
 * the compiler turns into vector code; work is split over threads only when it is large
 * enough to pay for waking them. */
#define PARALLEL_ABOVE 16384 /* elements */

/* out = weight * (x / sqrt(mean(x^2) + eps)), row by row: HF's LlamaRMSNorm. */
void rms_norm(const float* x, const float* weight, float* out, int rows, int dim, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * dim > PARALLEL_ABOVE)
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + (int64_t)r * dim;
    float sq = 0.f;
#pragma omp simd reduction(+ : sq)
    for (int i = 0; i < dim; ++i) sq += xr[i] * xr[i];
    const float inv = 1.f / sqrtf(sq / dim + eps);
    for (int i = 0; i < dim; ++i) out[(int64_t)r * dim + i] = weight[i] * (xr[i] * inv);
  }
}

/* RoPE in place on x [n, heads, D], with cos and sin [n, D] (each token's position's row):
 * the halves (x1, x2) of every head become (x1 cos - x2 sin, x2 cos + x1 sin), as HF's
 * rotate_half computes. */
void rotary(float* x, const float* cos, const float* sin, int n, int heads, int D) {
  const int half = D / 2;
#pragma omp parallel for schedule(static) if ((int64_t)n * heads * D > PARALLEL_ABOVE)
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < heads; ++h) {
      float* xh = x + ((int64_t)t * heads + h) * D;
      const float *c = cos + (int64_t)t * D, *s = sin + (int64_t)t * D;
      for (int i = 0; i < half; ++i) {
        const float x1 = xh[i], x2 = xh[i + half];
        xh[i] = x1 * c[i] - x2 * s[i];
        xh[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
}

/* out = silu(gate) * up, where silu(g) = g / (1 + e^-g), computed from e^-|g| so that the
 * exponential never overflows. */
void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > PARALLEL_ABOVE)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i], e = exp_nonpositive(g < 0.f ? g : -g);
    out[i] = g * ((g >= 0.f ? 1.f : e) / (1.f + e)) * up[i];
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
