"""Finished requests' outputs sent to the drafter's index of outputs (DESIGN §9).

The drafter's suffix drafts for a request come from outputs it has seen. Its Draft stream
hears only the rounds that drafted: a request decoded plainly (the governor judged that
speculation did not pay, or had not judged yet) taught it nothing, so its repeats drafted no
better, speculation never came to pay for them, and they stayed plain. So when a request that
may draft ends — finished, stopped or cancelled — the verifier sends the drafter every token it
committed after its prompt, and its prompt's last tokens (`Drafter.Record`), whatever its
rounds did; the drafter's index learns outputs from records only (not from streams, which
would count a drafted request twice).

A record is a hint, off every request's path: sent after the request's last event, in the
background, at most MAX_IN_FLIGHT at a time (more are dropped and counted: a drafter that does
not answer must not hold the verifier's memory), each bounded by RECORD_TIMEOUT_S; a failure
is counted and logged, never raised. A drain waits for the records in flight.
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from shared.metrics import VerifierMetrics
from shared.protocol import PROTOCOL_VERSION, RECORD_PROMPT_END, drafter_pb2, drafter_pb2_grpc

log = structlog.get_logger("verifier")

MAX_IN_FLIGHT = 64
RECORD_TIMEOUT_S = 5.0


def record_request(session_id: str, prompt_ids: list[int], output_ids: list[int],
                   trace_context: dict[str, str]) -> drafter_pb2.RecordRequest:
    """The record of a request with `prompt_ids` that committed `output_ids` after them."""
    return drafter_pb2.RecordRequest(protocol_version=PROTOCOL_VERSION, session_id=session_id,
                                     prompt_end_ids=prompt_ids[-RECORD_PROMPT_END:], output_ids=output_ids,
                                     trace_context=trace_context)


class Recorder:
    """Sends records to the drafter address in the background (one per finished request)."""

    def __init__(self, drafter: drafter_pb2_grpc.DrafterStub, metadata: tuple[tuple[str, str], ...],
                 metrics: VerifierMetrics) -> None:
        self.drafter = drafter
        self.metadata = metadata
        self.metrics = metrics
        self._in_flight: set[asyncio.Task] = set()
        self._unimplemented_logged = False

    def record(self, request: drafter_pb2.RecordRequest) -> None:
        """Send `request` in the background (dropped, and counted, if MAX_IN_FLIGHT are in flight)."""
        if len(self._in_flight) >= MAX_IN_FLIGHT:
            self.metrics.records.labels("dropped").inc()
            return
        task = asyncio.get_running_loop().create_task(self._send(request))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _send(self, request: drafter_pb2.RecordRequest) -> None:
        try:
            await self.drafter.Record(request, timeout=RECORD_TIMEOUT_S, metadata=self.metadata)
        except grpc.aio.AioRpcError as error:
            self.metrics.records.labels("failed").inc()
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:  # (a drafter without an index of outputs)
                if not self._unimplemented_logged:
                    self._unimplemented_logged = True
                    log.info("the drafter records no outputs (Record unimplemented)")
            else:
                log.debug("record failed", session_id=request.session_id, code=error.code().name,
                          details=error.details())
        else:
            self.metrics.records.labels("recorded").inc()

    async def drain(self, timeout_s: float = RECORD_TIMEOUT_S) -> None:
        """Wait for the records in flight (at most `timeout_s`; the rest are cancelled)."""
        if not self._in_flight:
            return
        _, pending = await asyncio.wait(set(self._in_flight), timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
