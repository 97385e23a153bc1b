/* Zero-copy sends straight through libzmq, without pyzmq's release thread; and receives
 * without zmq.Frame objects.
 *
 * pyzmq sends a buffer zero-copy by handing libzmq a free function that, when libzmq is done
 * with the bytes, posts a message to a garbage-collector thread, which takes the GIL to drop
 * the Python reference and to set the tracker's event. On the all-reduce that is one thread
 * wake-up and one GIL hand-over per payload frame, and a MessageTracker with its events for
 * every send. Here libzmq's free function only decrements an atomic counter in a small
 * C struct; the buffer is released later, on the I/O thread, by `reap()`. Waiting for sends
 * to finish (`Payload.wait`) sleeps on a condition variable with the GIL released.
 *
 * libzmq is the copy pyzmq already loaded (its path comes from the caller, who reads
 * /proc/self/maps): dlopen(RTLD_NOLOAD) returns that same library, so the socket handles
 * from `zmq.Socket.underlying` are valid here. zgossip.zsend checks the version and falls
 * back to pyzmq when anything is missing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifdef __linux__
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* libzmq 4.x: a message is an opaque 64-byte, pointer-aligned block (zmq.h) */
typedef struct {
    unsigned char _[64] __attribute__((aligned(sizeof(void *))));
} zmsg_t;
typedef void(zfree_fn)(void *data, void *hint);

#define ZMQ_DONTWAIT_ 1
#define ZMQ_SNDMORE_ 2

static int (*z_msg_init_data)(zmsg_t *, void *, size_t, zfree_fn *, void *);
static int (*z_msg_init)(zmsg_t *);
static int (*z_msg_recv)(zmsg_t *, void *, int);
static size_t (*z_msg_size)(const zmsg_t *);
static int (*z_msg_more)(const zmsg_t *);
static const char *(*z_msg_gets)(const zmsg_t *, const char *);
static int (*z_msg_init_size)(zmsg_t *, size_t);
static void *(*z_msg_data)(zmsg_t *);
static int (*z_msg_send)(zmsg_t *, void *, int);
static int (*z_msg_close)(zmsg_t *);
static int (*z_errno)(void);
static const char *(*z_strerror)(int);
static void (*z_version)(int *, int *, int *);

/* One payload buffer. refs: 1 while the Python object lives + 1 per message libzmq holds. */
typedef struct holder {
    Py_buffer view;
    atomic_long refs;
    struct holder *next; /* done list */
} holder_t;

static _Atomic(holder_t *) done_head = NULL; /* released by libzmq, waiting for reap() */
static pthread_mutex_t done_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;

/* Runs on libzmq's thread (or whichever thread closes a socket), never with the GIL. */
static void release_fn(void *data, void *hint) {
    (void)data;
    holder_t *h = (holder_t *)hint;
    long left = atomic_fetch_sub(&h->refs, 1) - 1;
    if (left == 0) { /* the Python object is gone too: hand the buffer to reap() */
        holder_t *head = atomic_load(&done_head);
        do {
            h->next = head;
        } while (!atomic_compare_exchange_weak(&done_head, &head, h));
    }
    pthread_mutex_lock(&done_mu);
    pthread_cond_broadcast(&done_cv);
    pthread_mutex_unlock(&done_mu);
}

static void free_holder(holder_t *h) {
    PyBuffer_Release(&h->view);
    PyMem_RawFree(h);
}

/* Release every buffer libzmq gave back after its Python object was dropped (GIL held). */
static Py_ssize_t reap_all(void) {
    holder_t *h = atomic_exchange(&done_head, NULL);
    Py_ssize_t n = 0;
    while (h != NULL) {
        holder_t *next = h->next;
        free_holder(h);
        h = next;
        n++;
    }
    return n;
}

typedef struct {
    PyObject_HEAD holder_t *h;
} PayloadObject;

static PyTypeObject PayloadType;

static int payload_init(PayloadObject *self, PyObject *args, PyObject *kw) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj)) return -1;
    if (self->h != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Payload already initialised");
        return -1;
    }
    holder_t *h = PyMem_RawMalloc(sizeof(holder_t));
    if (h == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (PyObject_GetBuffer(obj, &h->view, PyBUF_C_CONTIGUOUS) < 0) {
        PyMem_RawFree(h);
        return -1;
    }
    atomic_init(&h->refs, 1);
    h->next = NULL;
    self->h = h;
    return 0;
}

static void payload_dealloc(PayloadObject *self) {
    holder_t *h = self->h;
    if (h != NULL && atomic_fetch_sub(&h->refs, 1) == 1) free_holder(h); /* nothing in flight */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *payload_done(PayloadObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->h == NULL || atomic_load(&self->h->refs) <= 1);
}

static PyObject *payload_nbytes(PayloadObject *self, void *closure) {
    (void)closure;
    return PyLong_FromSsize_t(self->h == NULL ? 0 : self->h->view.len);
}

/* wait(timeout) -> True when libzmq released every message using this buffer */
static PyObject *payload_wait(PayloadObject *self, PyObject *args) {
    double timeout;
    if (!PyArg_ParseTuple(args, "d", &timeout)) return NULL;
    holder_t *h = self->h;
    if (h == NULL || atomic_load(&h->refs) <= 1) Py_RETURN_TRUE;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    if (timeout > 0) {
        double s = until.tv_sec + until.tv_nsec * 1e-9 + timeout;
        until.tv_sec = (time_t)s;
        until.tv_nsec = (long)((s - (double)until.tv_sec) * 1e9);
    }
    int done;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&done_mu);
    while (!(done = atomic_load(&h->refs) <= 1) && timeout > 0)
        if (pthread_cond_timedwait(&done_cv, &done_mu, &until) == ETIMEDOUT) {
            done = atomic_load(&h->refs) <= 1;
            break;
        }
    pthread_mutex_unlock(&done_mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

static PyGetSetDef payload_getset[] = {
    {"done", (getter)payload_done, NULL, "libzmq holds no message using this buffer", NULL},
    {"nbytes", (getter)payload_nbytes, NULL, "bytes in the buffer", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef payload_methods[] = {
    {"wait", (PyCFunction)payload_wait, METH_VARARGS, "wait(timeout) -> bool: every send released"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PayloadType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "zgossip._zsend.Payload",
    .tp_basicsize = sizeof(PayloadObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A buffer lent to libzmq for zero-copy sends; keeps the exporter alive until released.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)payload_init,
    .tp_dealloc = (destructor)payload_dealloc,
    .tp_getset = payload_getset,
    .tp_methods = payload_methods,
};

static PyObject *zmq_failure(int frame) {
    int e = z_errno();
    PyErr_Format(PyExc_OSError, "zmq_msg_send failed on frame %d: %s (errno %d)", frame, z_strerror(e), e);
    return NULL;
}

/* send(socket_address, frames) -> None. frames: bytes (copied) or Payload (zero-copy), sent
 * as one multipart message with ZMQ_DONTWAIT. On failure after the first frame the message is
 * incomplete on that socket: the caller must close it. */
static PyObject *py_send(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *addr_obj, *frames;
    if (!PyArg_ParseTuple(args, "OO!", &addr_obj, &PyTuple_Type, &frames)) return NULL;
    void *sock = PyLong_AsVoidPtr(addr_obj);
    if (sock == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null socket");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(frames);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "no frames");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyTuple_GET_ITEM(frames, i);
        if (!PyBytes_Check(f) && !(Py_TYPE(f) == &PayloadType && ((PayloadObject *)f)->h != NULL)) {
            PyErr_SetString(PyExc_TypeError, "frames must be bytes or initialised Payload objects");
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyTuple_GET_ITEM(frames, i);
        int flags = ZMQ_DONTWAIT_ | (i + 1 < n ? ZMQ_SNDMORE_ : 0);
        zmsg_t msg;
        if (PyBytes_Check(f) || ((PayloadObject *)f)->h->view.len == 0) { /* nothing to lend: copy */
            Py_ssize_t len = PyBytes_Check(f) ? PyBytes_GET_SIZE(f) : 0;
            if (z_msg_init_size(&msg, (size_t)len) != 0) return zmq_failure((int)i);
            if (len) memcpy(z_msg_data(&msg), PyBytes_AS_STRING(f), (size_t)len);
        } else {
            holder_t *h = ((PayloadObject *)f)->h;
            atomic_fetch_add(&h->refs, 1); /* libzmq's reference, dropped by release_fn */
            if (z_msg_init_data(&msg, h->view.buf, (size_t)h->view.len, release_fn, h) != 0) {
                atomic_fetch_sub(&h->refs, 1);
                return zmq_failure((int)i);
            }
        }
        if (z_msg_send(&msg, sock, flags) < 0) {
            PyObject *r = zmq_failure((int)i);
            z_msg_close(&msg); /* runs release_fn for a Payload */
            return r;
        }
    }
    Py_RETURN_NONE;
}

/* A received frame too large to copy into bytes: it owns libzmq's message and exposes its bytes
 * (read-only) through the buffer protocol; the message is closed when the last view is gone. */
typedef struct {
    PyObject_HEAD zmsg_t msg;
} FrameObject;

static int frame_getbuffer(FrameObject *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, z_msg_data(&self->msg), (Py_ssize_t)z_msg_size(&self->msg), 1,
                             flags);
}

static void frame_dealloc(FrameObject *self) {
    z_msg_close(&self->msg);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t frame_len(FrameObject *self) { return (Py_ssize_t)z_msg_size(&self->msg); }

static PyBufferProcs frame_as_buffer = {(getbufferproc)frame_getbuffer, NULL};
static PySequenceMethods frame_as_sequence = {.sq_length = (lenfunc)frame_len};

static PyTypeObject FrameType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "zgossip._zsend.Frame",
    .tp_basicsize = sizeof(FrameObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A received ZeroMQ frame, read-only, without a copy.",
    .tp_dealloc = (destructor)frame_dealloc,
    .tp_as_buffer = &frame_as_buffer,
    .tp_as_sequence = &frame_as_sequence,
};

/* recv(socket_address, inline_max[, prop[, prop2]]) -> tuple of frames, or None when nothing is waiting.
 * One whole multipart message, ZMQ_DONTWAIT; frames of at most inline_max bytes come as bytes,
 * larger ones as Frame objects (no copy). With `prop` (a message property such as "User-Id",
 * which a ZAP handler sets for an authenticated connection, or "__fd", the connection's socket)
 * it returns (frames, value or None); with `prop2` as well, (frames, value, value2). */
/* *out = the message property `name` as str (left NULL where the message has none); -1 on error. */
static int property(zmsg_t *msg, const char *name, PyObject **out) {
    if (name == NULL) return 0;
    const char *v = z_msg_gets(msg, name); /* NULL where the frame has no such property */
    if (v == NULL) return 0;
    *out = PyUnicode_DecodeUTF8(v, (Py_ssize_t)strlen(v), "replace");
    return *out == NULL ? -1 : 0;
}

static PyObject *py_recv(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *addr_obj;
    Py_ssize_t inline_max;
    const char *prop = NULL, *prop2 = NULL;
    PyObject *meta = NULL, *meta2 = NULL;
    if (!PyArg_ParseTuple(args, "On|zz", &addr_obj, &inline_max, &prop, &prop2)) return NULL;
    void *sock = PyLong_AsVoidPtr(addr_obj);
    if (sock == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null socket");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (int i = 0;; i++) {
        FrameObject *f = PyObject_New(FrameObject, &FrameType);
        if (f == NULL) goto fail;
        z_msg_init(&f->msg);
        if (z_msg_recv(&f->msg, sock, ZMQ_DONTWAIT_) < 0) {
            int e = z_errno();
            Py_DECREF(f);
            if (i == 0 && e == EAGAIN) {
                Py_DECREF(out);
                Py_RETURN_NONE;
            }
            PyErr_Format(PyExc_OSError, "zmq_msg_recv failed on frame %d: %s (errno %d)", i, z_strerror(e), e);
            goto fail;
        }
        int more = z_msg_more(&f->msg);
        if ((meta == NULL && property(&f->msg, prop, &meta) < 0) ||
            (meta2 == NULL && property(&f->msg, prop2, &meta2) < 0)) {
            Py_DECREF(f);
            goto fail;
        }
        PyObject *item = (PyObject *)f;
        size_t size = z_msg_size(&f->msg);
        if ((Py_ssize_t)size <= inline_max) {
            item = PyBytes_FromStringAndSize((const char *)z_msg_data(&f->msg), (Py_ssize_t)size);
            Py_DECREF(f);
            if (item == NULL) goto fail;
        }
        int rc = PyList_Append(out, item);
        Py_DECREF(item);
        if (rc < 0) goto fail;
        if (!more) break;
    }
    PyObject *t = PyList_AsTuple(out);
    Py_DECREF(out);
    if (prop == NULL || t == NULL) {
        Py_XDECREF(meta2);
        return t;
    }
    PyObject *pair = prop2 == NULL ? PyTuple_Pack(2, t, meta != NULL ? meta : Py_None)
                                   : PyTuple_Pack(3, t, meta != NULL ? meta : Py_None, meta2 != NULL ? meta2 : Py_None);
    Py_DECREF(t);
    Py_XDECREF(meta);
    Py_XDECREF(meta2);
    return pair;
fail:
    Py_XDECREF(meta);
    Py_XDECREF(meta2);
    Py_DECREF(out);
    return NULL;
}

static PyObject *py_reap(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyLong_FromSsize_t(reap_all());
}

/* load(path) -> (major, minor, patch): bind to the libzmq already loaded from `path` */
static PyObject *py_load(PyObject *self, PyObject *args) {
    (void)self;
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) return PyErr_Format(PyExc_OSError, "libzmq not loaded from %s: %s", path, dlerror());
#define SYM(var, name)                                                                  \
    *(void **)(&var) = dlsym(lib, name);                                                \
    if (var == NULL) return PyErr_Format(PyExc_OSError, "libzmq at %s lacks %s", path, name);
    SYM(z_msg_init_data, "zmq_msg_init_data")
    SYM(z_msg_init_size, "zmq_msg_init_size")
    SYM(z_msg_data, "zmq_msg_data")
    SYM(z_msg_send, "zmq_msg_send")
    SYM(z_msg_close, "zmq_msg_close")
    SYM(z_errno, "zmq_errno")
    SYM(z_strerror, "zmq_strerror")
    SYM(z_version, "zmq_version")
    SYM(z_msg_init, "zmq_msg_init")
    SYM(z_msg_recv, "zmq_msg_recv")
    SYM(z_msg_size, "zmq_msg_size")
    SYM(z_msg_more, "zmq_msg_more")
    SYM(z_msg_gets, "zmq_msg_gets")
#undef SYM
    int a, b, c;
    z_version(&a, &b, &c);
    return Py_BuildValue("(iii)", a, b, c);
}

static PyMethodDef methods[] = {
    {"load", py_load, METH_VARARGS, "load(path) -> libzmq version; bind to the already loaded libzmq"},
    {"send", py_send, METH_VARARGS, "send(socket_address, frames): one multipart message, DONTWAIT"},
    {"recv", py_recv, METH_VARARGS, "recv(socket_address, inline_max[, prop[, prop2]]) -> frames or None; with props: (frames, value[, value2])"},
    {"reap", py_reap, METH_NOARGS, "release buffers libzmq is done with; returns how many"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_zsend", NULL, -1, methods};

PyMODINIT_FUNC PyInit__zsend(void) {
    if (PyType_Ready(&PayloadType) < 0 || PyType_Ready(&FrameType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (m == NULL) return NULL;
    Py_INCREF(&PayloadType);
    if (PyModule_AddObject(m, "Payload", (PyObject *)&PayloadType) < 0) {
        Py_DECREF(&PayloadType);
        Py_DECREF(m);
        return NULL;
    }
    /* what this build offers, for zgossip.fast_send to refuse a stale build: 2 = recv takes two properties */
    if (PyModule_AddIntConstant(m, "API", 2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

#else /* not Linux: no module; zgossip uses pyzmq's zero-copy path */
#error "zgossip._zsend is built on Linux only"
#endif
