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
#include <math.h>
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

/* ------------------------------------------------------------------------------------------------
 * Wire codecs (zgossip/codecs.py holds the numpy versions and the documentation). Float32 only.
 * Each gives exactly the bytes and values of the numpy path (same IEEE operations, same rounding);
 * only the payload bits of a NaN may differ, and a NaN is refused by every reducer anyway.
 * Payload pointers may be unaligned (a part's pieces are packed back to back): memcpy for them. */
#define CODEC_FP16 1
#define CODEC_BF16 2
#define CODEC_INT8 3
#define INT8_BLOCK 1024 /* codecs.INT8_BLOCK must match */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_F16C_PATH 1
__attribute__((target("avx,f16c"))) static void f32_to_f16(const float *x, unsigned char *out, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(out + 2 * i), h);
    }
    if (i < n) {
        float tmp[8] = {0};
        unsigned char h8[16];
        memcpy(tmp, x + i, (size_t)(n - i) * 4);
        _mm_storeu_si128((__m128i *)h8, _mm256_cvtps_ph(_mm256_loadu_ps(tmp), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        memcpy(out + 2 * i, h8, (size_t)(n - i) * 2);
    }
}
__attribute__((target("avx,f16c"))) static void f16_to_f32(const unsigned char *in, float *out, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + 2 * i))));
    if (i < n) {
        unsigned char h8[16] = {0};
        float tmp[8];
        memcpy(h8, in + 2 * i, (size_t)(n - i) * 2);
        _mm256_storeu_ps(tmp, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h8)));
        memcpy(out + i, tmp, (size_t)(n - i) * 4);
    }
}
static int have_f16c(void) { return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx"); }
#else
#define HAVE_F16C_PATH 0
#endif

MULTIARCH static void bf16_encode(const float *x, unsigned char *out, Py_ssize_t n) {
    const uint32_t *u = (const uint32_t *)x;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t b = u[i];
        uint16_t r = (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
        if ((b & 0x7fffffffu) > 0x7f800000u) r = 0x7FC0; /* NaN stays NaN (rounding could carry it to inf) */
        memcpy(out + 2 * i, &r, 2);
    }
}

MULTIARCH static void bf16_decode(const unsigned char *in, float *out, Py_ssize_t n) {
    uint32_t *o = (uint32_t *)out;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, in + 2 * i, 2);
        o[i] = (uint32_t)h << 16;
    }
}

static float max_scale(void) {
    /* the largest float32 scale whose 127 steps stay finite (codecs._largest_scale) */
    volatile float s = 3.4028234663852886e38f / 127.0f;
    while (!(127.0f * s <= 3.4028234663852886e38f)) s = nextafterf(s, 0.0f);
    return s;
}

MULTIARCH static void int8_block(const float *x, Py_ssize_t m, float maxs, unsigned char *scale_out, int8_t *q) {
    const uint32_t *u = (const uint32_t *)x;
    uint32_t hi = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        uint32_t a = u[i] & 0x7fffffffu; /* |x| as bits: ordered like the floats, NaN/inf on top */
        hi = a > hi ? a : hi;
    }
    float scale;
    if (hi >= 0x7f800000u) { /* NaN or inf in the block: the whole block decodes as NaN */
        uint32_t nan = 0x7fc00000u;
        memcpy(&scale, &nan, 4);
        memset(q, 0, (size_t)m);
        memcpy(scale_out, &scale, 4);
        return;
    }
    float absmax;
    memcpy(&absmax, &hi, 4);
    scale = absmax / 127.0f;
    if (scale > maxs) scale = maxs;
    float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    if (inv > 3.4028234663852886e38f) { /* a subnormal scale has no finite inverse: divide (codecs._int8_blocks) */
        for (Py_ssize_t i = 0; i < m; i++) {
            float t = rintf(x[i] / scale);
            t = t < -127.0f ? -127.0f : (t > 127.0f ? 127.0f : t);
            q[i] = (int8_t)t;
        }
    } else {
        for (Py_ssize_t i = 0; i < m; i++) {
            float t = rintf(x[i] * inv);
            t = t < -127.0f ? -127.0f : (t > 127.0f ? 127.0f : t);
            q[i] = (int8_t)t;
        }
    }
    memcpy(scale_out, &scale, 4);
}

MULTIARCH static void int8_unblock(const int8_t *q, Py_ssize_t m, float scale, float *out) {
    for (Py_ssize_t i = 0; i < m; i++) out[i] = (float)q[i] * scale;
}

/* codec_encode(codec, x, out) -> bool: encode float32 x into the bytes out; False when this build
 * cannot (e.g. fp16 on a CPU without F16C): the caller uses numpy. */
static PyObject *py_codec_encode(PyObject *self, PyObject *args) {
    int codec;
    PyObject *x_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "iOO", &codec, &x_obj, &out_obj)) return NULL;
    Py_buffer x, out;
    if (get_buffer(x_obj, &x, 0, "x") < 0) return NULL;
    if (get_buffer(out_obj, &out, 1, "out") < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    Py_ssize_t n = x.len / 4, nb = (n + INT8_BLOCK - 1) / INT8_BLOCK;
    Py_ssize_t want = codec == CODEC_INT8 ? n + 4 * nb : 2 * n;
    int done = 1;
    if (x.len % 4 || out.len != want || codec < CODEC_FP16 || codec > CODEC_INT8) {
        PyBuffer_Release(&x);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "codec_encode: bad codec or buffer sizes");
        return NULL;
    }
    const float *xs = (const float *)x.buf;
    unsigned char *o = (unsigned char *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    if (codec == CODEC_FP16) {
#if HAVE_F16C_PATH
        if (have_f16c()) f32_to_f16(xs, o, n); else done = 0;
#else
        done = 0;
#endif
    } else if (codec == CODEC_BF16) {
        bf16_encode(xs, o, n);
    } else {
        float maxs = max_scale();
        for (Py_ssize_t b = 0; b < nb; b++) {
            Py_ssize_t s = b * INT8_BLOCK, m = n - s < INT8_BLOCK ? n - s : INT8_BLOCK;
            int8_block(xs + s, m, maxs, o + 4 * b, (int8_t *)(o + 4 * nb + s));
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return PyBool_FromLong(done);
}

/* codec_decode(codec, data, out) -> bool: decode the bytes data into float32 out (see codec_encode). */
static PyObject *py_codec_decode(PyObject *self, PyObject *args) {
    int codec;
    PyObject *d_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "iOO", &codec, &d_obj, &out_obj)) return NULL;
    Py_buffer d, out;
    if (get_buffer(d_obj, &d, 0, "data") < 0) return NULL;
    if (get_buffer(out_obj, &out, 1, "out") < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    Py_ssize_t n = out.len / 4, nb = (n + INT8_BLOCK - 1) / INT8_BLOCK;
    Py_ssize_t want = codec == CODEC_INT8 ? n + 4 * nb : 2 * n;
    int done = 1;
    if (out.len % 4 || d.len != want || codec < CODEC_FP16 || codec > CODEC_INT8) {
        PyBuffer_Release(&d);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "codec_decode: bad codec or buffer sizes");
        return NULL;
    }
    const unsigned char *in = (const unsigned char *)d.buf;
    float *o = (float *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    if (codec == CODEC_FP16) {
#if HAVE_F16C_PATH
        if (have_f16c()) f16_to_f32(in, o, n); else done = 0;
#else
        done = 0;
#endif
    } else if (codec == CODEC_BF16) {
        bf16_decode(in, o, n);
    } else {
        for (Py_ssize_t b = 0; b < nb; b++) {
            Py_ssize_t s = b * INT8_BLOCK, m = n - s < INT8_BLOCK ? n - s : INT8_BLOCK;
            float scale;
            memcpy(&scale, in + 4 * b, 4);
            int8_unblock((const int8_t *)(in + 4 * nb + s), m, scale, o + s);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&d);
    PyBuffer_Release(&out);
    return PyBool_FromLong(done);
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
    {"codec_encode", py_codec_encode, METH_VARARGS, "encode float32 values with a wire codec (zgossip.codecs)"},
    {"codec_decode", py_codec_decode, METH_VARARGS, "decode a wire codec's bytes into float32 values"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "zgossip's optional fused reductions", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
