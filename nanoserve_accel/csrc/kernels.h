/* What the fast path's C kernels share. kernels.py builds all nine, once per machine, into one
 * library:
 *   linear.c    linear_panels: §1, one weight read serving every row of the step;
 *   dpbf16.c, amx.c, dot_fp32.c: §1 where the compiler targets AVX512-BF16 (bf16, a few rows),
 *               AMX-BF16 (bf16, decode batch sizes) or AVX-512F (fp32, below oneDNN's rows);
 *   attention.c paged_decode: §5, decode attention read straight from the paged KV cache, with
 *               attention_avx512.c's loop nest on AVX-512; attention_prefill.c: bf16 prefill;
 *   fused.c     §4's element-wise steps; layer.c decode_layer: a decode row's layer in one call.
 * All sum in float32; bfloat16 values are widened on load (or multiplied in pairs by AVX512-BF16,
 * exactly) and results rounded to nearest even, as torch does. All arrays are contiguous and row-major.
 */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* A lone row's column blocks in equal runs, one a thread, as `static` splits them but in each
 * thread's own loop, so that a thread knows its run of the next weight too: thread t of T takes
 * blocks first_block(blocks, t, T) .. first_block(blocks, t + 1, T) - 1. */
static inline int first_block(int blocks, int t, int T) { return (int)((int64_t)blocks * t / T); }

/* Thread t, done with its run (*done counts the threads done), asks for its run of `next` (the
 * weight the caller multiplies next: `blocks` column blocks of `block_bytes`), 4 KB at a time
 * into L2, until every thread is done or it has asked for NEXT_MOST bytes. Why: one core of the Zen
 * 5 VM (avx512_bf16) reads ~39 GB/s alone and two ~78, so where a linear's blocks do not split
 * evenly (SmolLM2-135M's 9 and 15) the thread with a block fewer cannot hurry the other, and its
 * wait was memory left idle (figures: dpbf16.c, dot_fp32.c). */
enum { NEXT_MOST = 256 * 1024 };
static inline void ask_for_run(const void* next, int blocks, int64_t block_bytes, int t, int T,
                               int* done) {
  const char* p = (const char*)next + first_block(blocks, t, T) * block_bytes;
  const char* end = (const char*)next + first_block(blocks, t + 1, T) * block_bytes;
  if (end - p > NEXT_MOST) end = p + NEXT_MOST;
  while (p < end && __atomic_load_n(done, __ATOMIC_RELAXED) < T)
    for (int i = 0; i < 4096 && p < end; i += 64, p += 64) __builtin_prefetch(p, 0, 2);
}

/* CALL(R) with R a compile-time constant equal to `rows` (1 <= rows <= most <= 8): a GEMM kernel
 * inlined once per row count keeps its accumulators for exactly that many rows in registers. */
#define MIN_ROWS(r, most) ((r) < (most) ? (r) : (most))
#define BY_ROWS(rows, most, CALL)                                                        \
  do {                                                                                   \
    switch (rows) {                                                                      \
      case 1: CALL(1); break;                                                            \
      case 2: CALL(MIN_ROWS(2, most)); break;                                            \
      case 3: CALL(MIN_ROWS(3, most)); break;                                            \
      case 4: CALL(MIN_ROWS(4, most)); break;                                            \
      case 5: CALL(MIN_ROWS(5, most)); break;                                            \
      case 6: CALL(MIN_ROWS(6, most)); break;                                            \
      case 7: CALL(MIN_ROWS(7, most)); break;                                            \
      default: CALL(most);                                                               \
    }                                                                                    \
  } while (0)

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
#ifdef __AVX2__ /* two instructions, where GCC 12 made five of the form below */
  const __m256i bits = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i))), 16);
#else
  u16x8 half;
  memcpy(&half, (const uint16_t*)p + i, sizeof half);
  const u32x8 bits = __builtin_convertvector(half, u32x8) << 16;
#endif
  memcpy(&v, &bits, sizeof v);
  return v;
}

typedef float vec4 __attribute__((vector_size(16)));

/* ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)), as 3 vector adds: written with scalars, the
 * compiler took each lane out alone. */
static inline float sum8(vec8 v) {
  const vec4 a =
      __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  const vec4 c = a + __builtin_shufflevector(a, a, 1, 0, 3, 2); /* lane 0: a0 + a1, 2: a2 + a3 */
  return c[0] + c[2];
}

/* e^x for x <= 0 as 2^n * e^r, |r| <= ln2 / 2, with a degree-6 polynomial for e^r (Cephes'
 * expf coefficients, within ~1 ulp of expf). Plain arithmetic, so the softmax loop becomes
 * vector code, where expf was one library call per score. */
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
  /* 2^n: n + 127 (1..127) in the exponent field. A NaN x (a NaN activation) leaves p NaN, and
   * so the result; its n would convert to no int (UBSan: a shift of a negative value), so that
   * lane takes any exponent. Unsigned, the shift is defined for every value. */
  const uint32_t bits = (uint32_t)(n == n ? (int32_t)n + 127 : 0) << 23;
  float two_n;
  memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* e^x for x <= 0, 16 lanes: exp_nonpositive's arithmetic (above) */
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i two_n = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(two_n));
}

/* 16 floats as bf16, rounded to nearest even as store() rounds (vcvtneps2bf16 would flush
 * subnormals) */
static inline __m256i bf16x16(__m512 x) {
  __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}
#endif

/* Scores s[0 .. L-1] -> their softmax, in place; returns log(sum of e^s), which merges the
 * softmaxes of a split request's parts (attention.c). */
static inline float softmax(float* s, int L) {
  float m = -INFINITY, sum = 0.f;
  for (int t = 0; t < L; ++t) m = s[t] > m ? s[t] : m;
#pragma omp simd
  for (int t = 0; t < L; ++t) s[t] = exp_nonpositive(s[t] - m);
#pragma omp simd reduction(+ : sum)
  for (int t = 0; t < L; ++t) sum += s[t];
  for (int t = 0; t < L; ++t) s[t] /= sum;
  return m + logf(sum);
}

int decode_request_wide(const void* q, const void* k_cache, const void* v_cache,
                        const int64_t* offsets, int L, void* out, int H, int Hkv, int D,
                        float scale, int bf16, float* scores, int out_bf16, float* lse);
