/* The optional compiled piece of the tcp backend's shared-memory hot loop.
 *
 * colls_plugins/tcp/shm.py owns the memory layout and the protocol; this file only makes the
 * steps that run on every small collective cheaper than CPython's bytecode can:
 *
 *   post       store the phase word, a full fence, and which peers sleep (Sync.post);
 *   poll       spin on peers' phase words with acquire loads, then sched_yield with the GIL
 *              released (Sync.poll); blocking, timeouts and dead peers stay in Python;
 *   stamps     compare peers' stamp words with this rank's (Sync.same_stamp);
 *   tiny       write a tiny all_reduce's stamp and payload and post (Sync.tiny_post), then check
 *              the stamps and fold every rank's payload in rank order (Sync.tiny_fold), bitwise
 *              NumPy's result for float32/float64/int32/int64 sums and products;
 *   rings      write one point-to-point ring entry and publish it (Sync.ring_put), take the next
 *              entry of a peer's ring into a receive buffer (Sync.ring_take), spin until a
 *              peer's ring has an entry (Sync.ring_wait): the steps of
 *              colls_plugins/tcp/shm/p2p.py's Channel, whose Python code stays the fallback;
 *   mapping    map a peer's segment read-only without keeping its descriptor (map_read_only):
 *              CPython's mmap keeps a duplicate of it before Python 3.13, one per host peer.
 *
 * The word offsets come from shm.py through the constructor, so the layout has one source. The
 * pure-Python path (colls_plugins/tcp/shm.py) does the same steps and stays the fallback; the
 * two interoperate, rank by rank. Built by setup.py when a C compiler is there; see
 * docs/design.md, "A compiled piece for the shared-memory hot loop".
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "ring entries are little-endian int64 words (shm_p2p.ENTRY); this file assumes the host is"
#endif

static inline int64_t load_acquire(const int64_t *word) {
    return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Fold codes: dtype * 2 + (1 for a product). Python keeps the same table (shm_tiny.FOLDS). */
enum { F32 = 0, F64 = 1, I32 = 2, I64 = 3 };
/* A segment's control page (segment.CTRL_BYTES): its data slots and rings come after it. */
#define CTRL_PAGE_BYTES 4096

typedef struct {
    PyObject_HEAD
    Py_ssize_t size;
    Py_ssize_t rank;
    Py_ssize_t w_seq, w_sleep, w_tiny, tiny_bytes;
    Py_buffer *bufs;     /* one per rank's segment, held until close() */
    int64_t **ctrl;      /* each rank's control page as int64 words */
    Py_ssize_t *scratch; /* ranks being polled, copied out before the GIL is released */
    const char **srcs;   /* every rank's payload of a fold (used with the GIL held) */
    int busy;            /* a poll runs without the GIL: close() must not release the buffers */
    int closed;
    /* point-to-point rings (set by rings(); ring_bytes 0 until then): the control line of
     * pair q of a segment is at pair_ctrl_base + q * pair_ctrl_bytes, its ring at
     * ring_base + q * ring_bytes */
    Py_ssize_t pair_ctrl_base, pair_ctrl_bytes, ring_base, ring_bytes, w_p2p_sleep;
} SyncObject;

/* A ring entry's header: tag, payload bytes (RING_SKIP: the rest of the ring is unused),
 * socket messages sent before it. Entries start on 8-byte boundaries. */
#define ENTRY_BYTES 24
#define RING_SKIP (-1)
/* Placement (shm_p2p.py, SMALL_SPAN, has the same rule): an entry of at most RING_SMALL_BYTES
 * of payload stays within the first RING_SMALL_SPAN bytes of the ring, and a writer past them
 * that finds the ring empty starts again at its beginning, so the pages past the span are only
 * ever touched by large messages. */
#define RING_SMALL_BYTES (16 * 1024)
#define RING_SMALL_SPAN (64 * 1024)

static void release_buffers(SyncObject *self) {
    if (self->bufs != NULL) {
        for (Py_ssize_t r = 0; r < self->size; r++) {
            if (self->bufs[r].obj != NULL) {
                PyBuffer_Release(&self->bufs[r]);
            }
        }
        PyMem_Free(self->bufs);
        self->bufs = NULL;
    }
    PyMem_Free(self->ctrl);
    self->ctrl = NULL;
    PyMem_Free(self->scratch);
    self->scratch = NULL;
    PyMem_Free((void *)self->srcs);
    self->srcs = NULL;
}

static int check_open(SyncObject *self) {
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "tcp shm: the group's shared memory is closed");
        return -1;
    }
    return 0;
}

/* What every fastcall method checks first: its argument count, then that the memory is open. */
static int begin_call(SyncObject *self, Py_ssize_t nargs, Py_ssize_t expected,
                      const char *name) {
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, expected,
                     nargs);
        return -1;
    }
    return check_open(self);
}

static int Sync_init(SyncObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"segments", "rank", "seq_word", "sleep_word", "tiny_word",
                             "tiny_bytes", NULL};
    PyObject *segments;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onnnnn", kwlist, &segments, &self->rank,
                                     &self->w_seq, &self->w_sleep, &self->w_tiny,
                                     &self->tiny_bytes)) {
        return -1;
    }
    if (self->bufs != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tcp shm: Sync is already initialised");
        return -1;
    }
    PyObject *seq = PySequence_Fast(segments, "tcp shm: segments must be a sequence of mmaps");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t size = PySequence_Fast_GET_SIZE(seq);
    if (self->rank < 0 || self->rank >= size) {
        PyErr_Format(PyExc_ValueError, "tcp shm: rank %zd is not in [0, %zd)", self->rank, size);
        Py_DECREF(seq);
        return -1;
    }
    Py_ssize_t words = self->w_tiny + 8 * 2; /* the last word used: tiny line 1's payload end */
    if (self->w_seq < 0 || self->w_sleep < 0 || self->w_tiny < 0 || self->w_seq >= words
        || self->w_sleep >= words || self->tiny_bytes < 0 || self->tiny_bytes > 7 * 8) {
        PyErr_SetString(PyExc_ValueError, "tcp shm: word offsets out of range");
        Py_DECREF(seq);
        return -1;
    }
    self->size = size;
    self->bufs = PyMem_Calloc((size_t)size, sizeof(Py_buffer));
    self->ctrl = PyMem_Calloc((size_t)size, sizeof(int64_t *));
    self->scratch = PyMem_Calloc((size_t)size, sizeof(Py_ssize_t));
    self->srcs = (const char **)PyMem_Calloc((size_t)size, sizeof(char *));
    if (self->bufs == NULL || self->ctrl == NULL || self->scratch == NULL
        || self->srcs == NULL) {
        release_buffers(self);
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t r = 0; r < size; r++) {
        int flags = r == self->rank ? PyBUF_WRITABLE : PyBUF_SIMPLE;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, r), &self->bufs[r], flags) < 0) {
            release_buffers(self);
            Py_DECREF(seq);
            return -1;
        }
        if (self->bufs[r].len < (Py_ssize_t)(words * sizeof(int64_t))) {
            PyErr_Format(PyExc_ValueError, "tcp shm: segment %zd is too small", r);
            release_buffers(self);
            Py_DECREF(seq);
            return -1;
        }
        self->ctrl[r] = (int64_t *)self->bufs[r].buf;
    }
    Py_DECREF(seq);
    return 0;
}

static void Sync_dealloc(SyncObject *self) {
    release_buffers(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A sleeping peer's sleep word holds 1 + the host rank whose post it waits for
 * (shm.SLEEPS_FOR); 0 while it is awake. */
#define SLEEPS_FOR 1

/* Peers that sleep until this rank posts (read after a full fence), as a tuple of host ranks. */
static PyObject *sleepers(SyncObject *self) {
    Py_ssize_t count = 0;
    const int64_t for_me = SLEEPS_FOR + (int64_t)self->rank;
    for (Py_ssize_t r = 0; r < self->size; r++) {
        if (r != self->rank && load_acquire(&self->ctrl[r][self->w_sleep]) == for_me) {
            self->scratch[count++] = r;
        }
    }
    PyObject *out = PyTuple_New(count);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *r = PyLong_FromSsize_t(self->scratch[i]);
        if (r == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, r);
    }
    return out;
}

static void publish(SyncObject *self, int64_t phase) {
    __atomic_store_n(&self->ctrl[self->rank][self->w_seq], phase, __ATOMIC_RELEASE);
    /* Dekker with a sleeping peer: our phase store is visible before we read its flag. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

PyDoc_STRVAR(post_doc, "post(phase) -> tuple\n\n"
             "Publish ``phase`` and return the host ranks of peers that sleep until this rank\n"
             "posts (to be woken).");

static PyObject *Sync_post(SyncObject *self, PyObject *arg) {
    if (check_open(self) < 0) {
        return NULL;
    }
    long long phase = PyLong_AsLongLong(arg);
    if (phase == -1 && PyErr_Occurred()) {
        return NULL;
    }
    publish(self, (int64_t)phase);
    return sleepers(self);
}

/* Copy ``ranks`` (a sequence of host ranks) into scratch; return their count or -1. */
static Py_ssize_t take_ranks(SyncObject *self, PyObject *ranks) {
    PyObject *seq = PySequence_Fast(ranks, "tcp shm: ranks must be a sequence");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count > self->size) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "tcp shm: more ranks than the group has");
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t r = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (r == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (r < 0 || r >= self->size) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "tcp shm: rank %zd is not in [0, %zd)", r, self->size);
            return -1;
        }
        self->scratch[i] = r;
    }
    Py_DECREF(seq);
    return count;
}

/* Drop the ranks of ranks[:count] that reached ``target``; return how many are left. */
static Py_ssize_t pending(SyncObject *self, Py_ssize_t *ranks, Py_ssize_t count,
                          int64_t target) {
    Py_ssize_t left = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t r = ranks[i];
        if (load_acquire(&self->ctrl[r][self->w_seq]) < target) {
            ranks[left++] = r;
        }
    }
    return left;
}

/* Busy polls between two looks at the clock (a pause is tens of nanoseconds). */
#define POLLS_PER_CLOCK 32

PyDoc_STRVAR(poll_doc, "poll(ranks, target, spin_seconds, yield_seconds) -> int\n\n"
             "Wait until every host rank in ``ranks`` has posted ``target``: busy-poll for\n"
             "``spin_seconds`` holding the GIL, then poll with sched_yield for ``yield_seconds``\n"
             "without it. Return 0 (reached while spinning), 1 (while yielding) or 2 (not\n"
             "reached: the caller blocks).");

static PyObject *Sync_poll(SyncObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (begin_call(self, nargs, 4, "poll") < 0) {
        return NULL;
    }
    Py_ssize_t count = take_ranks(self, args[0]);
    if (count < 0) {
        return NULL;
    }
    long long target = PyLong_AsLongLong(args[1]);
    double spin = PyFloat_AsDouble(args[2]);
    double yield = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t *ranks = self->scratch;
    count = pending(self, ranks, count, target);
    if (count == 0) {
        return PyLong_FromLong(0);
    }
    if (spin > 0) {
        double deadline = now_seconds() + spin;
        do {
            for (int i = 0; i < POLLS_PER_CLOCK; i++) {
                cpu_relax();
                count = pending(self, ranks, count, target);
                if (count == 0) {
                    return PyLong_FromLong(0);
                }
            }
        } while (now_seconds() < deadline);
    }
    long status = 2;
    if (yield > 0) {
        /* Another thread may use scratch while this one runs without the GIL. */
        Py_ssize_t *own = PyMem_Malloc((size_t)count * sizeof(Py_ssize_t));
        if (own == NULL) {
            return PyErr_NoMemory();
        }
        memcpy(own, ranks, (size_t)count * sizeof(Py_ssize_t));
        self->busy++;
        Py_BEGIN_ALLOW_THREADS
        double deadline = now_seconds() + yield;
        do {
            sched_yield();
            count = pending(self, own, count, target);
            if (count == 0) {
                status = 1;
                break;
            }
        } while (now_seconds() < deadline);
        Py_END_ALLOW_THREADS
        PyMem_Free(own);
        if (--self->busy == 0 && self->closed) {
            release_buffers(self); /* close() came while we polled without the GIL */
        }
    }
    return PyLong_FromLong(status);
}

/* Whether the ``word`` of ranks[:count] all equal this rank's (acquire: read after their
 * phase). */
static int stamps_match(SyncObject *self, const Py_ssize_t *ranks, Py_ssize_t count,
                        Py_ssize_t word) {
    int64_t mine = self->ctrl[self->rank][word];
    for (Py_ssize_t i = 0; i < count; i++) {
        if (load_acquire(&self->ctrl[ranks[i]][word]) != mine) {
            return 0;
        }
    }
    return 1;
}

PyDoc_STRVAR(same_stamp_doc, "same_stamp(ranks, word) -> bool\n\n"
             "Whether the control word ``word`` of every host rank in ``ranks`` equals this\n"
             "rank's.");

static PyObject *Sync_same_stamp(SyncObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (begin_call(self, nargs, 2, "same_stamp") < 0) {
        return NULL;
    }
    Py_ssize_t count = take_ranks(self, args[0]);
    if (count < 0) {
        return NULL;
    }
    Py_ssize_t word = PyLong_AsSsize_t(args[1]);
    if (word == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (word < 0 || word >= self->w_tiny + 16) {
        PyErr_Format(PyExc_ValueError, "tcp shm: no stamp word %zd", word);
        return NULL;
    }
    return PyBool_FromLong(stamps_match(self, self->scratch, count, word));
}

static int64_t *tiny_line(SyncObject *self, Py_ssize_t rank, long line) {
    return self->ctrl[rank] + self->w_tiny + 8 * line;
}

PyDoc_STRVAR(tiny_post_doc, "tiny_post(array, line, tag, phase) -> tuple\n\n"
             "Stamp tiny line ``line`` with ``tag``, copy ``array``'s bytes into its payload,\n"
             "publish ``phase``; return the peers that sleep (as post()).");

static PyObject *Sync_tiny_post(SyncObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (begin_call(self, nargs, 4, "tiny_post") < 0) {
        return NULL;
    }
    long line = PyLong_AsLong(args[1]);
    long long tag = PyLong_AsLongLong(args[2]);
    long long phase = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (line != 0 && line != 1) {
        PyErr_Format(PyExc_ValueError, "tcp shm: no tiny line %ld", line);
        return NULL;
    }
    Py_buffer src;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (src.len > self->tiny_bytes) {
        PyErr_Format(PyExc_ValueError, "tcp shm: %zd bytes do not fit a tiny line (%zd)",
                     src.len, self->tiny_bytes);
        PyBuffer_Release(&src);
        return NULL;
    }
    int64_t *mine = tiny_line(self, self->rank, line);
    mine[0] = (int64_t)tag;
    memcpy(mine + 1, src.buf, (size_t)src.len);
    PyBuffer_Release(&src);
    publish(self, (int64_t)phase);
    return sleepers(self);
}

/* d[i] = d[i] OP s[i] for each next rank's payload s, in the element type: with d first set to
 * rank 0's, NumPy's rank-order result. Integers wrap as NumPy's do (computed unsigned: signed
 * overflow is undefined in C). Byte copies, not typed pointers: the caller's array need not be
 * aligned. */
#define FOLD_INTO(TYPE, ACC, OP)                                                               \
    for (Py_ssize_t r = 1; r < size; r++) {                                                  \
        const char *s = srcs[r];                                                             \
        for (Py_ssize_t i = 0; i < nbytes / (Py_ssize_t)sizeof(TYPE); i++) {                 \
            TYPE a, b;                                                                       \
            memcpy(&a, d + i * sizeof(TYPE), sizeof(TYPE));                                  \
            memcpy(&b, s + i * sizeof(TYPE), sizeof(TYPE));                                  \
            a = (TYPE)((ACC)a OP (ACC)b);                                                    \
            memcpy(d + i * sizeof(TYPE), &a, sizeof(TYPE));                                  \
        }                                                                                    \
    }

/* Element bytes of each fold dtype (code >> 1). */
static const Py_ssize_t fold_itemsize[] = {4, 8, 4, 8};

/* Set the ``nbytes`` at ``d`` to the rank-order fold ``code`` of ``srcs[0..size)``. */
static void fold_into(char *d, const char **srcs, Py_ssize_t size, Py_ssize_t nbytes,
                      long code) {
    memcpy(d, srcs[0], (size_t)nbytes);
    switch (code) {
    case 2 * F32: FOLD_INTO(float, float, +) break;
    case 2 * F32 + 1: FOLD_INTO(float, float, *) break;
    case 2 * F64: FOLD_INTO(double, double, +) break;
    case 2 * F64 + 1: FOLD_INTO(double, double, *) break;
    case 2 * I32: FOLD_INTO(int32_t, uint32_t, +) break;
    case 2 * I32 + 1: FOLD_INTO(int32_t, uint32_t, *) break;
    case 2 * I64: FOLD_INTO(int64_t, uint64_t, +) break;
    case 2 * I64 + 1: FOLD_INTO(int64_t, uint64_t, *) break;
    }
}

PyDoc_STRVAR(tiny_fold_doc, "tiny_fold(array, line, code) -> bool\n\n"
             "If every peer stamped tiny line ``line`` as this rank did, set ``array`` to the\n"
             "rank-order fold of every rank's payload (``code``: dtype * 2 + product, dtypes\n"
             "float32, float64, int32, int64) and return True; else return False, unchanged.");

static PyObject *Sync_tiny_fold(SyncObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (begin_call(self, nargs, 3, "tiny_fold") < 0) {
        return NULL;
    }
    long line = PyLong_AsLong(args[1]);
    long code = PyLong_AsLong(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if ((line != 0 && line != 1) || code < 0 || code > 7) {
        PyErr_Format(PyExc_ValueError, "tcp shm: no tiny line %ld or fold %ld", line, code);
        return NULL;
    }
    Py_ssize_t peers = 0;
    for (Py_ssize_t r = 0; r < self->size; r++) {
        if (r != self->rank) {
            self->scratch[peers++] = r;
        }
    }
    if (!stamps_match(self, self->scratch, peers, self->w_tiny + 8 * line)) {
        Py_RETURN_FALSE;
    }
    Py_buffer dst;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    if (dst.len > self->tiny_bytes || dst.len % fold_itemsize[code >> 1]) {
        PyErr_Format(PyExc_ValueError, "tcp shm: %zd bytes are not a tiny payload of fold %ld",
                     dst.len, code);
        PyBuffer_Release(&dst);
        return NULL;
    }
    for (Py_ssize_t r = 0; r < self->size; r++) {
        self->srcs[r] = (const char *)(tiny_line(self, r, line) + 1);
    }
    fold_into((char *)dst.buf, self->srcs, self->size, dst.len, code);
    PyBuffer_Release(&dst);
    Py_RETURN_TRUE;
}

/* The bytes [offset, offset + len) of rank r's segment, or NULL (an exception set) when they
 * are not all inside it. */
static char *segment_bytes(SyncObject *self, Py_ssize_t r, Py_ssize_t offset, Py_ssize_t len) {
    if (offset < CTRL_PAGE_BYTES || len < 0 || offset > self->bufs[r].len - len) {
        PyErr_Format(PyExc_ValueError, "tcp shm: bytes %zd..%zd are not a data area of segment %zd",
                     offset, offset + len, r);
        return NULL;
    }
    return (char *)self->bufs[r].buf + offset;
}

PyDoc_STRVAR(slot_post_doc, "slot_post(array, offset, phase) -> tuple\n\n"
             "Copy ``array``'s bytes to ``offset`` of this rank's segment (a data slot, already\n"
             "stamped), publish ``phase``; return the peers that sleep (as post()).");

static PyObject *Sync_slot_post(SyncObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (begin_call(self, nargs, 3, "slot_post") < 0) {
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    long long phase = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer src;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    char *slot = segment_bytes(self, self->rank, offset, src.len);
    if (slot != NULL) {
        memcpy(slot, src.buf, (size_t)src.len);
    }
    PyBuffer_Release(&src);
    if (slot == NULL) {
        return NULL;
    }
    publish(self, (int64_t)phase);
    return sleepers(self);
}

PyDoc_STRVAR(slot_fold_doc, "slot_fold(array, offset, stamp_word, code) -> bool\n\n"
             "If every peer stamped word ``stamp_word`` as this rank did, set ``array`` to the\n"
             "rank-order fold of every rank's bytes at ``offset`` (as many as ``array`` has;\n"
             "``code`` as tiny_fold's) and return True; else return False, unchanged.");

static PyObject *Sync_slot_fold(SyncObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (begin_call(self, nargs, 4, "slot_fold") < 0) {
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    Py_ssize_t word = PyLong_AsSsize_t(args[2]);
    long code = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (code < 0 || code > 7 || word < 0 || word >= CTRL_PAGE_BYTES / 8) {
        PyErr_Format(PyExc_ValueError, "tcp shm: no fold %ld or stamp word %zd", code, word);
        return NULL;
    }
    Py_ssize_t peers = 0;
    for (Py_ssize_t r = 0; r < self->size; r++) {
        if (r != self->rank) {
            self->scratch[peers++] = r;
        }
    }
    if (!stamps_match(self, self->scratch, peers, word)) {
        Py_RETURN_FALSE;
    }
    Py_buffer dst;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    if (dst.len % fold_itemsize[code >> 1]) {
        PyErr_Format(PyExc_ValueError, "tcp shm: %zd bytes are not whole elements of fold %ld",
                     dst.len, code);
        PyBuffer_Release(&dst);
        return NULL;
    }
    for (Py_ssize_t r = 0; r < self->size; r++) {
        self->srcs[r] = segment_bytes(self, r, offset, dst.len);
        if (self->srcs[r] == NULL) {
            PyBuffer_Release(&dst);
            return NULL;
        }
    }
    fold_into((char *)dst.buf, self->srcs, self->size, dst.len, code);
    PyBuffer_Release(&dst);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(rings_doc, "rings(pair_ctrl_base, pair_ctrl_bytes, ring_base, ring_bytes, p2p_sleep_word)\n\n"
             "Enable ring_put/ring_take on segments that carry one pair area per host rank.");

static PyObject *Sync_rings(SyncObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (begin_call(self, nargs, 5, "rings") < 0) {
        return NULL;
    }
    Py_ssize_t v[5];
    for (int i = 0; i < 5; i++) {
        v[i] = PyLong_AsSsize_t(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    Py_ssize_t end = v[2] + self->size * v[3];
    if (v[0] < 0 || v[1] < 16 || v[1] % 8 || v[3] < 4 * ENTRY_BYTES || v[3] % 8
        || v[2] < v[0] + self->size * v[1] || v[4] < 0 || v[4] * 8 >= v[0]) {
        PyErr_SetString(PyExc_ValueError, "tcp shm: ring layout out of range");
        return NULL;
    }
    for (Py_ssize_t r = 0; r < self->size; r++) {
        if (self->bufs[r].len < end) {
            PyErr_Format(PyExc_ValueError, "tcp shm: segment %zd has no pair areas", r);
            return NULL;
        }
    }
    self->pair_ctrl_base = v[0];
    self->pair_ctrl_bytes = v[1];
    self->ring_base = v[2];
    self->ring_bytes = v[3];
    self->w_p2p_sleep = v[4];
    Py_RETURN_NONE;
}

static inline int64_t *pair_ctrl(SyncObject *self, Py_ssize_t seg, Py_ssize_t q) {
    return (int64_t *)((char *)self->bufs[seg].buf + self->pair_ctrl_base
                       + q * self->pair_ctrl_bytes);
}

static inline char *pair_ring(SyncObject *self, Py_ssize_t seg, Py_ssize_t q) {
    return (char *)self->bufs[seg].buf + self->ring_base + q * self->ring_bytes;
}

static inline int64_t entry_size(int64_t nbytes) {
    return ENTRY_BYTES + (nbytes + 7) / 8 * 8;
}

/* The peer (host rank) named by args[0], after the common checks. -1 with an exception set. */
static Py_ssize_t ring_peer(SyncObject *self, PyObject *const *args, Py_ssize_t nargs,
                            Py_ssize_t expected, const char *name) {
    if (begin_call(self, nargs, expected, name) < 0) {
        return -1;
    }
    if (self->ring_bytes == 0) {
        PyErr_SetString(PyExc_ValueError, "tcp shm: rings() was not called");
        return -1;
    }
    Py_ssize_t peer = PyLong_AsSsize_t(args[0]);
    if (peer == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (peer < 0 || peer >= self->size || peer == self->rank) {
        PyErr_Format(PyExc_ValueError, "tcp shm: %zd is not a host peer", peer);
        return -1;
    }
    return peer;
}

/* The arguments of ring_put and ring_take: (peer, buffer, tag, count); the buffer is args[1].
 * Returns the peer, or -1 with an exception set. */
static Py_ssize_t ring_call(SyncObject *self, PyObject *const *args, Py_ssize_t nargs,
                            const char *name, long long *tag, long long *count) {
    Py_ssize_t peer = ring_peer(self, args, nargs, 4, name);
    if (peer < 0) {
        return -1;
    }
    *tag = PyLong_AsLongLong(args[2]);
    *count = PyLong_AsLongLong(args[3]);
    return PyErr_Occurred() ? -1 : peer;
}

PyDoc_STRVAR(ring_put_doc, "ring_put(peer, payload, tag, sockets_before) -> int\n\n"
             "Write one entry into this rank's ring to host rank ``peer`` and publish it:\n"
             "0 if it does not fit (more than half the ring, or the ring is full: the caller sends\n"
             "another way),\n"
             "1 written, 2 written and a thread of the peer sleeps (the caller wakes it).");

static PyObject *Sync_ring_put(SyncObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long tag, before;
    Py_ssize_t peer = ring_call(self, args, nargs, "ring_put", &tag, &before);
    if (peer < 0) {
        return NULL;
    }
    Py_buffer src;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    int64_t nbytes = (int64_t)src.len;
    int64_t ring_bytes = (int64_t)self->ring_bytes;
    if (nbytes > ring_bytes / 2) {
        PyBuffer_Release(&src);
        return PyLong_FromLong(0);
    }
    int64_t *mine = pair_ctrl(self, self->rank, peer);  /* [0]: my head to the peer */
    int64_t *theirs = pair_ctrl(self, peer, self->rank); /* [1]: what it consumed of mine */
    char *ring = pair_ring(self, self->rank, peer);
    int64_t size = entry_size(nbytes);
    int64_t head = mine[0]; /* this rank alone writes it */
    int64_t pos = head % ring_bytes;
    int64_t left = ring_bytes - pos;
    int64_t consumed = load_acquire(&theirs[1]);
    int64_t waste = 0;
    if (left < size || (pos && nbytes <= RING_SMALL_BYTES && pos + size > RING_SMALL_SPAN)) {
        waste = left;
    } else if (pos >= RING_SMALL_SPAN && head == consumed && size <= pos) {
        /* empty, and a large message took the writer past the span: start again at the
         * beginning (the wrap marker stays intact). Not from within the span: until the reader
         * passes the marker, the rest of the ring counts as used. */
        waste = left;
    }
    if (head + waste + size - consumed > ring_bytes) {
        PyBuffer_Release(&src);
        return PyLong_FromLong(0);
    }
    if (waste) {
        if (left >= ENTRY_BYTES) {
            int64_t skip[3] = {0, RING_SKIP, 0};
            memcpy(ring + pos, skip, sizeof skip);
        }
        head += waste;
        pos = 0;
    }
    int64_t header[3] = {(int64_t)tag, nbytes, (int64_t)before};
    memcpy(ring + pos, header, sizeof header);
    memcpy(ring + pos + ENTRY_BYTES, src.buf, (size_t)nbytes);
    PyBuffer_Release(&src);
    __atomic_store_n(&mine[0], head + size, __ATOMIC_RELEASE);
    /* Dekker with a peer about to sleep: our head is visible before we read its flag. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return PyLong_FromLong(load_acquire(&self->ctrl[peer][self->w_p2p_sleep]) ? 2 : 1);
}

/* The position of the next entry of host rank ``peer``'s ring to this rank, after skipping
 * wrap markers (consuming them); -1 when the ring is empty. Fills ``header``. */
static int64_t next_entry(SyncObject *self, Py_ssize_t peer, int64_t header[3]) {
    int64_t *theirs = pair_ctrl(self, peer, self->rank); /* [0]: its head to me */
    int64_t *mine = pair_ctrl(self, self->rank, peer);   /* [1]: what I consumed of it */
    const char *ring = pair_ring(self, peer, self->rank);
    int64_t ring_bytes = (int64_t)self->ring_bytes;
    for (;;) {
        int64_t consumed = mine[1]; /* this rank alone writes it */
        if (load_acquire(&theirs[0]) == consumed) {
            return -1;
        }
        int64_t pos = consumed % ring_bytes;
        int64_t left = ring_bytes - pos;
        if (left >= ENTRY_BYTES) {
            memcpy(header, ring + pos, 3 * sizeof(int64_t));
            if (header[1] != RING_SKIP) {
                return pos;
            }
        }
        __atomic_store_n(&mine[1], consumed + left, __ATOMIC_RELEASE);
    }
}

PyDoc_STRVAR(ring_peek_doc, "ring_peek(peer) -> (tag, nbytes, sockets_before) or None\n\n"
             "The header of the next entry of host rank ``peer``'s ring to this rank (wrap\n"
             "markers before it are consumed); None when the ring is empty.");

static PyObject *Sync_ring_peek(SyncObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t peer = ring_peer(self, args, nargs, 1, "ring_peek");
    if (peer < 0) {
        return NULL;
    }
    int64_t header[3];
    if (next_entry(self, peer, header) < 0) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(LLL)", (long long)header[0], (long long)header[1],
                         (long long)header[2]);
}

PyDoc_STRVAR(ring_wait_doc, "ring_wait(peer, seconds) -> bool\n\n"
             "Spin (the GIL held) until host rank ``peer``'s ring to this rank holds an entry\n"
             "not consumed yet, at most ``seconds``: whether it does. Reads only.");

static PyObject *Sync_ring_wait(SyncObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t peer = ring_peer(self, args, nargs, 2, "ring_wait");
    if (peer < 0) {
        return NULL;
    }
    double seconds = PyFloat_AsDouble(args[1]);
    if (seconds == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    const int64_t *theirs = pair_ctrl(self, peer, self->rank); /* [0]: its head to me */
    const int64_t *mine = pair_ctrl(self, self->rank, peer);   /* [1]: what I consumed of it */
    int64_t consumed = mine[1]; /* this rank alone writes it, and not while it waits here */
    double deadline = now_seconds() + seconds;
    do {
        for (int i = 0; i < POLLS_PER_CLOCK; i++) {
            if (load_acquire(&theirs[0]) != consumed) {
                Py_RETURN_TRUE;
            }
            cpu_relax();
        }
    } while (now_seconds() < deadline);
    return PyBool_FromLong(load_acquire(&theirs[0]) != consumed);
}

PyDoc_STRVAR(ring_take_doc, "ring_take(peer, buffer, tag, max_before) -> int\n\n"
             "Take the next entry of host rank ``peer``'s ring to this rank into ``buffer``\n"
             "(writable) if it carries ``tag``, fills ``buffer`` exactly and counts at most\n"
             "``max_before`` socket messages before it: 1 taken, 0 the ring is empty, -1 the\n"
             "next entry is another (left in place).");

static PyObject *Sync_ring_take(SyncObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long tag, max_before;
    Py_ssize_t peer = ring_call(self, args, nargs, "ring_take", &tag, &max_before);
    if (peer < 0) {
        return NULL;
    }
    int64_t *mine = pair_ctrl(self, self->rank, peer); /* [1]: what I consumed of it */
    const char *ring = pair_ring(self, peer, self->rank);
    int64_t ring_bytes = (int64_t)self->ring_bytes;
    int64_t header[3];
    int64_t pos = next_entry(self, peer, header);
    if (pos < 0) {
        return PyLong_FromLong(0);
    }
    /* A header the peer wrote wrong (or on purpose) is left to the Python path's checks. */
    if (header[0] != (int64_t)tag || header[2] > (int64_t)max_before || header[1] < 0
        || header[1] > ring_bytes - pos - ENTRY_BYTES) {
        return PyLong_FromLong(-1);
    }
    Py_buffer dst;
    if (PyObject_GetBuffer(args[1], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    if ((int64_t)dst.len != header[1]) {
        PyBuffer_Release(&dst);
        return PyLong_FromLong(-1);
    }
    memcpy(dst.buf, ring + pos + ENTRY_BYTES, (size_t)header[1]);
    PyBuffer_Release(&dst);
    /* Our reads of the entry happen before the peer may see it consumed and reuse it. */
    __atomic_store_n(&mine[1], mine[1] + entry_size(header[1]), __ATOMIC_RELEASE);
    return PyLong_FromLong(1);
}

PyDoc_STRVAR(close_doc, "close()\n\nRelease the segments (at once, or when a running poll ends).");

static PyObject *Sync_close(SyncObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->closed) {
        self->closed = 1;
        if (self->busy == 0) {
            release_buffers(self);
        }
    }
    Py_RETURN_NONE;
}

static PyMethodDef Sync_methods[] = {
    {"post", (PyCFunction)Sync_post, METH_O, post_doc},
    {"poll", (PyCFunction)(void (*)(void))Sync_poll, METH_FASTCALL, poll_doc},
    {"same_stamp", (PyCFunction)(void (*)(void))Sync_same_stamp, METH_FASTCALL, same_stamp_doc},
    {"tiny_post", (PyCFunction)(void (*)(void))Sync_tiny_post, METH_FASTCALL, tiny_post_doc},
    {"tiny_fold", (PyCFunction)(void (*)(void))Sync_tiny_fold, METH_FASTCALL, tiny_fold_doc},
    {"slot_post", (PyCFunction)(void (*)(void))Sync_slot_post, METH_FASTCALL, slot_post_doc},
    {"slot_fold", (PyCFunction)(void (*)(void))Sync_slot_fold, METH_FASTCALL, slot_fold_doc},
    {"rings", (PyCFunction)(void (*)(void))Sync_rings, METH_FASTCALL, rings_doc},
    {"ring_put", (PyCFunction)(void (*)(void))Sync_ring_put, METH_FASTCALL, ring_put_doc},
    {"ring_peek", (PyCFunction)(void (*)(void))Sync_ring_peek, METH_FASTCALL, ring_peek_doc},
    {"ring_take", (PyCFunction)(void (*)(void))Sync_ring_take, METH_FASTCALL, ring_take_doc},
    {"ring_wait", (PyCFunction)(void (*)(void))Sync_ring_wait, METH_FASTCALL, ring_wait_doc},
    {"close", (PyCFunction)Sync_close, METH_NOARGS, close_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Sync_doc,
             "Sync(segments, rank, seq_word, sleep_word, tiny_word, tiny_bytes)\n\n"
             "The phase words and tiny lines of every host rank's segment (``segments``: the\n"
             "mmaps, by host rank; this rank's is written, the others only read).");

static PyTypeObject SyncType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "colls_plugins.tcp.shm._native.Sync",
    .tp_basicsize = sizeof(SyncObject),
    .tp_dealloc = (destructor)Sync_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Sync_doc,
    .tp_methods = Sync_methods,
    .tp_init = (initproc)Sync_init,
    .tp_new = PyType_GenericNew,
};

/* ---- A read-only mapping that holds no descriptor ------------------------------------------ */

typedef struct {
    PyObject_HEAD
    char *addr;          /* NULL once closed */
    Py_ssize_t size;
    Py_ssize_t exports;  /* buffers handed out and not yet released: close() refuses while > 0 */
} MappingObject;

static int Mapping_getbuffer(MappingObject *self, Py_buffer *view, int flags) {
    if (self->addr == NULL) {
        PyErr_SetString(PyExc_ValueError, "tcp shm: mapping closed");
        return -1;
    }
    /* read-only: a request for a writable buffer raises BufferError */
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->addr, self->size, 1, flags) < 0) {
        return -1;
    }
    self->exports++;
    return 0;
}

static void Mapping_releasebuffer(MappingObject *self, Py_buffer *Py_UNUSED(view)) {
    self->exports--;
}

static PyBufferProcs Mapping_as_buffer = {
    .bf_getbuffer = (getbufferproc)Mapping_getbuffer,
    .bf_releasebuffer = (releasebufferproc)Mapping_releasebuffer,
};

PyDoc_STRVAR(Mapping_close_doc,
             "close()\n\nUnmap; BufferError while a view of it is alive (as mmap.mmap.close).");

static PyObject *Mapping_close(MappingObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->exports > 0) {
        PyErr_SetString(PyExc_BufferError, "cannot close exported pointers exist");
        return NULL;
    }
    if (self->addr != NULL) {
        munmap(self->addr, (size_t)self->size);
        self->addr = NULL;
    }
    Py_RETURN_NONE;
}

static Py_ssize_t Mapping_len(MappingObject *self) {
    return self->size;
}

static PyObject *Mapping_get_closed(MappingObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(self->addr == NULL);
}

static void Mapping_dealloc(MappingObject *self) {
    if (self->addr != NULL) {  /* no export can be alive: each holds a reference to us */
        munmap(self->addr, (size_t)self->size);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Mapping_methods[] = {
    {"close", (PyCFunction)Mapping_close, METH_NOARGS, Mapping_close_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Mapping_getset[] = {
    {"closed", (getter)Mapping_get_closed, NULL, "Whether it is unmapped.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Mapping_as_sequence = {
    .sq_length = (lenfunc)Mapping_len,
};

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "colls_plugins.tcp.shm._native.Mapping",
    .tp_basicsize = sizeof(MappingObject),
    .tp_dealloc = (destructor)Mapping_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A read-only shared mapping of a file (made by map_read_only).",
    .tp_methods = Mapping_methods,
    .tp_getset = Mapping_getset,
    .tp_as_buffer = &Mapping_as_buffer,
    .tp_as_sequence = &Mapping_as_sequence,
};

PyDoc_STRVAR(map_read_only_doc,
             "map_read_only(fd, size)\n\n"
             "Map ``size`` bytes of ``fd`` shared and read-only; the mapping keeps no descriptor,\n"
             "so the caller may close ``fd`` at once.");

static PyObject *map_read_only(PyObject *Py_UNUSED(module), PyObject *const *args,
                               Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "map_read_only(fd, size) takes 2 arguments");
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (fd < 0 || fd > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "tcp shm: not a file descriptor");
        return NULL;
    }
    Py_ssize_t size = PyLong_AsSsize_t(args[1]);
    if (size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (size <= 0) {
        PyErr_SetString(PyExc_ValueError, "tcp shm: mapping size must be positive");
        return NULL;
    }
    void *addr = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, (int)fd, 0);
    if (addr == MAP_FAILED) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    MappingObject *self = PyObject_New(MappingObject, &MappingType);
    if (self == NULL) {
        munmap(addr, (size_t)size);
        return NULL;
    }
    self->addr = addr;
    self->size = size;
    self->exports = 0;
    return (PyObject *)self;
}

static PyMethodDef module_methods[] = {
    {"map_read_only", (PyCFunction)(void (*)(void))map_read_only, METH_FASTCALL,
     map_read_only_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "colls_plugins.tcp.shm._native",
    .m_doc = "The compiled hot loop of the tcp backend's shared memory (optional).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&SyncType) < 0 || PyType_Ready(&MappingType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    /* colls_plugins/tcp/shm/native.py refuses a build whose interface is not the one it
     * expects (an editable install whose .so predates a change to this file). */
    if (PyModule_AddIntConstant(m, "INTERFACE", 7) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SyncType);
    if (PyModule_AddObject(m, "Sync", (PyObject *)&SyncType) < 0) {
        Py_DECREF(&SyncType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
