"""The MTP proposer on the fused-kernel path drafts what the reference modules draft."""

import pytest
import torch

from drafter_service.proposers.mtp import MTPProposer
from kernels.retention import RetentionPolicy
from kernels.sampling import SamplingParams
from kernels.speculative import Gate, Mode
from shared.model import RoutingOptions
from shared.protocol import common_pb2
from shared.model.families.qwen3_moe.fused import FusedModel
from shared.model.mtp_runner import POOL_START_BLOCKS, POOL_START_SLOTS


@pytest.mark.parametrize("temperature,moce", [(0.0, False), (0.7, True)])
def test_fused_mtp_drafts_like_the_reference(tiny_mtp_model, temperature, moce):
    model = tiny_mtp_model
    routing = RoutingOptions(moce=True, scale=1.4) if moce else None
    fused = FusedModel(model, max_rows=8, max_length=model.config.max_position_embeddings)
    tokens = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(4))
    _, hidden = model(tokens, model.new_cache(40))
    proposals = []
    for proposer in (MTPProposer(model, routing), MTPProposer(model, routing, fused)):
        state = proposer.new_state(64)
        proposer.catch_up(state, hidden[:20], tokens[1:21].tolist())  # 20 rows: fused (max_rows 8) falls back
        for end in (21, 24, 29):  # then short commits: the fused path
            proposer.catch_up(state, hidden[state.cache.length : end], tokens[state.cache.length + 1 : end + 1].tolist())
            proposal = proposer.draft(
                state, 4, sampling=SamplingParams(temperature=temperature), seed=3, base_position=end + 1,
                mode=Mode.EXACT, gate=Gate.TOP, coupled=False, policy=RetentionPolicy(),
            )
            assert state.cache.length == end  # draft rows rolled back
            proposals.append((proposal.token_ids, proposal.confidences))
    half = len(proposals) // 2
    assert [p[0] for p in proposals[:half]] == [p[0] for p in proposals[half:]]
    for (_, ref), (_, got) in zip(proposals[:half], proposals[half:]):
        assert got == pytest.approx(ref, rel=1e-4, abs=1e-6)


def test_a_greedy_chain_is_the_argmax_chain_of_the_mtp_layer(tiny_mtp_model):
    """Greedy drafts skip the draw (a point mass is drawn from with certainty): the chain is each
    step's argmax fed back, the confidences 1, and no q rows are sent."""
    model = tiny_mtp_model
    tokens = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(9))
    _, hidden = model(tokens, model.new_cache(32))
    proposer = MTPProposer(model)
    state = proposer.new_state(64)
    proposer.catch_up(state, hidden[:20], tokens[1:21].tolist())
    proposal = proposer.draft(state, 4, sampling=SamplingParams(temperature=0.0), seed=5, base_position=21,
                              mode=Mode.PROBABILISTIC, gate=Gate.TOP, coupled=False, policy=RetentionPolicy())
    cache = model.new_mtp_cache(64)
    logits, out = model.forward_mtp(hidden[:20], tokens[1:21], cache)
    expected = [int(logits[-1].argmax())]
    for _ in range(3):
        logits, out = model.forward_mtp(out[-1:], torch.tensor(expected[-1:]), cache)
        expected.append(int(logits[-1].argmax()))
    assert proposal.token_ids == expected
    assert proposal.confidences == [1.0] * 4 and proposal.q_rows is None


@pytest.mark.parametrize("path,max_rows,calls", [("reference", 0, 3), ("fused", 16, 1), ("fused", 4, 2)])
def test_deferred_commits_settle_to_the_eager_state(tiny_mtp_model, path, max_rows, calls):
    """Commits deferred (MTPProposer.defer) and settled later leave the state eager catch-ups
    leave, bit for bit: the same cache and first-draft logits. On the fused path consecutive
    commits run as one catch-up while they fit max_rows (row-invariant kernels: commits of 3, 1
    and 4 rows in one call, or two under 4 rows); the reference modules run one per commit."""
    model = tiny_mtp_model
    tokens = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(7))
    _, hidden = model(tokens, model.new_cache(40))
    fused = FusedModel(model, max_rows=max_rows, max_length=model.config.max_position_embeddings) if max_rows else None
    proposer = MTPProposer(model, None, fused)
    eager, lazy = proposer.new_state(64), proposer.new_state(64)
    for state in (eager, lazy):
        proposer.catch_up(state, hidden[:10], tokens[1:11].tolist())
    for start, end in ((10, 13), (13, 14), (14, 18)):
        proposer.catch_up(eager, hidden[start:end], tokens[start + 1 : end + 1].tolist())
        proposer.defer(lazy, hidden[start:end], tokens[start + 1 : end + 1].tolist())
    assert lazy.cache.length == 10 and len(lazy.pending) == 3 and lazy.pending_rows == 8  # nothing ran yet
    runs = []
    run = proposer.runner.run
    proposer.runner.run = lambda items: runs.append(len(items)) or run(items)
    proposer.settle(lazy)
    assert len(runs) == calls
    assert not lazy.pending and lazy.cache.length == eager.cache.length == 18
    assert torch.equal(lazy.next_logits, eager.next_logits)
    if path == "reference":
        assert torch.equal(lazy.cache.keys[:, :18], eager.cache.keys[:, :18])
    else:  # (one pool: the two states' rows live in its blocks; the next draft reads them)
        assert torch.equal(lazy.last_out, eager.last_out)


def test_suffix_rounds_owe_their_mtp_rows_until_an_mtp_chain_or_the_bound(tiny_mtp_model, open_up, commit_up):
    """With suffix drafting (planner "suffix"), commit + propose run no MTP forward, nor does the
    settle after the chain while the session's debt is under MTP_DEBT_ROWS; at the bound the
    debt is paid after the chain, all of it; an MTP chain pays it first."""
    from drafter_service.drafter import MTP_DEBT_ROWS, Drafter
    from drafter_service.settings import DrafterSettings

    drafter = Drafter(tiny_mtp_model, DrafterSettings(port=0, planner="suffix", fused="on"))
    forwards = []
    original = drafter.mtp.runner.run
    drafter.mtp.runner.run = lambda *a, **k: forwards.append(1) or original(*a, **k)
    up = open_up(tiny_mtp_model, [3, 4, 5, 6, 3, 4, 5, 6, 3, 4])
    up.open.max_new_tokens = MTP_DEBT_ROWS + 8
    session = drafter.open(up.open)
    drafter.propose(session)
    forwards.clear()
    for round_id in range(MTP_DEBT_ROWS // 4):
        drafter.commit(session, commit_up(tiny_mtp_model, round_id=round_id, emitted=[5, 6, 3, 4]).commit)
        chain = drafter.propose(session)
        assert chain.token_ids and not forwards  # a suffix chain, and no MTP work on the way
        if round_id < MTP_DEBT_ROWS // 4 - 1:
            assert not drafter.mtp_due(session) and drafter.settles_on_loop(session)
            drafter.settle(session)  # (the suffix counts)
            assert not forwards and not drafter.unsettled(session)
    assert session.mtp.pending_rows == MTP_DEBT_ROWS and drafter.unsettled(session)
    assert not drafter.settles_on_loop(session)  # (model work: a worker job)
    drafter.settle(session)
    assert len(forwards) == 1  # the fused path: the whole debt in one catch-up
    assert not session.mtp.pending and session.mtp.cache.length == len(session.tokens) - 1
    assert not drafter.unsettled(session)

    drafter.commit(session, commit_up(tiny_mtp_model, round_id=MTP_DEBT_ROWS // 4, emitted=[5, 6]).commit)
    assert session.mtp.pending_rows == 2 and not drafter.mtp_due(session)
    forwards.clear()
    drafter.settings = DrafterSettings(port=0, planner="mtp", fused="on")
    chain = drafter.propose(session)
    assert chain.source == common_pb2.DRAFT_SOURCE_MTP and chain.token_ids
    assert not session.mtp.pending and session.mtp.cache.length == len(session.tokens) - 1


def _fused_proposer(model, routing=None):
    return MTPProposer(model, routing, FusedModel(model, max_rows=16, max_length=model.config.max_position_embeddings))


@pytest.mark.parametrize("moce", [False, True])
def test_sessions_drafted_in_one_batch_get_their_chains_alone(tiny_mtp_model, moce, monkeypatch):
    """draft_batch (fused path, the sessions' rows in one pool and one forward per step): each
    session's chain — tokens, q rows, confidences — and cache are what it gets drafted alone,
    with different lengths, sampling settings (some shared: their rows are processed together),
    seeds, modes and a retention that cuts one short.
    The kernels are row-invariant (on the CPU: one-row steps), so this holds bit for bit."""
    from drafter_service.proposers.mtp import DraftJob

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the fused ops' torch code (the kernels: tests/kernels)
    model = tiny_mtp_model
    routing = RoutingOptions(moce=True, scale=1.4) if moce else None
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(11))
    _, hidden = model(tokens, model.new_cache(48))
    setups = [  # (rows committed, drafts, sampling, seed, mode, retention)
        (12, 4, SamplingParams(temperature=0.0), 1, Mode.EXACT, RetentionPolicy()),
        (20, 3, SamplingParams(temperature=0.8, top_p=0.9), 2, Mode.EXACT, RetentionPolicy()),
        (7, 5, SamplingParams(temperature=1.0), 3, Mode.PROBABILISTIC, RetentionPolicy.parse("0.3", 0.0, min_p=0.0)),
        (30, 1, SamplingParams(temperature=0.5, top_k=5), 4, Mode.EXACT, RetentionPolicy()),
        # the same settings as chains above: processed together, drawn each on its own stream
        (15, 3, SamplingParams(temperature=0.8, top_p=0.9), 5, Mode.PROBABILISTIC, RetentionPolicy()),
        (25, 2, SamplingParams(temperature=0.0), 6, Mode.PROBABILISTIC, RetentionPolicy()),
    ]

    def prepared(proposer):
        states = []
        for rows, *_ in setups:
            state = proposer.new_state(64)
            proposer.catch_up(state, hidden[: rows - 3], tokens[1 : rows - 2].tolist())
            proposer.defer(state, hidden[rows - 3 : rows], tokens[rows - 2 : rows + 1].tolist())  # a commit left
            states.append(state)
        return states

    def jobs(states):
        return [DraftJob(state, k, sampling, seed, rows + 1, mode, Gate.TOP, False, policy)
                for state, (rows, k, sampling, seed, mode, policy) in zip(states, setups)]

    alone_proposer, batch_proposer = _fused_proposer(model, routing), _fused_proposer(model, routing)
    alone_states, batch_states = prepared(alone_proposer), prepared(batch_proposer)
    alone = []
    for job in jobs(alone_states):
        alone_proposer.settle(job.state)
        alone.append(alone_proposer.draft_batch([job])[0])
    batch_proposer.settle_batch(batch_states)
    together = batch_proposer.draft_batch(jobs(batch_states))
    for a, b, (rows, *_), state_a, state_b in zip(alone, together, setups, alone_states, batch_states):
        assert a.token_ids == b.token_ids and a.confidences == b.confidences
        assert (a.q_rows is None) == (b.q_rows is None)
        if a.q_rows is not None:
            assert [a.q_rows.row(i) for i in range(len(a.token_ids))] == [b.q_rows.row(i) for i in range(len(b.token_ids))]
        assert state_a.cache.length == state_b.cache.length == rows  # draft rows rolled back
        assert torch.equal(state_a.next_logits, state_b.next_logits)
        keys_a, _ = alone_proposer.runner.pool.read(state_a.slot, rows)
        keys_b, _ = batch_proposer.runner.pool.read(state_b.slot, rows)
        assert torch.equal(keys_a, keys_b)
    assert len(together[2].token_ids) < 5  # the retention cut that chain short
    assert [len(p.token_ids) for p in together] != [k for _, k, *_ in setups]


def test_the_mtp_pool_grows_and_keeps_every_sessions_rows(tiny_mtp_model, monkeypatch):
    """Sessions beyond the pool's blocks or slots grow it; rows already written stay, and a long
    catch-up (more rows than the fused path takes) lands in the session's blocks like short ones."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_mtp_model
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(12))
    _, hidden = model(tokens, model.new_cache(48))
    proposer = _fused_proposer(model)
    reference = MTPProposer(model)
    pool = proposer.runner.pool
    first = proposer.new_state(39)
    proposer.catch_up(first, hidden[:30], tokens[1:31].tolist())  # 30 rows > max_rows 16: the long path
    before = pool.read(first.slot, 30)[0].clone()
    blocks, slots = pool.num_blocks, pool.num_slots
    others = [proposer.new_state(model.config.max_position_embeddings) for _ in range(slots)]
    assert pool.num_blocks > blocks and pool.num_slots > slots
    assert torch.equal(pool.read(first.slot, 30)[0], before)
    expected = reference.new_state(39)
    reference.catch_up(expected, hidden[:30], tokens[1:31].tolist())
    torch.testing.assert_close(before, expected.cache.keys[:, :30], rtol=1e-5, atol=1e-5)
    for proposer_, state in ((proposer, first), (reference, expected)):  # attention over the grown pool's tables
        proposer_.catch_up(state, hidden[30:33], tokens[31:34].tolist())
    torch.testing.assert_close(first.next_logits, expected.next_logits, rtol=1e-4, atol=1e-4)
    for state in [first, *others[:-1]]:
        proposer.release(state)
    assert proposer.runner.pool is pool and pool.num_free == pool.num_slots - 1  # a session still holds its slot
    proposer.release(others[-1])
    assert pool.num_free == pool.num_slots and pool.num_free_blocks == pool.num_blocks
    # the last session out of the grown pool shrank it to its start size; sessions use the new one
    fresh = proposer.runner.pool
    assert fresh is not pool and (fresh.num_blocks, fresh.num_slots) == (POOL_START_BLOCKS, POOL_START_SLOTS)
    again = proposer.new_state(39)
    proposer.catch_up(again, hidden[:33], tokens[1:34].tolist())
    torch.testing.assert_close(again.next_logits, expected.next_logits, rtol=1e-4, atol=1e-4)
    proposer.release(again)
    assert proposer.runner.pool is fresh  # (a pool at its start size stays)


def test_offloaded_mtp_layer_drafts_the_all_resident_chains(tiny_mtp_model):
    """The drafter with its MTP layer's experts in host memory (2 of 8 slots; the fused path's
    eager offload) drafts what it drafts with every expert resident (plain routing)."""
    from shared.model import ModelConfig, load_model
    from tests.conftest import TINY_MTP

    few = load_model(config=ModelConfig.from_dict(TINY_MTP), random_weights=True, seed=2, num_expert_slots=2)
    tokens = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(5))
    _, hidden = tiny_mtp_model(tokens, tiny_mtp_model.new_cache(40))
    chains = []
    for model in (tiny_mtp_model, few):
        fused = FusedModel(model, max_rows=8, max_length=model.config.max_position_embeddings)
        proposer = MTPProposer(model, None, fused)
        state = proposer.new_state(64)
        proposer.catch_up(state, hidden[:20], tokens[1:21].tolist())
        for end in (22, 25, 29):
            proposer.catch_up(state, hidden[state.cache.length : end], tokens[state.cache.length + 1 : end + 1].tolist())
            proposal = proposer.draft(
                state, 4, sampling=SamplingParams(temperature=0.7), seed=3, base_position=end + 1,
                mode=Mode.EXACT, gate=Gate.TOP, coupled=False, policy=RetentionPolicy(),
            )
            chains.append((proposal.token_ids, proposal.confidences))
    assert fused.mtp_offload is not None and few.mtp.layers[0].mlp.experts.counters.misses > 0
    assert chains[:3] == chains[3:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_chain_steps_replayed_as_graphs_draft_the_eager_chains():
    """On CUDA the pooled runner replays a graph per session count for chain steps (one row a
    session); the chains, confidences, q rows and kept logits are the eager runner's bit for
    bit — across 1-row commits (captured too), sampled and greedy chains, and the pool growing
    (its graphs dropped and captured again) when sessions join."""
    from drafter_service.proposers.mtp import DraftJob
    from shared.model import ModelConfig, load_model
    from tests.conftest import TINY_MTP

    model = load_model(config=ModelConfig.from_dict(TINY_MTP | dict(head_dim=16)), random_weights=True, seed=7,
                       dtype=torch.bfloat16, device="cuda")
    c = model.config
    gen = torch.Generator().manual_seed(3)
    proposers = {graphs: MTPProposer(model, None, FusedModel(model, max_rows=16, max_length=c.max_position_embeddings),
                                     use_graphs=graphs) for graphs in (False, True)}
    assert proposers[True].runner.use_graphs and not proposers[False].runner.use_graphs
    states = {graphs: [] for graphs in proposers}
    lengths = []

    def join(count: int) -> None:
        for _ in range(count):
            rows = int(torch.randint(8, 40, (1,), generator=gen))
            hidden, ids = torch.randn(rows, c.hidden_size, generator=gen), torch.randint(0, 97, (rows,), generator=gen)
            for graphs, proposer in proposers.items():
                state = proposer.new_state(200)
                proposer.catch_up(state, hidden.to(torch.bfloat16), ids.tolist())
                states[graphs].append(state)
            lengths.append(rows)

    join(6)
    for round_id in range(6):
        if round_id == 3:
            join(5)  # 11 sessions: the pool (8 slots at start) grows
        commits = []
        for i in range(len(lengths)):
            rows = 1 if (i + round_id) % 2 else 3
            commits.append((torch.randn(rows, c.hidden_size, generator=gen).to(torch.bfloat16),
                            torch.randint(0, 97, (rows,), generator=gen).tolist()))
            lengths[i] += rows
        chains = {}
        for graphs, proposer in proposers.items():
            for state, (hidden, ids) in zip(states[graphs], commits):
                proposer.defer(state, hidden, ids)
            proposer.settle_batch(states[graphs])
            jobs = [DraftJob(state, 4, SamplingParams(temperature=0.8 if i % 3 else 0.0, top_p=0.9), i,
                             lengths[i] + 1, Mode.EXACT, Gate.TOP, False, RetentionPolicy())
                    for i, state in enumerate(states[graphs])]
            out = proposer.draft_batch(jobs)
            chains[graphs] = ([(p.token_ids, p.confidences) for p in out],
                              [None if p.q_rows is None else [p.q_rows.row(j) for j in range(len(p.token_ids))]
                               for p in out],
                              torch.stack([state.next_logits for state in states[graphs]]))
        assert chains[True][0] == chains[False][0] and chains[True][1] == chains[False][1]
        assert torch.equal(chains[True][2], chains[False][2])
    runner = proposers[True].runner
    assert runner.graphs and all(captured is not None for captured in runner.graphs.values())
    assert runner.pool.num_slots > 8  # it grew (and the graphs were captured again)
