"""A fake verifier for the client and `tandem generate` tests: a real grpc.aio server whose
servicer echoes the prompt reversed, and what its final event reports."""

from __future__ import annotations

import grpc

from shared.protocol import common_pb2, verifier_pb2, verifier_pb2_grpc

BAD_LENGTH = "max_new_tokens must be > 0; got 0"


class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    """Echoes the prompt reversed (text prompts as code points, with text deltas) in two
    rounds, MTP then SUFFIX, then a final event. request_id "hold" holds the first round's
    text back (an empty delta) and sends it with the second."""

    def __init__(self) -> None:
        self.requests: list[verifier_pb2.GenerateRequest] = []
        self.info_calls = 0
        self.offered: str | None = None  # GetServerInfo's local socket (None: not implemented, as before it was)

    async def GetServerInfo(self, request, context):
        self.info_calls += 1
        if self.offered is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        return verifier_pb2.ServerInfo(local_socket=self.offered)

    async def Generate(self, request, context):
        self.requests.append(request)
        if request.max_new_tokens <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"max_new_tokens must be > 0; got {request.max_new_tokens}")
        with_text = request.WhichOneof("prompt") == "prompt_text"
        prompt = [ord(c) for c in request.prompt_text] if with_text else list(request.prompt_ids.ids)
        out = prompt[::-1][: request.max_new_tokens]
        half = (len(out) + 1) // 2
        chunks = [out[:half], out[half:]]
        held = ""
        for round_id, (chunk, source) in enumerate(zip(chunks, (common_pb2.DRAFT_SOURCE_MTP, common_pb2.DRAFT_SOURCE_SUFFIX))):
            text = "".join(map(chr, chunk)) if with_text else ""
            if request.request_id == "hold" and round_id == 0:
                held, text = text, ""
            else:
                text, held = held + text, ""
            # asked for: token t gets logprob -t/100, rank 2, one alternative (t + 1, -0.01)
            logprobs = [verifier_pb2.TokenLogprob(logprob=-t / 100, rank=2, top_token_ids=[t + 1], top_logprobs=[-0.01])
                        for t in chunk] if request.HasField("logprobs") else None
            yield verifier_pb2.GenerateEvent(
                token_ids=chunk,
                logprobs=logprobs,
                text_delta=text if with_text else None,  # set only where there is text (a tokenizer)
                round=verifier_pb2.RoundInfo(
                    round_id=round_id,
                    source=source,
                    proposed=3,
                    retained=2,
                    accepted=max(len(chunk) - 1, 0),
                    verify_ms=1.5,
                    draft_wait_ms=0.25,
                    speculative=True,
                ),
            )
        yield verifier_pb2.GenerateEvent(
            final=verifier_pb2.FinalEvent(
                finish_reason="length",
                stats=verifier_pb2.RequestStats(
                    prompt_tokens=len(prompt),
                    completion_tokens=len(out),
                    rounds=2,
                    proposed=6,
                    retained=4,
                    accepted=max(len(out) - 2, 0),
                    mean_accepted_length=len(out) / 2,
                    ttft_ms=2.5,
                    queue_ms=1.5,
                    tokens_per_s=100.0,
                    acceptance_by_source={"MTP": 0.5, "SUFFIX": 0.25},
                    drafter_faults=1,
                    speculative_rounds=1,
                    drafter_detaches=1,
                    ahead_hits=1,
                ),
            )
        )


async def _start(servicer: FakeVerifier) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


EXPECTED_STATS = {
    "rounds": 2,
    "proposed": 6,
    "retained": 4,
    "accepted": 2,
    "mean_accepted_length": 2.0,
    "ttft_ms": 2.5,
    "queue_ms": 1.5,
    "tokens_per_s": 100.0,
    "acceptance_by_source": {"MTP": 0.5, "SUFFIX": 0.25},
    "drafter_faults": 1,
    "prompt_tokens": 4,
    "completion_tokens": 4,
    "speculative_rounds": 1,
    "drafter_detaches": 1,
    "ahead_hits": 1,
    "ahead_misses": 0,
}
