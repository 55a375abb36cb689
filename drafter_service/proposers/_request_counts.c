/* A request's own context counting (suffix.py's _count_stream), natively, into the same dicts.

   suffix.py's ContextCounts keeps a request's counts in Python dicts, one per order: context
   hash -> the one token seen after it, packed with its count (token + (count - 1) << 32), or a
   dict token -> count in recency order (a counted token moves to the end). This file makes
   exactly those updates, in the same order (so dict order, and with it the tie rule of the
   walk, is the same); tests/drafter_service/proposers/test_suffix_walk.py compares the dicts
   with _count_stream's. Why native: every committed token is counted under 15 contexts; in
   Python that cost about ten times a round's proposal, on the drafter's event loop (after the
   chain is sent, but before the loop serves other sessions). Tokens must lie in [0, 2**32).

   Python API: count_stream(tables, tokens, prefix, start, stop) -> contexts added; tables is
   ContextCounts.tables, tokens the request's token list, prefix its prefix hashes. */
#include "_context_table.h"

#define COUNT_SHIFT 32  /* suffix.py's packing of a context seen with one token */
#define TOKEN_MASK 0xFFFFFFFFull

static PyObject *ONE;  /* the int 1 */

/* Count `token` (also as a C value) after context `key` in one order's dict; 1 when the
   context is new, 0 when it was counted before, -1 with an exception set. */
static int count_one(PyObject *table, uint32_t key, PyObject *token, uint64_t t) {
    PyObject *k = PyLong_FromUnsignedLong(key), *value, *update = NULL;
    if (!k) return -1;
    int result = -1;
    if (!(value = PyDict_GetItemWithError(table, k))) {
        if (!PyErr_Occurred() && PyDict_SetItem(table, k, token) == 0) result = 1;
    } else if (PyLong_CheckExact(value)) {
        unsigned long long packed = PyLong_AsUnsignedLongLong(value);
        if (packed == (unsigned long long)-1 && PyErr_Occurred()) goto done;
        if ((packed & TOKEN_MASK) == t) {  /* the same token once more: count + 1 */
            update = PyLong_FromUnsignedLongLong(packed + (1ull << COUNT_SHIFT));
        } else {  /* a second token: {the first: its count, this one: 1} (suffix.py's _split) */
            PyObject *first = PyLong_FromUnsignedLongLong(packed & TOKEN_MASK);
            PyObject *count = PyLong_FromUnsignedLongLong((packed >> COUNT_SHIFT) + 1);
            if (first && count && (update = PyDict_New())
                && (PyDict_SetItem(update, first, count) < 0 || PyDict_SetItem(update, token, ONE) < 0))
                Py_CLEAR(update);
            Py_XDECREF(first);
            Py_XDECREF(count);
        }
        if (update && PyDict_SetItem(table, k, update) == 0) result = 0;
    } else if (PyDict_CheckExact(value)) {  /* value[token] = value.pop(token, 0) + 1: to the end */
        PyObject *seen = PyDict_GetItemWithError(value, token);
        if (!seen && PyErr_Occurred()) goto done;
        if (!(update = seen ? PyNumber_Add(seen, ONE) : Py_NewRef(ONE))) goto done;
        if ((!seen || PyDict_DelItem(value, token) == 0) && PyDict_SetItem(value, token, update) == 0) result = 0;
    } else {
        PyErr_SetString(PyExc_TypeError, "suffix counts hold ints or dicts");
    }
done:
    Py_XDECREF(update);
    Py_DECREF(k);
    return result;
}

PyObject *count_stream(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_Check(args[0]) || PyList_GET_SIZE(args[0]) != NUM_ORDERS || !PyList_Check(args[1])
        || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "count_stream(tables: list of one dict per order, tokens: list, "
                                         "prefix: list, start, stop)");
        return NULL;
    }
    PyObject *tables = args[0], *tokens = args[1], *prefix = args[2];
    if (!ONE && !(ONE = PyLong_FromLong(1))) return NULL;
    for (int oi = 0; oi < NUM_ORDERS; oi++)
        if (!PyDict_CheckExact(PyList_GET_ITEM(tables, oi)))
            return PyErr_Format(PyExc_TypeError, "tables[%d] is not a dict", oi);
    Py_ssize_t start = PyLong_AsSsize_t(args[3]), stop = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (start < 0 || start > stop || stop > PyList_GET_SIZE(tokens) || PyList_GET_SIZE(prefix) < stop + 1)
        return PyErr_Format(PyExc_ValueError, "positions %zd..%zd outside the tokens or their hashes", start, stop);
    Py_ssize_t added = 0;
    for (Py_ssize_t n = start; n < stop; n++) {
        PyObject *token = PyList_GET_ITEM(tokens, n);
        unsigned long long t = PyLong_AsUnsignedLongLong(token);
        if (t > TOKEN_MASK) {  /* (also a negative or non-int one) */
            PyErr_Clear();
            return PyErr_Format(PyExc_ValueError, "tokens must lie in [0, 2**32) (position %zd)", n);
        }
        uint64_t hn, hm;
        if (prefix_hash(prefix, n, &hn) < 0) return NULL;
        Py_INCREF(token);  /* (held: a dict made below may run the collector, and with it any code) */
        for (int oi = 0; oi < NUM_ORDERS && ORDERS[oi] <= n; oi++) {
            int fresh = prefix_hash(prefix, n - ORDERS[oi], &hm);
            if (fresh == 0) {
                uint32_t key = (uint32_t)((hn + MOD - hm * POW[ORDERS[oi]] % MOD) % MOD);
                fresh = count_one(PyList_GET_ITEM(tables, oi), key, token, t);
            }
            if (fresh < 0) {
                Py_DECREF(token);
                return NULL;
            }
            added += fresh;
        }
        Py_DECREF(token);
    }
    return PyLong_FromSsize_t(added);
}
