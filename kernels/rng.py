"""Counter-based, position-keyed random numbers (DESIGN §2).

Philox4x32-10 (Salmon et al., Random123) with key words (seed & 0xffffffff, seed >> 32) and
counter words (c & 0xffffffff, c >> 32, t, 0), c = position | stream tag. The same seed,
stream, position and token id give the same uniform in every process and on every device:
the vectorised version does only 64-bit integer arithmetic that cannot overflow, so CPU and
CUDA results are bit-identical (on the host the same words are computed with numpy).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF

STREAM_TAGS: dict[str, int] = {
    "pick": 0,
    "draft": 1 << 61,
    "accept": 1 << 62,
    "residual": 1 << 63,
}
FEW_DRAWS = 8  # on the host, up to this many uniforms are computed in plain integers
MAX_POSITION = (1 << 61) - 1  # positions must not collide with the stream tags
MAX_SEED = (1 << 64) - 1


def philox4x32(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 on one block, in plain Python integers (the reference implementation)."""
    for i, word in enumerate((*counter, *key)):
        if not 0 <= word <= MASK32:
            raise ValueError(f"philox4x32 word {i} = {word!r} is not a uint32")
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(PHILOX_ROUNDS):
        if round_index:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        p0 = PHILOX_M0 * c0
        p1 = PHILOX_M1 * c2
        c0, c1, c2, c3 = (
            (p1 >> 32) ^ c1 ^ k0,
            p1 & MASK32,
            (p0 >> 32) ^ c3 ^ k1,
            p0 & MASK32,
        )
    return c0, c1, c2, c3


def _mulhilo(a: Tensor, multiplier: int) -> tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit words of a * multiplier for uint32 values held in int64.

    The product of two uint32 needs 64 unsigned bits, which int64 cannot hold, so the
    multiplier is split into 16-bit halves; every partial result stays below 2**49.
    """
    m_lo = multiplier & 0xFFFF
    m_hi = multiplier >> 16
    low_part = a * m_lo  # < 2**48
    high_part = a * m_hi  # < 2**48
    lo_sum = low_part + ((high_part & 0xFFFF) << 16)  # < 2**49
    hi = (high_part >> 16) + (lo_sum >> 32)
    return hi, lo_sum & MASK32


def philox4x32_tensor(
    counter: tuple[Tensor, Tensor, Tensor, Tensor], key: tuple[Tensor | int, Tensor | int]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Vectorised Philox4x32-10: every word an int64 tensor (or int) holding a uint32 value."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(PHILOX_ROUNDS):
        if round_index:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def seed_key(seed: int | Tensor) -> tuple[Tensor | int, Tensor | int]:
    """Key words (seed & 0xffffffff, seed >> 32) of a uint64 seed.

    A tensor of seeds is int64 holding the uint64 bit pattern (two's complement), so every
    uint64 seed can be batched.
    """
    if isinstance(seed, Tensor):
        if seed.dtype != torch.int64:
            raise ValueError(f"seed tensor dtype {seed.dtype} must be torch.int64")
        return seed & MASK32, (seed >> 32) & MASK32
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed {seed!r} must be an integer with 0 <= seed < 2**64")
    return seed & MASK32, seed >> 32


def seed_as_int64(seed: int) -> int:
    """The uint64 seed as the int64 bit pattern used by seed tensors."""
    seed_key(seed)
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def uniform(
    seed: int | Tensor,
    positions: Tensor,
    stream: str = "pick",
    token_ids: Tensor | None = None,
) -> Tensor:
    """u = (out[0] + 0.5) / 2**32 for each position, as float64 on the positions' device.

    positions: int64, 0 <= position < 2**61, any shape. token_ids (per-token draws such as
    Gumbel noise) and a seed tensor broadcast against positions.
    """
    if stream not in STREAM_TAGS:
        raise ValueError(f"stream {stream!r} must be one of {sorted(STREAM_TAGS)}")
    if positions.dtype != torch.int64:
        raise ValueError(f"positions dtype {positions.dtype} must be torch.int64")
    if token_ids is not None and token_ids.dtype != torch.int64:
        raise ValueError(f"token_ids dtype {token_ids.dtype} must be torch.int64")
    if positions.device.type == "cpu" and positions.numel() <= FEW_DRAWS:
        return _few_uniforms(seed, positions, stream, token_ids)
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) > MAX_POSITION):
        raise ValueError(f"positions must lie in [0, 2**61); got range [{int(positions.min())}, {int(positions.max())}]")
    k0, k1 = seed_key(seed)
    tag_hi = STREAM_TAGS[stream] >> 32
    c0 = positions & MASK32
    c1 = (positions >> 32) | tag_hi
    if token_ids is None:
        c2 = torch.zeros_like(positions)
    else:
        c0, c1, c2 = torch.broadcast_tensors(c0, c1, token_ids & MASK32)
    if isinstance(k0, Tensor):
        k0, k1 = (w.to(positions.device) for w in (k0, k1))
        c0, c1, c2, k0, k1 = torch.broadcast_tensors(c0, c1, c2, k0, k1)
    if positions.device.type == "cpu":
        # On the host numpy's uint64 holds the 32x32-bit products whole, and its ops cost a
        # fraction of a torch op's dispatch (Philox is ~200 ops): the same words, ~10x faster.
        words = np.broadcast_arrays(*(w.numpy().astype(np.uint64) if isinstance(w, Tensor) else np.uint64(w)
                                      for w in (c0, c1, c2, k0, k1)))
        out0 = torch.from_numpy(np.ascontiguousarray(_philox4x32_numpy(*words)).astype(np.int64))
    else:
        out0, _, _, _ = philox4x32_tensor((c0, c1, c2, torch.zeros_like(c0)), (k0, k1))
    return (out0.to(torch.float64) + 0.5) / 4294967296.0


def _few_uniforms(seed: int | Tensor, positions: Tensor, stream: str, token_ids: Tensor | None) -> Tensor:
    """`uniform` for a few positions on the host (a round's draws), in plain integers."""
    parts = [positions] + [t for t in (token_ids, seed) if isinstance(t, Tensor)]
    shape = np.broadcast_shapes(*(tuple(t.shape) for t in parts))
    flat_positions = positions.expand(shape).reshape(-1).tolist()
    if any(not 0 <= p <= MAX_POSITION for p in flat_positions):
        raise ValueError(f"positions must lie in [0, 2**61); got {flat_positions}")
    count = len(flat_positions)
    flat_ids = token_ids.expand(shape).reshape(-1).tolist() if token_ids is not None else [0] * count
    if isinstance(seed, Tensor):
        keys = [seed_key(s & MAX_SEED) for s in seed.expand(shape).reshape(-1).tolist()]  # (int64 bit patterns)
    else:
        keys = [seed_key(seed)] * count
    tag_hi = STREAM_TAGS[stream] >> 32
    out = [_u(key, p, tag_hi, t) for p, t, key in zip(flat_positions, flat_ids, keys)]
    return torch.tensor(out, dtype=torch.float64).reshape(shape)


def _u(key: tuple[int, int], position: int, tag_hi: int, token_id: int = 0) -> float:
    """u of one counter (position | stream tag, token id) under a key, in plain integers."""
    out0 = philox4x32((position & MASK32, (position >> 32) | tag_hi, token_id & MASK32, 0), key)[0]
    return (out0 + 0.5) / 4294967296.0  # (exact in a double, as in the tensor versions)


def _philox4x32_numpy(c0: np.ndarray, c1: np.ndarray, c2: np.ndarray, k0, k1) -> np.ndarray:
    """Word 0 of Philox4x32-10 on uint64 arrays holding uint32 values (counter word 3 = 0)."""
    c3 = np.zeros_like(c0)
    mask, m0, m1 = np.uint64(MASK32), np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    w0, w1, shift = np.uint64(PHILOX_W0), np.uint64(PHILOX_W1), np.uint64(32)
    for round_index in range(PHILOX_ROUNDS):
        if round_index:
            k0 = (k0 + w0) & mask
            k1 = (k1 + w1) & mask
        p0 = c0 * m0  # < 2**64: exact in uint64
        p1 = c2 * m1
        c0, c1, c2, c3 = (p1 >> shift) ^ c1 ^ k0, p1 & mask, (p0 >> shift) ^ c3 ^ k1, p0 & mask
    return c0


def uniform_at(seed: int, position: int, stream: str = "pick") -> float:
    """One u of `uniform` computed on the host in plain integers: the same value, with no
    tensor and no device (a draw for a device step is then a kernel argument)."""
    if stream not in STREAM_TAGS:
        raise ValueError(f"stream {stream!r} must be one of {sorted(STREAM_TAGS)}")
    if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= MAX_POSITION:
        raise ValueError(f"position {position!r} must be an integer in [0, 2**61)")
    return _u(seed_key(seed), position, STREAM_TAGS[stream] >> 32)
