/*
 * kvpool._copysum: copy a KV block and compute its chunk sums in the same pass.
 *
 * The host and disk tiers checksum every block they store and serve (kvpool/checksum.py,
 * "chunk-sum64"). In numpy that is a second full read of the block next to the copy; here each
 * 64-bit word is added to its chunk's sum while it is in a register on its way to the
 * destination, so a checksummed copy costs what a plain copy costs.
 *
 * On x86-64 the stores are non-temporal (they bypass the cache, like glibc's memcpy for large
 * copies): a block of a tier is not read again soon by this core, and streaming stores skip
 * the read-for-ownership of the destination. AVX2 when the CPU has it, SSE2 (always there on
 * x86-64) otherwise; plain C elsewhere or when the destination is not 16-byte aligned.
 *
 *   copy_sum(dst, src, sums, chunk_words) -> None
 *       dst: writable contiguous buffer; src: contiguous buffer of the same length, a multiple
 *       of 8 * chunk_words bytes; sums: writable buffer of len(src) / (8 * chunk_words) uint64.
 *       dst[:] = src[:]; sums[j] = sum of the little-endian uint64 words of chunk j, mod 2^64.
 *       The GIL is released during the copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HM_X86 1
#endif

/* Portable path: any alignment (memcpy of one word compiles to a plain load / store). */
static void copy_sum_plain(unsigned char *dst, const unsigned char *src, size_t chunks,
                           size_t chunk_words, uint64_t *sums) {
    for (size_t c = 0; c < chunks; c++) {
        uint64_t acc0 = 0, acc1 = 0;
        size_t i = 0;
        for (; i + 1 < chunk_words; i += 2) {
            uint64_t w0, w1;
            memcpy(&w0, src + 8 * i, 8);
            memcpy(&w1, src + 8 * i + 8, 8);
            memcpy(dst + 8 * i, &w0, 8);
            memcpy(dst + 8 * i + 8, &w1, 8);
            acc0 += w0;
            acc1 += w1;
        }
        if (i < chunk_words) {
            uint64_t w;
            memcpy(&w, src + 8 * i, 8);
            memcpy(dst + 8 * i, &w, 8);
            acc0 += w;
        }
        sums[c] = acc0 + acc1;
        src += 8 * chunk_words;
        dst += 8 * chunk_words;
    }
}

#ifdef HM_X86
/* SSE2, streaming stores: dst 16-byte aligned, chunk_words a multiple of 8 (one 64 B line). */
static void copy_sum_sse2(unsigned char *dst, const unsigned char *src, size_t chunks,
                          size_t chunk_words, uint64_t *sums) {
    for (size_t c = 0; c < chunks; c++) {
        const __m128i *s = (const __m128i *)(src + c * 8 * chunk_words);
        __m128i *d = (__m128i *)(dst + c * 8 * chunk_words);
        __m128i a0 = _mm_setzero_si128(), a1 = _mm_setzero_si128();
        for (size_t i = 0; i < chunk_words / 2; i += 4) {
            __m128i x0 = _mm_loadu_si128(s + i), x1 = _mm_loadu_si128(s + i + 1);
            __m128i x2 = _mm_loadu_si128(s + i + 2), x3 = _mm_loadu_si128(s + i + 3);
            _mm_stream_si128(d + i, x0);
            _mm_stream_si128(d + i + 1, x1);
            _mm_stream_si128(d + i + 2, x2);
            _mm_stream_si128(d + i + 3, x3);
            a0 = _mm_add_epi64(a0, _mm_add_epi64(x0, x2));
            a1 = _mm_add_epi64(a1, _mm_add_epi64(x1, x3));
        }
        uint64_t t[2];
        _mm_storeu_si128((__m128i *)t, _mm_add_epi64(a0, a1));
        sums[c] = t[0] + t[1];
    }
    _mm_sfence();
}

/* AVX2, streaming stores: dst 32-byte aligned, chunk_words a multiple of 8. */
__attribute__((target("avx2")))
static void copy_sum_avx2(unsigned char *dst, const unsigned char *src, size_t chunks,
                          size_t chunk_words, uint64_t *sums) {
    for (size_t c = 0; c < chunks; c++) {
        const __m256i *s = (const __m256i *)(src + c * 8 * chunk_words);
        __m256i *d = (__m256i *)(dst + c * 8 * chunk_words);
        __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
        for (size_t i = 0; i < chunk_words / 4; i += 2) {
            __m256i x0 = _mm256_loadu_si256(s + i), x1 = _mm256_loadu_si256(s + i + 1);
            _mm256_stream_si256(d + i, x0);
            _mm256_stream_si256(d + i + 1, x1);
            a0 = _mm256_add_epi64(a0, x0);
            a1 = _mm256_add_epi64(a1, x1);
        }
        uint64_t t[4];
        _mm256_storeu_si256((__m256i *)t, _mm256_add_epi64(a0, a1));
        sums[c] = t[0] + t[1] + t[2] + t[3];
    }
    _mm_sfence();
}
#endif

/* The fastest path the CPU, the alignment of dst and the chunk size allow. */
static const char *copy_sum(unsigned char *dst, const unsigned char *src, size_t chunks,
                            size_t chunk_words, uint64_t *sums) {
#ifdef HM_X86
    uintptr_t where = (uintptr_t)dst;
    if (chunk_words % 8 == 0 && where % 32 == 0 && __builtin_cpu_supports("avx2")) {
        copy_sum_avx2(dst, src, chunks, chunk_words, sums);
        return "avx2";
    }
    if (chunk_words % 8 == 0 && where % 16 == 0) {
        copy_sum_sse2(dst, src, chunks, chunk_words, sums);
        return "sse2";
    }
#endif
    copy_sum_plain(dst, src, chunks, chunk_words, sums);
    return "plain";
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous%s buffer", name,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

static PyObject *py_copy_sum(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj, *sums_obj;
    Py_ssize_t chunk_words;
    if (!PyArg_ParseTuple(args, "OOOn", &dst_obj, &src_obj, &sums_obj, &chunk_words))
        return NULL;
    Py_buffer dst, src, sums;
    if (get_buffer(dst_obj, &dst, 1, "dst") != 0)
        return NULL;
    if (get_buffer(src_obj, &src, 0, "src") != 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (get_buffer(sums_obj, &sums, 1, "sums") != 0) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t chunk_bytes = 8 * chunk_words;
    if (chunk_words <= 0 || src.len != dst.len || src.len % chunk_bytes != 0) {
        PyErr_Format(PyExc_ValueError,
                     "dst (%zd B) and src (%zd B) must be the same length, a multiple of "
                     "8 * chunk_words (chunk_words=%zd)", dst.len, src.len, chunk_words);
    } else if (sums.len != (src.len / chunk_bytes) * 8) {
        PyErr_Format(PyExc_ValueError, "sums must hold %zd uint64 (one per chunk), got %zd B",
                     src.len / chunk_bytes, sums.len);
    } else {
        const char *path;
        Py_BEGIN_ALLOW_THREADS
        path = copy_sum(dst.buf, src.buf, (size_t)(src.len / chunk_bytes), (size_t)chunk_words,
                        (uint64_t *)sums.buf);
        Py_END_ALLOW_THREADS
        result = PyUnicode_FromString(path);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&sums);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_sum", py_copy_sum, METH_VARARGS,
     "copy_sum(dst, src, sums, chunk_words) -> path: dst[:] = src and sums[j] = the uint64 sum "
     "of chunk j of src, in one pass; returns the kernel used ('avx2', 'sse2' or 'plain')."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpool._copysum",
    "Copy a KV block and compute its chunk sums in one pass (see kvpool/checksum.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__copysum(void) { return PyModule_Create(&module); }
