/* What _context_table.c (the global index's counts), _suffix_walk.c (the proposal rule, walked
   over those counts or over a request's own) and _request_counts.c (a request's own counting)
   share: the hashing constants and the table's layout. See _context_table.c's header for the
   layout's reasons. */
#ifndef TANDEM_CONTEXT_TABLE_H
#define TANDEM_CONTEXT_TABLE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define NUM_ORDERS 15
#define MAX_MATCH 32
static const int ORDERS[NUM_ORDERS] = {1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32};
#define MOD 2147483647ULL                    /* suffix.py's MOD, BASE: the same hashes */
#define BASE (0x9E3779B9ULL % MOD)
extern uint64_t POW[MAX_MATCH + 1];          /* BASE**i % MOD, set when the module loads */

#define LIST_FLAG 0x80000000u                /* value: a List id (31 bits) */
#define TOKEN_BITS 20                        /* value: token (20 bits) | count << 20 (11 bits) */
#define TOKEN_LIMIT (1u << TOKEN_BITS)       /* larger tokens, or counts, go to a List */
#define COUNT_LIMIT 0x7FFu

/* prefix[i] (a request's list of prefix hashes, suffix.py's SuffixIndex.prefix) into *out:
   0, or -1 with ValueError set for a value outside [0, MOD) (a negative or non-int one too: the
   conversion's error is replaced). */
static inline int prefix_hash(PyObject *prefix, Py_ssize_t i, uint64_t *out) {
    unsigned long long value = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(prefix, i));
    if (value >= MOD) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "prefix hashes must lie in [0, 2**31 - 1)");
        return -1;
    }
    *out = value;
    return 0;
}

typedef struct { uint32_t key, value; } Slot;  /* key: hash + 1; 0 = empty */
typedef struct { Slot *slots; uint32_t mask, size; int shift; } Table;
typedef struct { uint32_t length, capacity; uint32_t items[]; } List;  /* (token, count) pairs */

typedef struct {
    PyObject_HEAD
    Table tables[NUM_ORDERS];
    List **lists;         /* by id; a freed id's entry is NULL and its id on `free_ids` */
    uint32_t *free_ids;
    uint32_t lists_cap, lists_used, n_free;
    size_t bytes;
    uint64_t contexts;
} ContextTable;

static inline uint32_t home(const Table *t, uint32_t key) {
    return (uint32_t)(((uint64_t)key * 0x9E3779B97F4A7C15ULL) >> t->shift) & t->mask;
}

/* The slot holding key, or the empty slot where it would go. */
static inline uint32_t find(const Table *t, uint32_t key) {
    uint32_t i = home(t, key);
    while (t->slots[i].key && t->slots[i].key != key) i = (i + 1) & t->mask;
    return i;
}

/* The value of context `key` at order oi (0: none). */
static inline uint32_t table_value(const ContextTable *self, int oi, uint32_t key) {
    const Table *t = &self->tables[oi];
    const Slot *slot = &t->slots[find(t, key)];
    return slot->key ? slot->value : 0;
}

/* _suffix_walk.c: suffix.py's _propose over the global counts (ContextTable.propose), over a
   request's own (the module's propose_counts), and a round's whole proposal: both walks, the
   better chain (ContextTable.best). */
PyObject *walk_table(ContextTable *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *walk_counts(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *walk_best(ContextTable *self, PyObject *const *args, Py_ssize_t nargs);
/* _request_counts.c: suffix.py's _count_stream into a request's dicts. */
PyObject *count_stream(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
