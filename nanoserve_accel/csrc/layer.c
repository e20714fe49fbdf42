#include "kernels.h"

/* ---- §4 for a step of decode rows: one decoder layer in one call ----
 *   x += o_proj(attention(rope(qkv_proj(rms_norm(x)))))
 *   x += down_proj(silu_mul(gate_up_proj(rms_norm(x))))
 * The same kernels the fast path's modules call one at a time (so the same values), called here
 * in a row: a decode row's layer is a dozen small calls, and from Python each pays its own
 * dispatch, argument conversion and output allocation, which at one row added up to about a
 * tenth of the step (layer.py). Only for steps where every row decodes one token and
 * every linear of the layer takes a C GEMM at that row count; else the modules run. */

void linear_panels(const void* x, const void* w, const void* bias, void* y, int N, int M, int K,
            int bf16);
void rms_norm(const void* x, const void* weight, void* out, int rows, int dim, float eps,
              int bf16);
void add(const void* x, const void* y, void* out, int rows, int dim, int bf16);
void add_rms_norm(const void* x, const void* y, const void* weight, void* sum, void* out,
                  int rows, int dim, float eps, int bf16);
void qkv_rope(const void* qkv, const void* cos, const void* sin, void* q, void* k, void* v, int n,
              int H, int Hkv, int D, int bf16);
void silu_mul(const void* gate_up, void* out, int n, int I, int bf16);
int store_kv(const char* k, const char* v, char* k_cache, char* v_cache, const int64_t* slots,
             int n, int row_bytes, int64_t num_slots);
int paged_decode(const void* q, const void* k_cache, const void* v_cache,
                 const int32_t* block_table, const int32_t* lens, void* out, int B, int H,
                 int Hkv, int D, int block_size, int W, int num_blocks, float scale, int bf16,
                 const void* next, int64_t next_bytes);
#ifdef __AVX512F__
void linear_dot_fp32(const float* x, const float* w, const float* bias, float* y, int N, int M,
                     int K);
void linear_fp32_blocked_then(const float* x, const float* w, const float* bias, float* y, int N,
                              int M, int K, const float* next, int next_n, int next_k);
#endif
#ifdef __AVX512BF16__
void linear_dpbf16(const void* x, const void* w, const void* bias, void* y, int N, int M, int K);
void linear_dpbf16_blocked_then(const void* x, const void* w, const void* bias, void* y, int N,
                                int M, int K, const void* next, int next_n, int next_k);
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
void linear_amx(const void* x, const void* w, const void* bias, void* y, int N, int M, int K);
#endif

/* Which C GEMM a linear takes: plan.GEMM_KINDS (a test holds the two equal). */
enum { GEMM_PANELS = 0, GEMM_DOT_FP32 = 1, GEMM_DPBF16 = 2, GEMM_AMX = 3,
       GEMM_DPBF16_BLOCKED = 4, GEMM_DOT_FP32_BLOCKED = 5 };

struct gemm {
  const void* w;    /* the module's weight in its kernel's layout */
  const void* bias; /* or NULL */
  int kind, n, k;
};

/* A layer's weights and sizes, set once (layer.py's LayerArgs mirrors it). */
struct layer {
  const void *input_norm, *post_norm; /* RMSNorm weights [hidden] */
  struct gemm qkv, o, gate_up, down;
  void *k_cache, *v_cache; /* [num_blocks, block_size, Hkv, D] */
  int hidden, H, Hkv, D, I, block_size, num_blocks, bf16;
  float eps, scale;
};

/* y [M, g->n] = x [M, g->k] W^T (+ bias); 0, or -1 for a kind this library was not built with.
 * `next`: the GEMM the layer runs next (or NULL), whose weights a lone row's threads ask for
 * while they wait for each other (kernels.h's ask_for_run). */
static int gemm(const struct gemm* g, const struct gemm* next, const void* x, void* y, int M,
                int bf16) {
  /* asked for only in this GEMM's own layout, the one its thread runs are counted in */
  if (next && next->kind != g->kind) next = NULL;
  const void* next_w = next ? next->w : NULL;
  const int next_n = next ? next->n : 0, next_k = next ? next->k : 0;
  switch (g->kind) {
    case GEMM_PANELS: linear_panels(x, g->w, g->bias, y, g->n, M, g->k, bf16); return 0;
#ifdef __AVX512F__
    case GEMM_DOT_FP32: linear_dot_fp32(x, g->w, g->bias, y, g->n, M, g->k); return 0;
    case GEMM_DOT_FP32_BLOCKED:
      linear_fp32_blocked_then(x, g->w, g->bias, y, g->n, M, g->k, next_w, next_n, next_k);
      return 0;
#endif
#ifdef __AVX512BF16__
    case GEMM_DPBF16: linear_dpbf16(x, g->w, g->bias, y, g->n, M, g->k); return 0;
    case GEMM_DPBF16_BLOCKED:
      linear_dpbf16_blocked_then(x, g->w, g->bias, y, g->n, M, g->k, next_w, next_n, next_k);
      return 0;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    case GEMM_AMX: linear_amx(x, g->w, g->bias, y, g->n, M, g->k); return 0;
#endif
    default: return -1;
  }
}

/* Where a layer's time goes, built with -DSTEP_PARTS (nanoserve_accel/bench/step_breakdown.py):
 * decode_layer adds each part's nanoseconds to part_ns, step_parts() hands them over and starts
 * again from 0. In the engine's build the marks are nothing. */
#ifdef STEP_PARTS
#include <time.h>
enum { PART_OTHER, PART_QKV, PART_ATTENTION, PART_O, PART_GATE_UP, PART_DOWN, NUM_PARTS };
static int64_t part_ns[NUM_PARTS];
static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}
void step_parts(int64_t* out) {
  for (int i = 0; i < NUM_PARTS; ++i) out[i] = part_ns[i], part_ns[i] = 0;
}
#define MARKS_START int64_t mark_ = now_ns()
#define MARK(part) \
  do { const int64_t t_ = now_ns(); part_ns[part] += t_ - mark_; mark_ = t_; } while (0)
#else
#define MARKS_START (void)0
#define MARK(part) (void)0
#endif

/* One layer for n decode rows, x [n, hidden] -> out [n, hidden]; cos, sin [n, D] (each row's
 * position); slots [n], block_table [n, W], lens [n] as AttentionMetadata's decode fields.
 * Returns -1; or a row r in [0, n) whose block_table / lens paged_decode refuses, or n + i for
 * a slot i outside the cache (then the caller raises); or -2 for a GEMM kind not built here.
 * `then`: the layer that runs next (or NULL), whose qkv_proj follows this layer's down_proj. */
static int layer_then(const struct layer* L, const struct layer* then, const void* x, void* out,
                      const void* cos, const void* sin, const int64_t* slots,
                      const int32_t* block_table, const int32_t* lens, int n, int W) {
  const int esize = L->bf16 ? 2 : 4, q_width = L->H * L->D, kv_width = L->Hkv * L->D;
  const int64_t rows = n;
  char* ws = malloc(esize * rows * (L->hidden + L->qkv.n + q_width + 2 * kv_width + q_width +
                                    L->gate_up.n + L->I));
  char *h = ws, *qkv = h + esize * rows * L->hidden, *q = qkv + esize * rows * L->qkv.n;
  char *k = q + esize * rows * q_width, *v = k + esize * rows * kv_width;
  char *att = v + esize * rows * kv_width, *gate_up = att + esize * rows * q_width;
  char* act = gate_up + esize * rows * L->gate_up.n;
  int status = -1, bad;
  MARKS_START;
  rms_norm(x, L->input_norm, h, n, L->hidden, L->eps, L->bf16); MARK(PART_OTHER);
  if (gemm(&L->qkv, &L->o, h, qkv, n, L->bf16)) { status = -2; goto done; } MARK(PART_QKV);
  qkv_rope(qkv, cos, sin, q, k, v, n, L->H, L->Hkv, L->D, L->bf16);
  bad = store_kv(k, v, L->k_cache, L->v_cache, slots, n, kv_width * esize,
                 (int64_t)L->num_blocks * L->block_size);
  if (bad >= 0) { status = n + bad; goto done; } MARK(PART_OTHER);
  bad = paged_decode(q, L->k_cache, L->v_cache, block_table, lens, att, n, L->H, L->Hkv, L->D,
                     L->block_size, W, L->num_blocks, L->scale, L->bf16, L->o.w,
                     (int64_t)L->o.n * L->o.k * esize); /* o_proj's weights: read next */
  if (bad >= 0) { status = bad; goto done; } MARK(PART_ATTENTION);
  if (gemm(&L->o, &L->gate_up, att, h, n, L->bf16)) { status = -2; goto done; } MARK(PART_O);
  add_rms_norm(x, h, L->post_norm, out, h, n, L->hidden, L->eps, L->bf16); MARK(PART_OTHER);
  if (gemm(&L->gate_up, &L->down, h, gate_up, n, L->bf16)) { status = -2; goto done; }
  MARK(PART_GATE_UP);
  silu_mul(gate_up, act, n, L->I, L->bf16); MARK(PART_OTHER);
  if (gemm(&L->down, then ? &then->qkv : NULL, act, h, n, L->bf16)) { status = -2; goto done; }
  MARK(PART_DOWN);
  add(out, h, out, n, L->hidden, L->bf16); MARK(PART_OTHER);
done:
  free(ws);
  return status;
}

int decode_layer(const struct layer* L, const void* x, void* out, const void* cos, const void* sin,
                 const int64_t* slots, const int32_t* block_table, const int32_t* lens, int n,
                 int W) {
  return layer_then(L, NULL, x, out, cos, sin, slots, block_table, lens, n, W);
}

/* Every layer of the model for n decode rows, one after another: one call from Python a step,
 * not one a layer (each ~8 us of checks, argument conversion and an output at one row: ~3% of
 * SmolLM2-135M's step on the Zen 4 VM). Layer 0 reads x, every layer writes out, in place from
 * layer 1 on (decode_layer reads a row before it writes it). Returns decode_layer's status:
 * -1 with *done = count, or that of the layer *done, which wrote nothing to out. */
int decode_layers(const struct layer* const* layers, int count, const void* x, void* out,
                  const void* cos, const void* sin, const int64_t* slots,
                  const int32_t* block_table, const int32_t* lens, int n, int W, int* done) {
  for (int i = 0; i < count; ++i) {
    const int status = layer_then(layers[i], i + 1 < count ? layers[i + 1] : NULL, i ? out : x,
                                  out, cos, sin, slots, block_table, lens, n, W);
    if (status != -1) {
      *done = i;
      return status;
    }
  }
  *done = count;
  return -1;
}

/* What the decoder does around its layers on a decode step (layer.py's ModelArgs mirrors it). */
struct model {
  const void* embed;            /* embed_tokens.weight [vocab, hidden], the layers' dtype */
  const float *cos, *sin;       /* RotaryEmbedding's float32 tables [max_positions, D] */
  const void* norm;             /* the final RMSNorm's weight [hidden] */
  int vocab, max_positions;
};

/* The model's decode step, DecoderModel.forward in one call: each row's embedding and its
 * position's cos and sin (rounded to the layers' dtype, as .to(dtype) rounds), every layer
 * (decode_layers), the final norm into out [n, hidden]. From Python these are three more calls
 * of torch ops a step, ~0.2 ms of a 135M model's one-row step once the step's weights have
 * passed through the caches. Returns -3 (nothing done) where a token id or a position is out of
 * range, else decode_layers' status: on a refusal at layer *done, out holds the layer before's
 * output (if any) and the caller carries on with the modules. */
int decode_model(const struct model* m, const struct layer* const* layers, int count,
                 const int64_t* ids, const int64_t* positions, void* out, const int64_t* slots,
                 const int32_t* block_table, const int32_t* lens, int n, int W, int* done) {
  *done = 0;
  for (int i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= m->vocab || positions[i] < 0 || positions[i] >= m->max_positions)
      return -3;
  const struct layer* L = layers[0];
  const int bf16 = L->bf16, esize = bf16 ? 2 : 4, D = L->D;
  const int64_t row = (int64_t)L->hidden * esize;
  char* x = malloc(n * (row + 2 * (int64_t)D * esize));
  char *cos = x + n * row, *sin = cos + (int64_t)n * D * esize;
  for (int i = 0; i < n; ++i) {
    memcpy(x + i * row, (const char*)m->embed + ids[i] * row, row);
    for (int d = 0; d < D; ++d) {
      store(cos, (int64_t)i * D + d, m->cos[positions[i] * D + d], bf16);
      store(sin, (int64_t)i * D + d, m->sin[positions[i] * D + d], bf16);
    }
  }
  const int status = decode_layers(layers, count, x, out, cos, sin, slots, block_table, lens, n,
                                   W, done);
  if (status == -1) rms_norm(out, m->norm, out, n, L->hidden, L->eps, bf16); /* row by row */
  free(x);
  return status;
}
