"""What a request asks of log-probabilities, and a round's, read from its window's logits.

Each emitted token's numbers come from the target's row at its position, the row the token
was decided by (DESIGN §2), never from the drafter's q: an accepted draft and the token a
plain round decodes there get the same numbers (exact mode: the same bits, since a window's
rows are computed as alone). A round computes them after its verdict, from the step's logits
on the device, and copies one small tensor per round to the host; the decode step is then not
enqueued ahead for the request (verifier_service.engine), which is what asking costs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.logprobs import MAX_TOP_LOGPROBS, RowLogprobs, processed_logprobs, raw_logprobs
from kernels.sampling import SamplingParams


class LogprobMode(enum.Enum):
    RAW = "raw"  # the model's own distribution (log_softmax of the logits)
    PROCESSED = "processed"  # the law the token is drawn from (after temperature and the filters)


@dataclass(frozen=True)
class LogprobSpec:
    num_top: int = 0  # alternatives at each position
    mode: LogprobMode = LogprobMode.RAW

    def __post_init__(self) -> None:
        if isinstance(self.num_top, bool) or not isinstance(self.num_top, int) or not 0 <= self.num_top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"num_top {self.num_top!r} must be an integer in [0, {MAX_TOP_LOGPROBS}]")


def window_logprobs(logits: Tensor, emitted: list[int], spec: LogprobSpec, sampling: SamplingParams) -> RowLogprobs:
    """logits [>= len(emitted), vocab]: a window's rows (on the device), row j deciding
    emitted[j]; the emitted tokens' numbers, on the host."""
    rows = logits[: len(emitted)]  # [n, vocab]
    token_ids = torch.tensor(emitted, dtype=torch.int64).to(logits.device, non_blocking=True)
    if spec.mode is LogprobMode.RAW:
        out = raw_logprobs(rows, token_ids, spec.num_top)
    else:
        out = processed_logprobs(rows, token_ids, spec.num_top, sampling)
    k = out.top_ids.shape[1]
    # one copy to the host: [n, 2 + 2k] float64 holds every int (ids < 2^31) and float exactly
    packed = torch.cat([out.logprobs.double().unsqueeze(-1), out.ranks.double().unsqueeze(-1),
                        out.top_ids.double(), out.top_logprobs.double()], dim=-1).cpu()
    return RowLogprobs(packed[:, 0].float(), packed[:, 1].long(), packed[:, 2 : 2 + k].long(),
                       packed[:, 2 + k :].float())
