"""The processed target distribution and how tokens are drawn from it (DESIGN §2).

p for a position: temperature → top_k → top_p → min_p → renormalise, then capped to the
`max_support` most likely tokens and renormalised. The cap is part of the definition, so
every distribution in tandem is a sparse row of at most `max_support` (token id, prob)
pairs. Rows are kept sorted by ascending token id, because inverse-CDF sampling walks the
support in token-id order: two close distributions sampled with the same u then usually
agree, which is what coupled drafting relies on.

Ties are always broken towards the lower token id (greedy argmax, top_k, top_p and the cap).
"""

from __future__ import annotations

import functools
import math
from array import array
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from kernels.fused import cpu_rows
from kernels.rng import MAX_POSITION, seed_key, uniform

DEFAULT_MAX_SUPPORT = 64
PAD_ID = -1  # padding entries of a sparse row: id -1, prob 0, always after the real ones


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; temperature 0 means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    max_support: int = DEFAULT_MAX_SUPPORT

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature {self.temperature!r} must be finite and >= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k {self.top_k!r} must be an integer >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p {self.top_p!r} must lie in (0, 1]")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p {self.min_p!r} must lie in [0, 1]")
        if isinstance(self.max_support, bool) or not isinstance(self.max_support, int) or self.max_support < 1:
            raise ValueError(f"max_support {self.max_support!r} must be an integer >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SparseRows:
    """Sparse distributions, one per row, sorted by ascending token id.

    Padding entries (id -1, prob 0) follow the real ones, so every row has the same width
    and a fixed shape suits CUDA graphs and the wire format alike.
    """

    token_ids: Tensor  # [rows, width] int64
    probs: Tensor  # [rows, width] float64

    def __post_init__(self) -> None:
        if self.token_ids.shape != self.probs.shape or self.token_ids.dim() != 2:
            raise ValueError(
                f"token_ids {tuple(self.token_ids.shape)} and probs {tuple(self.probs.shape)} must be equal 2-D shapes"
            )

    @property
    def num_rows(self) -> int:
        return self.token_ids.shape[0]

    def row(self, index: int) -> dict[int, float]:
        """One row as {token id: prob} (padding dropped); for tests and the wire format."""
        ids = self.token_ids[index].tolist()
        probs = self.probs[index].tolist()
        return {t: p for t, p in zip(ids, probs) if t != PAD_ID}

    def __getitem__(self, index: slice | int) -> SparseRows:
        if isinstance(index, int):
            index = slice(index, index + 1)
        return SparseRows(self.token_ids[index], self.probs[index])

    def to(self, device: torch.device | str) -> SparseRows:
        return SparseRows(self.token_ids.to(device), self.probs.to(device))

    @staticmethod
    def from_dicts(rows: list[dict[int, float]], width: int | None = None) -> SparseRows:
        """Build rows from {token id: prob} dicts (sorted here); width defaults to the widest row."""
        width = max([len(r) for r in rows] + [1]) if width is None else width
        token_ids = torch.full((len(rows), width), PAD_ID, dtype=torch.int64)
        probs = torch.zeros((len(rows), width), dtype=torch.float64)
        for i, row in enumerate(rows):
            if len(row) > width:
                raise ValueError(f"row {i} has {len(row)} entries, more than width {width}")
            items = sorted(row.items())
            token_ids[i, : len(items)] = torch.tensor([t for t, _ in items], dtype=torch.int64)
            probs[i, : len(items)] = torch.tensor([p for _, p in items], dtype=torch.float64)
        return SparseRows(token_ids, probs)

    @staticmethod
    def point_masses(token_ids: Tensor) -> SparseRows:
        """q = one-hot rows (suffix-lookup drafts, greedy targets)."""
        ids = token_ids.reshape(-1, 1).to(torch.int64)
        return SparseRows(ids, torch.ones(ids.shape, dtype=torch.float64, device=ids.device))


def _renormalise(probs: Tensor, keep: Tensor) -> Tensor:
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


MAX_CANDIDATES = 1024  # beyond this many candidate tokens a row is processed by sorting it whole
# On CUDA a call is bound by the host's launches, not the device: sorting whole rows (fewer
# ops) took 0.65 ms per call against 1.23 ms for selecting candidates (H200, vocab 151,936,
# bench/sampling_rows.py); selection pays on the CPU (3.7-6.8x), where the sort is the work.
SELECT_ON_CUDA = False


def process_logits(logits: Tensor, params: SamplingParams) -> SparseRows:
    """The processed distribution p of each row of `logits` [rows, vocab] as sparse rows.

    Computed in float64 from the given logits. Width is min(max_support, vocab); greedy rows
    are point masses on the argmax (lowest id on ties). No host synchronisation.

    Every filter keeps a prefix of the tokens sorted by descending logit (lower id first on
    ties), and the result depends only on the first max(width, top_k) of them and on the
    normaliser of the softmax; so on the CPU a row is not sorted whole but its candidates are
    found by selection: natively (_sampling_rows.c, one pass a row) where the extension is built,
    else in torch (`_candidates`) unless they are not much fewer than the vocabulary. The torch
    code below stays the definition (tests compare the native rows with it).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab]; got shape {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    width = min(params.max_support, vocab_size)
    if params.greedy:
        # torch.argmax returns the first maximal index: the lowest token id on ties.
        best = logits.argmax(dim=-1, keepdim=True)
        token_ids = torch.full((num_rows, width), PAD_ID, dtype=torch.int64, device=logits.device)
        probs = torch.zeros((num_rows, width), dtype=torch.float64, device=logits.device)
        token_ids[:, :1] = best
        probs[:, :1] = 1.0
        return SparseRows(token_ids, probs)
    top_k = params.top_k if params.top_k < vocab_size else 0  # (top_k >= vocab keeps every token)
    num_candidates = max(width, top_k)
    native = _native_rows(logits, params, top_k, width, num_candidates)
    if native is not None:
        return native
    scaled = logits.to(torch.float64) / params.temperature
    if (num_candidates * 2 > vocab_size or num_candidates > MAX_CANDIDATES
            or (logits.is_cuda and not SELECT_ON_CUDA)):
        order = torch.argsort(scaled, dim=-1, descending=True, stable=True)
        # [rows, vocab]: the definition, every token sorted (the softmax over the sorted row)
        return _filter(torch.softmax(scaled.gather(-1, order), dim=-1), order, params, top_k, width, vocab_size)
    order = _candidates(scaled, num_candidates)  # [rows, num_candidates]
    probs = torch.softmax(scaled, dim=-1).gather(-1, order)
    return _filter(probs, order, params, top_k, width, vocab_size)


NATIVE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float64: 2}  # _sampling_rows.c's


@functools.cache
def _native() -> ModuleType | None:
    try:
        from kernels import _sampling_rows
    except ImportError:  # not built (a source tree without `pip install -e .` or build_ext)
        return None
    return _sampling_rows


def _native_rows(logits: Tensor, params: SamplingParams, top_k: int, width: int, num_candidates: int
                 ) -> SparseRows | None:
    """process_logits' rows by _sampling_rows.c (CPU rows of float32, bf16 or float64: the
    selection path's arithmetic in one pass a row, other summation orders), or None."""
    native = _native()
    if native is None or logits.device.type != "cpu" or logits.dtype not in NATIVE_TYPES:
        return None
    logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    token_ids = torch.empty((num_rows, width), dtype=torch.int64)
    probs = torch.empty((num_rows, width), dtype=torch.float64)
    if num_rows:
        native.process(logits.data_ptr(), NATIVE_TYPES[logits.dtype], num_rows, vocab_size, float(params.temperature),
                       top_k, float(params.top_p), float(params.min_p), width, num_candidates, token_ids.data_ptr(),
                       probs.data_ptr())
    return SparseRows(token_ids, probs)


@dataclass(frozen=True)
class DrawWindow:
    """A session's rows of one step to draw its own tokens from (`draw_windows`): rows first_row
    .. first_row + num_rows - 1 of the logits, row j with the pick stream's u at position + j
    (kernels.rng.uniform_at(seed, position + j)); drafts (fewer than num_rows): the window's
    drafts — its rows are drawn in order, up to the first draft they reject; None: every row."""

    first_row: int
    num_rows: int
    params: SamplingParams
    seed: int
    position: int
    drafts: tuple[int, ...] | None = None


def draw_windows(logits: Tensor, windows: list[DrawWindow], out: Tensor, threads: int | None = None) -> bool:
    """Each window's own tokens into out (indexed by row) by kernels/fused/_cpu_draws.c, in one
    call on the CPU step's threads (a window whole on one thread: the tokens do not depend on
    them): row j's token is sample(process_logits(logits[row j], params), u(position + j)) for j
    up to the first draft the row's token differs from (or the row after the last draft; every
    row where the window's drafts are None); out's later rows keep
    their values — in exact mode no verdict reads them (rounds.greedy_verdict stops there). False
    where it does not apply (not built, not CPU rows of float32 / bf16 / float64, a greedy
    window): nothing is written then. threads: torch's count when None.

    logits [R, vocab] contiguous; out [>= R] int64 contiguous, on the CPU."""
    native = cpu_rows.native()
    if (native is None or logits.device.type != "cpu" or logits.dtype not in NATIVE_TYPES or logits.dim() != 2
            or not logits.is_contiguous() or out.device.type != "cpu" or out.dtype != torch.int64 or out.dim() != 1
            or not out.is_contiguous() or any(w.params.greedy for w in windows)):
        return False
    num_rows, vocab_size = logits.shape
    fields, drafts, params = array("q"), array("q"), array("d")
    for w in windows:
        if w.num_rows < 1 or w.first_row < 0 or w.first_row + w.num_rows > min(num_rows, out.shape[0]):
            raise IndexError(f"draw_windows: rows {w.first_row}..{w.first_row + w.num_rows - 1} are outside the "
                             f"logits' {num_rows} rows or out's {out.shape[0]}")
        if w.drafts is not None and len(w.drafts) >= w.num_rows:
            raise ValueError(f"draw_windows: {len(w.drafts)} drafts for a window of {w.num_rows} rows")
        if not 0 <= w.position <= MAX_POSITION - w.num_rows:
            raise ValueError(f"draw_windows: position {w.position} must lie in [0, 2**61) with its window's "
                             f"{w.num_rows} rows")
        k0, k1 = seed_key(w.seed)
        width = min(w.params.max_support, vocab_size)
        top_k = w.params.top_k if w.params.top_k < vocab_size else 0
        fields.extend((w.first_row, w.num_rows, len(drafts), -1 if w.drafts is None else len(w.drafts), top_k, width,
                       max(width, top_k), k0, k1, w.position))
        drafts.extend(w.drafts or ())
        params.extend((w.params.temperature, w.params.top_p, w.params.min_p))
    if windows:
        drafts.append(0)  # (never read: an address for a call whose windows have no drafts)
        native.draw_windows(logits.data_ptr(), NATIVE_TYPES[logits.dtype], vocab_size, len(windows),
                            fields.buffer_info()[0], drafts.buffer_info()[0], params.buffer_info()[0], out.data_ptr(),
                            torch.get_num_threads() if threads is None else threads)
    return True


def _candidates(scaled: Tensor, num_candidates: int) -> Tensor:
    """Ids of the `num_candidates` largest entries of each row [rows, vocab], sorted by
    descending value, lower id first on ties — the first columns of a stable descending sort.

    torch.topk breaks ties arbitrarily, so it only finds the smallest value taken (the
    threshold); a second selection over integer keys takes every id above the threshold and
    then the lowest ids at it.
    """
    vocab_size = scaled.shape[-1]
    threshold = torch.topk(scaled, num_candidates, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    token_ids = torch.arange(vocab_size, device=scaled.device)
    at = (vocab_size - token_ids).expand_as(scaled)  # ties at the threshold: the lower id ranks higher
    key = torch.where(scaled > threshold, vocab_size + 1, torch.where(scaled == threshold, at, 0))
    chosen = torch.topk(key, num_candidates, dim=-1, sorted=False).indices
    chosen = torch.sort(chosen, dim=-1).values  # ascending ids, so the stable sort below breaks ties by id
    ranked = torch.sort(scaled.gather(-1, chosen), dim=-1, descending=True, stable=True).indices
    return chosen.gather(-1, ranked)


def _filter(probs: Tensor, order: Tensor, params: SamplingParams, top_k: int, width: int, vocab_size: int
            ) -> SparseRows:
    """top_k → top_p → min_p → the cap on the leading tokens of each row by rank.

    probs: [rows, n] softmax probabilities of the tokens `order` [rows, n] (ids), sorted by
    descending logit; the first max(width, top_k) tokens of every row at least. top_k: 0 when
    it keeps every token (so the probabilities top_p sees stay the softmax's: n may be less
    than the vocabulary).
    """
    num_rows, n = probs.shape
    rank = torch.arange(n, device=probs.device).expand(num_rows, n)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k:
        keep &= rank < top_k
        probs = _renormalise(probs, keep)
    if params.top_p < 1:
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep &= mass_before < params.top_p
        probs = _renormalise(probs, keep)
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs[:, :1]
        probs = _renormalise(probs, keep)
    keep &= rank < width
    probs = _renormalise(probs, keep)[:, :width]
    keep = keep[:, :width]
    token_ids = torch.where(keep, order[:, :width], torch.full_like(order[:, :width], vocab_size))
    token_ids, by_id = torch.sort(token_ids, dim=-1)
    probs = torch.gather(probs, -1, by_id)
    token_ids = torch.where(token_ids == vocab_size, torch.full_like(token_ids, PAD_ID), token_ids)
    return SparseRows(token_ids, probs)


def sample(rows: SparseRows, u: Tensor | float) -> Tensor:
    """Inverse-CDF draw of one token per row with the given uniforms u [rows] (float64), or
    one u (a float) for every row — a host value that needs no copy to the device.

    Walks each row's support in ascending token id order and returns the first token whose
    cumulative probability exceeds u. If rounding leaves u above the total mass, the last
    token with positive probability is returned. No host synchronisation.
    """
    cdf = torch.cumsum(rows.probs, dim=-1)
    if isinstance(u, Tensor):
        if u.shape != (rows.num_rows,):
            raise ValueError(f"u shape {tuple(u.shape)} must be ({rows.num_rows},)")
        u = u.unsqueeze(-1).to(cdf.dtype)
    below = (cdf <= u).sum(dim=-1)
    positive = rows.probs > 0
    last_positive = (positive.cumsum(dim=-1) == positive.sum(dim=-1, keepdim=True)) & positive
    last_index = last_positive.to(torch.int64).argmax(dim=-1)
    # The first entry whose cdf exceeds u has positive probability (the cdf rose there), so
    # zero-probability entries (padding, or holes in a residual row) are never returned.
    index = torch.minimum(below, last_index)
    return rows.token_ids.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def sample_gumbel(rows: SparseRows, seed: int | Tensor, positions: Tensor) -> Tensor:
    """Gumbel-max (exponential race) draw: argmax_i p_i / E_i, E_i ~ Exp(1).

    E_i = -log u(seed, position, "pick", token id i): keyed by token id, so a drafter with a
    different distribution over the same tokens sees the same noise (coupling).
    positions: [rows] int64. Lowest id wins exact ties.
    """
    safe_ids = torch.where(rows.token_ids == PAD_ID, torch.zeros_like(rows.token_ids), rows.token_ids)
    seed = seed.unsqueeze(-1) if isinstance(seed, Tensor) else seed  # a row's seed for each of its tokens
    u = uniform(seed, positions.unsqueeze(-1).expand_as(safe_ids).contiguous(), "pick", token_ids=safe_ids)
    score = rows.probs / -torch.log(u)
    score = torch.where(rows.probs > 0, score, torch.full_like(score, -1.0))
    index = score.argmax(dim=-1, keepdim=True)
    return rows.token_ids.gather(-1, index).squeeze(-1)


def draw(
    rows: SparseRows,
    seed: int | Tensor,
    positions: Tensor,
    *,
    stream: str = "pick",
    sampler: str = "inverse_cdf",
) -> Tensor:
    """The one way tandem draws a token from each row: plain decoding, verification and
    coupled drafting all call this, so equal rows and positions give equal tokens.

    positions: [rows] int64 (the position of the token being drawn); sampler
    "inverse_cdf" (u from `stream`) or "gumbel" (Gumbel-max, pick stream only).
    """
    if sampler == "inverse_cdf":
        return sample(rows, uniform(seed, positions, stream))
    if sampler == "gumbel":
        if stream != "pick":
            raise ValueError(f"the gumbel sampler draws from the pick stream only; got stream {stream!r}")
        return sample_gumbel(rows, seed, positions)
    raise ValueError(f"sampler {sampler!r} must be 'inverse_cdf' or 'gumbel'")


def lookup(rows: SparseRows, token_ids: Tensor) -> Tensor:
    """Probability of token_ids [rows] (or [rows, n]) under each row; 0 where absent."""
    query = token_ids if token_ids.dim() == 2 else token_ids.unsqueeze(-1)
    match = rows.token_ids.unsqueeze(1) == query.unsqueeze(-1)  # [rows, n, width]
    found = (match & (query.unsqueeze(-1) != PAD_ID)).to(rows.probs.dtype)
    probs = (found * rows.probs.unsqueeze(1)).sum(dim=-1)
    return probs if token_ids.dim() == 2 else probs.squeeze(-1)
