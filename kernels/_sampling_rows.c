/* The processed target distribution of logit rows on the CPU, natively (kernels/sampling.py's
   process_logits is the definition; this computes the same law in one pass a row, where torch
   spends a dozen small ops on it).

   process(logits, type, rows, vocab, temperature, top_k, top_p, min_p, width, candidates,
           token_ids, probs)
   logits [rows, vocab] of `type` (0 float32, 1 bfloat16, 2 float64); candidates = max(width,
   top_k) (top_k 0: off); token_ids [rows, width] int64 and probs [rows, width] float64 out.
   Per row, in float64: scaled = logit / temperature; the softmax's normaliser over the whole
   row; the `candidates` largest scaled values (ties: the lower id first) selected (a heap), then sorted;
   their softmax probabilities; top_k, top_p (the mass before a token below top_p), min_p
   (against the most likely), the cap to `width`, each followed by a renormalisation; the kept
   tokens by ascending id, then padding (id -1, prob 0). The arithmetic is the definition's, in
   another summation order (the normaliser, the renormalisations): probabilities agree to
   rounding, never in which tokens are kept except at a boundary met to the last bit.

   A step's draws from such rows (sample()'s pick, the pick stream's u) are the step's own, on its
   threads: kernels/fused/_cpu_draws.c, from the same code (_sampling_core.h). */
#include "_sampling_core.h"

static void process_rows(const struct process_call *c, const struct row_scratch *b) {
    for (Py_ssize_t r = 0; r < c->rows; r++)
        process_row(c, r, b, c->token_ids + r * c->width, c->probs + r * c->width);
}

static PyObject *process(PyObject *self, PyObject *args) {
    unsigned long long logits, token_ids, probs;
    struct process_call c;
    if (!PyArg_ParseTuple(args, "Kinndnddnn" "KK", &logits, &c.type, &c.rows, &c.vocab, &c.temperature, &c.top_k,
                          &c.top_p, &c.min_p, &c.width, &c.candidates, &token_ids, &probs))
        return NULL;
    if (c.type < 0 || c.type > 2 || c.vocab < 1 || c.width < 1 || c.candidates < c.width || c.candidates > c.vocab ||
        c.top_k < 0 || !(c.temperature > 0.0)) {
        PyErr_SetString(PyExc_ValueError, "process: bad type, sizes or temperature");
        return NULL;
    }
    c.logits = (const char *)(uintptr_t)logits;
    c.token_ids = (int64_t *)(uintptr_t)token_ids;
    c.probs = (double *)(uintptr_t)probs;
    struct row_scratch b;
    if (!scratch_alloc(&b, c.vocab, c.candidates)) {
        scratch_free(&b);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    process_rows(&c, &b);
    Py_END_ALLOW_THREADS
    scratch_free(&b);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"process", process, METH_VARARGS, "The processed distribution of logit rows (see kernels/sampling.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sampling_rows", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sampling_rows(void) { return PyModule_Create(&module); }
