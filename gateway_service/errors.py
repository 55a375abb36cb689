"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, for every answer
the gateway gives that is not a success: a refused field, a verifier's refusal, an unknown
path or method, a body too large, an unexpected failure (its traceback in the log, not in the answer)."""

from __future__ import annotations

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from shared.client import VerifierError

# The verifier names fields by their place in GenerateRequest; clients know OpenAI's names.
# "max_tokens" and "prompt" stand for whatever the client sent (max_completion_tokens,
# messages): see ClientNames.
VERIFIER_FIELDS = [
    ("max_new_tokens", "max_tokens"), ("sampling.temperature", "temperature"), ("sampling.top_p", "top_p"),
    ("sampling.top_k", "top_k"), ("sampling.min_p", "min_p"), ("sampling.max_support", "max_support"),
    ("sampling.seed", "seed"), ("stop.stop_sequences", "stop"), ("speculation.max_draft_tokens", "max_draft_tokens"),
    ("speculation.retention.min_cum", "retention_min_cum"), ("speculation.retention", "retention_schedule"),
    ("speculation.gate", "gate"), ("speculation.coupled", "coupled"), ("speculation.mode", "mode"),
    ("logprobs.mode", "logprobs_mode"), ("logprobs.num_top", "logprobs"),
    ("prompt_text", "prompt"), ("prompt_ids", "prompt"), ("prompt", "prompt"), ("the context holds", "prompt"),
]
STATUS = {  # gRPC status of the verifier → (HTTP status, OpenAI error type)
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
    grpc.StatusCode.UNAUTHENTICATED: (502, "server_error"),  # the gateway's own credentials are wrong
    grpc.StatusCode.PERMISSION_DENIED: (502, "server_error"),
}


class ClientNames:
    """The names this client used for the fields the verifier reports under other names, and
    whether max_tokens was the gateway's default (a refusal of it should say so)."""

    def __init__(self, *, prompt: str = "prompt", max_tokens: str = "max_tokens", default_max_tokens: bool = False) -> None:
        self.names = {"prompt": prompt, "max_tokens": max_tokens}
        self.default_max_tokens = default_max_tokens

    def __getitem__(self, name: str) -> str:
        return self.names.get(name, name)


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, request_id: str | None = None) -> JSONResponse:
        headers = {"x-request-id": request_id} if request_id else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    @classmethod
    def from_verifier(cls, error: VerifierError, names: ClientNames | None = None) -> ApiError:
        """The verifier's refusal, its field renamed to the one the client sent (in the
        message too: a client that sent max_tokens should not read max_new_tokens)."""
        names = names or ClientNames()
        status, kind = STATUS.get(error.code, (502, "server_error"))
        param, message = None, error.message
        if error.code == grpc.StatusCode.INVALID_ARGUMENT:
            for theirs, ours in VERIFIER_FIELDS:
                if message.startswith(theirs):
                    param = names[ours]
                    if ours != "prompt":  # "prompt has N tokens" reads true of a chat's rendered prompt too
                        message = param + message[len(theirs):]
                    if ours == "max_tokens" and names.default_max_tokens:
                        message += f" ({param} was not sent: this is the gateway's default; send a smaller one)"
                    break
        return cls(status, message, param=param, kind=kind, code=error.code.name.lower())


def bad(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def shutting_down() -> ApiError:
    """A request the gateway (or its verifier) ended because it is stopping: retry elsewhere.
    503, which OpenAI's clients retry on their own."""
    return ApiError(503, "the server is shutting down; resend the request (with the text received appended to "
                         "the prompt to continue)", kind="server_error", code="shutdown")


def install_handlers(app: FastAPI) -> None:
    """Framework answers (unknown path, wrong method) and unexpected failures in OpenAI's shape."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        if error.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif error.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(error.detail)
        body = ApiError(error.status_code, message).body()
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        # (Starlette re-raises the error after this answer, so the server logs its traceback.)
        return ApiError(500, "internal error; the gateway's log has the details", kind="server_error",
                        code="internal_error").response()
