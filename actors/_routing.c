/* strata's compiled prefix-index walk (actors/routing.py has the rule, the Python walk and the fallback).
 *
 * overlap(full, swa, keys, shifts, l3_shift, window_pages) -> [(pages, l1, l2, l3) per worker], or None
 * where the index holds something the Python walk must judge (a value that is not an int): the same answer
 * as routing._walk. ``full`` / ``swa``: block id -> mask, bit ``3 * slot + rank`` (rank L1 0, L2 1, L3 2)
 * set where the holder of that slot holds the page in that tier (``swa`` None: no window to check);
 * ``shifts``: ``3 * slot`` per worker (-1: a worker the index never saw); ``l3_shift``: the shared L3
 * store's (its tier-L3 bit is the one that serves every worker; -1: none). Each key is looked up once in
 * ``full`` up to the first one nobody holds; each worker's pages run up to its first page held neither by
 * it nor by the shared L3, each page served from the fastest tier the worker holds it in, else L3; the
 * prefix is usable up to the end of the last run of SWA pages (the worker's or L3's) inside it that is
 * ``window_pages`` long or starts at page 0.
 *
 * Why C: one loop looks every key up, the lookups' cache misses prefetched together (prefetch_lookups),
 * and keeps each page's mask as a machine word; the workers' walks are then shifts and ands over that
 * array. Measured at 100k indexed pages (bench/router.py's index, 63-page prompts, cold cache as after
 * hashing a fresh prompt): the walk of 4 workers ~10.6 us without the prefetch, ~5.5 us with it, ~2.2 us
 * with everything in cache.
 * Masks wider than 64 bits (holders of slot 21 and up: a cluster whose workers came and went) are read
 * through Python's own int operations for those holders only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The 3 tier bits at ``shift`` of the mask ``v`` (a Python int; ``lo``: its low 64 bits). -1 on error. */
static int tier_bits(PyObject *v, uint64_t lo, Py_ssize_t shift) {
    if (shift < 0)
        return 0;
    if (shift <= 61)
        return (int)((lo >> shift) & 7);
    PyObject *s = PyLong_FromSsize_t(shift);
    if (s == NULL)
        return -1;
    PyObject *r = PyNumber_Rshift(v, s);
    Py_DECREF(s);
    if (r == NULL)
        return -1;
    unsigned long long b = PyLong_AsUnsignedLongLongMask(r);
    Py_DECREF(r);
    if (b == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    return (int)(b & 7);
}

/* Low 64 bits of an int mask; 0 with *bad set where it is not an int (the Python walk judges it). */
static uint64_t low_bits(PyObject *v, int *bad) {
    if (!PyLong_CheckExact(v)) {
        *bad = 1;
        return 0;
    }
    return (uint64_t)PyLong_AsUnsignedLongLongMask(v);
}

/* Prefetching dict lookups. A cold lookup is a chain of dependent cache misses (the hash slot, the
 * entry, the stored key object, compared on a hash match); one after another they cost ~100 ns a page.
 * ``prefetch_lookups`` walks a batch of keys through the chain a link at a time (all slots, then all
 * entries, then all stored keys), so the batch's misses overlap; the real lookups then hit the cache.
 * It reads CPython's dict layout (Include/internal/pycore_dict.h, the same in 3.11 and 3.12), only to
 * prefetch: the lookups themselves go through the API. Other versions skip it. */
#define BATCH 64   /* keys whose lookups are prefetched together */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000 && !defined(Py_GIL_DISABLED)
typedef struct {
    Py_ssize_t dk_refcnt;
    uint8_t dk_log2_size;
    uint8_t dk_log2_index_bytes;
    uint8_t dk_kind;
    uint32_t dk_version;
    Py_ssize_t dk_usable;
    Py_ssize_t dk_nentries;
    char dk_indices[];
} dk_layout;
typedef struct {
    Py_hash_t me_hash;
    PyObject *me_key;
    PyObject *me_value;
} dk_entry;

typedef struct {
    dk_layout *dk;
    int ix_log;
    size_t mask;
    dk_entry *entries;
} dk_view;

static int dk_of(PyObject *dict, dk_view *v) {
    if (dict == NULL || !PyDict_Check(dict))
        return 0;
    v->dk = (dk_layout *)((PyDictObject *)dict)->ma_keys;
    if (v->dk->dk_kind != 0 || ((PyDictObject *)dict)->ma_values != NULL)   /* not a plain general table */
        return 0;
    v->ix_log = v->dk->dk_log2_index_bytes - v->dk->dk_log2_size;   /* log2 of an index's bytes */
    v->mask = ((size_t)1 << v->dk->dk_log2_size) - 1;
    v->entries = (dk_entry *)(v->dk->dk_indices + ((size_t)1 << v->dk->dk_log2_index_bytes));
    return 1;
}

/* Prefetches the lookups of keys[lo:hi] in ``a`` and (unless NULL) ``b``, both tables' chains together. */
static void prefetch_lookups(PyObject *a, PyObject *b, PyObject *keys, Py_ssize_t lo, Py_ssize_t hi) {
    dk_view dv[2];
    int nd = 0;
    nd += dk_of(a, &dv[nd]);
    nd += dk_of(b, &dv[nd]);
    if (!nd)
        return;
    for (Py_ssize_t s = lo; s < hi; s += BATCH) {
        Py_ssize_t e = s + BATCH < hi ? s + BATCH : hi;
        Py_hash_t hash[BATCH];
        Py_ssize_t at[2][BATCH];
        for (Py_ssize_t i = s; i < e; i++) {
            PyObject *k = PyList_GET_ITEM(keys, i);
            hash[i - s] = -1;
            if (!PyLong_CheckExact(k))
                continue;
            Py_hash_t h = PyObject_Hash(k);   /* an exact int: no Python code, no error */
            if (h == -1) {
                PyErr_Clear();
                continue;
            }
            hash[i - s] = h;
            for (int d = 0; d < nd; d++)
                __builtin_prefetch(dv[d].dk->dk_indices + (((size_t)h & dv[d].mask) << dv[d].ix_log));
        }
        for (int d = 0; d < nd; d++) {
            dk_view *v = &dv[d];
            for (Py_ssize_t i = s; i < e; i++) {
                at[d][i - s] = -1;
                if (hash[i - s] == -1)
                    continue;
                size_t slot = (size_t)hash[i - s] & v->mask;
                Py_ssize_t ix;
                switch (v->ix_log) {
                case 0: ix = ((int8_t *)v->dk->dk_indices)[slot]; break;
                case 1: ix = ((int16_t *)v->dk->dk_indices)[slot]; break;
                case 2: ix = ((int32_t *)v->dk->dk_indices)[slot]; break;
                default: ix = ((int64_t *)v->dk->dk_indices)[slot]; break;
                }
                if (ix >= 0 && ix < v->dk->dk_nentries) {
                    at[d][i - s] = ix;
                    __builtin_prefetch(&v->entries[ix]);
                    __builtin_prefetch((char *)&v->entries[ix] + sizeof(dk_entry) - 1);
                }
            }
        }
        for (int d = 0; d < nd; d++) {
            dk_entry *entries = dv[d].entries;
            for (Py_ssize_t i = s; i < e; i++) {
                Py_ssize_t ix = at[d][i - s];
                if (ix >= 0 && entries[ix].me_hash == hash[i - s] && entries[ix].me_key != NULL) {
                    __builtin_prefetch(entries[ix].me_key);
                    __builtin_prefetch((char *)entries[ix].me_key + 24);   /* an int's digits */
                }
            }
        }
    }
}
#else
static void prefetch_lookups(PyObject *a, PyObject *b, PyObject *keys, Py_ssize_t lo, Py_ssize_t hi) {
    (void)a; (void)b; (void)keys; (void)lo; (void)hi;
}
#endif

#define UNREAD ((int8_t)-1)

/* The SWA table as one call reads it: each page looked up once, its mask kept. */
typedef struct {
    PyObject *swa, *keys;
    PyObject **sv;     /* the SWA masks (borrowed; NULL: nobody holds the page's SWA data) */
    uint64_t *sm;      /* their low 64 bits */
    int8_t *l3;        /* per page: L3 has its SWA data (1 / 0), UNREAD */
    uint64_t l3_bit;
} swa_view;

/* Whether the worker at ``shift`` can read page i's SWA data (it holds it or L3 does): 1 / 0; -1 error,
 * -2 a value the Python walk must judge. */
static int swa_has(swa_view *s, Py_ssize_t i, Py_ssize_t shift) {
    if (s->l3[i] == UNREAD) {
        PyObject *v = PyDict_GetItemWithError(s->swa, PyList_GET_ITEM(s->keys, i));
        if (v == NULL && PyErr_Occurred())
            return -1;
        int bad = 0;
        s->sv[i] = v;
        s->sm[i] = v == NULL ? 0 : low_bits(v, &bad);
        if (bad)
            return -2;
        s->l3[i] = (s->sm[i] & s->l3_bit) != 0;
    }
    if (s->l3[i])
        return 1;
    if (s->sv[i] == NULL)
        return 0;
    int t = tier_bits(s->sv[i], s->sm[i], shift);
    return t < 0 ? -1 : t != 0;
}

static PyObject *overlap(PyObject *self, PyObject *args) {
    PyObject *full, *swa, *keys, *shifts;
    Py_ssize_t l3_shift, window;
    if (!PyArg_ParseTuple(args, "O!OO!O!nn", &PyDict_Type, &full, &swa, &PyList_Type, &keys, &PyList_Type,
                          &shifts, &l3_shift, &window))
        return NULL;
    if (swa != Py_None && !PyDict_Check(swa)) {
        PyErr_SetString(PyExc_TypeError, "overlap: swa must be a dict or None");
        return NULL;
    }
    if (l3_shift > 61)   /* the L3 bit outside the low word: the Python walk (L3 is slot 0 in practice) */
        Py_RETURN_NONE;
    Py_ssize_t n_keys = PyList_GET_SIZE(keys), n_workers = PyList_GET_SIZE(shifts);
    size_t cap = (size_t)(n_keys ? n_keys : 1);
    PyObject **fv = PyMem_Malloc(sizeof(PyObject *) * cap);      /* the full masks (borrowed) */
    uint64_t *fm = PyMem_Malloc(sizeof(uint64_t) * cap);        /* their low 64 bits */
    int8_t *rk = PyMem_Malloc(cap);                              /* a worker's rank per page */
    swa_view s = {swa, keys, PyMem_Malloc(sizeof(PyObject *) * cap), PyMem_Malloc(sizeof(uint64_t) * cap),
                  PyMem_Malloc(cap), l3_shift >= 0 ? (uint64_t)4 << l3_shift : 0};
    PyObject *out = NULL;
    if (fv == NULL || fm == NULL || rk == NULL || s.sv == NULL || s.sm == NULL || s.l3 == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const uint64_t l3_bit = s.l3_bit;
    static const int8_t rank_of[8] = {2, 0, 1, 0, 2, 0, 1, 0};   /* the fastest tier of 3 bits; 0: L3's */
    int bad = 0;
    /* Borrowed references: nothing below runs Python code that could change the index (int keys
     * compare in C). */
    Py_ssize_t n = 0;
    for (; n < n_keys; n++) {
        if (n % BATCH == 0)   /* the next keys' lookups, together (most prompts: a few batches) */
            prefetch_lookups(full, swa != Py_None && window > 0 ? swa : NULL, keys, n,
                             n + BATCH < n_keys ? n + BATCH : n_keys);
        PyObject *v = PyDict_GetItemWithError(full, PyList_GET_ITEM(keys, n));
        if (v == NULL) {
            if (PyErr_Occurred())
                goto done;
            break;
        }
        fv[n] = v;
        fm[n] = low_bits(v, &bad);
        s.l3[n] = UNREAD;
    }
    if (bad)
        goto python;
    out = PyList_New(n_workers);
    if (out == NULL)
        goto done;
    for (Py_ssize_t w = 0; w < n_workers; w++) {
        Py_ssize_t shift = PyLong_AsSsize_t(PyList_GET_ITEM(shifts, w));
        if (shift == -1 && PyErr_Occurred())
            goto fail;
        if (shift < -1)
            shift = -1;
        /* the worker's pages, up to its first page neither it nor L3 holds; the rank each is served at */
        Py_ssize_t m = 0;
        for (; m < n; m++) {
            int t = tier_bits(fv[m], fm[m], shift);
            if (t < 0)
                goto fail;
            if (t == 0 && !(fm[m] & l3_bit))
                break;
            rk[m] = rank_of[t];
        }
        Py_ssize_t best = m;
        if (swa != Py_None && window > 0) {
            /* the last SWA run that counts: scan down from the end of the full prefix, run by run */
            best = 0;
            Py_ssize_t i = m - 1;
            int has = 0;
            while (i >= 0) {
                for (; i >= 0 && (has = swa_has(&s, i, shift)) == 0; i--)
                    ;
                if (has < 0)
                    goto fail_or_python;
                Py_ssize_t end = i;
                for (; i >= 0 && (has = swa_has(&s, i, shift)) == 1; i--)
                    ;
                if (has < 0)
                    goto fail_or_python;
                if (end >= 0 && (i < 0 || end - i >= window)) {
                    best = end + 1;
                    break;
                }
            }
        }
        Py_ssize_t count[3] = {0, 0, 0};
        for (Py_ssize_t i = 0; i < best; i++)
            count[(int)rk[i]]++;
        PyObject *row = Py_BuildValue("(nnnn)", best, count[0], count[1], count[2]);
        if (row == NULL)
            goto fail;
        PyList_SET_ITEM(out, w, row);
        continue;
    fail_or_python:
        if (PyErr_Occurred())
            goto fail;
        goto python;
    }
    goto done;
python:
    Py_XDECREF(out);
    out = Py_None;
    Py_INCREF(out);
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyMem_Free(fv);
    PyMem_Free(fm);
    PyMem_Free(rk);
    PyMem_Free(s.sv);
    PyMem_Free(s.sm);
    PyMem_Free(s.l3);
    return out;
}

static PyMethodDef methods[] = {
    {"overlap", overlap, METH_VARARGS,
     "overlap(full, swa, keys, shifts, l3_shift, window_pages) -> [(pages, l1, l2, l3)] per worker, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_routing", NULL, -1, methods};

PyMODINIT_FUNC PyInit__routing(void) {
    return PyModule_Create(&module);
}
