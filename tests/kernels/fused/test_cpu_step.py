"""The CPU's step as one native call (kernels.fused.cpu_step): the per-op path's bits, through the
runner the engine calls, for windows, decode batches and verify batches (DESIGN §11)."""

import pytest
import torch

from kernels.fused import cpu_rows, cpu_step
from shared.model import ModelConfig, RoutingOptions, load_model
from shared.model.families.qwen3_moe.fused import FusedModel
from shared.model import graphs
from shared.model.graphs import FusedRunner
from shared.model.kv_cache import KVPool

# Odd sizes where the kernels have tails: hidden 40 (not a multiple of the eight lanes), 3 layers,
# top 3 of 6 experts, a vocabulary of 101.
STEP_MODEL = dict(
    model_type="qwen3_moe", vocab_size=101, hidden_size=40, intermediate_size=48, moe_intermediate_size=12,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
    num_experts_per_tok=3, max_position_embeddings=128, rope_theta=10000.0, norm_topk_prob=True,
    initializer_range=0.5,
)

pytestmark = pytest.mark.skipif(not cpu_rows.available(), reason="the native kernels are not built")


@pytest.fixture(autouse=True)
def _as_a_service_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the interpreter's kernels are not the step's)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def step_model(request):
    return load_model(config=ModelConfig.from_dict(STEP_MODEL), random_weights=True, seed=5, dtype=request.param)


def runner_over(model, native: bool, block_size: int | None):
    c = model.config
    pool = KVPool(num_layers=c.num_hidden_layers, num_slots=4, max_length=64, num_kv_heads=c.num_key_value_heads,
                  head_dim=c.head_dim, dtype=model.dtype, device="cpu", block_size=block_size)
    fused = FusedModel(model, max_rows=32, max_length=64)
    fused.native_step = native
    return FusedRunner(fused, pool, max_rows=6, max_batch_rows=32), pool


@pytest.mark.parametrize("block_size", [None, 4])
def test_steps_are_the_per_op_paths_bits(step_model, block_size, monkeypatch, lockstep):
    # The same prompts and steps through three runners on the same weights: one running each
    # step as one native call from lists into its reused buffers (the runner's CPU step), one
    # staging its inputs and calling the step with tensors (where decode-ahead may follow), and
    # one op by op: every step's logits, hidden rows, greedy ids and the whole KV pool after it
    # are equal bit for bit.
    calls = []
    monkeypatch.setattr(graphs, "STEPPED_PROMPT_ROWS", 0)  # (every arm prefills by the forward: the pools start equal)
    run, run_into = cpu_step.StepPlan.run, cpu_step.StepPlan.run_into
    monkeypatch.setattr(cpu_step.StepPlan, "run", lambda self, *a: calls.append("run") or run(self, *a))
    monkeypatch.setattr(cpu_step.StepPlan, "run_into", lambda self, *a: calls.append("into") or run_into(self, *a))
    native, native_pool = runner_over(step_model, True, block_size)
    staged, staged_pool = runner_over(step_model, True, block_size)
    staged.can_run_ahead = True  # (inputs staged for a chained step)
    per_op, per_op_pool = runner_over(step_model, False, block_size)
    arms = ((native, native_pool), (staged, staged_pool), (per_op, per_op_pool))
    gen = torch.Generator().manual_seed(block_size or 0)
    prompts = [torch.randint(0, 101, (n,), generator=gen) for n in (7, 12, 3)]
    slots = []
    for runner, pool in arms:
        taken = [pool.acquire(64)[0] for _ in prompts]
        for slot, prompt in zip(taken, prompts):
            runner.prefill([(slot, prompt.tolist(), 0)])
        slots.append(taken)
    lengths = [len(p) for p in prompts]

    def step(picks):  # picks: (sequence, window length); the window starts at the sequence's last token
        return lockstep(arms, slots, lengths, picks, gen, 101)

    steps = [[(0, 1)], [(1, 5)], [(2, 3)], [(0, 1), (1, 1), (2, 1)], [(1, 4), (0, 2)], [(2, 5), (0, 1), (1, 3)],
             [(0, 6)], [(2, 1), (1, 1)]]
    for picks in steps:
        *mine, b = step(picks)
        for a in mine:
            assert torch.equal(a.logits, b.logits), picks
            assert torch.equal(a.hidden, b.hidden), picks
            assert torch.equal(a.greedy_ids, b.greedy_ids), picks
            assert a.logits.dtype == torch.float32 and a.hidden.dtype == step_model.dtype
        for pool, _ in ((native_pool, 0), (staged_pool, 1)):
            for theirs, ours in zip(per_op_pool.paged().layers, pool.paged().layers):
                assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]), picks
    assert calls == ["into", "run"] * len(steps)  # every step of the first two ran as one call


def test_a_row_alone_and_in_a_batch(step_model):
    # The step's own row invariance: a sequence's one-row step alone equals its row in a batch.
    c = step_model.config
    outs = []
    for others in (0, 2):
        runner, pool = runner_over(step_model, True, 4)
        slots = [pool.acquire(64)[0] for _ in range(others + 1)]
        for i, slot in enumerate(slots):
            runner.prefill([(slot, list(range(3 + i, 13 + i)), 0)])
        windows = [(slots[0], [7, 9, 11], 9)] + [(s, [5], 9 + i) for i, s in enumerate(slots[1:])]
        outs.append(runner.run(windows))
    assert torch.equal(outs[0].logits, outs[1].logits[:3]) and torch.equal(outs[0].hidden, outs[1].hidden[:3])
    assert outs[1].logits.shape == (5, c.vocab_size)


@pytest.mark.parametrize("num_rows", [1, 5, 20])
def test_the_steps_threads_change_no_bit(step_model, num_rows):
    # The step's work items (product column chunks, attention's (row, KV head) pairs, the experts)
    # are each computed whole by whichever thread takes them: any number of threads (more than the
    # cores or the items included) and two steps at once from two Python threads give the bits of
    # one thread.
    import threading

    runner, pool = runner_over(step_model, True, 4)
    slots = [pool.acquire(64)[0] for _ in range(4)]
    for i, slot in enumerate(slots):
        runner.prefill([(slot, list(range(2 + i, 30 + i)), 0)])
    plan = runner.fused.step_plan(pool.paged())
    gen = torch.Generator().manual_seed(num_rows)
    token_ids = torch.randint(0, 101, (num_rows,), generator=gen)
    row_slots = torch.tensor([slots[t % 4] for t in range(num_rows)])
    positions = torch.tensor([28 + t // 4 for t in range(num_rows)])  # (rewrites the same K and V each run)
    alone = plan.run(token_ids, positions, row_slots, None, threads=1)
    for threads in (2, 3, 8):
        logits, hidden = plan.run(token_ids, positions, row_slots, None, threads=threads)
        assert torch.equal(logits, alone[0]) and torch.equal(hidden, alone[1]), threads
    outs = [None, None]

    def run(i):
        outs[i] = plan.run(token_ids, positions, row_slots, None, threads=2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for logits, hidden in outs:
        assert torch.equal(logits, alone[0]) and torch.equal(hidden, alone[1])
    with pytest.raises(ValueError, match="threads 0 must be >= 1"):
        plan.run(token_ids, positions, row_slots, None, threads=0)


def test_the_step_refuses_rows_it_cannot_index(step_model):
    runner, pool = runner_over(step_model, True, None)
    slot, _ = pool.acquire(64)
    plan = runner.fused.step_plan(pool.paged())
    assert plan is not None
    positions, slots = torch.tensor([0, 1]), torch.tensor([slot, slot])
    with pytest.raises(IndexError, match="token id 101 of row 1 is outside the vocabulary"):
        plan.run(torch.tensor([3, 101]), positions, slots, None)
    with pytest.raises(ValueError, match="row 0's position or slot is outside"):
        plan.run(torch.tensor([3, 4]), torch.tensor([64, 1]), slots, None)
    with pytest.raises(ValueError, match="position or slot"):
        plan.run(torch.tensor([3, 4]), positions, torch.tensor([slot, 4]), None)
    with pytest.raises(ValueError, match="more than the step's"):
        plan.run(torch.zeros(cpu_step.MAX_ROWS + 1, dtype=torch.int64), torch.zeros(cpu_step.MAX_ROWS + 1),
                 torch.zeros(cpu_step.MAX_ROWS + 1), None)


def test_forwards_the_step_does_not_read_run_op_by_op(step_model, tiny_fp8_model, monkeypatch):
    def plan_of(model, **kwargs):
        c = model.config
        pool = KVPool(num_layers=c.num_hidden_layers, num_slots=2, max_length=32, num_kv_heads=c.num_key_value_heads,
                      head_dim=c.head_dim, dtype=model.dtype, device="cpu")
        return FusedModel(model, max_rows=8, max_length=32, **kwargs).step_plan(pool.paged())

    assert plan_of(step_model) is not None
    assert plan_of(step_model, invariant=False) is None  # (the yardstick's cuBLAS products)
    assert plan_of(tiny_fp8_model) is None  # FP8 weights
    dense = dict(STEP_MODEL, mlp_only_layers=[1])
    assert plan_of(load_model(config=ModelConfig.from_dict(dense), random_weights=True, seed=1)) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert plan_of(step_model) is None  # the interpreter runs the kernels' own code
    monkeypatch.delenv("TRITON_INTERPRET")
    # MoCE routing (the drafter's draft rows) runs op by op even where the step applies
    calls = []
    monkeypatch.setattr(cpu_step.StepPlan, "run", lambda self, *a: calls.append(1))
    runner, pool = runner_over(step_model, True, None)
    slot, _ = pool.acquire(64)
    rows = runner._rows((1, 1, 1))
    routing = RoutingOptions(moce=True, scale=1.5, draft_rows=torch.ones(1, dtype=torch.bool))
    runner.fused.forward(torch.tensor([3]), rows, pool.paged(), routing=routing)
    assert not calls


def test_argmax_is_torchs():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(7, 301, generator=g)
    logits[1, 40] = logits[1, 200] = logits[1].max() + 1  # a tie: the first
    logits[2] = float("-inf")
    logits[3, 5] = float("nan")  # a NaN counts as the largest
    logits[4, 0] = float("nan")
    logits[4, 9] = float("nan")
    logits[5, 300] = float("inf")
    assert torch.equal(cpu_rows.argmax(logits), logits.argmax(dim=-1))
    assert cpu_rows.argmax(logits[:0]).shape == (0,)
    assert cpu_rows.argmax(logits.double()) is None


def test_prompt_rows_are_the_steps_rows_without_logits(step_model):
    # Prompt rows through the step (no logits) against the same rows as a step with logits: the
    # hidden rows and the KV written, bit for bit; more rows than one call takes go in order.
    def pool_and_plan():
        runner, pool = runner_over(step_model, True, 4)
        return pool, runner.fused.step_plan(runner.kv), pool.acquire(64)[0]

    (pool_a, plan_a, slot_a), (pool_b, plan_b, slot_b) = pool_and_plan(), pool_and_plan()
    ids = torch.randint(0, 101, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    hidden = plan_a.prompt_rows(ids, list(range(60)), [slot_a] * 60)
    expected = []
    for start in range(0, 60, 20):  # (windows of 20: each row's bits are its one-row step's)
        _, rows = plan_b.run(torch.tensor(ids[start : start + 20]), torch.arange(start, start + 20),
                             torch.full((20,), slot_b), None)
        expected.append(rows)
    assert hidden.dtype == step_model.dtype and torch.equal(hidden, torch.cat(expected))
    for ours, theirs in zip(pool_a.read(slot_a, 60), pool_b.read(slot_b, 60)):
        assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="greedy ids need the logits"):
        plan_a._native.step_run(plan_a._capsule, 0, 0, 0, 0, 0, 0, hidden.data_ptr(), 1, hidden.data_ptr())


def test_a_prompt_prefills_to_the_same_bits_however_it_is_chunked_or_batched(step_model, monkeypatch):
    # The runner's prefill: rows at positions below STEPPED_PROMPT_ROWS through the step, the rest
    # by the forward. The stepped rows (and their KV) are the same bits however the prompt is
    # chunked and whatever prompts share its jobs; the forward's rows are the same where the
    # forward gets the same chunk (its torch products on the CPU do not promise more).
    monkeypatch.setattr(graphs, "STEPPED_PROMPT_ROWS", 9)
    gen = torch.Generator().manual_seed(8)
    prompt, other = torch.randint(0, 101, (23,), generator=gen).tolist(), torch.randint(0, 101, (12,), generator=gen).tolist()

    def prefilled(length, chunkings):
        runner, pool = runner_over(step_model, True, 4)
        slot, slot_other = pool.acquire(64)[0], pool.acquire(64)[0]
        rows = []
        for start, count, beside in chunkings:  # (beside: with the other prompt's rows at the same positions)
            windows = [(slot, prompt[start : start + count], start)]
            if beside:
                windows.insert(0, (slot_other, other[start : start + count], start))
            hidden = runner.prefill(windows)
            rows.append(hidden[-count:] if beside else hidden)
        return torch.cat(rows), pool.read(slot, length), runner, slot

    for length, chunkings in [
        (23, [[(0, 5, True), (5, 18, False)], [(0, 9, True), (9, 14, False)], [(0, 3, False), (3, 4, True), (7, 16, False)]]),
        (8, [[(0, 3, True), (3, 5, True)], [(0, 1, False), (1, 7, True)]]),  # (every row stepped)
    ]:
        whole, kv, runner, slot = prefilled(length, [(0, length, False)])
        for chunking in chunkings:
            hidden, theirs, _, _ = prefilled(length, chunking)
            assert torch.equal(hidden, whole), chunking
            assert all(torch.equal(a, b) for a, b in zip(theirs, kv)), chunking
        head = min(length, 9)
        stepped = runner.fused.step_plan(runner.kv).prompt_rows(prompt[:head], list(range(head)), [slot] * head)
        assert torch.equal(stepped, whole[:head])
