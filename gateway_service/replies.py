"""OpenAI's response shapes for one request: a whole (chat) completion, or its chunks as
server-sent events ending in `data: [DONE]`.

A stream that cannot finish (the verifier refused or failed after the status line was sent,
or the server is stopping) ends with an error event in OpenAI's error shape and then
`[DONE]`, as vLLM's streams end on an error: the client always learns why it ended. The
verifier's finish reason `shutdown` (it stopped the request while draining) is no OpenAI
value; it becomes that error too (503 when the status is still to be sent), not "length" or
"stop": a client must be able to tell a cut reply from a finished one, and OpenAI's clients
retry a 503 on their own.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from gateway_service.errors import ApiError, ClientNames, shutting_down
from gateway_service.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from shared.client import Generation, GenerationAccumulator, TokenLogprob, VerifierError

FINISH_REASONS = {"stop": "stop", "length": "length", "stop_sequence": "stop"}  # the verifier's → OpenAI's


def usage(generation: Generation) -> dict:
    """OpenAI's usage plus tandem's speculative statistics."""
    stats = generation.stats
    return {
        "prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["completion_tokens"],
        "total_tokens": stats["prompt_tokens"] + stats["completion_tokens"],
        "rounds": stats["rounds"], "mean_accepted_length": stats["mean_accepted_length"],
        "acceptance_by_source": stats["acceptance_by_source"], "proposed": stats["proposed"],
        "accepted": stats["accepted"], "drafter_faults": stats["drafter_faults"],
    }


def finish_reason(generation: Generation) -> str:
    """OpenAI's finish reason; ApiError (503) for a request the verifier ended as it stopped."""
    if generation.finish_reason == "shutdown":
        raise shutting_down()
    return FINISH_REASONS.get(generation.finish_reason, "stop")


class Reply:
    """OpenAI's response shapes for one request (completion or chat)."""

    def __init__(self, request_id: str, model: str, *, chat: bool, names: ClientNames,
                 texts: TokenTexts | None = None, num_top: int | None = None) -> None:
        """texts and num_top: where the request asked for logprobs (num_top alternatives)."""
        self.request_id, self.model, self.chat, self.names = request_id, model, chat, names
        self.texts, self.num_top = texts, num_top
        self.created = int(time.time())
        self.accumulator = GenerationAccumulator()
        self.text_offset = 0  # (a stream's completion logprobs: characters before the chunk's tokens)

    def _envelope(self, choices: list, *, chunk: bool, **extra) -> dict:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"  # OpenAI's completion chunks carry the same object name
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        if self.num_top is None or self.texts is None:
            return None
        if self.chat:
            return chat_logprobs(logprobs or [], self.texts, self.num_top)
        shaped = completion_logprobs(logprobs or [], self.texts, self.text_offset)
        self.text_offset += sum(len(t) for t in shaped["tokens"])
        return shaped

    def _choice(self, text: str | None, reason: str | None, *, chunk: bool, first: bool = False,
                logprobs: list[TokenLogprob] | None = None) -> dict:
        shaped = self._logprobs(logprobs) if logprobs or not chunk else None
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": shaped, "finish_reason": reason}
        if chunk:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": shaped, "finish_reason": reason}
        return {"index": 0, "message": {"role": "assistant", "content": text or ""}, "logprobs": shaped, "finish_reason": reason}

    async def collect(self, first, events: AsyncIterator) -> Generation:
        """The whole generation; raises VerifierError or ApiError where it cannot finish."""
        if first is not None:
            self.accumulator.add(first)
        async for event in events:
            self.accumulator.add(event)
        return self.accumulator.result()

    def response(self, generation: Generation) -> dict:
        choice = self._choice(generation.text, finish_reason(generation), chunk=False, logprobs=generation.logprobs)
        return self._envelope([choice], chunk=False, usage=usage(generation))

    async def stream(self, first, events: AsyncIterator, include_usage: bool) -> AsyncIterator[str]:
        sent_first = False
        try:
            pending = [first] if first is not None else []
            while True:
                event = pending.pop() if pending else await anext(events, None)
                if event is None:
                    break
                self.accumulator.add(event)
                if event.HasField("final"):
                    continue
                text = event.text_delta if event.HasField("text_delta") else ""
                logprobs = TokenLogprob.from_event(event) if self.num_top is not None else None
                if text or logprobs or (self.chat and not sent_first):  # (a chunk's logprobs: its tokens', text held back or not)
                    yield self._sse(self._envelope([self._choice(text, None, chunk=True, first=not sent_first,
                                                                 logprobs=logprobs)], chunk=True))
                    sent_first = True
            generation = self.accumulator.result()
            reason = finish_reason(generation)
            yield self._sse(self._envelope([self._choice(None, reason, chunk=True, first=not sent_first)], chunk=True))
            if include_usage:
                yield self._sse(self._envelope([], chunk=True, usage=usage(generation)))
        except VerifierError as error:  # after the status line: the error travels in the stream
            yield self._sse(ApiError.from_verifier(error, self.names).body())
        except ApiError as error:  # the server is stopping
            yield self._sse(error.body())
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    @staticmethod
    def _sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
