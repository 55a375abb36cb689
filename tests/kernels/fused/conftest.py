"""Fused-kernel tests run the Triton kernels: compiled on a GPU, interpreted on the CPU."""

import pytest
import torch

from kernels.fused import interpreting, triton_available


@pytest.fixture(scope="session", autouse=True)
def _kernels_really_run():
    # Without Triton (or without the interpreter on a CPU box) every op would fall back to its
    # torch reference and these tests would compare the reference with itself.
    assert triton_available(), "the fused-kernel tests need triton (scripts/test installs it)"
    assert torch.cuda.is_available() or interpreting(), "TRITON_INTERPRET=1 must be set on a CPU-only machine"


def devices_and_dtypes():
    """fp32 everywhere; bf16 only where kernels compile (the interpreter has no bf16 dot)."""
    cases = [("cpu", torch.float32)] if not torch.cuda.is_available() else [("cuda", torch.float32), ("cuda", torch.bfloat16)]
    return pytest.mark.parametrize("device,dtype", cases, ids=[f"{d}-{str(t).split('.')[-1]}" for d, t in cases])


def tolerance(dtype):
    return 2e-5 if dtype == torch.float32 else 3e-2


def assert_same_row(alone, in_window):
    """Row invariance: bit-identical on the GPU. The interpreter's dots are numpy matmuls whose
    summation order follows memory alignment, so there it is checked to float32 rounding only."""
    if alone.is_cuda:
        assert torch.equal(alone, in_window), f"max diff {(alone.double() - in_window.double()).abs().max():.3g}"
    else:
        torch.testing.assert_close(alone, in_window, rtol=2e-5, atol=1e-4)


def page(contiguous, block_size, generator):
    """A [slots, max_length, Hkv, D] cache in paged form: its blocks shuffled over a pool with a
    spare block; returns (blocks [num_blocks, block_size, Hkv, D], block_tables [slots, max_blocks])."""
    num_slots, max_length = contiguous.shape[:2]
    per_slot = -(-max_length // block_size)
    padded = torch.zeros(num_slots, per_slot * block_size, *contiguous.shape[2:], dtype=contiguous.dtype)
    padded[:, :max_length] = contiguous.cpu()
    order = torch.randperm(num_slots * per_slot + 1, generator=generator)  # physical block of each logical one
    blocks = torch.zeros(num_slots * per_slot + 1, block_size, *contiguous.shape[2:], dtype=contiguous.dtype)
    blocks[order[:-1]] = padded.reshape(num_slots * per_slot, block_size, *contiguous.shape[2:])
    tables = order[:-1].reshape(num_slots, per_slot).to(torch.int32)
    return blocks.to(contiguous.device), tables.to(contiguous.device)


def identity_tables(num_slots, device):
    """Block tables of a contiguous [slots, max_length, ...] cache: one block per slot."""
    return torch.arange(num_slots, dtype=torch.int32, device=device).unsqueeze(1)


@pytest.fixture
def lockstep():
    """Runs the same windows through several runners (`arms`: (runner, pool) pairs, each with its
    sequences' `slots`): `picks` are (sequence, window length), each window of random ids from
    `generator` starting at its sequence's last token; `lengths` advance. Returns each arm's
    output."""

    def step(arms, slots, lengths, picks, generator, vocab_size):
        windows = [[] for _ in arms]
        for seq, size in picks:
            ids = torch.randint(0, vocab_size, (size,), generator=generator).tolist()
            for which in range(len(arms)):
                windows[which].append((slots[which][seq], ids, lengths[seq] - 1))
        outs = [runner.run(w) for (runner, _), w in zip(arms, windows)]
        for seq, size in picks:
            lengths[seq] += size
        return outs

    return step
