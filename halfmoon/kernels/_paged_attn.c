/*
 * kernels._paged_attn: decode attention that reads the paged KV cache in place.
 *
 * The torch backend's decode path gathers every request's K/V blocks into a contiguous copy
 * (`index_select`) and then runs SDPA over the copy: the whole context is read twice and written
 * once per layer. Here each (request, KV head) walks its block table and reads K/V where they
 * lie, with an online softmax over chunks of tokens (flash-decoding without the split):
 *
 *     for each chunk of <= CHUNK tokens inside one block:
 *         s[g][t] = scale * q_g . k_t            (the query heads g sharing this KV head)
 *         m' = max(m, max_t s);  acc *= e^(m - m');  l *= e^(m - m')
 *         p = e^(s - m');  l += sum_t p;  acc += sum_t p[t] v_t
 *     out_g = acc_g / l_g
 *
 * Accumulation is fp32 whatever the cache dtype (fp32 or bf16, converted on load). The query
 * heads that share a KV head are adjacent (head = kv_head * group + g), as in HF's GQA layout.
 *
 * A sliding window W (Mistral, Gemma 3's local layers; HF's `sliding_window_overlay`): the query
 * at position ctx - 1 sees only the last W tokens, positions [max(0, ctx - W), ctx). The chunks
 * start at the first visible token (mid-block, possibly); blocks wholly before it are not read.
 *
 *     | not read (ctx - W tokens) | visible: the last W tokens, the query's own included |
 *
 * Several queries per request (speculative decoding's verify step: the last token and k drafted
 * ones): with `q_starts` request i owns the query rows [q_starts[i], q_starts[i + 1]), n_i of
 * them, and its ctx_lens[i] keys count them all. Its query j (0-based) sits at position
 * ctx - n_i + j and sees the keys before and at it (causal within the request's queries), the
 * last W of them under a window:
 *
 *     | cached (ctx - n) | new: q0 q1 ... q(n-1) |      query j sees [max(0, hi - W), hi),
 *                                                        hi = ctx - n + j + 1
 *
 * A work item is still one (request, KV head): it scores all its rows' query heads against each
 * K/V row it loads, MAX_PASS query vectors (rows x group) a pass over the keys; a request with
 * more rows takes more passes. A row scores only the tokens it sees, into its own chunk buffer,
 * so its result is bit-identical to the same query alone with ctx_len = hi whenever the chunks
 * start at the same place (no window, or block_size <= CHUNK).
 *
 *   decode(q, q_row_stride, kv, tables, table_stride, ctx_lens, out, out_row_stride,
 *          num_seqs, heads, kv_heads, head_dim, num_blocks, block_size, bf16, scale, threads,
 *          window=0, q_starts=0)
 *       q, kv, tables, ctx_lens, out: addresses (tensor.data_ptr()). q rows [heads, head_dim]
 *       at q + i * q_row_stride elements; kv: one layer's cache, contiguous
 *       [2, num_blocks, block_size, kv_heads, head_dim]; tables: int64 [num_seqs, table_stride];
 *       ctx_lens: int64 [num_seqs] (>= 1); out rows [heads * head_dim] at out + i *
 *       out_row_stride. bf16: q, kv and out are bfloat16 (else float32). window: int64, the
 *       sliding window in tokens (0 = full causal attention). q_starts: address of int64
 *       [num_seqs + 1] prefix sums of the query rows per request (q_starts[0] = 0, each request
 *       1 to ctx_lens[i] rows, else a ValueError), 0 = one row per request (row i = request i).
 *       The GIL is released; work items (request, KV head) are spread over `threads` OpenMP
 *       threads (torch's pool) when there is enough of it (counted in (query row, visible
 *       token) pairs).
 *
 *   decode_rope(qkv, qkv_row_stride, kv, tables, table_stride, ctx_lens, out, out_row_stride,
 *               num_seqs, heads, kv_heads, head_dim, num_blocks, block_size, bf16, scale, threads,
 *               positions, cos, sin, slots, window=0, q_norm=0, k_norm=0, norm_eps=0.0,
 *               q_starts=0)
 *       The same, for rows of a fused QKV projection ([heads + 2 kv_heads, head_dim] each, q
 *       first) whose q and k are not rotated yet and whose k and v are not in the cache yet: each
 *       work item first applies RoPE to its query heads (in place, in qkv) and its K head, writes
 *       K and V to the request's new slot, then attends (so the whole step's KV is written when
 *       the call returns); with q_starts, each row's q and K are rotated and its K and V written
 *       for all the request's rows before any of them attends. positions, slots: int64, one per
 *       row (num_seqs, or q_starts[num_seqs]); cos, sin: [max_position,
 *       head_dim] tables in the q dtype, sin signed as in engine/model.py's `rope_tables`:
 *       rope(x) = x * cos + swap_halves(x) * sin, computed as torch does (each product rounded,
 *       then the sum), so the rotated q and k are bit-identical to the torch composition.
 *       q_norm, k_norm: addresses of [head_dim] weights in the q dtype (0 = none): each query
 *       head (q_norm) and the K head (k_norm) is first RMS-normalised over head_dim, then scaled
 *       by the weight, then rotated (Qwen3's and Gemma 3's q_norm / k_norm; Gemma's 1 + w is
 *       folded into the weight by the loader): x * rsqrt(mean(x^2) + norm_eps) * w in fp32, one
 *       rounding to the dtype, as _fused.add_rms_norm (and F.rms_norm) do. The sum of squares is
 *       this file's order, so a normalised head differs from F.rms_norm's by a few fp32 ulp
 *       (bf16: occasionally one bf16 ulp), and RoPE then rotates exactly what it is given.
 *
 * AVX-512, or AVX2 + FMA, when the CPU has them (the same C compiled for each and chosen at
 * import); plain C otherwise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_expf.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
/* Query vectors (rows x group) one pass over a request's keys scores: a request with more query
 * rows than MAX_PASS / group takes several passes (any number of rows runs). */
#define MAX_PASS 64
#define CHUNK 32
/* Below this many context tokens in the whole batch one thread is faster than a fork/join. */
#define PARALLEL_MIN_TOKENS 2048

typedef struct {
    const char *q;
    int64_t q_row_stride;
    const char *kv;
    const int64_t *tables;
    int64_t table_stride;
    const int64_t *ctx_lens;
    char *out;
    int64_t out_row_stride;
    int64_t num_seqs, heads, kv_heads, head_dim, num_blocks, block_size;
    int bf16;
    float scale;
    /* decode_rope only (positions == NULL for decode): */
    const int64_t *positions, *slots;
    const char *cos, *sin;
    int64_t window; /* 0: full causal attention */
    const char *q_norm, *k_norm; /* decode_rope: NULL = no q / k RMSNorm */
    float norm_eps;
    const int64_t *q_starts; /* [num_seqs + 1] rows of each request; NULL: row i = request i */
} Args;

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40); /* quiet NaN */
    c.u += 0x7fffu + ((c.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(c.u >> 16);
}

/* e^x for x <= 0 (scores minus their running max), vectorizable (kernels/_expf.h); e^x = 0
 * below -87 (and for -inf). */
static inline __attribute__((always_inline)) float exp_nonpos(float x) {
    const float e = hm_exp_in_range(x < -87.0f ? -87.0f : x);
    return x < -87.0f ? 0.0f : e;
}

#define INLINE static inline __attribute__((always_inline))

INLINE float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

INLINE void axpy(float *restrict y, float p, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; d++) y[d] += p * x[d];
}

INLINE void scale_row(float *restrict y, float alpha, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; d++) y[d] *= alpha;
}

/* One token's K or V row of one KV head as fp32: where it lies (fp32), or converted into `row`
 * (bf16; once per token, then reused by every query head of the group). */
INLINE const float *load_row(float *restrict row, const char *kv, int64_t off, int bf16, int64_t n) {
    if (!bf16) return (const float *)kv + off;
    const uint16_t *restrict src = (const uint16_t *)kv + off;
#pragma omp simd
    for (int64_t d = 0; d < n; d++) row[d] = bf16_to_f32(src[d]);
    return row;
}

/* Online softmax over one chunk's scores s[0..n) of one query head: rescales acc and l. */
INLINE void softmax_chunk(float *restrict s, int64_t n, float *m, float *l, float *restrict acc,
                          int64_t hd) {
    float mx = *m;
    for (int64_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    const float alpha = exp_nonpos(*m - mx); /* 0 on the first chunk (m = -inf) */
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        s[t] = exp_nonpos(s[t] - mx);
        sum += s[t];
    }
    *l = *l * alpha + sum;
    *m = mx;
    scale_row(acc, alpha, hd);
}

/* One (request, KV head) of a request with one query row, `r`, with head_dim `hd` (a constant
 * where the wrappers below inline it): the loop of the one-row kernel, kept as it was (its
 * speed, its results bit for bit). */
INLINE void attend_one(const Args *a, int64_t seq, int64_t r, int64_t kvh, const int64_t hd) {
    const int64_t group = a->heads / a->kv_heads, bs = a->block_size;
    const int64_t esz = a->bf16 ? 2 : 4, tok_stride = a->kv_heads * hd;
    const int64_t half = a->num_blocks * bs * tok_stride; /* elements of K (then V) */
    float q[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float acc[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float s[MAX_GROUP][CHUNK], m[MAX_GROUP], l[MAX_GROUP];
    float row[MAX_HEAD_DIM] __attribute__((aligned(64)));
    const char *qrow = a->q + (r * a->q_row_stride + kvh * group * hd) * esz;
    for (int64_t g = 0; g < group; g++) {
        const float *src = load_row(q[g], qrow, g * hd, a->bf16, hd);
        for (int64_t d = 0; d < hd; d++) q[g][d] = a->scale * src[d];
        memset(acc[g], 0, (size_t)hd * sizeof(float));
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const int64_t ctx = a->ctx_lens[seq];
    const int64_t *table = a->tables + seq * a->table_stride;
    /* the first visible token: the window's start, mid-block possibly */
    const int64_t start = a->window > 0 && ctx > a->window ? ctx - a->window : 0;
    for (int64_t t0 = start; t0 < ctx;) {
        const int64_t block = table[t0 / bs], in_block = t0 % bs;
        int64_t n = bs - in_block;
        if (n > CHUNK) n = CHUNK;
        if (n > ctx - t0) n = ctx - t0;
        const int64_t first = (block * bs + in_block) * tok_stride + kvh * hd;
        for (int64_t t = 0; t < n; t++) {
            const float *k = load_row(row, a->kv, first + t * tok_stride, a->bf16, hd);
            for (int64_t g = 0; g < group; g++) s[g][t] = dot(q[g], k, hd);
        }
        for (int64_t g = 0; g < group; g++) softmax_chunk(s[g], n, &m[g], &l[g], acc[g], hd);
        for (int64_t t = 0; t < n; t++) {
            const float *v = load_row(row, a->kv, half + first + t * tok_stride, a->bf16, hd);
            for (int64_t g = 0; g < group; g++) axpy(acc[g], s[g][t], v, hd);
        }
        t0 += n;
    }
    char *orow = a->out + (r * a->out_row_stride + kvh * group * hd) * esz;
    for (int64_t g = 0; g < group; g++) {
        scale_row(acc[g], 1.0f / l[g], hd);
        if (a->bf16) {
            for (int64_t d = 0; d < hd; d++) ((uint16_t *)orow)[g * hd + d] = f32_to_bf16(acc[g][d]);
        } else {
            memcpy((float *)orow + g * hd, acc[g], (size_t)hd * sizeof(float));
        }
    }
}

/* Request `seq`'s query rows: [first_row, first_row + num_rows) of q and out. */
INLINE int64_t first_row(const Args *a, int64_t seq) {
    return a->q_starts != NULL ? a->q_starts[seq] : seq;
}

INLINE int64_t num_rows(const Args *a, int64_t seq) {
    return a->q_starts != NULL ? a->q_starts[seq + 1] - a->q_starts[seq] : 1;
}

/* The keys query j of a request with `ctx` keys and `rows` queries sees: [lo, hi), its own
 * position's included (causal within the request's block of queries), the last `window` only. */
INLINE void visible(const Args *a, int64_t ctx, int64_t rows, int64_t j, int64_t *lo, int64_t *hi) {
    *hi = ctx - rows + j + 1;
    *lo = a->window > 0 && *hi > a->window ? *hi - a->window : 0;
}

/* One pass of (request, KV head) over its keys for the query rows [r0, r1) of the request (at
 * most MAX_PASS / group of them), head_dim `hd` (a constant where the wrappers below inline it).
 * The chunks start at the first row's first visible token; each query vector scores only the
 * tokens of a chunk its row sees, into s[i][0..), so a row's chunks, scores and sums are exactly
 * those of the same query alone over its own keys whenever the chunks start at the same block
 * boundaries (block_size <= CHUNK, or no window). */
INLINE void attend_rows(const Args *a, int64_t seq, int64_t kvh, int64_t r0, int64_t r1,
                        const int64_t hd) {
    const int64_t group = a->heads / a->kv_heads, bs = a->block_size, nr = r1 - r0;
    const int64_t esz = a->bf16 ? 2 : 4, tok_stride = a->kv_heads * hd;
    const int64_t half = a->num_blocks * bs * tok_stride; /* elements of K (then V) */
    float q[MAX_PASS][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float acc[MAX_PASS][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float s[MAX_PASS][CHUNK], m[MAX_PASS], l[MAX_PASS];
    float row[MAX_HEAD_DIM] __attribute__((aligned(64)));
    int64_t lo[MAX_PASS] = {0}, hi[MAX_PASS] = {0}, from[MAX_PASS], to[MAX_PASS]; /* nr >= 1 */
    const int64_t ctx = a->ctx_lens[seq], rows = num_rows(a, seq), first = first_row(a, seq);
    for (int64_t i = 0; i < nr; i++) {
        visible(a, ctx, rows, r0 + i - first, &lo[i], &hi[i]);
        const char *qrow = a->q + ((r0 + i) * a->q_row_stride + kvh * group * hd) * esz;
        for (int64_t g = 0; g < group; g++) {
            float *qv = q[i * group + g];
            const float *src = load_row(qv, qrow, g * hd, a->bf16, hd);
            for (int64_t d = 0; d < hd; d++) qv[d] = a->scale * src[d];
            memset(acc[i * group + g], 0, (size_t)hd * sizeof(float));
            m[i * group + g] = -INFINITY;
            l[i * group + g] = 0.0f;
        }
    }
    const int64_t *table = a->tables + seq * a->table_stride;
    /* a later row sees no key before an earlier one's first, nor misses one it sees: lo and hi
     * grow with the row, so the pass reads [lo[0], hi[nr - 1]) */
    for (int64_t t0 = lo[0], end = hi[nr - 1]; t0 < end;) {
        const int64_t block = table[t0 / bs], in_block = t0 % bs;
        int64_t n = bs - in_block;
        if (n > CHUNK) n = CHUNK;
        if (n > end - t0) n = end - t0;
        for (int64_t i = 0; i < nr; i++) { /* row i's tokens of this chunk: [from, to) */
            from[i] = lo[i] > t0 ? lo[i] - t0 : 0;
            to[i] = hi[i] - t0 < n ? hi[i] - t0 : n;
        }
        const int64_t at = (block * bs + in_block) * tok_stride + kvh * hd;
        for (int64_t t = 0; t < n; t++) {
            const float *k = load_row(row, a->kv, at + t * tok_stride, a->bf16, hd);
            for (int64_t i = 0; i < nr; i++) {
                if (t < from[i] || t >= to[i]) continue;
                for (int64_t g = 0; g < group; g++)
                    s[i * group + g][t - from[i]] = dot(q[i * group + g], k, hd);
            }
        }
        for (int64_t i = 0; i < nr; i++) {
            if (from[i] >= to[i]) continue; /* none of this chunk: m, l, acc stay */
            for (int64_t g = 0; g < group; g++) {
                const int64_t j = i * group + g;
                softmax_chunk(s[j], to[i] - from[i], &m[j], &l[j], acc[j], hd);
            }
        }
        for (int64_t t = 0; t < n; t++) {
            const float *v = load_row(row, a->kv, half + at + t * tok_stride, a->bf16, hd);
            for (int64_t i = 0; i < nr; i++) {
                if (t < from[i] || t >= to[i]) continue;
                for (int64_t g = 0; g < group; g++)
                    axpy(acc[i * group + g], s[i * group + g][t - from[i]], v, hd);
            }
        }
        t0 += n;
    }
    for (int64_t i = 0; i < nr; i++) {
        char *orow = a->out + ((r0 + i) * a->out_row_stride + kvh * group * hd) * esz;
        for (int64_t g = 0; g < group; g++) {
            float *o = acc[i * group + g];
            scale_row(o, 1.0f / l[i * group + g], hd);
            if (a->bf16) {
                for (int64_t d = 0; d < hd; d++) ((uint16_t *)orow)[g * hd + d] = f32_to_bf16(o[d]);
            } else {
                memcpy((float *)orow + g * hd, o, (size_t)hd * sizeof(float));
            }
        }
    }
}

/* One (request, KV head) with several query rows, in passes of at most MAX_PASS / group rows
 * (each pass reads the request's visible K/V once for all its rows). */
INLINE void rows_body(const Args *a, int64_t seq, int64_t kvh, const int64_t hd) {
    const int64_t per_pass = MAX_PASS / (a->heads / a->kv_heads);
    const int64_t first = first_row(a, seq), end = first + num_rows(a, seq);
    for (int64_t r0 = first; r0 < end; r0 += per_pass)
        attend_rows(a, seq, kvh, r0, r0 + per_pass < end ? r0 + per_pass : end, hd);
}

/* x * cos + swap_halves(x) * sin of one head, from `src` into `dst` (may alias: read first),
 * rounded as torch's `x * cos` then `addcmul`: the first product stored in the dtype, then one
 * fused multiply-add (ATen's fp32 addcmul is an FMA; for bf16 the product is exact either way). */
INLINE void rope_head(char *dst, const char *src, const char *cos, const char *sin, int bf16,
                      int64_t hd) {
    float x[MAX_HEAD_DIM], c[MAX_HEAD_DIM], s[MAX_HEAD_DIM];
    const int64_t half = hd / 2;
    for (int64_t d = 0; d < hd; d++) {
        x[d] = bf16 ? bf16_to_f32(((const uint16_t *)src)[d]) : ((const float *)src)[d];
        c[d] = bf16 ? bf16_to_f32(((const uint16_t *)cos)[d]) : ((const float *)cos)[d];
        s[d] = bf16 ? bf16_to_f32(((const uint16_t *)sin)[d]) : ((const float *)sin)[d];
    }
    for (int64_t d = 0; d < hd; d++) {
        const float swapped = x[d < half ? d + half : d - half];
        if (bf16) {
            const float xc = bf16_to_f32(f32_to_bf16(x[d] * c[d]));
            ((uint16_t *)dst)[d] = f32_to_bf16(fmaf(swapped, s[d], xc));
        } else {
            ((float *)dst)[d] = fmaf(swapped, s[d], x[d] * c[d]);
        }
    }
}

/* RMSNorm of one head from `src` into `dst` (may alias: read first): x * rsqrt(mean(x^2) + eps)
 * * w, fp32 math, one rounding to the dtype, as _fused.add_rms_norm (torch's rsqrt as 1 / sqrt,
 * then two fp32 products). */
INLINE void rms_norm_head(char *dst, const char *src, const char *w, int bf16, float eps,
                          int64_t hd) {
    float x[MAX_HEAD_DIM] __attribute__((aligned(64))), ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < hd; d++) {
        x[d] = bf16 ? bf16_to_f32(((const uint16_t *)src)[d]) : ((const float *)src)[d];
        ss += x[d] * x[d];
    }
    const float inv = 1.0f / sqrtf(ss / (float)hd + eps);
    for (int64_t d = 0; d < hd; d++) {
        const float wd = bf16 ? bf16_to_f32(((const uint16_t *)w)[d]) : ((const float *)w)[d];
        const float y = (x[d] * inv) * wd;
        if (bf16) ((uint16_t *)dst)[d] = f32_to_bf16(y);
        else ((float *)dst)[d] = y;
    }
}

/* decode_rope's part of one (row, KV head): normalise (q_norm, k_norm, when given) and rotate
 * the group's query heads in place, normalise and rotate K into the row's slot, copy V there. */
INLINE void rope_write_row(const Args *a, int64_t r, int64_t kvh) {
    const int64_t group = a->heads / a->kv_heads, hd = a->head_dim;
    const int64_t esz = a->bf16 ? 2 : 4, tok_stride = a->kv_heads * hd;
    const int64_t half = a->num_blocks * a->block_size * tok_stride;
    char *row = (char *)a->q + r * a->q_row_stride * esz; /* [heads + 2 kv_heads, hd] */
    const int64_t table_row = a->positions[r] * hd * esz;
    const char *cos = a->cos + table_row, *sin = a->sin + table_row;
    for (int64_t g = 0; g < group; g++) {
        char *head = row + (kvh * group + g) * hd * esz;
        if (a->q_norm != NULL) rms_norm_head(head, head, a->q_norm, a->bf16, a->norm_eps, hd);
        rope_head(head, head, cos, sin, a->bf16, hd);
    }
    char *kv = (char *)a->kv;
    const int64_t at = (a->slots[r] * a->kv_heads + kvh) * hd * esz;
    const char *k = row + (a->heads + kvh) * hd * esz;
    float normed[MAX_HEAD_DIM] __attribute__((aligned(64))); /* hd elements of the dtype */
    if (a->k_norm != NULL) {
        rms_norm_head((char *)normed, k, a->k_norm, a->bf16, a->norm_eps, hd);
        k = (const char *)normed; /* qkv's k stays as the projection left it */
    }
    rope_head(kv + at, k, cos, sin, a->bf16, hd);
    const char *v = row + (a->heads + a->kv_heads + kvh) * hd * esz;
    memcpy(kv + half * esz + at, v, (size_t)(hd * esz));
}

/* decode_rope's writes of one (request, KV head): every row of the request, before any of its
 * queries attends (a query sees the request's new tokens before it). */
INLINE void rope_write_item(const Args *a, int64_t seq, int64_t kvh) {
    const int64_t first = first_row(a, seq), end = first + num_rows(a, seq);
    for (int64_t r = first; r < end; r++) rope_write_row(a, r, kvh);
}

/* The bodies compiled once per instruction set, head_dim 64 and 128 (most models) specialised.
 * Several rows per request take a function of their own, so that the one-row kernel's code (and
 * speed) stays what it was. */
#define KERNEL(NAME, ATTR)                                                                      \
    ATTR __attribute__((noinline)) static void NAME##_rows(const Args *a, int64_t seq,          \
                                                           int64_t kvh) {                       \
        if (a->head_dim == 64) rows_body(a, seq, kvh, 64);                                      \
        else if (a->head_dim == 128) rows_body(a, seq, kvh, 128);                               \
        else rows_body(a, seq, kvh, a->head_dim);                                               \
    }                                                                                           \
    ATTR static void NAME(const Args *a, int64_t seq, int64_t kvh) {                            \
        if (a->positions != NULL) rope_write_item(a, seq, kvh);                                 \
        if (num_rows(a, seq) > 1) {                                                             \
            NAME##_rows(a, seq, kvh);                                                           \
            return;                                                                             \
        }                                                                                       \
        const int64_t r = first_row(a, seq);                                                    \
        if (a->head_dim == 64) attend_one(a, seq, r, kvh, 64);                                  \
        else if (a->head_dim == 128) attend_one(a, seq, r, kvh, 128);                           \
        else attend_one(a, seq, r, kvh, a->head_dim);                                           \
    }

typedef void (*item_fn)(const Args *, int64_t, int64_t);

KERNEL(item_plain, )
#if defined(__x86_64__) && defined(__GNUC__)
KERNEL(item_avx2, __attribute__((target("avx2,fma"))))
KERNEL(item_avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))))
#endif

static item_fn pick_kernel(const char **name) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl")) {
        *name = "avx512";
        return item_avx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        *name = "avx2";
        return item_avx2;
    }
#endif
    *name = "plain";
    return item_plain;
}

static item_fn KERNEL_FN; /* chosen once at import, read-only afterwards */

static void run_items(const Args *a, int threads) {
    const int64_t items = a->num_seqs * a->kv_heads;
    int64_t tokens = 0; /* the (query row, token) pairs scored: each row's visible tokens */
    for (int64_t i = 0; i < a->num_seqs; i++) {
        const int64_t rows = num_rows(a, i);
        for (int64_t j = 0; j < rows; j++) {
            int64_t lo, hi;
            visible(a, a->ctx_lens[i], rows, j, &lo, &hi);
            tokens += hi - lo;
        }
    }
    if (threads <= 1 || items < 2 || tokens < PARALLEL_MIN_TOKENS) {
        for (int64_t i = 0; i < items; i++) KERNEL_FN(a, i / a->kv_heads, i % a->kv_heads);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t i = 0; i < items; i++) KERNEL_FN(a, i / a->kv_heads, i % a->kv_heads);
}

/* Each request's query rows: q_starts[0] = 0, 1 <= q_starts[i + 1] - q_starts[i] <= ctx_lens[i]
 * (a query sees at least its own token); 0 on success. */
static int check_rows(const int64_t *q_starts, const int64_t *ctx_lens, int64_t num_seqs) {
    if (num_seqs > 0 && q_starts[0] != 0) {
        PyErr_Format(PyExc_ValueError, "q_starts[0] is 0, got %lld", (long long)q_starts[0]);
        return -1;
    }
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t rows = q_starts[i + 1] - q_starts[i];
        if (rows < 1 || rows > ctx_lens[i]) {
            PyErr_Format(PyExc_ValueError,
                         "request %lld has %lld query rows and %lld keys: each request has 1 to "
                         "ctx_len query rows", (long long)i, (long long)rows,
                         (long long)ctx_lens[i]);
            return -1;
        }
    }
    return 0;
}

/* Parses decode's 17 arguments + window, q_starts, or decode_rope's 21 + window, q_norm, k_norm,
 * norm_eps, q_starts (the trailing ones optional), into `a`; 0 on success. */
static int parse_args(PyObject *args, Args *a, int *threads, int rope) {
    unsigned long long q, kv, tables, ctx_lens, out, positions = 0, cos = 0, sin = 0, slots = 0,
        q_norm = 0, k_norm = 0, q_starts = 0;
    long long q_row_stride, table_stride, out_row_stride, num_seqs, heads, kv_heads, head_dim,
        num_blocks, block_size, window = 0;
    int bf16;
    float scale, norm_eps = 0.0f;
    const int ok = rope
        ? PyArg_ParseTuple(args, "KLKKLKKLLLLLLLpfiKKKK|LKKfK", &q, &q_row_stride, &kv, &tables,
                           &table_stride, &ctx_lens, &out, &out_row_stride, &num_seqs, &heads,
                           &kv_heads, &head_dim, &num_blocks, &block_size, &bf16, &scale, threads,
                           &positions, &cos, &sin, &slots, &window, &q_norm, &k_norm, &norm_eps,
                           &q_starts)
        : PyArg_ParseTuple(args, "KLKKLKKLLLLLLLpfi|LK", &q, &q_row_stride, &kv, &tables,
                           &table_stride, &ctx_lens, &out, &out_row_stride, &num_seqs, &heads,
                           &kv_heads, &head_dim, &num_blocks, &block_size, &bf16, &scale, threads,
                           &window, &q_starts);
    if (!ok) return -1;
    if (window < 0) {
        PyErr_Format(PyExc_ValueError, "a sliding window is >= 0 tokens (0 = none), got %lld",
                     window);
        return -1;
    }
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP
        || head_dim <= 0 || head_dim > MAX_HEAD_DIM || (rope && head_dim % 2 != 0)
        || block_size <= 0 || num_seqs < 0) {
        PyErr_Format(PyExc_ValueError,
                     "paged decode attention supports a head_dim <= %d (even with RoPE) and <= "
                     "%d query heads per KV head (got heads=%lld kv_heads=%lld head_dim=%lld "
                     "block_size=%lld)", MAX_HEAD_DIM, MAX_GROUP, heads, kv_heads, head_dim,
                     block_size);
        return -1;
    }
    *a = (Args){(const char *)(uintptr_t)q, q_row_stride, (const char *)(uintptr_t)kv,
                (const int64_t *)(uintptr_t)tables, table_stride,
                (const int64_t *)(uintptr_t)ctx_lens, (char *)(uintptr_t)out, out_row_stride,
                num_seqs, heads, kv_heads, head_dim, num_blocks, block_size, bf16, scale,
                (const int64_t *)(uintptr_t)positions, (const int64_t *)(uintptr_t)slots,
                (const char *)(uintptr_t)cos, (const char *)(uintptr_t)sin, window,
                (const char *)(uintptr_t)q_norm, (const char *)(uintptr_t)k_norm, norm_eps,
                (const int64_t *)(uintptr_t)q_starts};
    if (a->q_starts != NULL) return check_rows(a->q_starts, a->ctx_lens, num_seqs);
    return 0;
}

static PyObject *run(PyObject *args, int rope) {
    Args a;
    int threads;
    if (parse_args(args, &a, &threads, rope) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    run_items(&a, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    (void)self;
    return run(args, 0);
}

static PyObject *decode_rope(PyObject *self, PyObject *args) {
    (void)self;
    return run(args, 1);
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "Paged decode attention over one layer's cache, in place."},
    {"decode_rope", decode_rope, METH_VARARGS,
     "RoPE on q and k, k and v into their slots, then paged decode attention (one layer)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_attn", NULL, -1, methods};

PyMODINIT_FUNC PyInit__paged_attn(void) {
    const char *isa;
    KERNEL_FN = pick_kernel(&isa);
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "ISA", isa) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
