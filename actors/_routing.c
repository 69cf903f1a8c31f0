/* strata's compiled prefix-index walk (actors/routing.py has the rule, the Python walk and the fallback).
 *
 * overlap(full, swa, keys, workers, window_pages) -> [(pages, l1, l2, l3) per worker], or None where the
 * index holds something the Python walk must judge (a tier outside L1/L2/L3, a holder that is not a set):
 * the same answer as routing._walk over ``full`` / ``swa`` (block id -> holder -> set of tiers; ``swa``
 * None: no window to check). Each key is looked up once in ``full`` up to the first one nobody holds; each
 * worker's pages run up to its first page held neither by it nor by the shared L3 (holder "L3" with tier
 * "L3"), each page served from the fastest tier the worker holds it in, else L3; the prefix is usable up to
 * the end of the last run of SWA pages (the worker's or L3's) inside it that is ``window_pages`` long or
 * starts at page 0.
 *
 * Why C: on a large index every page is a few cache misses (the table's slot and entry, the key, the
 * holders' dict and the tier set); a Python walk pays them one after another between interpreter steps,
 * this loop lets the CPU overlap them (and prefetches each page's holder table before reading it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *S_L1, *S_L2, *S_L3;   /* the tier names; "L3" is also the shared store's holder name */

/* The rank (0 L1, 1 L2, 2 L3) of the fastest tier in ``tiers``; -1 if empty; -2 if not judgeable here. */
static int best_rank(PyObject *tiers) {
    if (!PyAnySet_Check(tiers))
        return -2;
    Py_ssize_t size = PySet_GET_SIZE(tiers);
    if (size == 0)
        return -1;
    int found = 0, best = 3;
    PyObject *names[3] = {S_L1, S_L2, S_L3};
    for (int r = 0; r < 3; r++) {
        int c = PySet_Contains(tiers, names[r]);
        if (c < 0)
            return -3;
        if (c) {
            found++;
            if (r < best)
                best = r;
        }
    }
    return found == size ? best : -2;   /* another tier name: the Python walk says what it means */
}

/* Whether the shared L3 holds a page: holder "L3" with tier "L3". -1 on error, -2 not judgeable. */
static int l3_has(PyObject *holders) {
    PyObject *t = PyDict_GetItemWithError(holders, S_L3);
    if (t == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyAnySet_Check(t))
        return -2;
    return PySet_Contains(t, S_L3);
}

/* Whether ``worker`` can read a page's SWA data (``h``: the page's SWA holders, NULL if none): it holds
 * it in some tier, or L3 does. -1 on error, -2 not judgeable here. */
static int swa_has(PyObject *h, PyObject *worker) {
    if (h == NULL)
        return 0;
    if (!PyDict_Check(h))
        return -2;
    PyObject *t = PyDict_GetItemWithError(h, worker);
    if (t == NULL && PyErr_Occurred())
        return -1;
    if (t != NULL) {
        int r = best_rank(t);
        if (r >= 0)
            return 1;
        if (r != -1)
            return r == -3 ? -1 : -2;
    }
    return l3_has(h);
}

#define UNREAD (Py_None + 1)   /* an address no holder has: "not looked up yet" */

/* The SWA holders of page ``i`` (NULL: none), looked up once per call and kept in ``sh``. */
static int swa_get(PyObject *swa, PyObject *keys, PyObject **sh, Py_ssize_t i, PyObject **out) {
    if (sh[i] == UNREAD) {
        PyObject *h = PyDict_GetItemWithError(swa, PyList_GET_ITEM(keys, i));
        if (h == NULL && PyErr_Occurred())
            return -1;
        sh[i] = h;
    }
    *out = sh[i];
    return 0;
}

static PyObject *overlap(PyObject *self, PyObject *args) {
    PyObject *full, *swa, *keys, *workers;
    Py_ssize_t window;
    if (!PyArg_ParseTuple(args, "O!OO!O!n", &PyDict_Type, &full, &swa, &PyList_Type, &keys, &PyList_Type,
                          &workers, &window))
        return NULL;
    if (swa != Py_None && !PyDict_Check(swa)) {
        PyErr_SetString(PyExc_TypeError, "overlap: swa must be a dict or None");
        return NULL;
    }
    Py_ssize_t n_keys = PyList_GET_SIZE(keys), n_workers = PyList_GET_SIZE(workers);
    PyObject **fulls = PyMem_Malloc(sizeof(PyObject *) * (size_t)(n_keys ? n_keys : 1));
    signed char *rank = PyMem_Malloc((size_t)(n_keys ? n_keys : 1));
    PyObject **sh = PyMem_Malloc(sizeof(PyObject *) * (size_t)(n_keys ? n_keys : 1));
    PyObject *out = NULL;
    if (fulls == NULL || rank == NULL || sh == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* Borrowed references: nothing below runs Python code that could change the index (int and str
     * keys compare in C). */
    Py_ssize_t n = 0;
    for (; n < n_keys; n++) {
        PyObject *h = PyDict_GetItemWithError(full, PyList_GET_ITEM(keys, n));
        if (h == NULL) {
            if (PyErr_Occurred())
                goto done;
            break;
        }
        fulls[n] = h;   /* checked to be a dict where it is read: this loop only looks up */
    }
    for (Py_ssize_t i = 0; i < n; i++)
        sh[i] = UNREAD;
    out = PyList_New(n_workers);
    if (out == NULL)
        goto done;
    for (Py_ssize_t w = 0; w < n_workers; w++) {
        PyObject *worker = PyList_GET_ITEM(workers, w);
        Py_ssize_t m = 0;
        int prefetched = 0;
        for (; m < n; m++) {
            if (!PyDict_Check(fulls[m]))
                goto python;
            if (m == 1 && !prefetched) {
                /* the worker holds the first page: it will read the holders of the next ones */
                for (Py_ssize_t i = 1; i < n; i++)
                    if (PyDict_Check(fulls[i]))
                        __builtin_prefetch(((PyDictObject *)fulls[i])->ma_keys);
                for (Py_ssize_t i = 1; i < n; i++) {   /* then each page's tier set, both of its lines */
                    if (!PyDict_Check(fulls[i]))
                        continue;
                    PyObject *t = PyDict_GetItemWithError(fulls[i], worker);
                    if (t != NULL) {
                        __builtin_prefetch(t);
                        __builtin_prefetch((char *)t + 64);
                    }
                }
                PyErr_Clear();   /* a str key does not fail; the walk below would see it again anyway */
                prefetched = 1;
            }
            PyObject *t = PyDict_GetItemWithError(fulls[m], worker);
            int r = -1;
            if (t == NULL && PyErr_Occurred())
                goto fail;
            if (t != NULL) {
                r = best_rank(t);
                if (r == -3)
                    goto fail;
                if (r == -2)
                    goto python;
            }
            if (r < 0) {
                int l3 = l3_has(fulls[m]);
                if (l3 < 0)
                    goto fail_or_python;
                if (!l3)
                    break;
                r = 2;
            }
            rank[m] = (signed char)r;
        }
        Py_ssize_t best = m;
        if (swa != Py_None && window > 0) {
            /* the scan below reads the last window or so: look those pages up together first (the
             * lookups overlap), then the scan reads what it needs */
            for (Py_ssize_t i = m - 1; i >= 0 && i >= m - 2 * window - 2; i--) {
                PyObject *h;
                if (swa_get(swa, keys, sh, i, &h) < 0)
                    goto fail;
                if (h != NULL && PyDict_Check(h))
                    __builtin_prefetch(((PyDictObject *)h)->ma_keys);
            }
            best = 0;
            Py_ssize_t i = m - 1;
            while (i >= 0) {
                int has = 0;
                PyObject *h;
                while (i >= 0) {
                    if (swa_get(swa, keys, sh, i, &h) < 0 || (has = swa_has(h, worker)) == -1)
                        goto fail;
                    if (has != 0)
                        break;
                    i--;
                }
                if (i >= 0 && has == -2)
                    goto python;
                Py_ssize_t end = i;
                while (i >= 0) {
                    if (swa_get(swa, keys, sh, i, &h) < 0 || (has = swa_has(h, worker)) == -1)
                        goto fail;
                    if (has != 1)
                        break;
                    i--;
                }
                if (i >= 0 && has == -2)
                    goto python;
                if (end >= 0 && (i < 0 || end - i >= window)) {
                    best = end + 1;
                    break;
                }
            }
        }
        Py_ssize_t count[3] = {0, 0, 0};
        for (Py_ssize_t i = 0; i < best; i++)
            count[(int)rank[i]]++;
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
    PyMem_Free(fulls);
    PyMem_Free(rank);
    PyMem_Free(sh);
    return out;
}

static PyMethodDef methods[] = {
    {"overlap", overlap, METH_VARARGS,
     "overlap(full, swa, keys, workers, window_pages) -> [(pages, l1, l2, l3)] per worker, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_routing", NULL, -1, methods};

PyMODINIT_FUNC PyInit__routing(void) {
    S_L1 = PyUnicode_InternFromString("L1");
    S_L2 = PyUnicode_InternFromString("L2");
    S_L3 = PyUnicode_InternFromString("L3");
    if (S_L1 == NULL || S_L2 == NULL || S_L3 == NULL)
        return NULL;
    return PyModule_Create(&module);
}
