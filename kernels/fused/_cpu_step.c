/* The CPU's decode/verify step as one native call (kernels/fused/cpu_step.py wraps it).

A qwen3_moe trunk's rows through every layer — the embedding, each layer's norms, q/k/v, q/k
norms + RoPE + the KV write, attention, the o projection, the router's top-k, the routed experts
and their combine — and then the logits, by the row kernels of _cpu_rows.c, called in the order
the per-op path (shared/model/families/qwen3_moe/fused.py) calls them, with the roundings its
wrappers make between them (a product's float32 output to the model's dtype). The step computes
nothing itself, so a row's bits are the per-op path's, which are its one-row step's (DESIGN §11).

Why one call: the per-op path makes ~15 native calls a layer from Python, each dropping and
retaking the interpreter lock; in the service the event loop, a thread of the same process,
holds that lock between them, and every retake waits for it. The step takes it back once.

step_plan(model, layers) -> a capsule of the weights' and caches' addresses and the shapes
  model: (embed, lm_head, cos, sin, tables, hidden, vocab, num_heads, num_kv, head_dim, num_experts,
          inter, block_size, max_blocks, num_slots, max_positions, embed_stride, lm_head_stride, type, wtype)
          wtype: the products' and experts' weights (qkv, o, gate_up, down, lm_head): `type`, or PAIRED
          under float32 rows (the embedding, norms and router stay of `type`)
  layers: [(input_norm, qkv, q_norm, k_norm, o, post_norm, router, gate_up, down, next_norm, keys,
            values, o_splits, o_step, router_splits, router_step, top_k, normalize, eps)]
step_run(plan, token_ids, positions, slots, live, num_rows, logits, hidden, threads, greedy_ids)
  token_ids, positions, slots [T] int64, live [T] int64 or 0 (the router's padding rows); writes
  logits [T, vocab] float32 unless 0 (prompt rows: then no greedy ids either), hidden [T, H] (the
  final norm's rows, of the model's type), greedy_ids [T] int64 unless 0 (argmax's rule: the first
  largest, NaN largest) and the rows' K and V into
  the cache. Raises IndexError / ValueError (the lock held) for a token id
  outside the vocabulary or a position or slot outside the tables, as the per-op path does. */

#include "_cpu_rows.h"

#include <pthread.h>
#include <sched.h>

#define MAX_HELPERS 7
#define MIN(a, b) ((a) < (b) ? (a) : (b))

struct step_layer {
    const void *input_norm, *qkv, *q_norm, *k_norm, *o, *post_norm, *router, *gate_up, *down, *next_norm;
    void *keys, *values;
    Py_ssize_t o_splits, o_step, router_splits, router_step, top_k;
    int normalize;
    float eps;
};

struct step_plan {
    const void *embed, *lm_head;
    const float *cos, *sin;
    const int32_t *tables;
    Py_ssize_t hidden, vocab, num_heads, num_kv, head_dim, num_experts, inter, block_size, max_blocks, num_slots,
        max_positions, embed_stride, lm_head_stride, num_layers;
    int type, wtype;
    struct step_layer layers[];
};

/* One step's rows and its buffers (named views of one allocation). */
struct step_rows {
    const int64_t *token_ids, *positions, *slots, *live;
    Py_ssize_t num_rows, max_length;
    float *logits;
    void *hidden;
    int64_t *greedy_ids;  /* or NULL */
};

struct step_buffers {
    void *residual, *normed, *qkv, *q, *attn;  /* the model's type */
    float *product, *attn_f32,  /* (bfloat16: the products' float32 outputs before their rounding) */
    *o_partials, *router_partials, *route_weights, *route_out, *scratch;
    int64_t *expert_ids;
    float *scratches[1 + MAX_HELPERS];  /* per thread: the step's (= scratch), then each helper's */
    int helpers;  /* helpers taking work items in this step */
    Py_ssize_t claim;  /* the work items' counter of the kernel running */
};

static const char PLAN[] = "tandem.cpu_step";

static void free_plan(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, PLAN)); }

static void *address(unsigned long long value) { return (void *)(uintptr_t)value; }

KERNEL PyObject *step_plan(PyObject *self, PyObject *args) {
    PyObject *model, *layers;
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &model, &PyList_Type, &layers)) return NULL;
    const Py_ssize_t num_layers = PyList_GET_SIZE(layers);
    struct step_plan *p = calloc(1, sizeof *p + (size_t)num_layers * sizeof(struct step_layer));
    if (!p) return PyErr_NoMemory();
    unsigned long long embed, lm_head, cos, sin, tables;
    if (!PyArg_ParseTuple(model, "KKKKKnnnnnnnnnnnnnii", &embed, &lm_head, &cos, &sin, &tables, &p->hidden, &p->vocab,
                          &p->num_heads, &p->num_kv, &p->head_dim, &p->num_experts, &p->inter, &p->block_size,
                          &p->max_blocks, &p->num_slots, &p->max_positions, &p->embed_stride, &p->lm_head_stride,
                          &p->type, &p->wtype)) {
        free(p);
        return NULL;
    }
    if (!weights_read(p->type, p->wtype)) {
        free(p);
        return NULL;
    }
    p->embed = address(embed), p->lm_head = address(lm_head);
    p->cos = address(cos), p->sin = address(sin), p->tables = address(tables);
    p->num_layers = num_layers;
    for (Py_ssize_t i = 0; i < num_layers; i++) {
        struct step_layer *l = &p->layers[i];
        unsigned long long w[12];
        PyObject *item = PyList_GET_ITEM(layers, i);
        if (!PyTuple_Check(item) ||
            !PyArg_ParseTuple(item, "KKKKKKKKKKKKnnnnnif", &w[0], &w[1], &w[2], &w[3], &w[4], &w[5], &w[6], &w[7], &w[8],
                              &w[9], &w[10], &w[11], &l->o_splits, &l->o_step, &l->router_splits, &l->router_step,
                              &l->top_k, &l->normalize, &l->eps)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "step_plan: a layer is a tuple");
            free(p);
            return NULL;
        }
        l->input_norm = address(w[0]), l->qkv = address(w[1]), l->q_norm = address(w[2]), l->k_norm = address(w[3]);
        l->o = address(w[4]), l->post_norm = address(w[5]), l->router = address(w[6]), l->gate_up = address(w[7]);
        l->down = address(w[8]), l->next_norm = address(w[9]), l->keys = address(w[10]), l->values = address(w[11]);
    }
    PyObject *capsule = PyCapsule_New(p, PLAN, free_plan);
    if (!capsule) free(p);
    return capsule;
}

static Py_ssize_t most_splits(const struct step_plan *p, int router) {
    Py_ssize_t most = 1;
    for (Py_ssize_t i = 0; i < p->num_layers; i++) {
        const Py_ssize_t s = router ? p->layers[i].router_splits : p->layers[i].o_splits;
        if (s > most) most = s;
    }
    return most;
}

static Py_ssize_t most_top_k(const struct step_plan *p) {
    Py_ssize_t most = 1;
    for (Py_ssize_t i = 0; i < p->num_layers; i++)
        if (p->layers[i].top_k > most) most = p->layers[i].top_k;
    return most;
}

#define MAX(a, b) ((a) > (b) ? (a) : (b))

/* The largest scratch any kernel of the step asks for (kernels share one). */
static size_t scratch_floats(const struct step_plan *p, const struct step_rows *r) {
    const Py_ssize_t T = r->num_rows, H = p->hidden, k = most_top_k(p);
    const struct attention_call attention = {.max_length = r->max_length, .head_dim = p->head_dim,
                                             .block_size = p->block_size, .num_heads = p->num_heads,
                                             .num_kv = p->num_kv};
    const struct experts_call experts = {.num_tokens = T, .top_k = k, .num_experts = p->num_experts, .hidden = H,
                                         .inter = p->inter};
    const struct products_call widest = {.num_rows = T, .num_in = MAX(H, p->num_heads * p->head_dim)};
    const struct norm_call norm = {.hidden = H};
    const struct rope_call rope = {.head_dim = p->head_dim};
    const struct route_call route = {.num_experts = p->num_experts};
    size_t most = attention_scratch(&attention);
    most = MAX(most, experts_scratch(&experts));
    most = MAX(most, partials_scratch(&widest));
    most = MAX(most, norm_scratch(&norm));
    most = MAX(most, rope_scratch(&rope));
    return MAX(most, route_scratch(&route));
}

/* Carve the buffers out of one allocation (each 64-byte aligned); returns it (NULL: no memory). */
static void *allocate(const struct step_plan *p, const struct step_rows *r, struct step_buffers *b) {
    const size_t T = (size_t)r->num_rows, H = (size_t)p->hidden, es = p->type == F32 ? 4 : 2;
    const size_t heads = (size_t)(p->num_heads * p->head_dim), qkv = (size_t)((p->num_heads + 2 * p->num_kv) * p->head_dim);
    const size_t k = (size_t)most_top_k(p), E = (size_t)p->num_experts;
    const size_t sizes[] = {
        T * H * es, T * H * es, T * qkv * es, T * heads * es, T * heads * es,  /* residual .. attn */
        T * qkv * 4, T * heads * 4, T * (size_t)most_splits(p, 0) * H * 4, T * (size_t)most_splits(p, 1) * E * 4,
        T * k * 4, T * k * H * 4, scratch_floats(p, r) * 4 * (size_t)(1 + b->helpers), T * k * 8,
    };
    enum { COUNT = sizeof sizes / sizeof sizes[0] };
    size_t offsets[COUNT], total = 0;
    for (int i = 0; i < COUNT; i++) {
        offsets[i] = total;
        total += (sizes[i] + 63) / 64 * 64;
    }
    unsigned char *base = aligned_alloc(64, total ? total : 64);
    if (!base) return NULL;
    void **views[] = {&b->residual, &b->normed, &b->qkv, &b->q, &b->attn};
    for (int i = 0; i < 5; i++) *views[i] = base + offsets[i];
    float **floats[] = {&b->product, &b->attn_f32, &b->o_partials, &b->router_partials, &b->route_weights,
                        &b->route_out, &b->scratch};
    for (int i = 0; i < 7; i++) *floats[i] = (float *)(base + offsets[5 + i]);
    b->expert_ids = (int64_t *)(base + offsets[12]);
    for (int i = 0; i <= b->helpers; i++) b->scratches[i] = b->scratch + (size_t)i * scratch_floats(p, r);
    return base;
}

/* The step's threads. The products, attention and the experts split into work items (_cpu_rows.h:
   `claim`); the step's thread and its helpers take items from one counter until none is left, each
   computing an item whole with its own scratch, so a row's bits do not depend on the threads or on
   who took what. A helper joins a job only while it is open (the step's thread closes it when it
   has run out of items, then waits for the helpers that joined): a helper slow to wake costs
   nothing, the step's thread takes its items. Between a step's jobs helpers spin, yielding the core
   to any other thread (the service's event loop shares this process's cores); between steps they
   sleep. */
#define JOB_CLOSED ((uint64_t)1 << 32)

struct pool {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int num_helpers;
    int stepping;  /* a step runs: helpers spin between its jobs */
    int team;  /* the helpers of the running step (index < team); the others sleep */
    uint64_t job;  /* generation << 33 | closed << 32 | helpers joined */
    uint64_t finished;  /* helpers done with the current job */
    row_kernel kernel;
    const void *call;
    float *const *scratch;  /* per thread (0: the step's) */
};

static struct pool pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};
static pthread_mutex_t pool_user = PTHREAD_MUTEX_INITIALIZER;  /* held by the step using the helpers */

static uint64_t load_acquire(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static int on_team(int index) {
    return __atomic_load_n(&pool.stepping, __ATOMIC_RELAXED) && index < __atomic_load_n(&pool.team, __ATOMIC_RELAXED);
}

static void *helper_main(void *arg) {
    const int index = (int)(intptr_t)arg;  /* its scratch: 1 + index */
    uint64_t seen = 0;  /* the last generation it looked at */
    for (;;) {
        uint64_t job = load_acquire(&pool.job);
        while (job >> 33 == seen && on_team(index)) {
            sched_yield();
            job = load_acquire(&pool.job);
        }
        if (job >> 33 == seen) {  /* between steps: sleep until the next one */
            pthread_mutex_lock(&pool.lock);
            while (load_acquire(&pool.job) >> 33 == seen && !on_team(index)) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
            job = load_acquire(&pool.job);
            if (job >> 33 == seen) continue;  /* (a step began: spin for its first job) */
        }
        seen = job >> 33;
        /* join the job while it is open */
        while (!(job & JOB_CLOSED) &&  /* (a failed exchange reloads job) */
               !__atomic_compare_exchange_n(&pool.job, &job, job + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            if (job >> 33 != seen) break;
        if (job >> 33 != seen || (job & JOB_CLOSED)) continue;
        /* joined: the step's thread counts it done either way (team, read after the job: this step's) */
        if (index < __atomic_load_n(&pool.team, __ATOMIC_RELAXED)) pool.kernel(pool.call, pool.scratch[1 + index]);
        __atomic_fetch_add(&pool.finished, 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* A forked child has none of the parent's helpers, and its locks start free. */
static void after_fork_in_child(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_mutex_init(&pool_user, NULL);
    pool.num_helpers = 0;
    pool.stepping = pool.team = 0;
}

static pthread_once_t fork_handler = PTHREAD_ONCE_INIT;

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

/* At most `wanted` helpers running (started once, never stopped); how many there are. */
static int ensure_helpers(int wanted) {
    if (wanted > MAX_HELPERS) wanted = MAX_HELPERS;
    pthread_once(&fork_handler, register_fork_handler);
    pthread_mutex_lock(&pool.lock);
    while (pool.num_helpers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, helper_main, (void *)(intptr_t)pool.num_helpers);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.num_helpers++;
    }
    const int have = pool.num_helpers;
    pthread_mutex_unlock(&pool.lock);
    return have;
}

static void set_stepping(int stepping, int team) {
    pthread_mutex_lock(&pool.lock);
    __atomic_store_n(&pool.team, team, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.stepping, stepping, __ATOMIC_RELAXED);
    if (stepping) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
}

/* kernel(call) on the step's thread and the helpers that join; `claim` is the call's counter. */
static void parallel(row_kernel kernel, const void *call, Py_ssize_t *claim, float *const *scratch, int helpers) {
    *claim = 0;
    if (helpers == 0) {
        kernel(call, scratch[0]);
        return;
    }
    pool.kernel = kernel, pool.call = call, pool.scratch = scratch;
    __atomic_store_n(&pool.finished, 0, __ATOMIC_RELAXED);
    const uint64_t generation = (load_acquire(&pool.job) >> 33) + 1;
    __atomic_store_n(&pool.job, generation << 33, __ATOMIC_RELEASE);  /* open, nobody joined */
    kernel(call, scratch[0]);
    const uint64_t joined = __atomic_fetch_or(&pool.job, JOB_CLOSED, __ATOMIC_ACQ_REL) & (JOB_CLOSED - 1);
    while (load_acquire(&pool.finished) < joined) sched_yield();
}

/* kernel(call) outside a step (a step's draws, _cpu_draws.c) on up to `threads` threads: the
   caller's, and the helpers where no step holds them; the interpreter lock dropped meanwhile. */
KERNEL void pool_parallel(row_kernel kernel, const void *call, Py_ssize_t *claim, int threads) {
    float *scratch[1 + MAX_HELPERS] = {NULL};
    const int team = threads > 1 && pthread_mutex_trylock(&pool_user) == 0;
    const int helpers = team ? MIN(ensure_helpers(threads - 1), threads - 1) : 0;
    Py_BEGIN_ALLOW_THREADS
    if (helpers) set_stepping(1, helpers);
    parallel(kernel, call, claim, scratch, helpers);
    if (helpers) set_stepping(0, 0);
    Py_END_ALLOW_THREADS
    if (team) pthread_mutex_unlock(&pool_user);
}

/* One product as the per-op path's `linear` (one split over all of K) or `linear_partials`. */
static void product(const void *x, Py_ssize_t num_rows, Py_ssize_t num_in, const void *weight, Py_ssize_t num_out,
                    Py_ssize_t weight_stride, Py_ssize_t splits, Py_ssize_t step, float *out, int type, int wtype,
                    struct step_buffers *b) {
    const struct products_call c = {.x = x, .weight = weight, .out = out, .num_rows = num_rows, .num_out = num_out,
                                    .num_in = num_in, .x_stride = num_in, .weight_stride = weight_stride,
                                    .splits = splits, .step = step, .claim = &b->claim, .type = type, .wtype = wtype};
    parallel(partial_rows, &c, &b->claim, b->scratches, b->helpers);
}

static void norm(const void *x, int kind, Py_ssize_t terms, const float *route_weights, void *residual,
                 const void *weight, void *normed, const struct step_plan *p, Py_ssize_t num_rows, float eps,
                 float *scratch) {
    const struct norm_call c = {.x = x, .residual = kind ? residual : NULL, .weight = weight,
                                .route_weights = route_weights, .normed = normed, .new_residual = kind ? residual : NULL,
                                .num_rows = num_rows, .hidden = p->hidden, .terms = terms, .eps = eps, .kind = kind,
                                .centred = 0, .type = p->type};
    add_norm_rows(&c, scratch);  /* (a row's residual is read before it is written: in place is safe) */
}

static void layer_rows(const struct step_plan *p, const struct step_layer *l, const struct step_rows *r,
                       struct step_buffers *b) {
    const Py_ssize_t T = r->num_rows, H = p->hidden, D = p->head_dim;
    const Py_ssize_t heads = p->num_heads * D, width = (p->num_heads + 2 * p->num_kv) * D;
    const int type = p->type;
    /* mix: q/k/v, their norms and RoPE (k and v to the cache), attention, o, the residual and the post norm */
    product(b->normed, T, H, l->qkv, width, H, 1, H, type == F32 ? (float *)b->qkv : b->product, type, p->wtype, b);
    if (type == BF16) store_row(b->qkv, 0, b->product, T * width, BF16);
    const struct rope_call rope = {.qkv = b->qkv, .q_norm = l->q_norm, .k_norm = l->k_norm, .q_out = b->q,
                                   .keys = l->keys, .values = l->values, .tables = p->tables,
                                   .positions = r->positions, .slots = r->slots, .cos = p->cos, .sin = p->sin,
                                   .num_rows = T, .qkv_stride = width, .num_heads = p->num_heads,
                                   .num_kv = p->num_kv, .head_dim = D, .q_head_stride = D, .rot = D,
                                   .block_size = p->block_size, .max_blocks = p->max_blocks, .eps = l->eps,
                                   .centred = 0, .type = type};
    qk_rope_rows(&rope, b->scratch);
    const struct attention_call attention = {.q = b->q, .keys = l->keys, .values = l->values, .tables = p->tables,
                                             .positions = r->positions, .slots = r->slots,
                                             .out = type == F32 ? (float *)b->attn : b->attn_f32,
                                             .num_rows = T, .num_heads = p->num_heads, .num_kv = p->num_kv,
                                             .head_dim = D, .block_size = p->block_size,
                                             .max_blocks = p->max_blocks, .max_length = r->max_length, .claim = &b->claim,
                                             .type = type};
    parallel(attention_rows, &attention, &b->claim, b->scratches, b->helpers);
    if (type == BF16) store_row(b->attn, 0, b->attn_f32, T * heads, BF16);
    product(b->attn, T, heads, l->o, H, heads, l->o_splits, l->o_step, b->o_partials, type, p->wtype, b);
    norm(b->o_partials, 1, l->o_splits, NULL, b->residual, l->post_norm, b->normed, p, T, l->eps, b->scratch);
    /* the router's top-k, the routed experts, their weighted sum, the residual and the next norm */
    product(b->normed, T, H, l->router, p->num_experts, H, l->router_splits, l->router_step, b->router_partials,
            type, type, b);
    const struct route_call route = {.partials = b->router_partials, .live = r->live, .ids = b->expert_ids,
                                     .weights = b->route_weights, .num_rows = T, .splits = l->router_splits,
                                     .num_experts = p->num_experts, .top_k = l->top_k, .normalize = l->normalize,
                                     .round = type == BF16, .has_live = r->live != NULL};
    route_rows(&route, b->scratch);
    const struct experts_call experts = {.x = b->normed, .gate_up = l->gate_up, .down = l->down, .ids = b->expert_ids,
                                         .out = b->route_out, .num_tokens = T, .top_k = l->top_k,
                                         .num_experts = p->num_experts, .hidden = H, .inter = p->inter, .claim = &b->claim,
                                         .type = type, .wtype = p->wtype};
    parallel(expert_routes, &experts, &b->claim, b->scratches, b->helpers);
    norm(b->route_out, 2, l->top_k, b->route_weights, b->residual, l->next_norm, b->normed, p, T, l->eps, b->scratch);
}

static void run_step(const struct step_plan *p, const struct step_rows *r, struct step_buffers *b) {
    const Py_ssize_t T = r->num_rows, H = p->hidden;
    const size_t es = p->type == F32 ? 4 : 2;
    for (Py_ssize_t t = 0; t < T; t++)  /* the embedding's rows: the first residual */
        memcpy((unsigned char *)b->residual + (size_t)(t * H) * es,
               (const unsigned char *)p->embed + (size_t)(r->token_ids[t] * p->embed_stride) * es, (size_t)H * es);
    norm(b->residual, 0, 1, NULL, NULL, p->layers[0].input_norm, b->normed, p, T, p->layers[0].eps, b->scratch);
    for (Py_ssize_t i = 0; i < p->num_layers; i++) layer_rows(p, &p->layers[i], r, b);
    memcpy(r->hidden, b->normed, (size_t)(T * H) * es);
    if (!r->logits) return;  /* (prompt rows: no logits) */
    /* the logits: `linear` to float32 rounds through the model's type first */
    product(b->normed, T, H, p->lm_head, p->vocab, p->lm_head_stride, 1, H, r->logits, p->type, p->wtype, b);
    if (p->type == BF16)
        for (size_t j = 0; j < (size_t)(T * p->vocab); j++) r->logits[j] = round_bf16(r->logits[j]);
    if (r->greedy_ids) argmax_rows(r->logits, r->greedy_ids, T, p->vocab);
}

KERNEL PyObject *step_run(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long token_ids, positions, slots, live, logits, hidden, greedy_ids;
    struct step_rows r;
    int threads;
    if (!PyArg_ParseTuple(args, "OKKKKnKKiK", &capsule, &token_ids, &positions, &slots, &live, &r.num_rows, &logits,
                          &hidden, &threads, &greedy_ids))
        return NULL;
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "step_run: threads %d must be >= 1", threads);
        return NULL;
    }
    const struct step_plan *p = PyCapsule_GetPointer(capsule, PLAN);
    if (!p) return NULL;
    if (p->num_layers < 1) {
        PyErr_SetString(PyExc_ValueError, "step_run: the plan has no layers");
        return NULL;
    }
    r.token_ids = address(token_ids), r.positions = address(positions), r.slots = address(slots);
    r.live = address(live), r.logits = address(logits), r.hidden = address(hidden);
    r.greedy_ids = address(greedy_ids);
    if (r.greedy_ids && !r.logits) {
        PyErr_SetString(PyExc_ValueError, "step_run: greedy ids need the logits");
        return NULL;
    }
    const Py_ssize_t position_limit = MAX(0, p->max_positions < p->max_blocks * p->block_size
                                                 ? p->max_positions : p->max_blocks * p->block_size);
    r.max_length = 0;
    for (Py_ssize_t t = 0; t < r.num_rows; t++) {  /* the C kernels index with these unchecked */
        if (r.token_ids[t] < 0 || r.token_ids[t] >= p->vocab) {
            PyErr_Format(PyExc_IndexError, "step_run: token id %lld of row %zd is outside the vocabulary (%zd)",
                         (long long)r.token_ids[t], t, p->vocab);
            return NULL;
        }
        if (r.positions[t] < 0 || r.positions[t] >= position_limit || r.slots[t] < 0 || r.slots[t] >= p->num_slots) {
            PyErr_Format(PyExc_ValueError, "step_run: row %zd's position or slot is outside the block tables "
                         "(or the rotary table)", t);
            return NULL;
        }
        if (r.positions[t] + 1 > r.max_length) r.max_length = r.positions[t] + 1;
    }
    if (r.num_rows == 0) Py_RETURN_NONE;
    struct step_buffers b = {.helpers = 0};
    /* one step at a time has the helpers (another, in another thread, runs on its own) */
    const int team = threads > 1 && pthread_mutex_trylock(&pool_user) == 0;
    if (team) b.helpers = MIN(ensure_helpers(threads - 1), threads - 1);
    void *arena = allocate(p, &r, &b);
    if (!arena) {
        if (team) pthread_mutex_unlock(&pool_user);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    if (b.helpers) set_stepping(1, b.helpers);
    run_step(p, &r, &b);
    if (b.helpers) set_stepping(0, 0);
    Py_END_ALLOW_THREADS
    if (team) pthread_mutex_unlock(&pool_user);
    free(arena);
    Py_RETURN_NONE;
}
