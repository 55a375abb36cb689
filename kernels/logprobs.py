"""Log-probabilities of chosen tokens and the most likely alternatives, row by row.

Two laws, as vLLM's logprobs modes: `raw_logprobs` is the model's own distribution (the
log-softmax of its logits, in float32, before temperature or any filter); `processed_logprobs`
is the law a token is drawn from (kernels.sampling.process_logits: temperature, top-k, top-p,
min-p and the max_support cut; a greedy row's law is a point mass), in float64. Neither reads
anything but the row itself, so a token's numbers do not depend on whether it was drafted
(DESIGN §2: a window's rows are computed as they would be alone).

Pure functions; nothing is copied to the host here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.sampling import PAD_ID, SamplingParams, process_logits

MAX_TOP_LOGPROBS = 20  # alternatives a row may return (OpenAI's and vLLM's default limit)


@dataclass(frozen=True)
class RowLogprobs:
    """Per row: the chosen token's log-probability and rank, and the top alternatives."""

    logprobs: Tensor  # [rows] the chosen token's (-inf where the law gives it no mass)
    ranks: Tensor  # [rows] int64: 1 + the number of tokens strictly more likely
    top_ids: Tensor  # [rows, num_top] int64, most likely first (PAD_ID past a row's support)
    top_logprobs: Tensor  # [rows, num_top] (-inf past a row's support)


def _check(rows: int, token_ids: Tensor, num_top: int) -> None:
    if token_ids.shape != (rows,):
        raise ValueError(f"token_ids must be [{rows}] (one per row); got shape {tuple(token_ids.shape)}")
    if not 0 <= num_top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"num_top {num_top} must lie in [0, {MAX_TOP_LOGPROBS}]")


def raw_logprobs(logits: Tensor, token_ids: Tensor, num_top: int) -> RowLogprobs:
    """logits [rows, vocab], token_ids [rows] (on logits' device): under log_softmax(logits)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab]; got shape {tuple(logits.shape)}")
    _check(logits.shape[0], token_ids, num_top)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1))  # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1, sorted=True)
    return RowLogprobs(chosen.squeeze(-1), ranks, top_ids, top_logprobs)


def processed_logprobs(logits: Tensor, token_ids: Tensor, num_top: int, params: SamplingParams) -> RowLogprobs:
    """logits [rows, vocab], token_ids [rows]: under process_logits(logits, params)."""
    rows = process_logits(logits, params)
    _check(rows.num_rows, token_ids, num_top)
    logprobs = torch.where(rows.probs > 0, rows.probs.log(), -torch.inf)  # [rows, width]
    match = rows.token_ids == token_ids.unsqueeze(-1)  # [rows, width]
    chosen = torch.where(match, logprobs, -torch.inf).amax(dim=-1, keepdim=True)  # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_logprobs, order = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1, sorted=True)
    top_ids = torch.where(top_logprobs > -torch.inf, rows.token_ids.gather(-1, order), PAD_ID)
    return RowLogprobs(chosen.squeeze(-1), ranks, top_ids, top_logprobs)
