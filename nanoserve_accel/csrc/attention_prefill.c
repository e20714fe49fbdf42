#include "kernels.h"

/* ---- §5: prefill attention over the paged KV cache, bf16 on AVX512-BF16 (and AMX), fp32 ----
 * flash_attn_varlen_func's contract (causal, with a block table) for bf16 caches and head sizes
 * 64 and 128. Why a kernel: the torch twin gathers each request's blocks into a copy, runs one
 * scaled_dot_product_attention per request and copies its result out, in every layer; for
 * chunks of short prompts that was a fifth of a prefill step. Here one call does every request
 * of the chunk, reading the cache in place. A task is one request's KV head (and, when there
 * are few, a run of its query rows), every query head of the group. It lays that head's keys
 * out 16 at a time as pairs of dimensions and its values as pairs of tokens: the operand layout
 * of both AVX512-BF16's vdpbf16ps and AMX's tiles. Then, 16 query vectors (rows x heads) at a
 * time: scores (16 keys of a query per instruction, or a 16 x 16 tile), an exact softmax over
 * each query's visible keys (no online rescaling), probabilities rounded to bf16 as torch's CPU
 * flash attention rounds them, and p . v. */
#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

#define VB 16 /* query vectors per block */

typedef struct {
  int seq, kv_head, row0, rows;
} Task;

typedef struct { /* one thread's work space, sized for the longest context of the call */
  uint32_t* kt; /* [keys / 16][D / 2][16]: 16 keys' dimension pairs (fp32: [keys / 16][D][16]) */
  uint32_t* vp; /* [keys / 2][D]: token pairs' values (fp32: [keys][D]) */
  uint16_t* q; /* [VB][D]: the block's query vectors, contiguous */
  float* scores; /* [VB][keys] */
  uint16_t* probs; /* [VB][keys], bf16 (fp32 in the fp32 path) */
  float* sums; /* [VB][D]: AMX's p . v */
} Space;

static inline void store16_bf16(uint16_t* p, __m512 x) {
  _mm256_storeu_si256((__m256i*)p, bf16x16(x));
}

/* Scores s[0 .. L-1] (unscaled) -> e^(scale (s - max)) into p[0 .. padded - 1] (zeros past L),
 * rounded to bf16 (BF16) or kept in fp32; returns 1 / the sum of the unrounded exponentials. 16
 * lanes at a time, the last 16 masked. Always inlined: BF16 is then a constant. */
static inline __attribute__((always_inline)) float softmax_row(const float* s, int L,
                                                               float scale, void* p,
                                                               int padded, const int BF16) {
#define LANES(t) ((t) + 16 <= L ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - (t))) - 1))
  __m512 m = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
  for (int t = 0; t < L; t += 16) m = _mm512_mask_max_ps(m, LANES(t), m, _mm512_loadu_ps(s + t));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(m)), k = _mm512_set1_ps(scale);
  int t = 0;
  for (; t < L; t += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), max), k);
    const __m512 e = _mm512_maskz_mov_ps(LANES(t), exp16(x));
    sum = _mm512_add_ps(sum, e);
    if (BF16) store16_bf16((uint16_t*)p + t, e);
    else _mm512_storeu_ps((float*)p + t, e);
  }
#undef LANES
  memset((char*)p + (size_t)t * (BF16 ? 2 : 4), 0, (size_t)(padded - t) * (BF16 ? 2 : 4));
  return 1.f / _mm512_reduce_add_ps(sum);
}

/* A task's query vectors v0 .. v0 + VB - 1 (vector v: row v / G of the task, head
 * kv_head * G + v % G), `esize` bytes an element: copied into qs (zeros past the task's nv),
 * each one's element offset in q and out (-1 past the task) and how many keys it sees; returns
 * the most any of them sees. */
static int gather_block(const Task* task, const char* q, const int32_t* cu_q, int H, int G,
                        int D, int before, int v0, int nv, int esize, char* qs, int64_t at[VB],
                        int visible[VB]) {
  int most = 0;
  for (int i = 0; i < VB; ++i) {
    const int v = v0 + i;
    at[i] = v < nv ? (((int64_t)cu_q[task->seq] + task->row0 + v / G) * H +
                      task->kv_head * G + v % G) * D : -1;
    if (at[i] >= 0) memcpy(qs + (int64_t)i * D * esize, q + at[i] * esize, (size_t)D * esize);
    else memset(qs + (int64_t)i * D * esize, 0, (size_t)D * esize);
    visible[i] = at[i] >= 0 ? before + task->row0 + v / G + 1 : 0;
    most = visible[i] > most ? visible[i] : most;
  }
  return most;
}

#if defined(__AVX512BF16__)

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

/* Keys 0 .. nk - 1 of one KV head, read through the block table into space->kt and space->vp,
 * zeros up to `padded` keys (a multiple of 32). */
static void lay_out_kv(const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* blocks,
                       int nk, int padded, int kv_head, int Hkv, int D, int block_size,
                       Space* space) {
  const int pairs = D / 2;
  for (int t = 0; t < padded; t += 2) {
    const uint16_t *k[2], *v[2];
    for (int i = 0; i < 2; ++i) {
      const int u = t + i;
      const int64_t at =
          u < nk ? ((int64_t)blocks[u / block_size] * block_size + u % block_size) * Hkv + kv_head
                 : -1;
      k[i] = at < 0 ? NULL : k_cache + at * D;
      v[i] = at < 0 ? NULL : v_cache + at * D;
    }
    uint32_t* vp = space->vp + (int64_t)(t / 2) * D;
    for (int d = 0; d < D; ++d)
      vp[d] = (v[0] ? v[0][d] : 0) | (uint32_t)(v[1] ? v[1][d] : 0) << 16;
    for (int i = 0; i < 2; ++i) {
      uint32_t* kt = space->kt + (int64_t)((t + i) / 16) * pairs * 16 + (t + i) % 16;
      const uint32_t* src = (const uint32_t*)k[i];
      for (int j = 0; j < pairs; ++j) kt[j * 16] = src ? src[j] : 0;
    }
  }
}

/* scores[i][0 .. 16 * groups) = q_i . k for the block's VB vectors, 8 at a time: each load of
 * 16 keys' dimension pairs serves 8 queries. */
static void qk_dpbf16(const Space* s, int groups, int D, int stride) {
  const int pairs = D / 2;
  for (int i0 = 0; i0 < VB; i0 += 8) {
    const uint32_t* q = (const uint32_t*)(s->q + (int64_t)i0 * D);
    for (int g = 0; g < groups; ++g) {
      __m512 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
      const uint32_t* k = s->kt + (int64_t)g * pairs * 16;
      for (int j = 0; j < pairs; ++j) {
        const __m512i keys = _mm512_loadu_si512(k + j * 16);
        for (int i = 0; i < 8; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], as_bh(_mm512_set1_epi32((int)q[i * pairs + j])),
                                    as_bh(keys));
      }
      for (int i = 0; i < 8; ++i)
        _mm512_storeu_ps(s->scores + (int64_t)(i0 + i) * stride + g * 16, acc[i]);
    }
  }
}

/* out_i = (p_i . v) * inv_i, NV vectors at a time, D = 16 * C lanes: each load of a token
 * pair's values serves NV queries. Always inlined: NV and C are then constants (acc stays in
 * registers). */
static inline __attribute__((always_inline)) void pv_dpbf16(const Space* s, int npairs,
                                                            int stride, const float* inv,
                                                            uint16_t* const out[VB],
                                                            const int NV, const int C) {
  for (int i0 = 0; i0 < VB; i0 += NV) {
    __m512 acc[4][8];
    for (int i = 0; i < NV; ++i)
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int p = 0; p < npairs; ++p) {
      __m512i v[8];
      for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_si512(s->vp + ((int64_t)p * C + c) * 16);
      for (int i = 0; i < NV; ++i) {
        const uint32_t w = ((const uint32_t*)(s->probs + (int64_t)(i0 + i) * stride))[p];
        for (int c = 0; c < C; ++c)
          acc[i][c] = _mm512_dpbf16_ps(acc[i][c], as_bh(_mm512_set1_epi32((int)w)), as_bh(v[c]));
      }
    }
    for (int i = 0; i < NV; ++i)
      for (int c = 0; out[i0 + i] && c < C; ++c)
        store16_bf16(out[i0 + i] + c * 16,
                     _mm512_mul_ps(acc[i][c], _mm512_set1_ps(inv[i0 + i])));
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The same two products on AMX tiles (every tile 16 rows of 64 bytes): tile 0 a 16 x 16 block of
 * scores, 1 queries (32 dimensions), 2 keys (16 dimension pairs of 16 keys); then 0-3 the sums
 * of 64 output lanes, 4 probabilities (32 keys), 5 values (16 token pairs of 16 lanes). */
static void qk_amx(const Space* s, int groups, int D, int stride) {
  for (int g = 0; g < groups; ++g) {
    _tile_zero(0);
    for (int c = 0; c < D / 32; ++c) {
      _tile_loadd(1, s->q + c * 32, D * 2);
      _tile_loadd(2, s->kt + ((int64_t)g * D / 2 + c * 16) * 16, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, s->scores + g * 16, stride * 4);
  }
}

static void pv_amx(const Space* s, int npairs, int D, int stride, const float* inv,
                   uint16_t* const out[VB]) {
  for (int d0 = 0; d0 < D; d0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int p = 0; p < npairs; p += 16) { /* 32 keys: the probabilities are zero past each */
      _tile_loadd(4, s->probs + 2 * p, stride * 2);
      const uint32_t* v = s->vp + (int64_t)p * D + d0;
      _tile_loadd(5, v, D * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(5, v + 16, D * 4);
      _tile_dpbf16ps(1, 4, 5);
      _tile_loadd(5, v + 32, D * 4);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(5, v + 48, D * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, s->sums + d0, D * 4);
    _tile_stored(1, s->sums + d0 + 16, D * 4);
    _tile_stored(2, s->sums + d0 + 32, D * 4);
    _tile_stored(3, s->sums + d0 + 48, D * 4);
  }
  for (int i = 0; i < VB; ++i)
    if (out[i])
      for (int c = 0; c < D; c += 16)
        store16_bf16(out[i] + c, _mm512_mul_ps(_mm512_loadu_ps(s->sums + (int64_t)i * D + c),
                                               _mm512_set1_ps(inv[i])));
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((aligned(64))) tile_config;

static void configure_tiles(void) {
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}
#define AMX 1
#else
#define AMX 0
#endif

static void run_task(const Task* task, const uint16_t* q, const uint16_t* k_cache,
                     const uint16_t* v_cache, const int32_t* cu_q, const int32_t* cu_k,
                     const int32_t* block_table, uint16_t* out, int H, int Hkv, int D,
                     int block_size, int max_blocks, float scale, int amx, Space* space) {
  const int G = H / Hkv, s = task->seq, nv = task->rows * G;
  const int before = (cu_k[s + 1] - cu_k[s]) - (cu_q[s + 1] - cu_q[s]);
  const int nk = before + task->row0 + task->rows; /* the last row sees keys 0 .. nk - 1 */
  const int stride = (nk + 31) & ~31;
  lay_out_kv(k_cache, v_cache, block_table + (int64_t)s * max_blocks, nk, stride, task->kv_head,
             Hkv, D, block_size, space);
  for (int v0 = 0; v0 < nv; v0 += VB) {
    uint16_t* o[VB];
    float inv[VB];
    int64_t at[VB];
    int visible[VB];
    const int most = gather_block(task, (const char*)q, cu_q, H, G, D, before, v0, nv, 2,
                                  (char*)space->q, at, visible);
    for (int i = 0; i < VB; ++i) o[i] = at[i] >= 0 ? out + at[i] : NULL;
    const int groups = (most + 15) / 16, npairs = ((most + 31) & ~31) / 2;
#if AMX
    if (amx) qk_amx(space, groups, D, stride);
    else
#endif
      qk_dpbf16(space, groups, D, stride);
    for (int i = 0; i < VB; ++i) {
      uint16_t* probs = space->probs + (int64_t)i * stride;
      if (visible[i]) inv[i] = softmax_row(space->scores + (int64_t)i * stride, visible[i], scale,
                                           probs, stride, 1);
      else memset(probs, 0, (size_t)stride * 2), inv[i] = 0.f; /* past the task's last row */
    }
#if AMX
    if (amx) pv_amx(space, npairs, D, stride, inv, o);
    else
#endif
    if (D == 64) pv_dpbf16(space, npairs, stride, inv, o, 4, 4);
    else pv_dpbf16(space, npairs, stride, inv, o, 2, 8);
  }
}

#endif /* __AVX512BF16__ */

/* ---- The same attention for fp32 caches, on AVX-512F ----
 * Why: on a 2-core Zen 4 VM (avx512f, avx512_bf16, no AMX), a 1024-token fp32 prefill step of
 * SmolLM2-135M (8 prompts of 128, the served benchmark's chunks) on one thread spent 91% in
 * oneDNN's GEMMs at their peak and 6.6% in the twin's SDPA, one call per request at ~31
 * GFLOP/s. This path, one layer's attention of that chunk: 2.9-3.2 ms against the twin's
 * 7.7-8.0 on one thread, 1.27-1.35 against 3.9-4.1 on two; the whole step, alternating in one
 * process: 2.232 against 2.338 s on one thread (0.955), 1.198 against 1.288 on two (0.930).
 * The same tasks and blocks as the bf16 path, in fp32 throughout: keys laid out 16 at a time
 * ([keys / 16][D][16]), values a token a row, scores by FMA (each load of 16 keys serves 8
 * queries), the exact softmax, p . v (each load of a token's values serves NV queries). */
static void lay_out_kv_fp32(const float* k_cache, const float* v_cache, const int32_t* blocks,
                            int nk, int padded, int kv_head, int Hkv, int D, int block_size,
                            float* kt, float* vp) {
  for (int t = 0; t < padded; ++t) {
    const int64_t at =
        t < nk ? ((int64_t)blocks[t / block_size] * block_size + t % block_size) * Hkv + kv_head
               : -1;
    float* keys = kt + (int64_t)(t / 16) * D * 16 + t % 16;
    if (at < 0) {
      memset(vp + (int64_t)t * D, 0, (size_t)D * 4);
      for (int d = 0; d < D; ++d) keys[d * 16] = 0.f;
      continue;
    }
    memcpy(vp + (int64_t)t * D, v_cache + at * D, (size_t)D * 4);
    const float* k = k_cache + at * D;
    for (int d = 0; d < D; ++d) keys[d * 16] = k[d];
  }
}

static void qk_fp32(const float* q, const float* kt, float* scores, int groups, int D,
                    int stride) {
  for (int i0 = 0; i0 < VB; i0 += 8) {
    const float* qi = q + (int64_t)i0 * D;
    for (int g = 0; g < groups; ++g) {
      __m512 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
      const float* k = kt + (int64_t)g * D * 16;
      for (int d = 0; d < D; ++d) {
        const __m512 keys = _mm512_loadu_ps(k + d * 16);
        for (int i = 0; i < 8; ++i)
          acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(qi[i * D + d]), keys, acc[i]);
      }
      for (int i = 0; i < 8; ++i)
        _mm512_storeu_ps(scores + (int64_t)(i0 + i) * stride + g * 16, acc[i]);
    }
  }
}

static inline __attribute__((always_inline)) void pv_fp32(const float* vp, const float* probs,
                                                          int nkeys, int stride, int D,
                                                          const float* inv,
                                                          float* const out[VB], const int NV,
                                                          const int C) {
  for (int i0 = 0; i0 < VB; i0 += NV) {
    __m512 acc[4][8];
    for (int i = 0; i < NV; ++i)
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int t = 0; t < nkeys; ++t) {
      __m512 v[8];
      for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vp + (int64_t)t * D + c * 16);
      for (int i = 0; i < NV; ++i) {
        const __m512 w = _mm512_set1_ps(probs[(int64_t)(i0 + i) * stride + t]);
        for (int c = 0; c < C; ++c) acc[i][c] = _mm512_fmadd_ps(w, v[c], acc[i][c]);
      }
    }
    for (int i = 0; i < NV; ++i)
      for (int c = 0; out[i0 + i] && c < C; ++c)
        _mm512_storeu_ps(out[i0 + i] + c * 16,
                         _mm512_mul_ps(acc[i][c], _mm512_set1_ps(inv[i0 + i])));
  }
}

static void run_task_fp32(const Task* task, const float* q, const float* k_cache,
                          const float* v_cache, const int32_t* cu_q, const int32_t* cu_k,
                          const int32_t* block_table, float* out, int H, int Hkv, int D,
                          int block_size, int max_blocks, float scale, Space* space) {
  const int G = H / Hkv, s = task->seq, nv = task->rows * G;
  const int before = (cu_k[s + 1] - cu_k[s]) - (cu_q[s + 1] - cu_q[s]);
  const int nk = before + task->row0 + task->rows; /* the last row sees keys 0 .. nk - 1 */
  const int stride = (nk + 31) & ~31;
  float *kt = (float*)space->kt, *vp = (float*)space->vp, *qs = (float*)space->q;
  float* probs = (float*)space->probs;
  lay_out_kv_fp32(k_cache, v_cache, block_table + (int64_t)s * max_blocks, nk, stride,
                  task->kv_head, Hkv, D, block_size, kt, vp);
  for (int v0 = 0; v0 < nv; v0 += VB) {
    float* o[VB];
    float inv[VB];
    int visible[VB];
    int64_t at[VB];
    const int most = gather_block(task, (const char*)q, cu_q, H, G, D, before, v0, nv, 4,
                                  (char*)qs, at, visible);
    for (int i = 0; i < VB; ++i) o[i] = at[i] >= 0 ? out + at[i] : NULL;
    qk_fp32(qs, kt, space->scores, (most + 15) / 16, D, stride);
    for (int i = 0; i < VB; ++i) {
      float* p = probs + (int64_t)i * stride;
      if (visible[i]) inv[i] = softmax_row(space->scores + (int64_t)i * stride, visible[i],
                                           scale, p, stride, 0);
      else memset(p, 0, (size_t)stride * 4), inv[i] = 0.f;
    }
    if (D == 64) pv_fp32(vp, probs, most, stride, D, inv, o, 4, 4);
    else pv_fp32(vp, probs, most, stride, D, inv, o, 2, 8);
  }
}

/* q [total_q, H, D] (rows past the last sequence's are not read), caches [num_blocks,
 * block_size, Hkv, D], out like q, all bf16 (bf16 = 1) or all fp32; sequence s: query rows
 * cu_q[s] .. cu_q[s+1] - 1, the last of its lk = cu_k[s+1] - cu_k[s] tokens, whose blocks are
 * block_table row s. amx: use the tiles for bf16 (where built with them; the caller asked Linux
 * for them). Returns -1, or (nothing written) the first sequence whose lengths or block ids are
 * out of range, -2 if out of memory, -3 for a head layout (or bf16 where not built) it does not
 * take. */
int paged_prefill(const void* q, const void* k_cache, const void* v_cache, const int32_t* cu_q,
                  const int32_t* cu_k, const int32_t* block_table, void* out, int num_seqs,
                  int total_q, int H, int Hkv, int D, int block_size, int max_blocks,
                  int num_blocks, int max_seqlen_q, int max_seqlen_k, float scale, int bf16,
                  int amx) {
#if !defined(__AVX512BF16__)
  if (bf16) return -3;
#endif
  if ((D != 64 && D != 128) || Hkv < 1 || H % Hkv) return -3;
  int longest = 0, pieces = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int lq = cu_q[s + 1] - cu_q[s], lk = cu_k[s + 1] - cu_k[s];
    const int nb = (lk + block_size - 1) / block_size;
    if (cu_q[s] < 0 || cu_q[s + 1] > total_q || lq < 0 || lk < lq || lq > max_seqlen_q ||
        lk > max_seqlen_k || nb > max_blocks)
      return s;
    for (int b = 0; b < nb; ++b) {
      const int32_t id = block_table[(int64_t)s * max_blocks + b];
      if (id < 0 || id >= num_blocks) return s;
    }
    longest = lk > longest ? lk : longest;
    pieces += lq > 0;
  }
  /* A task per request and KV head; its rows split in parts where that leaves threads idle. */
  const int wanted = 4 * omp_get_max_threads(), heads = pieces * Hkv;
  const int parts = heads == 0 || heads >= wanted ? 1 : (wanted + heads - 1) / heads;
  Task* tasks = malloc(sizeof(Task) * ((size_t)num_seqs * Hkv * parts + 1));
  if (!tasks) return -2;
  int num_tasks = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int lq = cu_q[s + 1] - cu_q[s], step = (lq + parts - 1) / parts;
    for (int r = 0; r < lq; r += step)
      for (int h = 0; h < Hkv; ++h)
        tasks[num_tasks++] = (Task){s, h, r, lq - r < step ? lq - r : step};
  }
  const int64_t keys = ((int64_t)longest + 31) & ~31;
  int failed = 0;
#pragma omp parallel if (num_tasks > 1)
  {
    const int64_t e = bf16 ? 2 : 4; /* bytes an element */
    Space space = {malloc(keys * D * e), malloc(keys * D * e), malloc(VB * D * e),
                   malloc(VB * keys * 4), malloc(VB * keys * e), malloc(VB * D * 4)};
    const int ok = space.kt && space.vp && space.q && space.scores && space.probs && space.sums;
#if AMX
    if (amx && bf16) configure_tiles();
#endif
#pragma omp for schedule(dynamic)
    for (int t = 0; t < num_tasks; ++t) {
      if (ok && !bf16)
        run_task_fp32(&tasks[t], q, k_cache, v_cache, cu_q, cu_k, block_table, out, H, Hkv, D,
                      block_size, max_blocks, scale, &space);
#if defined(__AVX512BF16__)
      else if (ok)
        run_task(&tasks[t], q, k_cache, v_cache, cu_q, cu_k, block_table, out, H, Hkv, D,
                 block_size, max_blocks, scale, amx && AMX, &space);
#endif
      else {
#pragma omp atomic write
        failed = 1;
      }
    }
#if AMX
    if (amx && bf16) _tile_release();
#endif
    free(space.kt), free(space.vp), free(space.q);
    free(space.scores), free(space.probs), free(space.sums);
  }
  free(tasks);
  return failed ? -2 : -1;
}

#if defined(__AVX512BF16__)
int has_paged_prefill(void) { return 1; }
#endif
int has_paged_prefill_fp32(void) { return 1; }
#endif
