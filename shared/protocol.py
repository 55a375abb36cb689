"""The wire protocol: generated message modules and the protocol version both sides speak.

The `tandem.v1` modules are generated from protos/tandem/v1/*.proto when the package is
installed (setup.py); importing this module fails with a clear message when they are not.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
MAX_ID_LENGTH = 128  # characters of a request id (the drafter's session id)
RECORD_PROMPT_END = 64  # a RecordRequest's prompt tokens: its last ones (the drafter's longest context is shorter)

try:
    from tandem.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
except ImportError as error:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "the generated protocol modules (tandem.v1.*_pb2) are missing; "
        "install the package (`pip install -e .`), which generates them from protos/"
    ) from error

__all__ = [
    "PROTOCOL_VERSION",
    "common_pb2",
    "drafter_pb2",
    "drafter_pb2_grpc",
    "verifier_pb2",
    "verifier_pb2_grpc",
    "service_names",
]


def service_names() -> list[str]:
    """Fully-qualified names of the gRPC services (for health checking and reflection)."""
    return [
        verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name,
        drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name,
    ]


def encode_hidden(rows) -> "drafter_pb2.HiddenRows":
    """Final-norm hidden rows [n, hidden] as bf16 bytes (row-major)."""
    import torch

    # (as few torch calls as the rows need: on the event loop each may wait for the interpreter lock)
    if rows.requires_grad:
        rows = rows.detach()
    if rows.device.type != "cpu" or rows.dtype != torch.bfloat16:
        rows = rows.to("cpu", torch.bfloat16)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    num_rows, hidden_size = rows.shape
    return drafter_pb2.HiddenRows(
        num_rows=num_rows, hidden_size=hidden_size, bf16=rows.view(torch.int16).numpy().tobytes()
    )


def decode_hidden(message: "drafter_pb2.HiddenRows"):
    """HiddenRows → bf16 tensor [num_rows, hidden_size]; ValueError if the byte count is off."""
    import numpy as np
    import torch

    expected = 2 * message.num_rows * message.hidden_size
    if len(message.bf16) != expected:
        raise ValueError(
            f"hidden rows carry {len(message.bf16)} bytes; {message.num_rows} x {message.hidden_size} bf16 needs {expected}"
        )
    if expected == 0:
        return torch.zeros((message.num_rows, message.hidden_size), dtype=torch.bfloat16)
    data = np.frombuffer(message.bf16, dtype=np.int16).copy()
    return torch.from_numpy(data).view(torch.bfloat16).view(message.num_rows, message.hidden_size)


def encode_logprobs(rows, count: int) -> list["verifier_pb2.TokenLogprob"]:
    """The first `count` rows of host RowLogprobs (kernels.logprobs) as TokenLogprob messages;
    a row's alternatives past its support (id -1) are left out."""
    logprobs, ranks = rows.logprobs.tolist(), rows.ranks.tolist()
    top_ids, top_logprobs = rows.top_ids.tolist(), rows.top_logprobs.tolist()
    out = []
    for i in range(count):
        ids = [t for t in top_ids[i] if t >= 0]
        out.append(verifier_pb2.TokenLogprob(logprob=logprobs[i], rank=ranks[i], top_token_ids=ids,
                                             top_logprobs=top_logprobs[i][: len(ids)]))
    return out
