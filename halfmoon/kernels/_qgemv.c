/*
 * kernels._qgemv: weight-only int4 (Q4_1 blocks) and int8 (per output channel) matrix products
 * for a few activation rows (decode), AVX2 + FMA + F16C when the CPU has them, plain C otherwise.
 *
 * torch's CPU kernels for these formats (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)
 * convert every weight to float and multiply in float: on an AVX2 CPU they stream packed weights
 * at ~6 GB/s, compute bound. Here, as in llama.cpp, each activation row is quantized once per
 * call to int8 in blocks of 32 (scale = max |x| / 127, round to nearest even), and each block's
 * dot product is done in integers (`_mm256_maddubs_epi16`: u8 x s8 pairs summed to s16, then
 * `_mm256_madd_epi16` to s32), one float multiply-add per 32 weights:
 *
 *   Q4_1 block b of row n, x block b of row m:
 *     sum_j (d * q_j + mn) * x_j  ~=  d * dx * sum_j q_j * xq_j  +  mn * sum_j x_j
 *   (the minimum's term uses the exact float sum of the block, so the only approximation is
 *   x_j ~= dx * xq_j: at most dx / 2 = max|x_block| / 254 per element.)
 *
 *   int8 row n (w = s[n] * qw): y = s[n] * sum_b dx_b * sum_j qw_j * xq_j
 *   (qw in -127..127: |qw|, sign(xq, qw) keep maddubs' s16 pair sums below 2 * 127 * 127.)
 *
 * Layouts (kernels/quant_linear.py builds them):
 *   q4: uint8 [N, 20 * K / 32], a row's Q4_1 blocks split into three runs (nb = K / 32):
 *       | nibbles: nb x 16 bytes | d: nb x fp16 | m: nb x fp16 |
 *       In a block's 16 bytes element j < 16 is the low nibble of byte j, element j + 16 its high
 *       nibble (GGUF's order). The runs let 8 blocks' scales load as one vector: the integer
 *       sums of 8 blocks are reduced into one vector (hadd) and scaled by one multiply-add.
 *   q8: int8 [N, K] row-major, fp32 scale [N].
 *   bf16: bf16 [N, K] row-major (any K).
 *   x:  M rows of K fp32 or bf16, row stride x_stride elements (a strided view is fine).
 *   y:  M rows of N fp32 or bf16, row stride y_stride elements.
 *
 * bf16 weights (kernels/linear.py, kind "bf16-native", for CPUs whose oneDNN has no bf16 path):
 * no quantization of the activations. They are copied once per call to fp32 (bf16 ones exactly),
 * and each weight is widened to fp32 in registers (a bf16 is the high half of its fp32) and
 * multiplied in fp32 FMAs: the only roundings are fp32 accumulation and, for a bf16 output, its
 * round to nearest even. AVX2 widens 16 weights with two integer ops and no shuffle: read as 8
 * 32-bit lanes, `lane << 16` is the even element and `lane & 0xFFFF0000` the odd one, so the
 * activation copy is stored in the same order, per 16: | x0 x2 .. x14 | x1 x3 .. x15 |. A weight
 * tile of NR rows is read once for MR activation rows (registers: MR x NR accumulators, 2 x NR
 * widened weights, 2 activations).
 *
 * Output rows are split across OpenMP threads. The extension is linked against libgomp.so.1, the
 * soname torch's wheel ships its own libgomp under, and is imported after torch: the dynamic
 * loader then binds it to torch's already loaded runtime, so the kernels run on torch's thread
 * pool (torch.set_num_threads applies) instead of a second pool fighting it for the cores.
 * The GIL is released while the kernel runs.
 *
 *   q4_mm(x, x_bf16, x_stride, M, K, w, N, y, y_bf16, y_stride[, plain]) -> None  (addresses as ints)
 *   q8_mm(x, x_bf16, x_stride, M, K, w, scale, N, y, y_bf16, y_stride[, plain]) -> None
 *   bf16_mm(x, x_bf16, x_stride, M, K, w, N, y, y_bf16, y_stride[, plain]) -> None
 *   (plain=True runs the plain C kernel even where AVX2 is there: tests compare the two)
 *   kernel() -> 'avx2' or 'plain'
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HM_X86 1
#endif

#define QK 32         /* weights per block */
#define Q4_BYTES 20   /* fp16 d, fp16 m, 16 bytes of nibbles */
#define MR 4          /* activation rows one pass over a weight row serves */
#define PAR_MIN 32768 /* fewer weights than this: one thread (the fork costs more) */
#define BF_MR 4       /* bf16: activation rows one pass over a weight tile serves */
#define BF_NR 4       /* bf16: most weight rows in a tile (4 for one activation row, else 2) */

/* ---------------------------------------------------------------- scalar helpers */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalize */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((bits >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* One activation row as int8 blocks: xq[K], dx[K/32] (scale), sx[K/32] (float sum). */
typedef struct {
    int8_t *q;
    float *d;
    float *s;
} QRow;

static void quantize_row(const void *x, int bf16, int64_t k, QRow r) {
    float tmp[QK];
    for (int64_t b = 0; b < k / QK; b++) {
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < QK; j++) {
            float v = bf16 ? bf16_to_float(((const uint16_t *)x)[b * QK + j]) : ((const float *)x)[b * QK + j];
            tmp[j] = v;
            sum += v;
            amax = fmaxf(amax, fabsf(v));
        }
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < QK; j++)
            r.q[b * QK + j] = (int8_t)lrintf(tmp[j] * id);
        r.d[b] = d;
        r.s[b] = sum;
    }
}

static inline void store_out(void *y, int bf16, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)y)[i] = float_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* ---------------------------------------------------------------- plain C kernels */

static void q4_row_plain(const uint8_t *w, int64_t nb, const QRow *xr, int mr, float *out) {
    const uint8_t *ds = w + nb * 16, *ms = ds + nb * 2;
    for (int r = 0; r < mr; r++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *nib = w + b * 16;
            const int8_t *xq = xr[r].q + b * QK;
            int32_t dot = 0;
            for (int j = 0; j < 16; j++)
                dot += (nib[j] & 0x0F) * xq[j] + (nib[j] >> 4) * xq[j + 16];
            acc += half_to_float(load_u16(ds + 2 * b)) * xr[r].d[b] * (float)dot +
                   half_to_float(load_u16(ms + 2 * b)) * xr[r].s[b];
        }
        out[r] = acc;
    }
}

static void q8_row_plain(const int8_t *w, float scale, int64_t nb, const QRow *xr, int mr, float *out) {
    for (int r = 0; r < mr; r++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int32_t dot = 0;
            for (int j = 0; j < QK; j++)
                dot += w[b * QK + j] * xr[r].q[b * QK + j];
            acc += xr[r].d[b] * (float)dot;
        }
        out[r] = acc * scale;
    }
}

/* out[r * BF_NR + j] = x row r . w row j, for mr activation rows (fp32, natural order, row
   stride xs) and nr bf16 weight rows of k. */
static void bf16_tile_plain(const uint16_t *w, int64_t k, const float *x, int64_t xs, int mr, int nr, float *out) {
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++)
                acc += bf16_to_float(w[j * k + i]) * x[r * xs + i];
            out[r * BF_NR + j] = acc;
        }
}

/* ---------------------------------------------------------------- AVX2 kernels */

#ifdef HM_X86
#define HM_AVX2 __attribute__((target("avx2,fma,f16c")))

HM_AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 values 0..15 from 16 bytes: the bytes in both halves (a broadcast load), the high half
   shifted right by 4, both masked; no shuffle uop. */
HM_AVX2 static inline __m256i unpack_q4(const uint8_t *nib) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)nib));
    return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
}

/* s32 sums of 32 u8 x s8 products, 8 lanes. */
HM_AVX2 static inline __m256i dot_u8s8(__m256i q, const int8_t *x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)x)), _mm256_set1_epi16(1));
}

/* [sum(p0) .. sum(p7)]: each p's 8 lanes added. */
HM_AVX2 static inline __m256i reduce8(__m256i p0, __m256i p1, __m256i p2, __m256i p3, __m256i p4, __m256i p5,
                                      __m256i p6, __m256i p7) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p4, p5), _mm256_hadd_epi32(p6, p7));
    /* a = [s0 s1 s2 s3 (low halves) | s0 s1 s2 s3 (high halves)], b likewise for 4..7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* mr is a compile-time constant at every call site (always_inline + switch): the accumulators
   stay in registers. Blocks go 8 at a time (one vector of scales), the rest one by one. */
HM_AVX2 static inline __attribute__((always_inline)) void
q4_row_avx2_n(const uint8_t *w, int64_t nb, const QRow *xr, const int mr, float *out) {
    const uint8_t *ds = w + nb * 16, *ms = ds + nb * 2;
    __m256 acc[MR];
    float tail[MR];
    for (int r = 0; r < mr; r++) {
        acc[r] = _mm256_setzero_ps();
        tail[r] = 0.0f;
    }
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const uint8_t *nib = w + b * 16;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ds + 2 * b)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ms + 2 * b)));
        const __m256i q0 = unpack_q4(nib), q1 = unpack_q4(nib + 16), q2 = unpack_q4(nib + 32),
                      q3 = unpack_q4(nib + 48), q4 = unpack_q4(nib + 64), q5 = unpack_q4(nib + 80),
                      q6 = unpack_q4(nib + 96), q7 = unpack_q4(nib + 112);
        for (int r = 0; r < mr; r++) {
            const int8_t *x = xr[r].q + b * QK;
            const __m256i s = reduce8(dot_u8s8(q0, x), dot_u8s8(q1, x + 32), dot_u8s8(q2, x + 64),
                                      dot_u8s8(q3, x + 96), dot_u8s8(q4, x + 128), dot_u8s8(q5, x + 160),
                                      dot_u8s8(q6, x + 192), dot_u8s8(q7, x + 224));
            const __m256 dd = _mm256_mul_ps(d, _mm256_loadu_ps(xr[r].d + b));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dd, acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xr[r].s + b), acc[r]);
        }
    }
    for (; b < nb; b++) {
        const __m256i q = unpack_q4(w + b * 16);
        const float d = _cvtsh_ss(load_u16(ds + 2 * b)), m = _cvtsh_ss(load_u16(ms + 2 * b));
        for (int r = 0; r < mr; r++) {
            const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(q, xr[r].q + b * QK));
            acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * xr[r].d[b]), acc[r]);
            tail[r] += m * xr[r].s[b];
        }
    }
    for (int r = 0; r < mr; r++)
        out[r] = hsum(acc[r]) + tail[r];
}

HM_AVX2 static void q4_row_avx2(const uint8_t *w, int64_t nb, const QRow *xr, int mr, float *out) {
    switch (mr) {
    case 1: q4_row_avx2_n(w, nb, xr, 1, out); break;
    case 2: q4_row_avx2_n(w, nb, xr, 2, out); break;
    case 3: q4_row_avx2_n(w, nb, xr, 3, out); break;
    default: q4_row_avx2_n(w, nb, xr, 4, out); break;
    }
}

HM_AVX2 static inline __attribute__((always_inline)) void
q8_row_avx2_n(const int8_t *w, float scale, int64_t nb, const QRow *xr, const int mr, float *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    for (int r = 0; r < mr; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i qw = _mm256_loadu_si256((const __m256i *)(w + b * QK));
        const __m256i aw = _mm256_sign_epi8(qw, qw);
        for (int r = 0; r < mr; r++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(xr[r].q + b * QK));
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xq, qw)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xr[r].d[b]), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++)
        out[r] = hsum(acc[r]) * scale;
}

HM_AVX2 static void q8_row_avx2(const int8_t *w, float scale, int64_t nb, const QRow *xr, int mr, float *out) {
    switch (mr) {
    case 1: q8_row_avx2_n(w, scale, nb, xr, 1, out); break;
    case 2: q8_row_avx2_n(w, scale, nb, xr, 2, out); break;
    case 3: q8_row_avx2_n(w, scale, nb, xr, 3, out); break;
    default: q8_row_avx2_n(w, scale, nb, xr, 4, out); break;
    }
}

/* bf16_tile_plain's product with x in the even/odd order (header), mr and nr compile-time
   constants at every call site. The last k % 16 elements (natural order) go one by one. The
   next tile's rows are prefetched: a tile is nr short rows (1-3 KB) read side by side, which the
   hardware prefetcher follows poorly (measured 11.5 -> 16 GB/s at one activation row). */
HM_AVX2 static inline __attribute__((always_inline)) void
bf16_tile_avx2_n(const uint16_t *w, int64_t k, const float *x, int64_t xs, const int mr, const int nr, float *out) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    const int64_t k16 = k & ~(int64_t)15;
    __m256 acc[BF_MR][BF_NR];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++)
            acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k16; i += 16) {
        __m256 even[BF_NR], odd[BF_NR];
        for (int j = 0; j < nr; j++) {
            /* the next tile's row j (past the last tile: a prefetch never faults) */
            _mm_prefetch((const char *)(w + (nr + j) * k + i), _MM_HINT_T0);
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + j * k + i));
            even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            odd[j] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        }
        for (int r = 0; r < mr; r++) {
            const __m256 xe = _mm256_loadu_ps(x + r * xs + i), xo = _mm256_loadu_ps(x + r * xs + i + 8);
            for (int j = 0; j < nr; j++)
                acc[r][j] = _mm256_fmadd_ps(odd[j], xo, _mm256_fmadd_ps(even[j], xe, acc[r][j]));
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++) {
            float t = hsum(acc[r][j]);
            for (int64_t i = k16; i < k; i++)
                t += bf16_to_float(w[j * k + i]) * x[r * xs + i];
            out[r * BF_NR + j] = t;
        }
}

#define BF16_TILE(mr, nr) \
    case (mr) * 8 + (nr): bf16_tile_avx2_n(w, k, x, xs, mr, nr, out); break
HM_AVX2 static void bf16_tile_avx2(const uint16_t *w, int64_t k, const float *x, int64_t xs, int mr, int nr,
                                   float *out) {
    switch (mr * 8 + nr) { /* the tiles run_bf16 asks for: nr 1..4 with mr 1, 1..2 otherwise */
    BF16_TILE(1, 1); BF16_TILE(1, 2); BF16_TILE(1, 3); BF16_TILE(1, 4);
    BF16_TILE(2, 1); BF16_TILE(2, 2); BF16_TILE(3, 1); BF16_TILE(3, 2);
    BF16_TILE(4, 1); BF16_TILE(4, 2);
    default: abort(); /* a tile run_bf16 never asks for */
    }
}
#undef BF16_TILE
#endif

static int use_avx2(void) {
#ifdef HM_X86
    static int cached = -1;
    if (cached < 0)
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    return cached;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------- the products */

typedef struct {
    const void *x;
    int x_bf16;
    int64_t x_stride, m, k;
    const void *w;      /* q4 blocks or q8 values */
    const float *scale; /* q8 only */
    int64_t n;
    void *y;
    int y_bf16;
    int64_t y_stride;
    int plain; /* 1: the plain C kernel even where AVX2 is there (tests compare the two) */
} Problem;

/* Quantize all M rows into one allocation; returns NULL when out of memory. */
static void *quantize_rows(const Problem *p, QRow *rows) {
    int64_t nb = p->k / QK;
    size_t per_row = (size_t)p->k + 2 * sizeof(float) * (size_t)nb;
    char *buf = malloc(per_row * (size_t)p->m + 64);
    if (buf == NULL)
        return NULL;
    size_t elem = p->x_bf16 ? 2 : 4;
    for (int64_t i = 0; i < p->m; i++) {
        char *base = buf + per_row * (size_t)i;
        rows[i].d = (float *)base;
        rows[i].s = rows[i].d + nb;
        rows[i].q = (int8_t *)(rows[i].s + nb);
        quantize_row((const char *)p->x + (size_t)i * (size_t)p->x_stride * elem, p->x_bf16, p->k, rows[i]);
    }
    return buf;
}

static void run(const Problem *p, int q4) {
    const int64_t nb = p->k / QK;
    QRow *rows = malloc(sizeof(QRow) * (size_t)p->m);
    void *buf = rows ? quantize_rows(p, rows) : NULL;
    if (buf == NULL) { /* caller checked sizes; a failed small malloc means the process is dying */
        free(rows);
        abort();
    }
    const int avx2 = use_avx2() && !p->plain;
    const int64_t row_bytes = q4 ? nb * Q4_BYTES : p->k;
#pragma omp parallel for schedule(static) if (p->n * p->k >= PAR_MIN)
    for (int64_t n = 0; n < p->n; n++) {
        const uint8_t *w = (const uint8_t *)p->w + n * row_bytes;
        float out[MR];
        for (int64_t m0 = 0; m0 < p->m; m0 += MR) {
            int mr = (int)(p->m - m0 < MR ? p->m - m0 : MR);
#ifdef HM_X86
            if (avx2) {
                if (q4)
                    q4_row_avx2(w, nb, rows + m0, mr, out);
                else
                    q8_row_avx2((const int8_t *)w, p->scale[n], nb, rows + m0, mr, out);
            } else
#endif
            {
                (void)avx2;
                if (q4)
                    q4_row_plain(w, nb, rows + m0, mr, out);
                else
                    q8_row_plain((const int8_t *)w, p->scale[n], nb, rows + m0, mr, out);
            }
            for (int r = 0; r < mr; r++)
                store_out(p->y, p->y_bf16, (m0 + r) * p->y_stride + n, out[r]);
        }
    }
    free(buf);
    free(rows);
}

/* The M activation rows as fp32 (bf16 ones exactly), row stride xs, in the AVX2 kernel's
   even/odd order per 16 elements (header) when `interleave`; NULL when out of memory. */
static float *widen_rows(const Problem *p, int64_t xs, int interleave) {
    float *buf = malloc(sizeof(float) * (size_t)xs * (size_t)p->m);
    if (buf == NULL)
        return NULL;
    const int64_t k16 = interleave ? p->k & ~(int64_t)15 : 0;
    for (int64_t r = 0; r < p->m; r++) {
        const char *src = (const char *)p->x + (size_t)(r * p->x_stride) * (p->x_bf16 ? 2 : 4);
        float *dst = buf + r * xs;
        for (int64_t i = 0; i < p->k; i++) {
            const float v = p->x_bf16 ? bf16_to_float(((const uint16_t *)src)[i]) : ((const float *)src)[i];
            dst[i < k16 ? (i & ~(int64_t)15) + (i & 1) * 8 + ((i & 15) >> 1) : i] = v;
        }
    }
    return buf;
}

/* Weight tiles of nr rows split across threads; each tile is read from memory once and from L1
   once per BF_MR activation rows, the activations from L1/L2. */
static void run_bf16(const Problem *p) {
    const int avx2 = use_avx2() && !p->plain;
    const int64_t xs = (p->k + 7) & ~(int64_t)7;
    float *x = widen_rows(p, xs, avx2);
    if (x == NULL) /* M x K floats (KBs at decode): as in run(), the process is dying */
        abort();
    const int nr = p->m == 1 ? 4 : 2; /* one row: more weight rows in flight; more: more activations */
    const int64_t tiles = (p->n + nr - 1) / nr;
#pragma omp parallel for schedule(static) if (p->n * p->k >= PAR_MIN)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * nr;
        const int nt = (int)(p->n - n0 < nr ? p->n - n0 : nr);
        const uint16_t *w = (const uint16_t *)p->w + n0 * p->k;
        float out[BF_MR * BF_NR];
        for (int64_t m0 = 0; m0 < p->m; m0 += BF_MR) {
            const int mr = (int)(p->m - m0 < BF_MR ? p->m - m0 : BF_MR);
#ifdef HM_X86
            if (avx2)
                bf16_tile_avx2(w, p->k, x + m0 * xs, xs, mr, nt, out);
            else
#endif
                bf16_tile_plain(w, p->k, x + m0 * xs, xs, mr, nt, out);
            for (int r = 0; r < mr; r++)
                for (int j = 0; j < nt; j++)
                    store_out(p->y, p->y_bf16, (m0 + r) * p->y_stride + n0 + j, out[r * BF_NR + j]);
        }
    }
    free(x);
}

/* k_multiple: what K must be a multiple of (QK for the block formats, 1 for bf16). */
static int check(const Problem *p, int k_multiple) {
    if (p->m <= 0 || p->n <= 0 || p->k <= 0 || p->k % k_multiple != 0) {
        PyErr_Format(PyExc_ValueError, "bad shape: M=%lld N=%lld K=%lld (K a multiple of %d)",
                     (long long)p->m, (long long)p->n, (long long)p->k, k_multiple);
        return -1;
    }
    if (p->x_stride < p->k || p->y_stride < p->n) {
        PyErr_SetString(PyExc_ValueError, "row strides must be at least the row lengths");
        return -1;
    }
    if (!p->x || !p->w || !p->y) {
        PyErr_SetString(PyExc_ValueError, "null data pointer");
        return -1;
    }
    return 0;
}

/* The arguments q4_mm and bf16_mm share (x, x_bf16, x_stride, M, K, w, N, y, y_bf16, y_stride
 * [, plain]) into p, checked with K a multiple of k_multiple; -1 with the Python error set. */
static int parse_xwy(PyObject *args, Problem *p, int k_multiple) {
    unsigned long long x, w, y;
    if (!PyArg_ParseTuple(args, "KiLLLKLKiL|p", &x, &p->x_bf16, &p->x_stride, &p->m, &p->k, &w, &p->n, &y,
                          &p->y_bf16, &p->y_stride, &p->plain))
        return -1;
    p->x = (const void *)(uintptr_t)x;
    p->w = (const void *)(uintptr_t)w;
    p->y = (void *)(uintptr_t)y;
    return check(p, k_multiple);
}

static PyObject *py_q4_mm(PyObject *self, PyObject *args) {
    Problem p = {0};
    if (parse_xwy(args, &p, QK) != 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    run(&p, 1);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_q8_mm(PyObject *self, PyObject *args) {
    Problem p = {0};
    unsigned long long x, w, s, y;
    if (!PyArg_ParseTuple(args, "KiLLLKKLKiL|p", &x, &p.x_bf16, &p.x_stride, &p.m, &p.k, &w, &s, &p.n, &y,
                          &p.y_bf16, &p.y_stride, &p.plain))
        return NULL;
    p.x = (const void *)(uintptr_t)x;
    p.w = (const void *)(uintptr_t)w;
    p.scale = (const float *)(uintptr_t)s;
    p.y = (void *)(uintptr_t)y;
    if (check(&p, QK) != 0)
        return NULL;
    if (!p.scale) {
        PyErr_SetString(PyExc_ValueError, "null scale pointer");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    run(&p, 0);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_bf16_mm(PyObject *self, PyObject *args) {
    Problem p = {0};
    if (parse_xwy(args, &p, 1) != 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    run_bf16(&p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_kernel(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(use_avx2() ? "avx2" : "plain");
}

static PyMethodDef methods[] = {
    {"q4_mm", py_q4_mm, METH_VARARGS,
     "q4_mm(x, x_bf16, x_stride, M, K, w, N, y, y_bf16, y_stride): y[M, N] = x[M, K] @ W.T, W in "
     "Q4_1 blocks [N, K/32, 20] (addresses as ints; the caller keeps the tensors alive)."},
    {"q8_mm", py_q8_mm, METH_VARARGS,
     "q8_mm(x, x_bf16, x_stride, M, K, w, scale, N, y, y_bf16, y_stride): y = x @ (scale[:, None] * "
     "W).T, W int8 [N, K]."},
    {"bf16_mm", py_bf16_mm, METH_VARARGS,
     "bf16_mm(x, x_bf16, x_stride, M, K, w, N, y, y_bf16, y_stride): y[M, N] = x[M, K] @ W.T, W bf16 [N, K] "
     "widened to fp32, fp32 accumulation, x used exactly."},
    {"kernel", py_kernel, METH_NOARGS, "kernel() -> 'avx2' or 'plain': the path this CPU runs."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kernels._qgemv",
    "Weight-only int4/int8 and bf16-weight products for a few activation rows (kernels/quant_linear.py, "
    "kernels/linear.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__qgemv(void) { return PyModule_Create(&module); }
