#include "kernels.h"
#include <omp.h>

/* Ask for a token's row a few tokens ahead: rows of consecutive blocks are not adjacent in
 * memory, so the CPU's own prefetcher stalls at every block edge. */
#define AHEAD 4
static inline void prefetch_row(const void* cache, int64_t i, int row, int bf16) {
  const char* p = (const char*)cache + i * (bf16 ? 2 : 4);
  for (int byte = 0; byte < row * (bf16 ? 2 : 4); byte += 64) __builtin_prefetch(p + byte);
}

/* Token t's K (or V) row of all KV heads, as floats: in place in a float32 cache; a bf16 row
 * is widened once into `tmp` for all its query heads, not once per query head. */
static inline __attribute__((always_inline)) const float* row_floats(
    const void* cache, int64_t offset, int row, const int bf16, float* tmp) {
  if (!bf16) return (const float*)cache + offset;
  for (int i = 0; i < row; i += 8) {
    const vec8 v = load8(cache, offset + i, 1);
    memcpy(tmp + i, &v, sizeof v);
  }
  return tmp;
}

/* Tokens t .. t + T - 1's rows of one cache as floats (row_floats); each also asks for the
 * row AHEAD tokens later. */
static inline __attribute__((always_inline)) void tile_rows(
    const void* cache, const int64_t* offsets, int t, const int T, int L, int row, const int bf16,
    float* tmp, const float* rows[4]) {
  for (int i = 0; i < T; ++i) {
    if (t + i + AHEAD < L) prefetch_row(cache, offsets[t + i + AHEAD], row, bf16);
    rows[i] = row_floats(cache, offsets[t + i], row, bf16, tmp + i * row);
  }
}

/* The K pass over tokens t .. t + T - 1 (T <= 4): scores[h][t + i] = (q * scale) . k. The T
 * sums of a head are independent chains of multiply-adds, which the core overlaps; each
 * token's sum is taken in the order it would be alone. */
static inline __attribute__((always_inline)) void score_tokens(
    const float* qf, const void* k_cache, const int64_t* offsets, int t, const int T, int L,
    int H, int group, const int D, int row, const int bf16, float* tmp, float* scores) {
  const float* k[4];
  tile_rows(k_cache, offsets, t, T, L, row, bf16, tmp, k);
  for (int h = 0; h < H; ++h) {
    vec8 s[4] = {{0}};
    for (int d = 0; d < D; d += 8) {
      vec8 qd;
      memcpy(&qd, qf + h * D + d, sizeof qd);
      for (int i = 0; i < T; ++i) s[i] += qd * load8(k[i] + (h / group) * D, d, 0);
    }
    for (int i = 0; i < T; ++i) scores[h * L + t + i] = sum8(s[i]);
  }
}

/* The V pass over the same tokens: acc += p . v, token after token as alone, with one load
 * and store of acc for the T of them. */
static inline __attribute__((always_inline)) void weigh_tokens(
    const float* scores, const void* v_cache, const int64_t* offsets, int t, const int T, int L,
    int H, int group, const int D, int row, const int bf16, float* tmp, float* acc) {
  const float* v[4];
  tile_rows(v_cache, offsets, t, T, L, row, bf16, tmp, v);
  for (int h = 0; h < H; ++h) {
    for (int d = 0; d < D; d += 8) {
      vec8 a;
      memcpy(&a, acc + h * D + d, sizeof a);
      for (int i = 0; i < T; ++i) a += scores[h * L + t + i] * load8(v[i] + (h / group) * D, d, 0);
      memcpy(acc + h * D + d, &a, sizeof a);
    }
  }
}

/* ---- §5: decode attention ----
 * One query per request, over its first lens[b] cached tokens, found through its block
 * table. Each cached token's K (and V) row of all KV heads is read once, in place: no copy
 * of the request's blocks is gathered first. The torch twin's arithmetic: scores, softmax,
 * weighted sum of V.
 * Layouts: q, out [B, H, D]; caches [num_blocks, block_size, Hkv, D], D a multiple of 8;
 * block_table [B, W] and lens [B] int32. Query head h reads KV head h / (H / Hkv) (GQA).
 * The caller (paged_attention.py) has checked the shapes; paged_decode checks the values.
 */

/* A thread's buffers, grown as needed: scores [H, L], each token's row offset [L] and the
 * output being summed [H, D]. */
struct scratch {
  float *scores, *acc;
  int64_t* offsets;
  int capacity;
};

/* Request b's tokens t0 .. t1 - 1 (all of them, or one part of a split request), KV heads
 * g0 .. g1 - 1 and their query heads, into `out`, its [H, D] row, in bf16 or float32
 * (out_bf16); lse: NULL, or each head's log(sum of e^score), to merge the parts. A head's
 * sums do not involve the other heads: its values are the same whichever heads share the task.
 * Always inlined: `D` and `bf16` are then constants in each call below, and the compiler
 * unrolls the head-sized loops into vector instructions. */
static inline __attribute__((always_inline)) void decode_request(
    const void* q, const void* k_cache, const void* v_cache, const int32_t* block_table,
    void* out, int H, int Hkv, const int D, int block_size, int W, float scale, const int bf16,
    int b, int t0, int t1, int g0, int g1, int out_bf16, float* lse, struct scratch* buf) {
  const int row = Hkv * D; /* one token's K (or V), all KV heads */
  const int L = t1 - t0, h0 = g0 * (H / Hkv);
  if (L > buf->capacity) { /* room for all H heads: a thread's tasks may have more or fewer */
    free(buf->scores);
    free(buf->offsets);
    buf->capacity = L;
    buf->scores = malloc(sizeof(float) * H * L);
    buf->offsets = malloc(sizeof(int64_t) * L);
  }
  if (!buf->acc) buf->acc = malloc(sizeof(float) * H * D);
  /* From here on only the task's heads: H of them reading Hkv KV heads, where each token's
   * offset points at KV head g0 of its row. */
  q = (const char*)q + ((int64_t)b * H + h0) * D * (bf16 ? 2 : 4);
  out = (char*)out + (int64_t)h0 * D * (out_bf16 ? 2 : 4);
  lse = lse ? lse + h0 : NULL;
  H = (g1 - g0) * (H / Hkv), Hkv = g1 - g0;
  const int group = H / Hkv;
  float *scores = buf->scores, *acc = buf->acc;
  int64_t* offsets = buf->offsets;
  const int32_t* blocks = block_table + (int64_t)b * W;
  for (int t = t0, j = t0 / block_size, in = t0 % block_size; t < t1; ++t) {
    /* where token t's KV head g0 starts in either cache: slot `in` of block j (counted: a
     * division and a remainder a token showed at long contexts, docs/benchmarks.md) */
    offsets[t - t0] = ((int64_t)blocks[j] * block_size + in) * row + g0 * D;
    if (++in == block_size) in = 0, ++j;
  }
  if (decode_request_wide(q, k_cache, v_cache, offsets, L, out, H, Hkv, D, scale, bf16, scores,
                          out_bf16, lse))
    return; /* AVX-512 and a head size it takes: attention_avx512.c */

  float qf[H * D]; /* q * scale, widened */
  for (int i = 0; i < H * D; ++i) qf[i] = load(q, i, bf16) * scale;
  /* Both passes walk the cache T tokens at a time, each row front to back. bf16: T = 4, whose
   * rows are widened first, and their sums overlap. float32 rows are read in place, one at a
   * time: 4 at a time measured slower with a cold cache. */
  const int T = bf16 ? 4 : 1, width = Hkv * D; /* the task's part of a row */
  float tmp[4 * width];
  int t = 0;
  for (; t + T <= L; t += T)
    score_tokens(qf, k_cache, offsets, t, T, L, H, group, D, width, bf16, tmp, scores);
  for (; t < L; ++t) /* the last L % T */
    score_tokens(qf, k_cache, offsets, t, 1, L, H, group, D, width, bf16, tmp, scores);
  for (int h = 0; h < H; ++h) { /* over the L keys */
    const float lse_h = softmax(scores + h * L, L);
    if (lse) lse[h] = lse_h;
  }
  memset(acc, 0, sizeof(float) * H * D);
  for (t = 0; t + T <= L; t += T) /* out = sum over keys of p . v */
    weigh_tokens(scores, v_cache, offsets, t, T, L, H, group, D, width, bf16, tmp, acc);
  for (; t < L; ++t)
    weigh_tokens(scores, v_cache, offsets, t, 1, L, H, group, D, width, bf16, tmp, acc);
  for (int i = 0; i < H * D; ++i) store(out, i, acc[i], out_bf16);
}

#define ARGS                                                                               \
  const void *q, const void *k_cache, const void *v_cache, const int32_t *block_table,     \
      const int32_t *lens, void *out, int B, int H, int Hkv, int D, int block_size, int W, \
      int num_blocks, float scale
/* `to`: the output of the task at hand (paged_decode) */
#define PASS(d, bf16) q, k_cache, v_cache, block_table, to, H, Hkv, d, block_size, W, scale, bf16

/* The first request whose length is not in [1, W * block_size] or that would read a block
 * outside [0, num_blocks), or -1. Checked here, where it costs a loop over the table: as
 * torch ops it was 2 reductions, 4 comparisons and 4 reads back per layer (~6% of a 1-row
 * step). */
static int first_bad_request(const int32_t* block_table, const int32_t* lens, int B, int W,
                             int block_size, int num_blocks) {
  for (int b = 0; b < B; ++b) {
    if (lens[b] < 1 || lens[b] > W * block_size) return b;
    for (int j = 0; j < (lens[b] + block_size - 1) / block_size; ++j) {
      const int32_t id = block_table[(int64_t)b * W + j];
      if (id < 0 || id >= num_blocks) return b;
    }
  }
  return -1;
}

/* One request per task (or a part of one, or a part's heads: below). Each (head size, dtype)
 * below gets its own copy of decode_request, with those two as constants: 64 and 128 unrolled,
 * any other multiple of 8 generic. Returns -1, or a request whose values first_bad_request
 * refuses: then nothing is read. */
/* A request longer than SPLIT tokens is split into parts of SPLIT, each a task of its own,
 * and the parts' outputs merged by their softmax sums (as flash-decoding does): with one task a
 * request, one row at a long context had one thread read its whole KV. 2-core Zen 4 VM
 * (avx512_bf16), bundled model, a step of 1 row at 4096 tokens of context (step_times.py,
 * two alternating rounds): float32 24.2, 24.3 -> 21.7, 21.0 ms; bf16 15.3, 12.7 -> 10.9, 10.6
 * ms; 16 rows level (114-116 / 67-68 ms both). The parts depend on the request's own length
 * only, so its result does not depend on the rows beside it or on the team. */
enum { SPLIT = 512 };

static int parts_of(int L) { return (L + SPLIT - 1) / SPLIT; }

/* out_b = sum over parts p of e^(lse_p - lse) out_p, lse = log(sum over p of e^lse_p). */
static void merge_parts(const float* part_out, const float* part_lse, int n, void* out, int H,
                        int D, int bf16) {
  for (int h = 0; h < H; ++h) {
    float m = -INFINITY, sum = 0.f;
    for (int p = 0; p < n; ++p) m = part_lse[p * H + h] > m ? part_lse[p * H + h] : m;
    float w[n];
    for (int p = 0; p < n; ++p) sum += w[p] = expf(part_lse[p * H + h] - m);
    for (int d = 0; d < D; ++d) {
      float x = 0.f;
      for (int p = 0; p < n; ++p) x += w[p] * part_out[((int64_t)p * H + h) * D + d];
      store(out, (int64_t)h * D + d, x / sum, bf16);
    }
  }
}

/* With fewer parts than two per thread (one row at a short context: one part, one thread
 * reading the whole KV while the others wait), each part's KV heads are split over tasks.
 * 2-core Zen 4 VM, one row at 241 tokens, a layer's attention from a cold cache: Llama-3.2-1B's
 * 8 KV heads 39.8 -> 25.2 us in bf16, 64.1 -> 40.7 in float32; SmolLM2-135M's 3 (split 2 + 1)
 * level in bf16 (17-19 us), 21-31 -> 19-21 in float32.
 * `next` (or NULL), `next_bytes`: memory the caller reads next (layer.c: the o_proj weights). A
 * thread out of tasks while another still computes asks for it, 4 KB at a time, until the last
 * task is done: the attention reads a few cache lines at a time, the memory is otherwise idle.
 * 2-core Zen 3 VM (AVX2), SmolLM2-135M bf16, one row at 240 tokens (3 tasks on 2 threads): the
 * o_proj GEMM after it 29.1, 28.0 -> 22.7, 22.5 us a layer, the attention level (37-41 us).
 * Not asked where the AVX-512 attention is built: on the 2-core Zen 4 VM (avx512_bf16) the
 * remaining task slowed by as much as o_proj gained where the memory read at ~35 GB/s, and
 * o_proj slowed too at ~65 (0.46 -> 0.55-0.57 ms a step); kernel_ab.py, 135M bf16, one row, the
 * step without over with: 0.975, 0.985 at 63-65 GB/s, 1.001 at 35; float32 and Llama-3.2-1B's
 * shape level (1.000-1.003, 0.999). */
#ifdef __AVX512F__
enum { ASK_FOR_NEXT = 0 };
#else
enum { ASK_FOR_NEXT = 1 };
#endif
int paged_decode(ARGS, int bf16, const void* next, int64_t next_bytes) {
  const int bad = first_bad_request(block_table, lens, B, W, block_size, num_blocks);
  if (bad >= 0) return bad;
  int first[B + 1]; /* request b's parts: first[b] .. first[b + 1] - 1 */
  first[0] = 0;
  for (int b = 0; b < B; ++b) first[b + 1] = first[b] + parts_of(lens[b]);
  const int parts = first[B], wanted = 2 * omp_get_max_threads();
  const int per = parts >= wanted ? Hkv : (Hkv * parts / wanted > 0 ? Hkv * parts / wanted : 1);
  const int pieces = (Hkv + per - 1) / per; /* of a part: KV heads per, per, ..., the rest */
  const int tasks = parts * pieces;
  /* a split request's parts: their float32 outputs [H, D] and log-sums [H], by part */
  float* part_out = parts > B ? malloc(sizeof(float) * parts * H * D) : NULL;
  float* part_lse = parts > B ? malloc(sizeof(float) * parts * H) : NULL;
  const int64_t row_bytes = (int64_t)H * D * (bf16 ? 2 : 4);
  int finished = 0;                           /* tasks done */
  int64_t asked = 0;                          /* 4 KB pieces of `next` taken */
  const int64_t pieces_of_next = next && ASK_FOR_NEXT ? (next_bytes + 4095) / 4096 : 0;
#pragma omp parallel if (tasks > 1) /* one task: no thread to wake for it */
  {
    struct scratch buf = {0};
    int b = 0; /* the request of this thread's task: its tasks come in increasing order */
#pragma omp for schedule(dynamic, 1) nowait
    for (int task = 0; task < tasks; ++task) {
      const int part = task / pieces, g0 = task % pieces * per;
      const int g1 = g0 + per < Hkv ? g0 + per : Hkv;
      while (first[b + 1] <= part) ++b;
      const int p = part - first[b], whole = first[b + 1] - first[b] == 1;
      const int t0 = p * SPLIT, t1 = whole ? lens[b] : (t0 + SPLIT < lens[b] ? t0 + SPLIT : lens[b]);
      void* to = whole ? (char*)out + b * row_bytes : (void*)(part_out + (int64_t)part * H * D);
      float* lse = whole ? NULL : part_lse + (int64_t)part * H;
      const int ob = whole ? bf16 : 0;
      if (D == 64 && bf16) decode_request(PASS(64, 1), b, t0, t1, g0, g1, ob, lse, &buf);
      else if (D == 64) decode_request(PASS(64, 0), b, t0, t1, g0, g1, ob, lse, &buf);
      else if (D == 128 && bf16) decode_request(PASS(128, 1), b, t0, t1, g0, g1, ob, lse, &buf);
      else if (D == 128) decode_request(PASS(128, 0), b, t0, t1, g0, g1, ob, lse, &buf);
      else if (bf16) decode_request(PASS(D, 1), b, t0, t1, g0, g1, ob, lse, &buf);
      else decode_request(PASS(D, 0), b, t0, t1, g0, g1, ob, lse, &buf);
      __atomic_add_fetch(&finished, 1, __ATOMIC_RELAXED);
    }
    free(buf.scores), free(buf.offsets), free(buf.acc);
    while (__atomic_load_n(&finished, __ATOMIC_RELAXED) < tasks) {
      const int64_t piece = __atomic_fetch_add(&asked, 1, __ATOMIC_RELAXED);
      if (piece >= pieces_of_next) break;
      const int64_t end = piece * 4096 + 4096 < next_bytes ? piece * 4096 + 4096 : next_bytes;
      for (int64_t byte = piece * 4096; byte < end; byte += 64)
        __builtin_prefetch((const char*)next + byte, 0, 2);
    }
    if (parts > B) { /* a split request: merge its parts once every part's output is written */
#pragma omp barrier
#pragma omp for
      for (int b2 = 0; b2 < B; ++b2)
        if (first[b2 + 1] - first[b2] > 1)
          merge_parts(part_out + (int64_t)first[b2] * H * D, part_lse + (int64_t)first[b2] * H,
                      first[b2 + 1] - first[b2], (char*)out + b2 * row_bytes, H, D, bf16);
    }
  }
  free(part_out), free(part_lse);
  return -1;
}

/* ---- §5: this step's K and V into their cache slots ----
 * Row i of k and of v (one token's K or V, all KV heads: row_bytes) is copied to slot
 * slots[i] of its cache: a plain copy, without index_copy_'s per-call cost in every layer.
 * Returns -1, or the first i whose slot is outside [0, num_slots): then nothing is written. */
int store_kv(const char* k, const char* v, char* k_cache, char* v_cache, const int64_t* slots,
             int n, int row_bytes, int64_t num_slots) {
  for (int i = 0; i < n; ++i)
    if (slots[i] < 0 || slots[i] >= num_slots) return i;
  for (int i = 0; i < n; ++i) {
    memcpy(k_cache + slots[i] * row_bytes, k + (int64_t)i * row_bytes, row_bytes);
    memcpy(v_cache + slots[i] * row_bytes, v + (int64_t)i * row_bytes, row_bytes);
  }
  return -1;
}
