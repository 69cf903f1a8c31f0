/* strata's compiled helper for the radix tree (storage/tokens.py has the reference and the fallback).
 *
 * same_run(a, off, b[, n]): whether list ``a`` holds the first ``n`` items of list ``b`` (default: all of
 * them) at offset ``off``, i.e. both are long enough and ``a[off:off + n] == b[:n]``, without building
 * the slices. A tree walk compares about a thousand token ids per request against its
 * edges; a slice copies and reference-counts every id object, and those writes to scattered objects
 * were most of a match's time. Items are compared by identity first, then with ``==``.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *same_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "same_run(a, off, b[, n]) takes 3 or 4 arguments");
        return NULL;
    }
    PyObject *a = args[0], *b = args[2];
    if (!PyList_Check(a) || !PyList_Check(b)) {
        PyErr_SetString(PyExc_TypeError, "same_run: a and b must be lists");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(args[1]);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(b);
    if (nargs == 4) {
        n = PyLong_AsSsize_t(args[3]);
        if (n == -1 && PyErr_Occurred())
            return NULL;
    }
    if (off < 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "same_run: off and n must be >= 0");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* sizes re-read every step: an item's __eq__ may change either list */
        if (i >= PyList_GET_SIZE(b) || off + i >= PyList_GET_SIZE(a))
            Py_RETURN_FALSE;
        PyObject *x = PyList_GET_ITEM(a, off + i), *y = PyList_GET_ITEM(b, i);
        if (x == y)
            continue;
        Py_INCREF(x);
        Py_INCREF(y);
        int eq = PyObject_RichCompareBool(x, y, Py_EQ);
        Py_DECREF(x);
        Py_DECREF(y);
        if (eq < 0)
            return NULL;
        if (!eq)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"same_run", (PyCFunction)(void (*)(void))same_run, METH_FASTCALL,
     "same_run(a, off, b[, n]) -> bool: a[off:off + n] == b[:n], both at least that long, without slices."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "storage._tokens", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tokens(void) { return PyModule_Create(&module); }
