"""Fixtures for verifier tests: a tiny model, real servers on port 0, scripted test drafters."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

from kernels.retention import RetentionPolicy
from kernels.sampling import SamplingParams, SparseRows, draw
from kernels.speculative import Gate, Mode
from shared.local_stream import LocalStreamServer
from shared.model import ModelConfig, load_model
from shared.protocol import PROTOCOL_VERSION, common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from shared.service import MAX_MESSAGE_BYTES
from verifier_service.requests import RequestSpec
from verifier_service.server import VerifierServer
from verifier_service.settings import VerifierSettings

TINY = dict(
    model_type="qwen3_moe", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=256, rope_theta=10000.0, norm_topk_prob=True,
    initializer_range=0.5,  # a peaked random model: p has a few likely tokens, like a real one
)

STALL = "stall"
CLOSE = "close"


@pytest.fixture(scope="session")
def tiny_model():
    return load_model(config=ModelConfig.from_dict(TINY), random_weights=True, seed=1)


@dataclass
class DrafterState:
    tokens: list[int]
    round_id: int
    seed: int
    mode: int
    opens: int = 1
    commits: list = field(default_factory=list)


class ScriptedDrafter(drafter_pb2_grpc.DrafterServicer):
    """A real Drafter servicer whose chains come from `propose(state)` (a chain, None, STALL or CLOSE),
    each sent `delay_s` after the message it answers (a slow drafter)."""

    def __init__(self, propose, delay_s: float = 0.0):
        self.propose = propose
        self.delay_s = delay_s
        self.sessions: list[DrafterState] = []
        self.records: list[drafter_pb2.RecordRequest] = []  # (Record: finished requests' outputs)

    async def Record(self, request, context):
        self.records.append(request)
        return drafter_pb2.RecordReply(protocol_version=PROTOCOL_VERSION)

    async def Draft(self, request_iterator, context):
        state = None
        async for up in request_iterator:
            if up.HasField("open"):
                o = up.open
                state = DrafterState(list(o.token_ids), o.next_round_id, o.sampling.seed, o.speculation.mode)
                self.sessions.append(state)
            else:
                state.tokens += list(up.commit.emitted_token_ids)
                state.commits.append(up.commit)
                state.round_id = up.commit.round_id + 1
            action = self.propose(state)
            if action == STALL:
                await asyncio.sleep(5)
                continue
            if action == CLOSE:
                return
            if action is not None:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield drafter_pb2.DraftDown(protocol_version=PROTOCOL_VERSION, chain=action)


def chain(state: DrafterState, tokens, q_rows=None, source=common_pb2.DRAFT_SOURCE_MTP, **overrides):
    fields = dict(round_id=state.round_id, base_length=len(state.tokens), source=source, token_ids=tokens,
                  q_rows=q_rows or [], confidences=[1.0] * len(tokens))
    fields.update(overrides)
    return drafter_pb2.DraftChain(**fields)


def q_row(probs: dict[int, float]):
    items = sorted(probs.items())
    return common_pb2.SparseRow(token_ids=[t for t, _ in items], probs=[p for _, p in items])


def sampled_chain(state: DrafterState, q: dict[int, float], k: int):
    """k drafts drawn from a fixed q on the draft stream (independent of the verifier's draws)."""
    rows = SparseRows.from_dicts([q])
    tokens = []
    for j in range(k):
        position = torch.tensor([len(state.tokens) + j])
        tokens.append(int(draw(rows, state.seed, position, stream="draft")[0]))
    return chain(state, tokens, [q_row(q)] * k)


class Servers:
    """A verifier (and optionally a scripted drafter) on real loopback ports; link "local": the
    drafter's Draft streams on a Unix socket too, and the verifier's over it (--drafter-socket)."""

    def __init__(self):
        self.verifier: VerifierServer | None = None
        self.drafter_server = None
        self.local: LocalStreamServer | None = None
        self.channel = None

    async def start(self, model, /, *, drafter: ScriptedDrafter | None = None, tokenizer=None, link="grpc",
                    **settings):
        target = None
        if drafter is not None:
            self.drafter_server = grpc.aio.server()
            drafter_pb2_grpc.add_DrafterServicer_to_server(drafter, self.drafter_server)
            port = self.drafter_server.add_insecure_port("127.0.0.1:0")
            await self.drafter_server.start()
            target = f"127.0.0.1:{port}"
            if link == "local":  # (a short path: a Unix socket's is at most 107 bytes)
                settings["drafter_socket"] = f"{tempfile.mkdtemp(prefix='tandem-test-')}/d.sock"
                self.local = LocalStreamServer(settings["drafter_socket"], drafter.Draft, drafter_pb2.DraftUp,
                                               limit=MAX_MESSAGE_BYTES)
                await self.local.start()
        # A fixed generous deadline unless a test sets one: the adaptive deadline (recent p95
        # + 5 ms) turns a slow CPU moment into a plain round — correct, but it makes "no
        # faults" assertions flaky on a loaded 2-core machine.
        settings.setdefault("drafter_deadline_ms", 2000.0)
        # Every round asks the drafter unless a test turns the governor on: whether speculation
        # pays on this machine at this moment must not decide what these tests see.
        settings.setdefault("governor", False)
        self.verifier = VerifierServer(VerifierSettings(port=0, drafter=target, **settings), model=model, tokenizer=tokenizer)
        port = await self.verifier.start()
        await self.verifier.wait_loaded()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        return verifier_pb2_grpc.VerifierStub(self.channel)

    async def stop(self):
        if self.channel is not None:
            await self.channel.close()
        if self.verifier is not None:
            await self.verifier.stop(0)
        if self.drafter_server is not None:
            await self.drafter_server.stop(0)
        if self.local is not None:
            await self.local.close()
            shutil.rmtree(Path(self.local.path).parent, ignore_errors=True)


@pytest.fixture
def socket_path():
    folder = tempfile.mkdtemp(prefix="tandem-test-")  # (a Unix socket's path is at most 107 bytes)
    yield f"{folder}/v.sock"
    shutil.rmtree(folder, ignore_errors=True)


async def wait_idle(verifier: VerifierServer, timeout_s: float = 10.0) -> None:
    """Until no request is in flight (a session released, its admission returned)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while verifier.in_flight():
        assert asyncio.get_running_loop().time() < deadline, "a request stayed in flight"
        await asyncio.sleep(0.01)


@pytest.fixture
async def servers():
    s = Servers()
    yield s
    await s.stop()


def request(prompt_ids, max_new_tokens=8, *, temperature=0.0, seed=0, mode=common_pb2.MODE_EXACT, gate=0,
            max_draft_tokens=0, schedule="", top_k=0, disable=False):
    return verifier_pb2.GenerateRequest(
        protocol_version=PROTOCOL_VERSION,
        prompt_ids=verifier_pb2.TokenIds(ids=prompt_ids),
        max_new_tokens=max_new_tokens,
        sampling=common_pb2.SamplingParams(temperature=temperature, seed=seed, top_k=top_k),
        speculation=common_pb2.SpeculationParams(mode=mode, gate=gate, max_draft_tokens=max_draft_tokens,
                                                 retention=common_pb2.RetentionParams(schedule=schedule),
                                                 disable=disable),
    )


async def generate(stub, req):
    """(token ids, final event, round infos) of one Generate call."""
    tokens, final, rounds = [], None, []
    async for event in stub.Generate(req):
        tokens += list(event.token_ids)
        if event.HasField("round"):
            rounds.append(event.round)
        if event.HasField("final"):
            final = event.final
    return tokens, final, rounds


async def drafted_as_plain(stub, prompt_ids, max_new_tokens, *, temperature, seeds):
    """Exact mode's promise through the service: each seed's request, once with drafts and once
    with speculation disabled, gives the same tokens. The drafted requests' final events."""
    finals = []
    for seed in seeds:
        req = request(prompt_ids, max_new_tokens, temperature=temperature, seed=seed)
        with_drafts, final, _ = await generate(stub, req)
        req.speculation.disable = True
        plain, _, _ = await generate(stub, req)
        assert with_drafts == plain, seed
        finals.append(final)
    return finals


def request_spec(prompt, *, temperature, seed=7, max_new_tokens=24, request_id="r"):
    """A RequestSpec as the engine takes it (exact mode, top-k 20 / top-p 0.95, up to 4 drafts)."""
    return RequestSpec(
        request_id=request_id, prompt_ids=tuple(prompt), max_new_tokens=max_new_tokens,
        sampling=SamplingParams(temperature=temperature, top_k=20, top_p=0.95), seed=seed, mode=Mode.EXACT,
        gate=Gate.TOP, speculate=True, coupled=False, max_draft_tokens=4, retention=RetentionPolicy(),
        retention_schedule="", retention_min_cum=0.0, eos_token_ids=frozenset(), stop_sequences=(),
    )


@pytest.fixture(name="request_spec", scope="session")
def request_spec_fixture():
    """request_spec(prompt, *, temperature, seed=7, max_new_tokens=24, request_id="r"): a RequestSpec."""
    return request_spec


def greedy_continuation(model, tokens, k):
    """The k tokens greedy decoding (model.score) appends to `tokens`."""
    out = []
    for _ in range(k):
        logits, _ = model.score(torch.tensor(tokens + out))
        out.append(int(logits[-1].argmax()))
    return out


@pytest.fixture(name="greedy_continuation", scope="session")
def greedy_continuation_fixture():
    """greedy_continuation(model, tokens, k): the k tokens greedy decoding appends to tokens."""
    return greedy_continuation
