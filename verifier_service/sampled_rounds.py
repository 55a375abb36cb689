"""Sampled rounds: windows' own tokens drawn on the device (plain rounds, exact mode), p's
rows processed per sampling group, probabilistic rounds verified together on the host
(DESIGN §2, §3, §11).

- Sessions of a batch that sample alike share one `process_logits` call over their rows
  (gathered by one small asynchronous index copy): one processing per group, not per session.
- A window's own tokens are drawn where its logits are (`own_tokens`): the pick stream's u of
  each row's position computed on the host (`uniform_at`, plain integers) and the draw by
  `sample`; on the CPU every window of a step in one native call on the step's threads
  (kernels.sampling.draw_windows: a window's rows only up to the first draft they reject). In
  exact mode the verdict follows from them as from greedy ids, and a plain
  round's token is the draw verify_chain would make in either mode: neither needs p's rows
  on the host, and the decode step ahead can be fed the token without a host read.
- A probabilistic round with drafts is verified from its window's p rows (and the drafter's
  q rows) on the host. One `verify_chain` call per session costs ~1–2 ms of host time on a small CPU
  whatever the chain's length; `verdicts` verifies a batch's chains with one `verify_chains`
  call per mode: chains padded to the longest (padding rows are never reached: a chain
  accepts at most its own drafts), rows padded to the widest (zero-probability entries
  change no draw), point-mass drafts as one-hot q rows when other chains of the call bring q
  rows (the same test and residual). Every chain keeps its own seed, accept key and
  positions, so its verdict is the one it gets alone (tests/verifier_service/test_sampled_rounds.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.rng import seed_as_int64, uniform_at
from kernels.sampling import PAD_ID, DrawWindow, SamplingParams, SparseRows, draw_windows, process_logits, sample
from kernels.speculative import Mode, verify_chains
from shared.threads import step_threads
from verifier_service.audit import accept_key
from verifier_service.rounds import Session, greedy_verdict


@dataclass(frozen=True)
class Chain:
    """One sampled round to verify: its window's p rows and its drafts (none: a plain round)."""

    target: SparseRows  # [len(drafts) + 1, width] on the host
    drafts: list[int]
    q_rows: SparseRows | None  # [len(drafts), width'], or None: point-mass drafts
    mode: Mode
    seed: int
    accept_seed: int  # the key of the accept and residual draws (verifier_service.audit)
    base_position: int  # the position the first draft decides


def verdicts(chains: list[Chain]) -> list[tuple[list[int], int]]:
    """(emitted tokens, accepted drafts) of each chain, in order."""
    out: list[tuple[list[int], int] | None] = [None] * len(chains)
    for mode in Mode:
        members = [i for i, c in enumerate(chains) if c.mode is mode]
        if members:
            for i, verdict in zip(members, _verify([chains[i] for i in members], mode)):
                out[i] = verdict
    return out  # type: ignore[return-value]


def _verify(chains: list[Chain], mode: Mode) -> list[tuple[list[int], int]]:
    batch = len(chains)
    k = max(len(c.drafts) for c in chains)
    width = max(c.target.token_ids.shape[1] for c in chains)
    target = _stack([c.target for c in chains], k + 1, width)
    draft = None
    if any(c.q_rows is not None for c in chains):
        q_rows = [c.q_rows if c.q_rows is not None else SparseRows.point_masses(torch.tensor(c.drafts, dtype=torch.int64))
                  for c in chains]
        draft = _stack(q_rows, k, max(q.token_ids.shape[1] for q in q_rows))
    draft_ids = torch.zeros((batch, k), dtype=torch.int64)
    for i, c in enumerate(chains):
        draft_ids[i, : len(c.drafts)] = torch.tensor(c.drafts, dtype=torch.int64)
    verdict = verify_chains(
        target, draft_ids, torch.tensor([len(c.drafts) for c in chains]), draft, mode=mode,
        seed=torch.tensor([seed_as_int64(c.seed) for c in chains]),
        base_positions=torch.tensor([c.base_position for c in chains]),
        accept_seed=torch.tensor([seed_as_int64(c.accept_seed) for c in chains]),
    )
    return [(verdict.emitted(i), int(verdict.num_accepted[i])) for i in range(batch)]


def _stack(rows: list[SparseRows], rows_per_chain: int, width: int) -> SparseRows:
    """Each chain's rows padded to rows_per_chain rows of `width` entries, chain-major."""
    token_ids = torch.full((len(rows), rows_per_chain, width), PAD_ID, dtype=torch.int64)
    probs = torch.zeros((len(rows), rows_per_chain, width), dtype=torch.float64)
    for i, r in enumerate(rows):
        token_ids[i, : r.num_rows, : r.token_ids.shape[1]] = r.token_ids
        probs[i, : r.num_rows, : r.probs.shape[1]] = r.probs
    return SparseRows(token_ids.view(-1, width), probs.view(-1, width))


def _groups(sessions: list[Session], num_rows: list[int], drawn: bool) -> dict[SamplingParams, list[int]]:
    """The sampled sessions' indexes by their sampling parameters: those whose windows are
    drawn here (drawn=True), or the others."""
    groups: dict[SamplingParams, list[int]] = {}
    for i, session in enumerate(sessions):
        if not session.spec.sampling.greedy and drawn_here(session, num_rows[i] - 1) == drawn:
            groups.setdefault(session.spec.sampling, []).append(i)
    return groups


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    # (from pageable memory, non_blocking stages the values at once: no device synchronisation)
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def drawn_here(session: Session, num_drafts: int) -> bool:
    """Whether a round's verdict follows from its window's own tokens drawn where the logits
    are: sampled plain rounds (either mode) and sampled exact-mode windows (greedy ones use
    their argmax; probabilistic windows with drafts need p's rows on the host)."""
    spec = session.spec
    return not spec.sampling.greedy and (spec.mode is Mode.EXACT or num_drafts == 0)


def own_tokens(sessions: list[Session], num_rows: list[int], logits: Tensor, greedy_ids: Tensor,
               positions: list[int], drafts: list[list[int]] | None = None) -> Tensor | None:
    """[rows] where the logits are: each window row's own token — for the sessions drawn here
    (`drawn_here`), the draw from p with the pick stream's u of the position the row decides
    (positions[i] + j for row j of sessions[i]); for the others the greedy id. In exact mode
    a window's verdict is then greedy_verdict(drafts, own tokens), verify_chain's verdict
    (and a plain round's token is its first row's). None when no session is drawn here.
    drafts: each window's drafts (None: not given, every row drawn); given, a window's rows are
    drawn on the CPU only up to the first draft they reject — the rows after it keep their
    greedy ids, which no verdict reads (greedy_verdict stops at that row).

    logits: [>= rows, vocab], greedy_ids: [>= rows]: the windows' rows, consecutive."""
    starts = _starts(num_rows)
    groups = _groups(sessions, num_rows, drawn=True)
    if not groups:
        return None
    token_ids = greedy_ids[: starts[-1]].clone()
    # on the CPU, every window's draws in one native call on the step's threads (the same tokens
    # as below, up to each window's first rejected draft); elsewhere no windows are built for it
    if logits.device.type == "cpu":
        windows = [DrawWindow(starts[i], num_rows[i], params, sessions[i].spec.seed, positions[i],
                              None if drafts is None else tuple(drafts[i]))
                   for params, members in groups.items() for i in members]
        if draw_windows(logits, windows, token_ids, step_threads()):
            return token_ids
    for params, members in groups.items():
        u = [uniform_at(sessions[i].spec.seed, positions[i] + j) for i in members for j in range(num_rows[i])]
        rows, where = _gather(logits, starts, members)
        # one row: u as a kernel argument, nothing to copy
        drawn = sample(process_logits(rows, params), u[0] if len(u) == 1 else _to_device(u, torch.float64, logits.device))
        if isinstance(where, slice):
            token_ids[where] = drawn
        else:
            token_ids.index_copy_(0, where, drawn)
    return token_ids


def process_targets(sessions: list[Session], num_rows: list[int], logits: Tensor
                    ) -> list[tuple[SparseRows, list[tuple[int, slice]]]]:
    """p rows of the sampled windows not drawn here (probabilistic mode with drafts; windows
    are consecutive rows of `logits`, num_rows[i] of them, on the device): one processing per
    sampling group, with the slice of the group's rows each session takes."""
    starts = _starts(num_rows)
    processed = []
    for params, members in _groups(sessions, num_rows, drawn=False).items():
        parts, at = [], 0
        for i in members:
            parts.append((i, slice(at, at + num_rows[i])))
            at += num_rows[i]
        processed.append((process_logits(_gather(logits, starts, members)[0], params), parts))
    return processed


def _starts(num_rows: list[int]) -> list[int]:
    """The first row of each window (and, last, the rows in all) when windows are consecutive."""
    starts = [0]
    for n in num_rows:
        starts.append(starts[-1] + n)
    return starts


def _gather(logits: Tensor, starts: list[int], members: list[int]) -> tuple[Tensor, slice | Tensor]:
    """A group's window rows of `logits`, and where they lie: a slice (one window: a view,
    nothing copied) or their index (one small asynchronous copy)."""
    if len(members) == 1:
        where = slice(starts[members[0]], starts[members[0] + 1])
        return logits[where], where
    index = _to_device([row for i in members for row in range(starts[i], starts[i + 1])], torch.int64, logits.device)
    return logits.index_select(0, index), index


def round_verdicts(rounds: list[tuple[Session, list[int], SparseRows | None, list[int], SparseRows | None]],
                   draw_secret: bytes) -> list[tuple[list[int], int]]:
    """(emitted, accepted) of each round (session, drafts, q rows, the window's own tokens, p
    rows on the host or None): rounds without p rows by their own tokens (greedy ids, or drawn
    here), the others verified together."""
    out: list[tuple[list[int], int] | None] = [None] * len(rounds)
    chains, members = [], []
    for i, (session, drafts, q_rows, own_ids, target) in enumerate(rounds):
        spec = session.spec
        if target is None:
            out[i] = greedy_verdict(drafts, own_ids)
            continue
        members.append(i)
        chains.append(Chain(target, drafts, q_rows, spec.mode, spec.seed, accept_key(draw_secret, spec.seed),
                            base_position=len(session.token_ids)))
    for i, verdict in zip(members, verdicts(chains) if chains else []):
        out[i] = verdict
    return out  # type: ignore[return-value]
