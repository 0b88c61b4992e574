/*
 * kernels._fused: a decode step's elementwise glue, one call each instead of a string of torch ops.
 *
 * At batch 1-32 a decoder layer's norms and activation are a few thousand elements each, so
 * torch's cost is the dispatch of every op, not the arithmetic: F.rms_norm alone is ~20 ATen ops
 * in this torch (upcast, pow, mean, add, rsqrt, mul, mul, downcast). Here each is one pass over
 * the rows, in fp32, rounding to bf16 exactly where the torch composition rounds:
 *
 *   add_rms_norm(x, x_stride, delta, delta_stride, weight, out, out_stride, rows, n, bf16, eps)
 *       when delta != 0:  x[r] += delta[r]           (rounded to the dtype: torch's `x += delta`)
 *       out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * weight
 *       (fp32 math, one rounding at the end: what F.rms_norm does for bf16 inputs)
 *       with delta == 0, x is only read: a plain RMSNorm of x into out (kernels/fused.py's
 *       DecodeStep.rms_norm)
 *   silu_mul(gate_up, gu_stride, out, out_stride, rows, n, bf16)
 *       out[r] = silu(gate_up[r, :n]) * gate_up[r, n:2n]
 *       (silu rounded to the dtype before the product: F.silu(gate) then mul_(up))
 *       ~2x cheaper than the torch ops for one or two rows of 1536, dearer from ~4 (bf16) or ~8
 *       (fp32) rows on: ATen's e^x loop is faster than this one, so kernels/fused.py calls it
 *       only for a few rows.
 *   gelu_tanh_mul(gate_up, gu_stride, out, out_stride, rows, n, bf16)
 *       out[r] = gelu_tanh(gate_up[r, :n]) * gate_up[r, n:2n]   (Gemma's gated MLP)
 *       gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), torch's
 *       F.gelu(x, approximate="tanh"), computed as the identical x / (1 + e^(-2 sqrt(2/pi)
 *       (x + 0.044715 x^3))) with the e^x below (rounded to the dtype before the product, as
 *       F.gelu then mul_(up)); kernels/fused.py calls it, as silu_mul, only for a few rows.
 *
 *   mask_by_bits(logits, logits_stride, bits, bits_stride, rows, n)
 *       logits[r][t] = -inf wherever bit t of bits[r] (int32 words, bit t % 32 of word t / 32:
 *       llguidance's token bitmask) is 0, fp32 logits, t < n. A word of all ones is skipped and one
 *       of zeros written as 32 -inf at once: a grammar's mask is mostly one or the other, so a
 *       32-row step costs a pass over the words, not an unpack of every bit (engine/grammar.py).
 *
 * Arguments are addresses (tensor.data_ptr()) and element strides of rows; bf16: every tensor is
 * bfloat16 (else float32). The sum of squares and e^x are this file's own (a different order and
 * polynomial than ATen's), so fp32 results agree with torch to a few ulp, bf16 ones to the bf16
 * rounding of those (occasionally one bf16 ulp). The GIL is released; one thread (a few rows).
 *
 * AVX-512, or AVX2 + FMA, when the CPU has them (the same C compiled for each and chosen at
 * import, as in _paged_attn.c); plain C otherwise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#include "_expf.h"

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

INLINE uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    const uint32_t rounded = (c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16; /* to nearest even */
    const uint32_t quiet_nan = (c.u >> 16) | 0x40u;
    /* a select, not a branch, so that loops over rows vectorize */
    return (uint16_t)((c.u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

INLINE float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Stores v in the dtype; returns the stored value as fp32 (what a later op of torch would read). */
INLINE float store(void *p, int64_t i, float v, int bf16) {
    if (!bf16) {
        ((float *)p)[i] = v;
        return v;
    }
    const uint16_t h = f32_to_bf16(v);
    ((uint16_t *)p)[i] = h;
    return bf16_to_f32(h);
}

/* e^x, vectorizable (kernels/_expf.h); x is clamped to [-87, 88], so e^x never overflows to inf
 * nor goes denormal. */
INLINE float exp_clamped(float x) {
    return hm_exp_in_range(x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x));
}

typedef struct {
    char *x;
    int64_t x_stride;
    const char *delta;
    int64_t delta_stride;
    const char *weight;
    char *out;
    int64_t out_stride, rows, n;
    int bf16;
    float eps;
} NormArgs;

/* `bf16` is a constant where add_rms_norm_body inlines this: each dtype gets its own loops. */
INLINE void add_rms_norm_typed(const NormArgs *a, const int bf16) {
    const int64_t esz = bf16 ? 2 : 4, n = a->n;
    for (int64_t r = 0; r < a->rows; r++) {
        char *x = a->x + r * a->x_stride * esz;
        float ss = 0.0f;
        if (a->delta != NULL) {
            const char *d = a->delta + r * a->delta_stride * esz;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) {
                const float v = store(x, i, load(x, i, bf16) + load(d, i, bf16), bf16);
                ss += v * v;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) {
                const float v = load(x, i, bf16);
                ss += v * v;
            }
        }
        /* torch: rsqrt(mean + eps) as 1 / sqrt, then (x * rsqrt) * w: two fp32 products */
        const float inv = 1.0f / sqrtf(ss / (float)n + a->eps);
        char *o = a->out + r * a->out_stride * esz;
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            store(o, i, (load(x, i, bf16) * inv) * load(a->weight, i, bf16), bf16);
    }
}

INLINE void add_rms_norm_body(const NormArgs *a) {
    if (a->bf16) add_rms_norm_typed(a, 1);
    else add_rms_norm_typed(a, 0);
}

typedef struct {
    const char *gate_up;
    int64_t gu_stride;
    char *out;
    int64_t out_stride, rows, n;
    int bf16;
} ActArgs;

INLINE void silu_mul_typed(const ActArgs *a, int64_t r, const int bf16) {
    const int64_t esz = bf16 ? 2 : 4, n = a->n;
    const char *g = a->gate_up + r * a->gu_stride * esz, *u = g + n * esz;
    char *o = a->out + r * a->out_stride * esz;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float x = load(g, i, bf16);
        float s = x / (1.0f + exp_clamped(-x));
        if (bf16) s = bf16_to_f32(f32_to_bf16(s));
        store(o, i, s * load(u, i, bf16), bf16);
    }
}

INLINE void silu_mul_row(const ActArgs *a, int64_t r) {
    if (a->bf16) silu_mul_typed(a, r, 1);
    else silu_mul_typed(a, r, 0);
}

/* 0.5 x (1 + tanh(y)) = x / (1 + e^(-2y)): the silu loop with the argument 2 y; e^x's clamp
 * makes x^3's overflow harmless (-2y = -inf: e^-87, the result x; +inf: e^88, the result ~0). */
INLINE void gelu_tanh_mul_typed(const ActArgs *a, int64_t r, const int bf16) {
    const int64_t esz = bf16 ? 2 : 4, n = a->n;
    const float two_beta = 2.0f * 0.7978845608028654f; /* 2 sqrt(2 / pi) */
    const char *g = a->gate_up + r * a->gu_stride * esz, *u = g + n * esz;
    char *o = a->out + r * a->out_stride * esz;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float x = load(g, i, bf16);
        const float y2 = two_beta * (x + 0.044715f * x * x * x);
        float s = x / (1.0f + exp_clamped(-y2));
        if (bf16) s = bf16_to_f32(f32_to_bf16(s));
        store(o, i, s * load(u, i, bf16), bf16);
    }
}

INLINE void gelu_tanh_mul_row(const ActArgs *a, int64_t r) {
    if (a->bf16) gelu_tanh_mul_typed(a, r, 1);
    else gelu_tanh_mul_typed(a, r, 0);
}

/* Each body compiled once per instruction set and picked at import. */
#define KERNELS(SUFFIX, ATTR)                                                                   \
    ATTR static void norm_##SUFFIX(const NormArgs *a) { add_rms_norm_body(a); }                 \
    ATTR static void act_##SUFFIX(const ActArgs *a, int64_t r) { silu_mul_row(a, r); }      \
    ATTR static void gelu_##SUFFIX(const ActArgs *a, int64_t r) { gelu_tanh_mul_row(a, r); }

typedef void (*norm_fn)(const NormArgs *);
typedef void (*act_fn)(const ActArgs *, int64_t);

KERNELS(plain, )
#if defined(__x86_64__) && defined(__GNUC__)
KERNELS(avx2, __attribute__((target("avx2,fma,f16c"))))
KERNELS(avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))))
#endif

/* chosen once at import, read-only afterwards */
static norm_fn NORM_FN;
static act_fn ACT_FN, GELU_FN;

static const char *pick_kernels(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl")) {
        NORM_FN = norm_avx512, ACT_FN = act_avx512, GELU_FN = gelu_avx512;
        return "avx512";
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        NORM_FN = norm_avx2, ACT_FN = act_avx2, GELU_FN = gelu_avx2;
        return "avx2";
    }
#endif
    NORM_FN = norm_plain, ACT_FN = act_plain, GELU_FN = gelu_plain;
    return "plain";
}

static int check_shape(long long rows, long long n) {
    if (rows < 0 || n <= 0) {
        PyErr_Format(PyExc_ValueError, "fused kernels need rows >= 0 and a row length > 0 (got "
                     "rows=%lld n=%lld)", rows, n);
        return -1;
    }
    return 0;
}

static PyObject *add_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, delta, weight, out;
    long long x_stride, delta_stride, out_stride, rows, n;
    int bf16;
    float eps;
    if (!PyArg_ParseTuple(args, "KLKLKKLLLpf", &x, &x_stride, &delta, &delta_stride, &weight,
                          &out, &out_stride, &rows, &n, &bf16, &eps)
        || check_shape(rows, n) < 0)
        return NULL;
    NormArgs a = {(char *)(uintptr_t)x, x_stride, (const char *)(uintptr_t)delta, delta_stride,
                  (const char *)(uintptr_t)weight, (char *)(uintptr_t)out, out_stride, rows, n,
                  bf16, eps};
    Py_BEGIN_ALLOW_THREADS
    NORM_FN(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* silu_mul and gelu_tanh_mul: the same arguments, `fn` per row. */
static PyObject *act_mul(PyObject *args, act_fn fn) {
    unsigned long long gate_up, out;
    long long gu_stride, out_stride, rows, n;
    int bf16;
    if (!PyArg_ParseTuple(args, "KLKLLLp", &gate_up, &gu_stride, &out, &out_stride, &rows, &n,
                          &bf16)
        || check_shape(rows, n) < 0)
        return NULL;
    ActArgs a = {(const char *)(uintptr_t)gate_up, gu_stride, (char *)(uintptr_t)out, out_stride,
                 rows, n, bf16};
    Py_BEGIN_ALLOW_THREADS
    for (int64_t r = 0; r < rows; r++) fn(&a, r);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *silu_mul(PyObject *self, PyObject *args) {
    (void)self;
    return act_mul(args, ACT_FN);
}

static PyObject *gelu_tanh_mul(PyObject *self, PyObject *args) {
    (void)self;
    return act_mul(args, GELU_FN);
}

static void mask_row(float *row, const int32_t *bits, int64_t n) {
    const int64_t words = (n + 31) / 32;
    for (int64_t w = 0; w < words; w++) {
        const uint32_t word = (uint32_t)bits[w];
        if (word == 0xffffffffu) continue;
        const int64_t start = w * 32, end = start + 32 < n ? start + 32 : n;
        if (word == 0) {
            for (int64_t t = start; t < end; t++) row[t] = -INFINITY;
            continue;
        }
        for (int64_t t = start; t < end; t++)
            if (!((word >> (t - start)) & 1u)) row[t] = -INFINITY;
    }
}

static PyObject *mask_by_bits(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long logits, bits;
    long long logits_stride, bits_stride, rows, n;
    if (!PyArg_ParseTuple(args, "KLKLLL", &logits, &logits_stride, &bits, &bits_stride, &rows, &n)
        || check_shape(rows, n) < 0)
        return NULL;
    if (bits_stride < (n + 31) / 32 || logits_stride < n) {
        PyErr_Format(PyExc_ValueError, "mask_by_bits: rows of %lld logits need %lld words and a "
                     "logits stride >= n (got %lld and %lld)", n, (n + 31) / 32, bits_stride,
                     logits_stride);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t r = 0; r < rows; r++)
        mask_row((float *)(uintptr_t)logits + r * logits_stride,
                 (const int32_t *)(uintptr_t)bits + r * bits_stride, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"mask_by_bits", mask_by_bits, METH_VARARGS,
     "logits[r][t] = -inf where bit t of the int32 words bits[r] is 0 (fp32, in place)."},
    {"add_rms_norm", add_rms_norm, METH_VARARGS,
     "x += delta (when given); out = rmsnorm(x) * weight, per row, in place."},
    {"silu_mul", silu_mul, METH_VARARGS, "out = silu(gate) * up for rows [gate | up], in place."},
    {"gelu_tanh_mul", gelu_tanh_mul, METH_VARARGS,
     "out = gelu_tanh(gate) * up for rows [gate | up], in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fused(void) {
    const char *isa = pick_kernels();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "ISA", isa) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
