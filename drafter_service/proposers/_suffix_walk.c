/* The suffix proposal rule (suffix.py's _propose), walked natively over either index's counts.

   A round's proposal walks the global index's counts (the ContextTable of _context_table.c)
   and then the request's own (suffix.py's ContextCounts.tables: one dict per order, context
   hash -> a packed int or a dict token -> count). Both walks run here, step for step the
   Python rule (the same look-ups in the same order, the same floats in the same order), so a
   proposal is the same token for token (tests/drafter_service/proposers/test_suffix_walk.py
   holds the walks equal). Why native: a proposal is on every round's latency path, and in
   Python the request's walk and the glue between the two walks cost about as much as the
   global walk's compute. What remains is the global walk's memory latency: each drafted token
   is one look-up whose key depends on the token before, into tables of up to GiBs, so those
   misses cannot overlap. (Prefetching the first search's slots, all at once or a step ahead,
   was measured and made it slower or changed nothing: docs/PERFORMANCE.md, 2026-12-04.)

   The request's counts stay Python dicts (counted off the round's path, by _request_counts.c
   or suffix.py); this file only reads them. Tokens must lie in [0, 2**32) (as suffix.py's packed ints assume).

   Python API (prefix: a request's list of prefix hashes, SuffixIndex.prefix; tables: its
   ContextCounts.tables):
     ContextTable.propose(prefix, max_tokens, min_prob, factor, offset, beat)
     propose_counts(tables, prefix, max_tokens, min_prob, factor, offset, beat)
                                 one walk: None or (matched, [tokens], score)
     ContextTable.best(tables, prefix, max_tokens, min_prob, factor, offset, own_min_prob,
                       own_factor, own_offset)
                                 a round's proposal (global_index.py's best_match): None or
                                 (matched, [tokens], score, "global" | "request") */
#include "_context_table.h"
#include <math.h>
#include <stdlib.h>

/* A walk's counts: the global table, or (table NULL) a request's NUM_ORDERS dicts. */
typedef struct {
    const ContextTable *table;
    PyObject *const *dicts;
} Counts;

/* What a look-up found: the table's slot value, or the dict's value (borrowed). */
typedef struct {
    uint32_t value;
    PyObject *object;
} Found;

/* Context `key` (hash + 1) at order oi: 1 found, 0 not, -1 with an exception set. */
static inline int counts_get(const Counts *c, int oi, uint32_t key, Found *found) {
    if (c->table) return (found->value = table_value(c->table, oi, key)) != 0;
    PyObject *k = PyLong_FromUnsignedLong(key - 1);
    if (!k) return -1;
    found->object = PyDict_GetItemWithError(c->dicts[oi], k);
    Py_DECREF(k);
    return found->object ? 1 : PyErr_Occurred() ? -1 : 0;
}

static int token_of(PyObject *object, uint32_t *token) {
    unsigned long value = PyLong_AsUnsignedLong(object);
    if (value > 0xFFFFFFFFul || (value == (unsigned long)-1 && PyErr_Occurred())) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "suffix counts' tokens must lie in [0, 2**32)");
        return -1;
    }
    *token = (uint32_t)value;
    return 0;
}

/* The continuation suffix.py's _best picks: the most frequent token, ties to the most recently
   counted (the later in a List, or in a dict's order); *p its frequency, or -1 when the
   context was only ever followed by one token (certain: the rule multiplies nothing in).
   0, or -1 with an exception set. */
static int counts_best(const Counts *c, const Found *found, uint32_t *token, double *p) {
    uint64_t best_count = 0, total = 0;
    if (c->table) {
        if (!(found->value & LIST_FLAG)) {
            *token = found->value & (TOKEN_LIMIT - 1), *p = -1.0;
            return 0;
        }
        const List *list = c->table->lists[found->value & ~LIST_FLAG];
        *token = 0;
        for (uint32_t i = 0; i < list->length; i++) {
            total += list->items[2 * i + 1];
            if (list->items[2 * i + 1] >= best_count) *token = list->items[2 * i], best_count = list->items[2 * i + 1];
        }
    } else if (PyLong_CheckExact(found->object)) {  /* token + (count - 1) << 32 */
        *token = (uint32_t)(PyLong_AsUnsignedLongLongMask(found->object) & 0xFFFFFFFFu), *p = -1.0;
        return PyErr_Occurred() ? -1 : 0;
    } else if (PyDict_CheckExact(found->object)) {
        Py_ssize_t pos = 0;
        PyObject *key, *count;
        PyObject *best = NULL;
        while (PyDict_Next(found->object, &pos, &key, &count)) {
            unsigned long long n = PyLong_AsUnsignedLongLong(count);
            if (n == (unsigned long long)-1 && PyErr_Occurred()) return -1;
            total += n;
            if (n >= best_count) best = key, best_count = n;
        }
        if (!best || token_of(best, token) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "an empty dict of suffix counts");
            return -1;
        }
    } else {
        PyErr_SetString(PyExc_TypeError, "suffix counts hold ints or dicts");
        return -1;
    }
    *p = (double)best_count / (double)total;
    return 0;
}

/* A request's prefix hashes, read from its list as the walk needs them (most are never
   read), then those of the drafted tokens. */
typedef struct {
    PyObject *prefix;
    Py_ssize_t first;  /* index in prefix of hashes[0] */
    Py_ssize_t have;   /* hashes[0..have) come from the list */
    uint64_t loaded;   /* bit i: hashes[i] read */
    uint64_t *hashes;
} Hashes;

static inline int hash_at(Hashes *h, Py_ssize_t i, uint64_t *out) {
    if (i < h->have && !(h->loaded >> i & 1)) {
        if (prefix_hash(h->prefix, h->first + i, &h->hashes[i]) < 0) return -1;
        h->loaded |= 1ULL << i;
    }
    *out = h->hashes[i];
    return 0;
}

/* The key (hash + 1) of the `order` tokens before hashes[end]: 0 with an exception set on a bad hash. */
static inline uint32_t window_key(Hashes *h, Py_ssize_t end, int order) {
    uint64_t last = 0, first = 0;
    if (hash_at(h, end, &last) < 0 || hash_at(h, end - order, &first) < 0) return 0;
    return (uint32_t)((last + MOD - first * POW[order] % MOD) % MOD) + 1;
}

/* Whether the context of ORDERS[oi] before hashes[end] is counted: 1, 0, -1 (exception). */
static inline int matches(const Counts *c, Hashes *h, Py_ssize_t end, int oi) {
    Found found;
    uint32_t key = window_key(h, end, ORDERS[oi]);
    return key ? counts_get(c, oi, key, &found) : -1;
}

/* A proposal rule's settings (suffix.py's min_prob, factor, offset) and a walk's result. */
typedef struct { double min_prob, factor, offset; } Rule;
typedef struct {
    int matched;       /* the context tokens matched */
    Py_ssize_t count;  /* drafts[0..count) */
    double score;
    uint32_t *drafts;
    uint64_t *hashes;  /* room for the walk's hashes: MAX_MATCH + 1 + max_tokens */
} Chain;

#define SMALL 64  /* drafts a Chain holds on the stack; more (a larger max_tokens) are allocated */
typedef struct { uint32_t drafts[SMALL]; uint64_t hashes[MAX_MATCH + 1 + SMALL]; } Room;

/* Room for the drafts a walk under `rule` can make: its chain limit after the longest match
   (the limits grow with the match), at most max_tokens. */
static int chain_init(Chain *chain, Room *room, Py_ssize_t max_tokens, const Rule *rule) {
    double most = MAX_MATCH * rule->factor + rule->offset + 1e-6;
    Py_ssize_t room_for = most < (double)max_tokens ? (most > 0 ? (Py_ssize_t)most : 0) : max_tokens;
    chain->drafts = room->drafts, chain->hashes = room->hashes;
    if (room_for <= SMALL) return 0;
    chain->drafts = malloc(sizeof(uint32_t) * room_for);
    chain->hashes = malloc(sizeof(uint64_t) * (MAX_MATCH + 1 + room_for));
    if (chain->drafts && chain->hashes) return 0;
    PyErr_NoMemory();
    return -1;
}

static void chain_free(Chain *chain, Room *room) {
    if (chain->drafts != room->drafts) free(chain->drafts);
    if (chain->hashes != room->hashes) free(chain->hashes);
}

/* suffix.py's _propose over `c`: 1 with *chain set, 0 when there is none (or it cannot score
   above beat), -1 with an exception set. n >= 0 tokens are committed (prefix: n + 1 hashes). */
static int walk(const Counts *c, PyObject *prefix, Py_ssize_t max_tokens, const Rule *rule, double beat, Chain *chain) {
    if (beat >= (double)max_tokens) return 0;
    Py_ssize_t n = PyList_GET_SIZE(prefix) - 1;
    if (n < 1) return 0;
    /* the request's last MAX_MATCH + 1 prefix hashes, then those of the drafts */
    Py_ssize_t have = n + 1 < MAX_MATCH + 1 ? n + 1 : MAX_MATCH + 1;
    Hashes h = {prefix, n + 1 - have, have, 0, chain->hashes};
    Py_ssize_t end = have - 1;  /* hashes[end] hashes all committed tokens; `end` tokens are visible */
    int low = 0, high = NUM_ORDERS;  /* ORDERS[:low] match, ORDERS[high:] do not */
    if (beat != 0.0) {
        /* Only a match of ORDERS[first:] allows a chain long enough to score above beat: if
           the shortest of them does not match, neither does a longer one (one look-up). */
        int first = 0;
        while (first < NUM_ORDERS && (double)(Py_ssize_t)(ORDERS[first] * rule->factor + rule->offset + 1e-6) <= beat)
            first++;
        if (first == NUM_ORDERS || ORDERS[first] > n) return 0;
        int found = matches(c, &h, end, first);
        if (found <= 0) return found;
        low = first + 1;
    }
    while (low < high) {  /* the matching orders are a prefix of ORDERS: binary search */
        int mid = (low + high) / 2, found = 0;
        if (ORDERS[mid] <= n && (found = matches(c, &h, end, mid)) < 0) return -1;
        if (found) low = mid + 1;
        else high = mid;
    }
    int oi = low - 1;
    if (oi < 0) return 0;
    int matched = ORDERS[oi];
    Py_ssize_t limit = (Py_ssize_t)(matched * rule->factor + rule->offset + 1e-6), count = 0;
    if (limit > max_tokens) limit = max_tokens;
    if ((double)limit <= beat) return 0;
    double prob = 1.0, score = 0.0;
    Py_ssize_t length = matched;  /* the match grows with every drafted token */
    int next_order = oi + 1 < NUM_ORDERS ? ORDERS[oi + 1] : 1 << 30;
    while (length < matched + limit) {
        while (length >= next_order) {  /* into longer contexts */
            oi++;
            next_order = oi + 1 < NUM_ORDERS ? ORDERS[oi + 1] : 1 << 30;
        }
        Found found = {0, NULL};
        int hit = 0;
        while (oi >= 0) {
            if (ORDERS[oi] <= end) {
                uint32_t key = window_key(&h, end, ORDERS[oi]);
                if (!key || (hit = counts_get(c, oi, key, &found)) < 0) return -1;
                if (hit) break;
            }
            oi--;
            next_order = ORDERS[oi + 1];
        }
        if (!hit) break;
        uint32_t token;
        double p;
        if (counts_best(c, &found, &token, &p) < 0) return -1;
        if (p >= 0.0) {
            prob *= p;
            if (prob < rule->min_prob) break;
        }
        chain->drafts[count++] = token;
        score += prob;
        length++;
        if (beat != 0.0 && score + (double)(matched + limit - length) * prob <= beat) return 0;
        uint64_t last = 0;
        if (hash_at(&h, end, &last) < 0) return -1;
        h.hashes[end + 1] = (last * BASE + token + 1) % MOD;
        end++;
    }
    chain->matched = matched, chain->count = count, chain->score = score;
    return count > 0;
}

/* (matched, [tokens], score), with `source` appended when given. */
static PyObject *chain_tuple(const Chain *chain, PyObject *source) {
    PyObject *list = PyList_New(chain->count);
    if (!list) return NULL;
    for (Py_ssize_t i = 0; i < chain->count; i++) {
        PyObject *item = PyLong_FromUnsignedLong(chain->drafts[i]);
        if (!item) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return source ? Py_BuildValue("(iNdO)", chain->matched, list, chain->score, source)
                  : Py_BuildValue("(iNd)", chain->matched, list, chain->score);
}

static int parse(PyObject *const *args, Py_ssize_t *max_tokens, Rule *rule) {  /* max_tokens, min_prob, factor, offset */
    *max_tokens = PyLong_AsSsize_t(args[0]);
    rule->min_prob = PyFloat_AsDouble(args[1]), rule->factor = PyFloat_AsDouble(args[2]);
    rule->offset = PyFloat_AsDouble(args[3]);
    return PyErr_Occurred() ? -1 : 0;
}

/* A request's counts (suffix.py's ContextCounts.tables) as a walk reads them: NULL on error. */
static PyObject *const *request_dicts(PyObject *tables) {
    if (!PyList_Check(tables) || PyList_GET_SIZE(tables) != NUM_ORDERS) {
        PyErr_SetString(PyExc_TypeError, "tables must be a list of one dict per order");
        return NULL;
    }
    PyObject *const *dicts = ((PyListObject *)tables)->ob_item;
    for (int oi = 0; oi < NUM_ORDERS; oi++)
        if (!PyDict_Check(dicts[oi])) {
            PyErr_Format(PyExc_TypeError, "tables[%d] is not a dict", oi);
            return NULL;
        }
    return dicts;
}

/* One walk: args = prefix, max_tokens, min_prob, factor, offset, beat. */
static PyObject *propose_one(const Counts *c, PyObject *const *args) {
    Py_ssize_t max_tokens;
    Rule rule;
    if (!PyList_Check(args[0])) return PyErr_Format(PyExc_TypeError, "prefix must be a list");
    if (parse(args + 1, &max_tokens, &rule) < 0) return NULL;
    double beat = PyFloat_AsDouble(args[5]);
    if (beat == -1.0 && PyErr_Occurred()) return NULL;
    Room room;
    Chain chain;
    PyObject *result = NULL;
    if (chain_init(&chain, &room, max_tokens, &rule) == 0) {
        int found = walk(c, args[0], max_tokens, &rule, beat, &chain);
        result = found < 0 ? NULL : found ? chain_tuple(&chain, NULL) : Py_NewRef(Py_None);
    }
    chain_free(&chain, &room);
    return result;
}

PyObject *walk_table(ContextTable *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "propose(prefix: list, max_tokens, min_prob, factor, offset, beat)");
        return NULL;
    }
    Counts c = {self, NULL};
    return propose_one(&c, args);
}

PyObject *walk_counts(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "propose_counts(tables, prefix, max_tokens, min_prob, factor, offset, beat)");
        return NULL;
    }
    Counts c = {NULL, request_dicts(args[0])};
    return c.dicts ? propose_one(&c, args + 1) : NULL;
}

/* global_index.py's best_match in one call: the global walk, then the request's own cut short
   by the global score (ties go to the request's own). args = tables, prefix, max_tokens, then
   the global rule and the request's (min_prob, factor, offset each); None or (matched,
   [tokens], score, "global" | "request"). */
PyObject *walk_best(ContextTable *self, PyObject *const *args, Py_ssize_t nargs) {
    static PyObject *sources[2];
    if (!sources[0] && (!(sources[0] = PyUnicode_InternFromString("global"))
                        || !(sources[1] = PyUnicode_InternFromString("request"))))
        return NULL;
    if (nargs != 9 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "best(tables, prefix: list, max_tokens, min_prob, factor, offset, "
                                         "own_min_prob, own_factor, own_offset)");
        return NULL;
    }
    Counts global = {self, NULL}, own = {NULL, request_dicts(args[0])};
    Py_ssize_t max_tokens;
    Rule global_rule, own_rule;
    if (!own.dicts || parse(args + 2, &max_tokens, &global_rule) < 0) return NULL;
    PyObject *const own_args[4] = {args[2], args[6], args[7], args[8]};  /* (max_tokens, the request's rule) */
    if (parse(own_args, &max_tokens, &own_rule) < 0) return NULL;
    Room rooms[2];
    Chain chains[2];  /* global, own */
    PyObject *result = NULL;
    int ready = chain_init(&chains[0], &rooms[0], max_tokens, &global_rule);
    if (chain_init(&chains[1], &rooms[1], max_tokens, &own_rule) == 0 && ready == 0) {
        int other = walk(&global, args[1], max_tokens, &global_rule, 0.0, &chains[0]), mine = 0;
        if (other >= 0)
            mine = walk(&own, args[1], max_tokens, &own_rule, other ? nextafter(chains[0].score, -INFINITY) : 0.0,
                        &chains[1]);
        if (other >= 0 && mine >= 0) {
            int pick = mine && (!other || chains[1].score >= chains[0].score) ? 1 : other ? 0 : -1;
            result = pick < 0 ? Py_NewRef(Py_None) : chain_tuple(&chains[pick], sources[pick]);
        }
    }
    chain_free(&chains[0], &rooms[0]);
    chain_free(&chains[1], &rooms[1]);
    return result;
}
