/* The file L3 store's system calls for a batch of objects, made with the GIL released once per batch
 * (storage/l3/file.py; without a C compiler it makes the same calls from Python).
 *
 * Why: each os.* call releases the GIL and takes it back. A worker writes its L3 pages on a thread beside
 * the engine's, which holds the GIL while it steps, so every one of those calls (a stat, an open, a
 * pwritev, a close, a rename: five a page) waited for the engine thread to hand the GIL over, and made
 * it stop to do so. Here a batch of pages costs one hand-over.
 *
 *   write_new(items, fsync) -> list[int]
 *       items: a sequence of (temp: bytes, final: bytes, header: buffer, page: buffer). Each object is
 *       written to its temp path (created exclusively; its directory made once if missing), header then
 *       page, fsync'd if asked, closed, and renamed onto its final path; on any failure the temp file
 *       is removed. Returns, per item, 0 or the errno of the failure (EIO for a write that stopped
 *       short).
 *   present(paths, size) -> list[bool]
 *       Per path: whether a regular object of exactly ``size`` bytes is there; if so its access and
 *       modification times are set to now (the store's LRU clock).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

typedef struct {
    const char *temp, *final;
    Py_buffer header, page;
    int err;
} Item;

/* mkdir -p of the directory holding ``path`` (the fan-out directory, or more if the store's tree was
 * removed meanwhile), as os.makedirs(..., exist_ok=True). */
static int make_parent(const char *path) {
    const char *slash = strrchr(path, '/');
    if (slash == NULL || slash == path)
        return ENOENT;
    size_t n = (size_t)(slash - path);
    char *dir = malloc(n + 1);
    if (dir == NULL)
        return ENOMEM;
    memcpy(dir, path, n);
    dir[n] = '\0';
    int err = 0;
    for (char *p = dir + 1; ; p++) {
        if (*p == '/' || *p == '\0') {
            char c = *p;
            *p = '\0';
            if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
                err = errno;
                *p = c;
                break;
            }
            *p = c;
            if (c == '\0')
                break;
        }
    }
    free(dir);
    return err;
}

static int write_one(Item *it, int do_fsync) {
    int fd = open(it->temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno == ENOENT) {
        int err = make_parent(it->temp);
        if (err)
            return err;
        fd = open(it->temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    }
    if (fd < 0)
        return errno;
    struct iovec iov[2] = {{it->header.buf, (size_t)it->header.len}, {it->page.buf, (size_t)it->page.len}};
    struct iovec *v = iov;
    int nv = 2;
    off_t off = 0;
    int err = 0;
    while (nv > 0) {
        ssize_t n = pwritev(fd, v, nv, off);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            err = errno;
            break;
        }
        if (n == 0) {
            err = EIO;
            break;
        }
        off += n;
        while (nv > 0 && (size_t)n >= v->iov_len) {
            n -= (ssize_t)v->iov_len;
            v++;
            nv--;
        }
        if (nv > 0 && n > 0) {
            v->iov_base = (char *)v->iov_base + n;
            v->iov_len -= (size_t)n;
        }
    }
    if (!err && do_fsync && fsync(fd) != 0)
        err = errno;
    if (close(fd) != 0 && !err)
        err = errno;
    if (!err && rename(it->temp, it->final) != 0)
        err = errno;
    if (err)
        unlink(it->temp);
    return err;
}

static PyObject *write_new(PyObject *self, PyObject *args) {
    PyObject *seq_in;
    int do_fsync = 0;
    if (!PyArg_ParseTuple(args, "O|p", &seq_in, &do_fsync))
        return NULL;
    PyObject *seq = PySequence_Fast(seq_in, "items must be a sequence of (temp, final, header, page)");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), got = 0;
    Item *items = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Item));
    PyObject *out = NULL;
    if (items == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, got);
        PyObject *temp, *final, *header, *page;
        if (!PyTuple_Check(t) || !PyArg_ParseTuple(t, "SSOO", &temp, &final, &header, &page)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "each item must be a tuple (temp, final, header, page)");
            goto done;
        }
        items[got].temp = PyBytes_AS_STRING(temp);
        items[got].final = PyBytes_AS_STRING(final);
        if (PyObject_GetBuffer(header, &items[got].header, PyBUF_SIMPLE) != 0)
            goto done;
        if (PyObject_GetBuffer(page, &items[got].page, PyBUF_SIMPLE) != 0) {
            PyBuffer_Release(&items[got].header);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        items[i].err = write_one(&items[i], do_fsync);
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyLong_FromLong(items[i].err);
        if (e == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, e);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) {
        PyBuffer_Release(&items[i].header);
        PyBuffer_Release(&items[i].page);
    }
    PyMem_Free(items);
    Py_DECREF(seq);   /* the items' bytes were borrowed from it: released only now */
    return out;
}

static PyObject *present(PyObject *self, PyObject *args) {
    PyObject *seq_in;
    long long size;
    if (!PyArg_ParseTuple(args, "OL", &seq_in, &size))
        return NULL;
    PyObject *seq = PySequence_Fast(seq_in, "paths must be a sequence of bytes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    const char **paths = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(char *));
    char *ok = PyMem_Calloc(n > 0 ? (size_t)n : 1, 1);
    PyObject *out = NULL;
    if (paths == NULL || ok == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(p)) {
            PyErr_SetString(PyExc_TypeError, "paths must be bytes");
            goto done;
        }
        paths[i] = PyBytes_AS_STRING(p);
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        struct stat st;
        ok[i] = stat(paths[i], &st) == 0 && S_ISREG(st.st_mode) && (long long)st.st_size == size
                && utimensat(AT_FDCWD, paths[i], NULL, 0) == 0;
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        PyList_SET_ITEM(out, i, PyBool_FromLong(ok[i]));
done:
    PyMem_Free(paths);
    PyMem_Free(ok);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"write_new", write_new, METH_VARARGS, "Write a batch of new objects (temp, final, header, page) -> errnos."},
    {"present", present, METH_VARARGS, "Which paths hold an object of exactly size bytes (their times bumped)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fileio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fileio(void) { return PyModule_Create(&module); }
