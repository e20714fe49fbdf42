/* The optimized CPU path's two kernels, built once per machine by cpu_kernels.py:
 *   linear: §1, one weight read serving every row of the step (y = x W^T + bias);
 *   paged_decode: §5, decode attention read straight from the paged KV cache.
 * Both compute in float32; bfloat16 values are widened on load and results rounded to
 * nearest even, as torch does. All arrays are contiguous and row-major.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float load(const void* p, int64_t i, int bf16) {
  if (!bf16) return ((const float*)p)[i];
  uint32_t bits = (uint32_t)((const uint16_t*)p)[i] << 16; /* bf16 = a float's top half */
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline void store(void* p, int64_t i, float x, int bf16) {
  if (!bf16) {
    ((float*)p)[i] = x;
    return;
  }
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even, as torch does */
  ((uint16_t*)p)[i] = (uint16_t)(bits >> 16);
}

/* Eight floats, one AVX register (a GCC/Clang vector extension: two SSE or NEON registers
 * elsewhere). Written out rather than left to the auto-vectorizer, which did not vectorize
 * these loops once they read through a block table. */
typedef float vec8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline vec8 load8(const void* p, int64_t i, int bf16) {
  vec8 v;
  if (!bf16) {
    memcpy(&v, (const float*)p + i, sizeof v);
    return v;
  }
  u16x8 half;
  memcpy(&half, (const uint16_t*)p + i, sizeof half);
  const u32x8 bits = __builtin_convertvector(half, u32x8) << 16;
  memcpy(&v, &bits, sizeof v);
  return v;
}

static inline float sum8(vec8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* e^x for x <= 0 as 2^n * e^r, |r| <= ln2 / 2, with a degree-6 polynomial for e^r (Cephes'
 * expf coefficients, within ~1 ulp of expf). Plain arithmetic, so the softmax loop becomes
 * vector code, where expf was one library call per score (measured: ~17% of the kernel). */
static inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x; /* e^-87 ~ 1.6e-38: smaller would leave 2^n's exponent range */
  const float n = floorf(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f; /* n ln2 in two parts */
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n: n in the exponent field */
  float two_n;
  memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

/* Ask for a token's row a few tokens ahead: rows of consecutive blocks are not adjacent in
 * memory, so the CPU's own prefetcher stalls at every block edge (measured: 0.9x). */
#define AHEAD 4
static inline void prefetch_row(const void* cache, int64_t i, int row, int bf16) {
  const char* p = (const char*)cache + i * (bf16 ? 2 : 4);
  for (int byte = 0; byte < row * (bf16 ? 2 : 4); byte += 64) __builtin_prefetch(p + byte);
}

/* ---- §5: decode attention ----
 * One query per request, over its first lens[b] cached tokens, found through its block
 * table. Each cached token's K (and V) row of all KV heads is read once, in place: no copy
 * of the request's blocks is gathered first. The torch twin's arithmetic: scores, softmax,
 * weighted sum of V.
 * Layouts: q, out [B, H, D]; caches [blocks, block_size, Hkv, D], D a multiple of 8;
 * block_table [B, W] and lens [B] int32. Query head h reads KV head h / (H / Hkv) (GQA).
 * The caller (cpu_attention.py) has checked every block id, length and D against the cache.
 */

/* A thread's buffers, grown as needed: scores [H, L], each token's row offset [L] and the
 * output being summed [H, D]. */
struct scratch {
  float *scores, *acc;
  int64_t* offsets;
  int capacity;
};

/* Request b. Always inlined: `D` and `bf16` are then constants in each call below, and the
 * compiler unrolls the head-sized loops into vector instructions. */
static inline __attribute__((always_inline)) void decode_request(
    const void* q, const void* k_cache, const void* v_cache, const int32_t* block_table,
    const int32_t* lens, void* out, int H, int Hkv, const int D, int block_size, int W,
    float scale, const int bf16, int b, struct scratch* buf) {
  const int group = H / Hkv, row = Hkv * D; /* row: one token's K (or V), all KV heads */
  const int L = lens[b];
  if (L > buf->capacity) {
    free(buf->scores);
    free(buf->offsets);
    buf->capacity = L;
    buf->scores = malloc(sizeof(float) * H * L);
    buf->offsets = malloc(sizeof(int64_t) * L);
  }
  if (!buf->acc) buf->acc = malloc(sizeof(float) * H * D);
  float *scores = buf->scores, *acc = buf->acc;
  int64_t* offsets = buf->offsets;
  const int32_t* blocks = block_table + (int64_t)b * W;
  for (int t = 0; t < L; ++t) /* where token t's row starts in either cache */
    offsets[t] = ((int64_t)blocks[t / block_size] * block_size + t % block_size) * row;

  float qf[H * D]; /* q * scale, widened */
  for (int i = 0; i < H * D; ++i) qf[i] = load(q, (int64_t)b * H * D + i, bf16) * scale;
  /* Both passes walk the cache token by token, each row front to back: reading a few
   * tokens at once, head slice by head slice, was 1.2-1.5x slower with a cold cache. */
  for (int t = 0; t < L; ++t) { /* scores = (q * scale) . k */
    if (t + AHEAD < L) prefetch_row(k_cache, offsets[t + AHEAD], row, bf16);
    for (int h = 0; h < H; ++h) {
      const int64_t k = offsets[t] + (h / group) * D;
      vec8 s = {0};
      for (int d = 0; d < D; d += 8) {
        vec8 qd;
        memcpy(&qd, qf + h * D + d, sizeof qd);
        s += qd * load8(k_cache, k + d, bf16);
      }
      scores[h * L + t] = sum8(s);
    }
  }
  for (int h = 0; h < H; ++h) { /* softmax over the L keys */
    float *sh = scores + h * L, m = -INFINITY, sum = 0.f;
    for (int t = 0; t < L; ++t) m = sh[t] > m ? sh[t] : m;
#pragma omp simd
    for (int t = 0; t < L; ++t) sh[t] = exp_nonpositive(sh[t] - m);
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < L; ++t) sum += sh[t];
    for (int t = 0; t < L; ++t) sh[t] /= sum;
  }
  memset(acc, 0, sizeof(float) * H * D);
  for (int t = 0; t < L; ++t) { /* out = sum over keys of p . v */
    if (t + AHEAD < L) prefetch_row(v_cache, offsets[t + AHEAD], row, bf16);
    for (int h = 0; h < H; ++h) {
      const int64_t v = offsets[t] + (h / group) * D;
      const float p = scores[h * L + t];
      for (int d = 0; d < D; d += 8) {
        vec8 a;
        memcpy(&a, acc + h * D + d, sizeof a);
        a += p * load8(v_cache, v + d, bf16);
        memcpy(acc + h * D + d, &a, sizeof a);
      }
    }
  }
  for (int i = 0; i < H * D; ++i) store(out, (int64_t)b * H * D + i, acc[i], bf16);
}

#define ARGS                                                                               \
  const void *q, const void *k_cache, const void *v_cache, const int32_t *block_table,     \
      const int32_t *lens, void *out, int B, int H, int Hkv, int D, int block_size, int W, \
      float scale
#define PASS(d, bf16) \
  q, k_cache, v_cache, block_table, lens, out, H, Hkv, d, block_size, W, scale, bf16

/* One request per task. Each (head size, dtype) below gets its own copy of decode_request,
 * with those two as constants: 64 and 128 unrolled, any other multiple of 8 generic. */
void paged_decode(ARGS, int bf16) {
#pragma omp parallel
  {
    struct scratch buf = {0};
#pragma omp for schedule(dynamic, 1)
    for (int b = 0; b < B; ++b) {
      if (D == 64 && bf16) decode_request(PASS(64, 1), b, &buf);
      else if (D == 64) decode_request(PASS(64, 0), b, &buf);
      else if (D == 128 && bf16) decode_request(PASS(128, 1), b, &buf);
      else if (D == 128) decode_request(PASS(128, 0), b, &buf);
      else if (bf16) decode_request(PASS(D, 1), b, &buf);
      else decode_request(PASS(D, 0), b, &buf);
    }
    free(buf.scores), free(buf.offsets), free(buf.acc);
  }
}

/* ---- §1: the linear layers' GEMM ----
 * W [N, K] is packed once, at load time (cpu_linear.py), as [N / 16][K][16]: panel p holds
 * output columns 16p..16p+15, one 16-wide row per input index k. Each panel is then read
 * front to back, once per block of 6 rows of x (a "pass"): for each k, the panel's 16 weights
 * meet 6 rows, 12 accumulators of 8 floats in registers. oneDNN's small-batch GEMM read the
 * weights at ~5 GB/s here, this at ~8-15. x [M, K], y [M, N]; N a multiple of 16 (caller). */
static inline __attribute__((always_inline)) void gemm_k(
    vec8 acc[6][2], const void* x, const void* w, const int64_t row[6], int64_t panel, int k,
    const int ROWS, const int bf16) {
  const vec8 w0 = load8(w, panel + k * 16, bf16), w1 = load8(w, panel + k * 16 + 8, bf16);
  for (int i = 0; i < ROWS; ++i) {
    const float xi = load(x, row[i] + k, bf16);
    acc[i][0] += xi * w0;
    acc[i][1] += xi * w1;
  }
}

/* Panel p's 16 columns for rows m0 .. m0 + ROWS - 1: pass `pass` of `passes`. Always inlined:
 * ROWS and bf16 are then constants in each loop below, and `acc` stays in registers. */
static inline __attribute__((always_inline)) void gemm_block(
    const void* x, const void* w, const void* bias, void* y, int M, int N, int K, int p,
    int m0, const int ROWS, const int bf16, int pass, int passes) {
  const int64_t panel = (int64_t)p * K * 16;
  int64_t row[6]; /* rows past M repeat the last one; their sums are not stored */
  for (int i = 0; i < ROWS; ++i) row[i] = (int64_t)(m0 + i < M ? m0 + i : M - 1) * K;
  vec8 acc[6][2] = {{{0}}}; /* ROWS <= 6 */
  if (bf16 || passes < 2 || p + 1 == N / 16) {
    /* bf16 (measured slower with it), one pass (the CPU's prefetcher keeps up), last panel */
    for (int k = 0; k < K; ++k) gemm_k(acc, x, w, row, panel, k, ROWS, bf16);
  } else {
    /* Each pass also asks for its share of the next panel's K rows, one every `passes`
     * values of k: the next panel arrives from memory while this one is computed, instead
     * of stalling its own first pass (fp32 step: 0.91x at 16 rows, 0.93x at 64). */
    const float* next = (const float*)w + panel + (int64_t)K * 16;
    const int share = (K + passes - 1) / passes;
    for (int k0 = 0, line = pass * share; k0 < K; k0 += passes, ++line) {
      if (line < K) __builtin_prefetch(next + (int64_t)line * 16, 0, 2);
      for (int k = k0; k < k0 + passes && k < K; ++k)
        gemm_k(acc, x, w, row, panel, k, ROWS, bf16);
    }
  }
  for (int i = 0; i < ROWS && m0 + i < M; ++i)
    for (int j = 0; j < 16; ++j)
      store(y, (int64_t)(m0 + i) * N + p * 16 + j,
            acc[i][j / 8][j % 8] + (bias ? load(bias, p * 16 + j, bf16) : 0.f), bf16);
}

/* One task per panel; (rows per block, dtype) as constants in each call. A lone decode row
 * takes the 1-row block: the 6-row one would multiply it six times. "guided" hands out runs
 * of adjacent panels, shrinking at the end: a core that a VM's host slows for a while is not
 * waited for (static: 1.04x the fp32 step at 64 rows here). */
void linear(const void* x, const void* w, const void* bias, void* y, int M, int N, int K,
            int bf16) {
  const int passes = (M + 5) / 6;
#pragma omp parallel for schedule(guided)
  for (int p = 0; p < N / 16; ++p)
    for (int m0 = 0; m0 < M; m0 += 6) {
      if (M == 1 && bf16) gemm_block(x, w, bias, y, M, N, K, p, m0, 1, 1, 0, 1);
      else if (M == 1) gemm_block(x, w, bias, y, M, N, K, p, m0, 1, 0, 0, 1);
      else if (bf16) gemm_block(x, w, bias, y, M, N, K, p, m0, 6, 1, m0 / 6, passes);
      else gemm_block(x, w, bias, y, M, N, K, p, m0, 6, 0, m0 / 6, passes);
    }
}
