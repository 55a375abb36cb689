/* Context counts of the global suffix index in native memory (issue 37).

   drafter_service/proposers/global_index.py drives this type (the byte budget, which outputs
   are held, evicting whole outputs); suffix.py defines the rule this file reproduces. The
   counts are those of suffix.py's ContextCounts: for every context of the lengths in ORDERS
   inside an output, the tokens that followed it, with their counts, most recently counted
   last. Keys are the same 31-bit rolling hashes, one table per order, so a lookup here finds
   exactly what a Python dict of the same counts would (collisions included).

   Memory: a table is an open-addressing array of 8-byte slots (linear probing, at most
   MAX_LOAD full, doubled when that is reached). A slot holds the key and either the one token
   seen after the context with its count (the common case: a context seen once) or the id of
   a List of (token, count) pairs. Every allocation is counted in `bytes`; count() never lets
   `bytes` pass the budget it is given (it stops before the token that would, and the caller
   evicts outputs), uncount() removes an output's counts again (slots freed by backward-shift
   deletion, so no tombstones pile up).

   Python API (ContextTable):
     count(tokens, start, stop, budget) -> int   count positions start..stop-1 of one output
                                                 (tokens: a buffer of uint32); returns the
                                                 position reached (< stop: the budget is full)
     uncount(tokens, start, stop)                remove positions start..stop-1 of an output
     propose(prefix, max_tokens, min_prob, factor, offset, beat) -> None | (matched, [tokens], score)
                                                 suffix.py's _propose on these counts; prefix
                                                 is a request's list of prefix hashes
     best(tables, prefix, max_tokens, min_prob, factor, offset, own_min_prob, own_factor, own_offset)
                                                 -> None | (matched, [tokens], score, source): a
                                                 round's proposal (global_index.py's best_match)
                                                 over these counts and a request's (tables)
     bytes, contexts                             allocated bytes, contexts held
   and the module's propose_counts (the same walk over a request's own counts) and count_stream
   (a request's own counting). The walk is _suffix_walk.c's, the request's counting
   _request_counts.c's; _context_table.h holds what they share.
*/
#include "_context_table.h"
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

uint64_t POW[MAX_MATCH + 1];

#define MIN_SLOTS 256
#define MAX_LOAD(slots) ((uint32_t)((uint64_t)(slots) * 4 / 5))
#define ALLOC_OVERHEAD 16                    /* the allocator's header per List, counted too */

static size_t list_bytes(uint32_t capacity) { return sizeof(List) + 8 * (size_t)capacity + ALLOC_OVERHEAD; }

#define HUGE_PAGE (2u << 20)

/* A table's slots, zeroed. A large one is aligned to and advised into 2 MiB pages where the
   kernel offers them (transparent huge pages): a lookup is a random access into it, and with
   4 KiB pages nearly every one would also miss the TLB (docs/PERFORMANCE.md, issue 37, has
   the measurement; compile with -DNO_HUGEPAGE to repeat it without). */
static Slot *slots_alloc(uint32_t slots) {
    size_t size = (size_t)slots * sizeof(Slot);
    if (size < HUGE_PAGE) return calloc(slots, sizeof(Slot));
    void *memory = NULL;
    if (posix_memalign(&memory, HUGE_PAGE, size)) return NULL;
#if defined(MADV_HUGEPAGE) && !defined(NO_HUGEPAGE)
    madvise(memory, size, MADV_HUGEPAGE);
#endif
    memset(memory, 0, size);
    return memory;
}

static int table_init(Table *t, uint32_t slots) {
    t->slots = slots_alloc(slots);
    if (!t->slots) return -1;
    t->mask = slots - 1;
    t->size = 0;
    t->shift = 64 - __builtin_ctz(slots);
    return 0;
}

static int table_grow(ContextTable *self, Table *t) {
    Table bigger;
    if (table_init(&bigger, (t->mask + 1) * 2) < 0) return -1;
    for (uint32_t i = 0; i <= t->mask; i++)
        if (t->slots[i].key) bigger.slots[find(&bigger, t->slots[i].key)] = t->slots[i];
    bigger.size = t->size;
    self->bytes += (size_t)(t->mask + 1) * sizeof(Slot);
    free(t->slots);
    *t = bigger;
    return 0;
}

static void table_delete(Table *t, uint32_t i) {  /* backward shift: later slots of the run move up */
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        if (!t->slots[j].key) break;
        uint32_t k = home(t, t->slots[j].key);
        /* slot j may move to i unless its home lies cyclically in (i, j] */
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            t->slots[i] = t->slots[j];
            i = j;
        }
    }
    t->slots[i].key = t->slots[i].value = 0;
    t->size--;
}

/* -- Lists ------------------------------------------------------------------------------- */

static int64_t list_new(ContextTable *self, uint32_t capacity) {  /* an id, or -1 */
    if (!self->n_free && self->lists_used == self->lists_cap) {
        uint32_t cap = self->lists_cap ? self->lists_cap * 2 : 1024;
        List **lists = realloc(self->lists, cap * sizeof(List *));
        if (!lists) return -1;
        self->lists = lists;
        uint32_t *free_ids = realloc(self->free_ids, cap * sizeof(uint32_t));
        if (!free_ids) return -1;
        self->free_ids = free_ids;
        self->bytes += (size_t)(cap - self->lists_cap) * (sizeof(List *) + sizeof(uint32_t));
        self->lists_cap = cap;
    }
    List *list = malloc(list_bytes(capacity) - ALLOC_OVERHEAD);
    if (!list) return -1;
    list->length = 0;
    list->capacity = capacity;
    uint32_t id = self->n_free ? self->free_ids[--self->n_free] : self->lists_used++;
    self->lists[id] = list;
    self->bytes += list_bytes(capacity);
    return id;
}

static void list_free(ContextTable *self, uint32_t id) {
    self->bytes -= list_bytes(self->lists[id]->capacity);
    free(self->lists[id]);
    self->lists[id] = NULL;
    self->free_ids[self->n_free++] = id;
}

static int list_index(const List *list, uint32_t token) {
    for (uint32_t i = 0; i < list->length; i++)
        if (list->items[2 * i] == token) return (int)i;
    return -1;
}

/* Count token in list `id`: its count + 1, moved to the end (the most recent). */
static int list_count(ContextTable *self, uint32_t id, uint32_t token, uint32_t add) {
    List *list = self->lists[id];
    int i = list_index(list, token);
    uint32_t count = add;
    if (i >= 0) {
        count += list->items[2 * i + 1];
        memmove(&list->items[2 * i], &list->items[2 * i + 2], 8 * (size_t)(list->length - i - 1));
        list->length--;
    } else if (list->length == list->capacity) {
        List *bigger = realloc(list, list_bytes(list->capacity * 2) - ALLOC_OVERHEAD);
        if (!bigger) return -1;
        self->bytes += list_bytes(bigger->capacity * 2) - list_bytes(bigger->capacity);
        bigger->capacity *= 2;
        self->lists[id] = list = bigger;
    }
    list->items[2 * list->length] = token;
    list->items[2 * list->length + 1] = count;
    list->length++;
    return 0;
}

/* -- one position of an output: its contexts' keys, the bytes counting it needs, counting -- */

/* keys[oi] = 1 + hash of tokens[n-ORDERS[oi]:n] for the orders <= n; returns how many. h[i]
   hashes the output's tokens base..base+i-1 (suffix.py's prefix hashes, from `base` on). */
static int position_keys(const uint32_t *h, Py_ssize_t base, Py_ssize_t n, uint32_t *keys) {
    int count = 0;
    for (int oi = 0; oi < NUM_ORDERS && ORDERS[oi] <= n; oi++, count++) {
        uint64_t hn = h[n - base], hm = h[n - ORDERS[oi] - base];
        keys[oi] = (uint32_t)((hn + MOD - hm * POW[ORDERS[oi]] % MOD) % MOD) + 1;
    }
    return count;
}

/* Bytes that counting `token` after these contexts may allocate (at its peak). */
static size_t position_needs(ContextTable *self, const uint32_t *keys, int orders, uint32_t token) {
    size_t need = 0;
    int new_lists = 0;
    for (int oi = 0; oi < orders; oi++) {
        Table *t = &self->tables[oi];
        Slot *slot = &t->slots[find(t, keys[oi])];
        if (!slot->key) {
            if (t->size + 1 > MAX_LOAD(t->mask + 1)) need += (size_t)(t->mask + 1) * 2 * sizeof(Slot);
            if (token >= TOKEN_LIMIT) need += list_bytes(2), new_lists++;
        } else if (!(slot->value & LIST_FLAG)) {
            uint32_t seen = slot->value & (TOKEN_LIMIT - 1), count = slot->value >> TOKEN_BITS;
            if (seen != token || count == COUNT_LIMIT) need += list_bytes(4), new_lists++;
        } else {
            List *list = self->lists[slot->value & ~LIST_FLAG];
            if (list->length == list->capacity && list_index(list, token) < 0) need += list_bytes(list->capacity * 2);
        }
    }
    if (new_lists > (int)(self->n_free + self->lists_cap - self->lists_used))
        need += (size_t)(self->lists_cap ? self->lists_cap : 1024) * (sizeof(List *) + sizeof(uint32_t));
    return need;
}

static int position_count(ContextTable *self, const uint32_t *keys, int orders, uint32_t token) {
    for (int oi = 0; oi < orders; oi++) {
        Table *t = &self->tables[oi];
        uint32_t i = find(t, keys[oi]);
        Slot *slot = &t->slots[i];
        if (!slot->key) {
            if (t->size + 1 > MAX_LOAD(t->mask + 1)) {
                if (table_grow(self, t) < 0) return -1;
                slot = &t->slots[find(t, keys[oi])];
            }
            slot->key = keys[oi];
            t->size++;
            self->contexts++;
            if (token < TOKEN_LIMIT) {
                slot->value = token | (1u << TOKEN_BITS);
            } else {
                int64_t id = list_new(self, 2);
                if (id < 0 || list_count(self, (uint32_t)id, token, 1) < 0) return -1;
                slot->value = LIST_FLAG | (uint32_t)id;
            }
        } else if (!(slot->value & LIST_FLAG)) {
            uint32_t seen = slot->value & (TOKEN_LIMIT - 1), count = slot->value >> TOKEN_BITS;
            if (seen == token && count < COUNT_LIMIT) {
                slot->value += 1u << TOKEN_BITS;
            } else {  /* a second token (or a count too large for the slot): a List, the older first */
                int64_t id = list_new(self, 4);
                if (id < 0) return -1;
                list_count(self, (uint32_t)id, seen, count);
                list_count(self, (uint32_t)id, token, 1);
                slot->value = LIST_FLAG | (uint32_t)id;
            }
        } else if (list_count(self, slot->value & ~LIST_FLAG, token, 1) < 0) {
            return -1;
        }
    }
    return 0;
}

static void position_uncount(ContextTable *self, const uint32_t *keys, int orders, uint32_t token) {
    for (int oi = 0; oi < orders; oi++) {
        Table *t = &self->tables[oi];
        uint32_t i = find(t, keys[oi]);
        Slot *slot = &t->slots[i];
        if (!slot->key) continue;  /* never counted (cannot happen when counts and uncounts pair) */
        if (!(slot->value & LIST_FLAG)) {
            if ((slot->value & (TOKEN_LIMIT - 1)) != token) continue;
            slot->value -= 1u << TOKEN_BITS;
            if (!(slot->value >> TOKEN_BITS)) table_delete(t, i), self->contexts--;
            continue;
        }
        uint32_t id = slot->value & ~LIST_FLAG;
        List *list = self->lists[id];
        int j = list_index(list, token);
        if (j < 0) continue;
        if (--list->items[2 * j + 1] == 0) {  /* the token leaves; the others keep their order */
            memmove(&list->items[2 * j], &list->items[2 * j + 2], 8 * (size_t)(list->length - j - 1));
            list->length--;
        }
        if (list->length == 0) {
            list_free(self, id);
            table_delete(t, i);
            self->contexts--;
        } else if (list->length == 1 && list->items[0] < TOKEN_LIMIT && list->items[1] <= COUNT_LIMIT) {
            slot->value = list->items[0] | (list->items[1] << TOKEN_BITS);  /* back to a single token */
            list_free(self, id);
        }
    }
}

/* h[0..length]: prefix hashes of tokens[base..base+length) (h[0] = 0). */
static uint32_t *prefix_hashes(const uint32_t *tokens, Py_ssize_t base, Py_ssize_t length) {
    uint32_t *h = malloc(sizeof(uint32_t) * (length + 1));
    if (!h) return NULL;
    h[0] = 0;
    for (Py_ssize_t i = 0; i < length; i++) h[i + 1] = (uint32_t)(((uint64_t)h[i] * BASE + tokens[base + i] + 1) % MOD);
    return h;
}

static int get_tokens(PyObject *arg, Py_buffer *view) {
    if (PyObject_GetBuffer(arg, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->itemsize != 4 || !view->format || (strcmp(view->format, "I") && strcmp(view->format, "=I"))) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "tokens must be a buffer of uint32 (array('I'))");
        return -1;
    }
    return 0;
}

static PyObject *ContextTable_count(ContextTable *self, PyObject *args) {
    PyObject *arg;
    Py_ssize_t start, stop, budget;
    if (!PyArg_ParseTuple(args, "Onnn", &arg, &start, &stop, &budget)) return NULL;
    Py_buffer view;
    if (get_tokens(arg, &view) < 0) return NULL;
    const uint32_t *tokens = view.buf;
    Py_ssize_t length = view.len / 4;
    if (start < 0 || stop > length || start > stop) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "positions %zd..%zd outside 0..%zd", start, stop, length);
    }
    Py_ssize_t base = start > MAX_MATCH ? start - MAX_MATCH : 0, n = start;
    uint32_t *h = prefix_hashes(tokens, base, stop - base);
    if (!h) goto nomem;
    uint32_t keys[NUM_ORDERS];
    for (; n < stop; n++) {
        int orders = position_keys(h, base, n, keys);
        if (self->bytes + position_needs(self, keys, orders, tokens[n]) > (size_t)(budget > 0 ? budget : 0)) break;
        if (position_count(self, keys, orders, tokens[n]) < 0) goto nomem;
    }
    free(h);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(n);
nomem:
    free(h);
    PyBuffer_Release(&view);
    return PyErr_NoMemory();
}

static PyObject *ContextTable_uncount(ContextTable *self, PyObject *args) {
    PyObject *arg;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "Onn", &arg, &start, &stop)) return NULL;
    Py_buffer view;
    if (get_tokens(arg, &view) < 0) return NULL;
    if (start < 0 || stop > view.len / 4 || start > stop) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "positions %zd..%zd outside 0..%zd", start, stop, view.len / 4);
    }
    const uint32_t *tokens = view.buf;
    Py_ssize_t base = start > MAX_MATCH ? start - MAX_MATCH : 0;
    uint32_t *h = prefix_hashes(tokens, base, stop - base);
    if (!h) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    uint32_t keys[NUM_ORDERS];
    for (Py_ssize_t n = start; n < stop; n++) position_uncount(self, keys, position_keys(h, base, n, keys), tokens[n]);
    free(h);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static int ContextTable_init(ContextTable *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist)) return -1;
    if (self->tables[0].slots) {
        PyErr_SetString(PyExc_RuntimeError, "ContextTable is initialised once");
        return -1;
    }
    self->bytes = sizeof(ContextTable);
    for (int oi = 0; oi < NUM_ORDERS; oi++) {
        if (table_init(&self->tables[oi], MIN_SLOTS) < 0) {
            PyErr_NoMemory();
            return -1;
        }
        self->bytes += MIN_SLOTS * sizeof(Slot);
    }
    return 0;
}

static void ContextTable_dealloc(ContextTable *self) {
    for (int oi = 0; oi < NUM_ORDERS; oi++) free(self->tables[oi].slots);
    for (uint32_t id = 0; id < self->lists_used; id++) free(self->lists[id]);
    free(self->lists);
    free(self->free_ids);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *ContextTable_bytes(ContextTable *self, void *closure) { return PyLong_FromSize_t(self->bytes); }
static PyObject *ContextTable_contexts(ContextTable *self, void *closure) { return PyLong_FromUnsignedLongLong(self->contexts); }

static PyMethodDef ContextTable_methods[] = {
    {"count", (PyCFunction)ContextTable_count, METH_VARARGS, "count(tokens, start, stop, budget) -> position reached"},
    {"uncount", (PyCFunction)ContextTable_uncount, METH_VARARGS, "uncount(tokens, start, stop): remove positions start..stop-1"},
    {"propose", (PyCFunction)(void (*)(void))walk_table, METH_FASTCALL,
     "propose(prefix, max_tokens, min_prob, factor, offset, beat) -> None | (matched, tokens, score)"},
    {"best", (PyCFunction)(void (*)(void))walk_best, METH_FASTCALL,
     "best(tables, prefix, max_tokens, min_prob, factor, offset, own_min_prob, own_factor, own_offset) "
     "-> None | (matched, tokens, score, source)"},
    {NULL},
};

static PyGetSetDef ContextTable_getset[] = {
    {"bytes", (getter)ContextTable_bytes, NULL, "bytes allocated (tables, lists and their ids)", NULL},
    {"contexts", (getter)ContextTable_contexts, NULL, "contexts held, over every order", NULL},
    {NULL},
};

static PyTypeObject ContextTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "drafter_service.proposers._context_table.ContextTable",
    .tp_basicsize = sizeof(ContextTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Context counts of the global suffix index (see the module source's header)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ContextTable_init,
    .tp_dealloc = (destructor)ContextTable_dealloc,
    .tp_methods = ContextTable_methods,
    .tp_getset = ContextTable_getset,
};

static PyMethodDef module_methods[] = {
    {"count_stream", (PyCFunction)(void (*)(void))count_stream, METH_FASTCALL,
     "count_stream(tables, tokens, prefix, start, stop) -> contexts added"},
    {"propose_counts", (PyCFunction)(void (*)(void))walk_counts, METH_FASTCALL,
     "propose_counts(tables, prefix, max_tokens, min_prob, factor, offset, beat) -> None | (matched, tokens, score)"},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_context_table", "Native context counts (issue 37)", -1,
                                    module_methods};

PyMODINIT_FUNC PyInit__context_table(void) {
    POW[0] = 1;
    for (int i = 1; i <= MAX_MATCH; i++) POW[i] = POW[i - 1] * BASE % MOD;
    if (PyType_Ready(&ContextTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    /* the constants this file shares with suffix.py (a test holds them equal) */
    PyObject *orders = PyTuple_New(NUM_ORDERS);
    for (int oi = 0; orders && oi < NUM_ORDERS; oi++) PyTuple_SET_ITEM(orders, oi, PyLong_FromLong(ORDERS[oi]));
    if (!orders || PyModule_AddObject(m, "ORDERS", orders) < 0 || PyModule_AddIntConstant(m, "MOD", (long)MOD) < 0
        || PyModule_AddIntConstant(m, "BASE", (long)BASE) < 0) {
        Py_XDECREF(orders);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ContextTableType);
    if (PyModule_AddObject(m, "ContextTable", (PyObject *)&ContextTableType) < 0) {
        Py_DECREF(&ContextTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
