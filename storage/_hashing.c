/* strata's compiled page-key chain (storage/hashing.py has the definition, the reference and the fallback).
 *
 * chain_ids(parent, tokens, page_size, n_pages, person) -> list of n_pages ints: the wire's block ids
 * (the first 8 bytes of each page key, big-endian, as an unsigned int) of the first ``n_pages`` pages of
 * list ``tokens``, the chain starting from the 16-byte key ``parent``. A page key is BLAKE2b (digest 16
 * bytes, no key, personalization ``person``) over the parent key then the page's token ids as
 * little-endian int64 -- the same bytes hashing.py feeds hashlib. Here the whole chain runs without a
 * Python object per page: hashlib's per-call work (copying a configured hasher, two updates, a slice, a
 * digest object, the int) was over half of a prompt's hashing time.
 *
 * Returns None (no exception) when an item is not an int in [0, 2**63): the caller takes the Python path,
 * which raises the precise error. BLAKE2b as specified in RFC 7693, written from the specification.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t load_le(const uint8_t *p) {
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 24)
           | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) | ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline void store_le(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define G(a, b, c, d, x, y)                 \
    do {                                    \
        a = a + b + (x); d = rotr(d ^ a, 32); \
        c = c + d;       b = rotr(b ^ c, 24); \
        a = a + b + (y); d = rotr(d ^ a, 16); \
        c = c + d;       b = rotr(b ^ c, 63); \
    } while (0)

/* One compression of a 128-byte block; ``t``: bytes hashed so far including this block. */
static void compress(uint64_t h[8], const uint8_t *block, uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++)
        m[i] = load_le(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t;   /* the counter's high word stays 0: a page is far below 2**64 bytes */
    if (last)
        v[14] = ~v[14];
#define ROUND(r)                                                      \
    do {                                                              \
        G(v[0], v[4], v[8], v[12], m[SIGMA[r][0]], m[SIGMA[r][1]]);   \
        G(v[1], v[5], v[9], v[13], m[SIGMA[r][2]], m[SIGMA[r][3]]);   \
        G(v[2], v[6], v[10], v[14], m[SIGMA[r][4]], m[SIGMA[r][5]]);  \
        G(v[3], v[7], v[11], v[15], m[SIGMA[r][6]], m[SIGMA[r][7]]);  \
        G(v[0], v[5], v[10], v[15], m[SIGMA[r][8]], m[SIGMA[r][9]]);  \
        G(v[1], v[6], v[11], v[12], m[SIGMA[r][10]], m[SIGMA[r][11]]); \
        G(v[2], v[7], v[8], v[13], m[SIGMA[r][12]], m[SIGMA[r][13]]);  \
        G(v[3], v[4], v[9], v[14], m[SIGMA[r][14]], m[SIGMA[r][15]]);  \
    } while (0)
    /* rounds written out: with constant indices the message words need no table lookups */
    ROUND(0); ROUND(1); ROUND(2); ROUND(3); ROUND(4); ROUND(5);
    ROUND(6); ROUND(7); ROUND(8); ROUND(9); ROUND(10); ROUND(11);
#undef ROUND
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

#define KEY_BYTES 16

static PyObject *chain_ids(PyObject *self, PyObject *args) {
    Py_buffer parent, person;
    PyObject *tokens;
    Py_ssize_t page_size, n_pages;
    if (!PyArg_ParseTuple(args, "y*O!nny*", &parent, &PyList_Type, &tokens, &page_size, &n_pages, &person))
        return NULL;
    PyObject *out = NULL;
    uint8_t *buf = NULL;
    if (parent.len != KEY_BYTES || person.len > 16 || page_size < 1 || n_pages < 0
            || n_pages > PyList_GET_SIZE(tokens) / page_size) {
        PyErr_SetString(PyExc_ValueError, "chain_ids: a 16-byte parent, person <= 16 bytes, page_size >= 1, "
                                          "n_pages <= len(tokens) // page_size");
        goto done;
    }
    /* The initial state: parameter block of digest 16, no key, fanout 1, depth 1, personalization. */
    uint8_t pers[16] = {0};
    memcpy(pers, person.buf, (size_t)person.len);
    uint64_t h0[8];
    memcpy(h0, IV, sizeof h0);
    h0[0] ^= 0x01010000ULL ^ KEY_BYTES;
    h0[6] ^= load_le(pers);
    h0[7] ^= load_le(pers + 8);

    Py_ssize_t msg = KEY_BYTES + 8 * page_size;            /* parent key, then the page's tokens */
    Py_ssize_t padded = (msg + 127) / 128 * 128;
    buf = PyMem_Malloc((size_t)padded);
    out = PyList_New(n_pages);
    if (buf == NULL || out == NULL) {
        if (buf == NULL)
            PyErr_NoMemory();
        Py_CLEAR(out);
        goto done;
    }
    memcpy(buf, parent.buf, KEY_BYTES);
    PyObject **items = PySequence_Fast_ITEMS(tokens);
    for (Py_ssize_t p = 0; p < n_pages; p++) {
        uint8_t *w = buf + KEY_BYTES;
        PyObject **tok = items + p * page_size;
        for (Py_ssize_t j = 0; j < page_size; j++) {
            PyObject *o = tok[j];
            long long v;
            if (!PyLong_Check(o) || ((v = PyLong_AsLongLong(o)) < 0)) {
                PyErr_Clear();   /* overflow, a negative id, not an int: the Python path says which */
                Py_DECREF(out);
                out = Py_None;
                Py_INCREF(out);
                goto done;
            }
            store_le(w + 8 * j, (uint64_t)v);
        }
        memset(buf + msg, 0, (size_t)(padded - msg));
        uint64_t h[8];
        memcpy(h, h0, sizeof h);
        Py_ssize_t off = 0;
        for (; off + 128 < msg; off += 128)
            compress(h, buf + off, (uint64_t)(off + 128), 0);
        compress(h, buf + off, (uint64_t)msg, 1);
        /* the key's first 8 bytes are h[0] little-endian; the block id reads them big-endian */
        uint64_t id = 0;
        for (int i = 0; i < 8; i++)
            id = (id << 8) | ((h[0] >> (8 * i)) & 0xff);
        PyObject *x = PyLong_FromUnsignedLongLong(id);
        if (x == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, p, x);
        store_le(buf, h[0]);   /* this page's key is the next page's parent */
        store_le(buf + 8, h[1]);
    }
done:
    PyMem_Free(buf);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&person);
    return out;
}

static PyMethodDef methods[] = {
    {"chain_ids", chain_ids, METH_VARARGS,
     "chain_ids(parent, tokens, page_size, n_pages, person) -> block ids of the pages (see the module doc)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hashing", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hashing(void) { return PyModule_Create(&module); }
