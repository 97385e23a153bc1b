/* Fused reductions for the all-reduce's hot path (optional: zgossip/kernels.py falls back to numpy).
 *
 * Why C: an owner sums the members' terms of a part as they arrive, and each term must be free of
 * NaN and inf before it may touch the sum. In numpy that is one pass over a term to check it and
 * more to add it (and to divide, after the last), over data no longer in the cache; here the
 * blocks of all terms at hand are checked, added and (with the last) divided while they are in L2,
 * and a result is checked and copied the same way, so every byte is read from memory once.
 *
 * The arithmetic is exactly numpy's: out = x*w for the first term, out = out + x*w for the next
 * (out + x when w is 1), then out / wsum, each operation rounded to the element type. setup.py compiles this
 * file with -ffp-contract=off, so no multiply-add is fused and both paths give identical bits.
 * Only float32 and float64 are handled here; other dtypes stay on the numpy path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* accumulate's block, in elements (64-128 KiB per term): the terms' blocks are checked, then summed
 * while they are still in L2; long enough runs of each term for the hardware prefetchers (blocks
 * of one 4 KiB page per term, switching terms every page, measured ~2x slower).
 * kernels.ACC_BLOCK must match. */
#define ACC_BLOCK 16384
#define COPY_BLOCK 1024 /* copy_finite's block, in elements: kernels.BLOCK must match */
#define MAX_TERMS 64
/* the sum is built SUB_BLOCK elements at a time (8-16 KiB): the partial sum stays in L1 while every
 * term is added to it, and each element still sees the same operations in the same order */
#define SUB_BLOCK 2048 /* kernels.SUB_BLOCK must match */

/* The loops below are plain C that the compiler vectorizes. Built for the baseline x86-64 (SSE2)
 * they run at a quarter of the memory bandwidth, so on x86-64 Linux with GCC each kernel is also
 * compiled for AVX2 and AVX-512 and the loader picks the best the CPU has (ifunc). Vector width
 * does not change the bits: every element gets the same IEEE operations in the same order. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define MULTIARCH __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MULTIARCH
#endif

MULTIARCH static int finite_f32(const float *x, Py_ssize_t n) {
    const uint32_t *u = (const uint32_t *)x;
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        bad |= (uint32_t)((u[i] & 0x7f800000u) == 0x7f800000u);
    return !bad;
}

MULTIARCH static int finite_f64(const double *x, Py_ssize_t n) {
    const uint64_t *u = (const uint64_t *)x;
    uint64_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        bad |= (uint64_t)((u[i] & 0x7ff0000000000000ull) == 0x7ff0000000000000ull);
    return !bad;
}

/* Adds k terms, in the order given, to the partial sum in src and writes the result to out, block
 * by block: x0*w0 (when `first`: src is not read) or src + x0*w0, then + x1*w1, ...; then, when
 * `divisor` is not 0, / divisor. Each sub-block is built in a scratch array in L1 and stored when
 * done, so out may be src (the usual in-place sum) or one of the terms (an owner writing the
 * final mean straight into its own tensor, whose data is a term). All terms' blocks are checked
 * for NaN/inf before the block is used, and a divided sub-block is checked before it is stored.
 * Returns -1 on success; when a term is not finite, its index, with *bad_at set to the offset of
 * the first block holding a bad value (in any term; the first such term in order is reported);
 * or -2 when the terms are finite but a divided sub-block is not (the sum overflowed), with
 * *bad_at set to that sub-block's offset. Either way out[0:*bad_at] was stored and the rest of
 * out is untouched. */
#define ACCUMULATE(T, FINITE)                                                                      \
    MULTIARCH static Py_ssize_t accumulate_##T(T *out, const T *src, const T *const *xs, const T *ws, \
                                               int k, int first, T divisor, Py_ssize_t n,          \
                                               Py_ssize_t *bad_at) {                               \
        T scratch[SUB_BLOCK];                                                                       \
        for (Py_ssize_t s = 0; s < n; s += ACC_BLOCK) {                                            \
            Py_ssize_t m = n - s < ACC_BLOCK ? n - s : ACC_BLOCK;                                  \
            for (int t = 0; t < k; t++)                                                            \
                if (!FINITE(xs[t] + s, m)) {                                                       \
                    *bad_at = s;                                                                   \
                    return t;                                                                      \
                }                                                                                  \
            for (Py_ssize_t b = s; b < s + m; b += SUB_BLOCK) {                                    \
                Py_ssize_t mb = s + m - b < SUB_BLOCK ? s + m - b : SUB_BLOCK;                     \
                T *restrict o = scratch;                                                           \
                const T *restrict base = src + b;                                                  \
                for (int t = 0; t < k; t++) {                                                      \
                    const T *restrict y = xs[t] + b;                                               \
                    T w = ws[t];                                                                   \
                    if (t == 0 && first)                                                           \
                        for (Py_ssize_t i = 0; i < mb; i++) o[i] = y[i] * w;                       \
                    else if (t == 0 && w == (T)1)                                                  \
                        for (Py_ssize_t i = 0; i < mb; i++) o[i] = base[i] + y[i];                 \
                    else if (t == 0)                                                               \
                        for (Py_ssize_t i = 0; i < mb; i++) o[i] = base[i] + y[i] * w;             \
                    else if (w == (T)1)                                                            \
                        for (Py_ssize_t i = 0; i < mb; i++) o[i] = o[i] + y[i];                    \
                    else                                                                           \
                        for (Py_ssize_t i = 0; i < mb; i++) o[i] = o[i] + y[i] * w;                \
                }                                                                                  \
                if (divisor != (T)0) {                                                             \
                    for (Py_ssize_t i = 0; i < mb; i++) o[i] = o[i] / divisor;                     \
                    if (!FINITE(o, mb)) {                                                          \
                        *bad_at = b;                                                               \
                        return -2;                                                                 \
                    }                                                                              \
                }                                                                                  \
                memcpy(out + b, o, (size_t)mb * sizeof(T));                                        \
            }                                                                                      \
        }                                                                                          \
        return -1;                                                                                 \
    }

ACCUMULATE(float, finite_f32)
ACCUMULATE(double, finite_f64)

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* accumulate(out, terms, weights, first, divisor, itemsize, src) -> (verdict, bad_at) (see accumulate_##T);
 * src None: the partial sum is in out */
static PyObject *py_accumulate(PyObject *self, PyObject *args) {
    PyObject *out_obj, *terms_obj, *weights_obj, *src_obj = Py_None;
    double divisor;
    int first, itemsize;
    if (!PyArg_ParseTuple(args, "OOOpdi|O", &out_obj, &terms_obj, &weights_obj, &first, &divisor, &itemsize,
                          &src_obj))
        return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be 4 or 8");
        return NULL;
    }
    PyObject *terms = PySequence_Fast(terms_obj, "terms must be a sequence");
    if (!terms) return NULL;
    PyObject *weights = PySequence_Fast(weights_obj, "weights must be a sequence");
    if (!weights) {
        Py_DECREF(terms);
        return NULL;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(terms), got = 0, verdict = -3, bad_at = 0;
    Py_buffer out, src, views[MAX_TERMS];
    const void *ptrs[MAX_TERMS];
    float wf[MAX_TERMS];
    double wd[MAX_TERMS];
    int have_out = 0, have_src = 0;
    if (k < 1 || k > MAX_TERMS || PySequence_Fast_GET_SIZE(weights) != k) {
        PyErr_SetString(PyExc_ValueError, "need 1..64 terms and one weight per term");
        goto done;
    }
    if (get_buffer(out_obj, &out, 1, "out") < 0) goto done;
    have_out = 1;
    if (out.len % itemsize) {
        PyErr_SetString(PyExc_ValueError, "out's length is not a whole number of elements");
        goto done;
    }
    if (src_obj != Py_None) {
        if (get_buffer(src_obj, &src, 0, "src") < 0) goto done;
        have_src = 1;
        if (src.len != out.len) {
            PyErr_SetString(PyExc_ValueError, "src must be as long as out");
            goto done;
        }
    }
    const void *from = have_src ? src.buf : out.buf;
    for (; got < k; got++) {
        double w = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(weights, got));
        if (w == -1.0 && PyErr_Occurred()) goto done;
        if (get_buffer(PySequence_Fast_GET_ITEM(terms, got), &views[got], 0, "every term") < 0) goto done;
        if (views[got].len != out.len) {
            got++;
            PyErr_SetString(PyExc_ValueError, "every term must be as long as out");
            goto done;
        }
        ptrs[got] = views[got].buf;
        wd[got] = w;
        wf[got] = (float)w;
    }
    Py_ssize_t n = out.len / itemsize;
    Py_BEGIN_ALLOW_THREADS
    if (itemsize == 4)
        verdict = accumulate_float((float *)out.buf, (const float *)from, (const float *const *)ptrs, wf, (int)k,
                                   first, (float)divisor, n, &bad_at);
    else
        verdict = accumulate_double((double *)out.buf, (const double *)from, (const double *const *)ptrs, wd, (int)k,
                                    first, divisor, n, &bad_at);
    Py_END_ALLOW_THREADS
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    if (have_src) PyBuffer_Release(&src);
    if (have_out) PyBuffer_Release(&out);
    Py_DECREF(terms);
    Py_DECREF(weights);
    if (verdict == -3) return NULL;
    return Py_BuildValue("(nn)", verdict, bad_at);
}

/* Copies n bytes with non-temporal stores where the CPU has them (SSE2): a received result is
 * written into the tensor and not read again this round, so there is no point reading the
 * destination's cache lines first (which an ordinary store does) or keeping them in cache.
 * The caller issues the store fence (`_mm_sfence`) after its last call. Opt-in (kernels.STREAM_STORES):
 * whether it pays depends on the CPU, and paired runs showed no gain on the machine we measure on. */
static void stream_copy(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (n < 256 || head >= n) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

/* copy_finite(dst, src, itemsize[, stream]) -> elements copied: blocks are checked and copied in order
 * (with non-temporal stores when `stream`, the default; plain memcpy otherwise), and copying stops
 * before the first block holding a NaN or inf (so the return value is a multiple of the block size,
 * or the full length when everything was finite). */
static PyObject *py_copy_finite(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    int itemsize, stream = 1;
    if (!PyArg_ParseTuple(args, "OOi|p", &dst_obj, &src_obj, &itemsize, &stream)) return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be 4 or 8");
        return NULL;
    }
    Py_buffer dst, src;
    if (get_buffer(dst_obj, &dst, 1, "dst") < 0) return NULL;
    if (get_buffer(src_obj, &src, 0, "src") < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len != src.len || dst.len % itemsize) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "dst and src must hold the same whole number of elements");
        return NULL;
    }
    Py_ssize_t n = dst.len / itemsize, s = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; s < n; s += COPY_BLOCK) {
        Py_ssize_t m = n - s < COPY_BLOCK ? n - s : COPY_BLOCK;
        const char *from = (const char *)src.buf + s * itemsize;
        if (itemsize == 4 ? !finite_f32((const float *)from, m) : !finite_f64((const double *)from, m)) break;
        if (stream)
            stream_copy((char *)dst.buf + s * itemsize, from, (size_t)(m * itemsize));
        else
            memcpy((char *)dst.buf + s * itemsize, from, (size_t)(m * itemsize));
    }
#if defined(__SSE2__)
    if (stream) _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromSsize_t(s < n ? s : n);
}

/* all_finite(buf, itemsize) -> bool */
static PyObject *py_all_finite(PyObject *self, PyObject *args) {
    PyObject *obj;
    int itemsize;
    if (!PyArg_ParseTuple(args, "Oi", &obj, &itemsize)) return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be 4 or 8");
        return NULL;
    }
    Py_buffer view;
    if (get_buffer(obj, &view, 0, "buf") < 0) return NULL;
    int ok;
    Py_ssize_t n = view.len / itemsize;
    Py_BEGIN_ALLOW_THREADS
    ok = itemsize == 4 ? finite_f32((const float *)view.buf, n) : finite_f64((const double *)view.buf, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

/* isa() -> the instruction set the loader picked for the kernels' loops ("avx512f", "avx2", "default"
 * where they are compiled for several; "baseline" where they are not) */
static PyObject *py_isa(PyObject *self, PyObject *noargs) {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return PyUnicode_FromString("avx512f");
    if (__builtin_cpu_supports("avx2")) return PyUnicode_FromString("avx2");
    return PyUnicode_FromString("default");
#else
    return PyUnicode_FromString("baseline");
#endif
}

static PyMethodDef methods[] = {
    {"isa", py_isa, METH_NOARGS, "the instruction set the kernels' loops run with"},
    {"accumulate", py_accumulate, METH_VARARGS, "out (+)= sum of w_i*x_i, optionally / divisor, with NaN/inf checks"},
    {"copy_finite", py_copy_finite, METH_VARARGS, "copy block by block up to the first non-finite block"},
    {"all_finite", py_all_finite, METH_VARARGS, "no NaN or inf in the buffer"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "zgossip's optional fused reductions", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
