/* §5 on a CPU: decode attention read straight from the paged KV cache.
 *
 * One query per request, over its first lens[b] cached tokens, found through its block
 * table. Each cached token's K (and V) row of all KV heads is read once, in place: no copy
 * of the request's blocks is gathered first. The torch twin's arithmetic, in float32 (bf16
 * values are widened on load): scores, softmax, weighted sum of V.
 * Layouts: q, out [B, H, D]; caches [blocks, block_size, Hkv, D], all contiguous, D a
 * multiple of 8; block_table [B, W] and lens [B] int32. Query head h reads KV head
 * h / (H / Hkv) (GQA). The caller (cpu_attention.py) has checked every block id, length and
 * D against the cache.
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

/* `D` and `bf16` are constants where the exported functions below call this: the compiler
 * then unrolls the head-sized loops into vector instructions. */
static inline void decode(const void* q, const void* k_cache, const void* v_cache,
                          const int32_t* block_table, const int32_t* lens, void* out, int B,
                          int H, int Hkv, const int D, int block_size, int W, float scale,
                          const int bf16) {
  const int group = H / Hkv, row = Hkv * D; /* row: one token's K (or V), all KV heads */
#pragma omp parallel
  {
    /* This thread's buffers, grown as needed: scores [H, L], each token's row offset [L]
     * and the output being summed [H, D]. */
    float* scores = NULL;
    int64_t* offsets = NULL;
    float* acc = malloc(sizeof(float) * H * D);
    int capacity = 0;
#pragma omp for schedule(dynamic, 1)
    for (int b = 0; b < B; ++b) { /* one request per task */
      const int L = lens[b];
      if (L > capacity) {
        free(scores);
        free(offsets);
        capacity = L;
        scores = malloc(sizeof(float) * H * capacity);
        offsets = malloc(sizeof(int64_t) * capacity);
      }
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
    free(scores);
    free(offsets);
    free(acc);
  }
}

#define ARGS                                                                               \
  const void *q, const void *k_cache, const void *v_cache, const int32_t *block_table,     \
      const int32_t *lens, void *out, int B, int H, int Hkv, int D, int block_size, int W, \
      float scale
#define PASS(d, bf16) \
  q, k_cache, v_cache, block_table, lens, out, B, H, Hkv, d, block_size, W, scale, bf16

void paged_decode_f32(ARGS) {
  if (D == 64) decode(PASS(64, 0));
  else if (D == 128) decode(PASS(128, 0));
  else decode(PASS(D, 0));
}

void paged_decode_bf16(ARGS) {
  if (D == 64) decode(PASS(64, 1));
  else if (D == 128) decode(PASS(128, 1));
  else decode(PASS(D, 1));
}
