"""DESIGN §2: Philox4x32-10 and position-keyed uniforms."""

import random

import pytest
import torch

from kernels.rng import FEW_DRAWS, MAX_POSITION, STREAM_TAGS, philox4x32, philox4x32_tensor, seed_as_int64, uniform, uniform_at

# Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter[4] key[2] -> output[4].
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_known_answer_vectors(counter, key, expected):
    assert philox4x32(counter, key) == expected


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_vectorised_known_answer_vectors(counter, key, expected):
    words = tuple(torch.tensor([w], dtype=torch.int64) for w in counter)
    out = philox4x32_tensor(words, key)
    assert tuple(int(w) for w in out) == expected


def test_vectorised_matches_reference_on_random_blocks():
    rng = random.Random(7)
    blocks = [(tuple(rng.getrandbits(32) for _ in range(4)), (rng.getrandbits(32), rng.getrandbits(32))) for _ in range(64)]
    counters = tuple(torch.tensor([b[0][i] for b in blocks], dtype=torch.int64) for i in range(4))
    keys = tuple(torch.tensor([b[1][i] for b in blocks], dtype=torch.int64) for i in range(2))
    out = philox4x32_tensor(counters, keys)
    for n, (counter, key) in enumerate(blocks):
        assert tuple(int(w[n]) for w in out) == philox4x32(counter, key)


@pytest.mark.parametrize("stream", sorted(STREAM_TAGS))
@pytest.mark.parametrize("seed", [0, 1, 0xDEADBEEF12345678, 2**64 - 1])
def test_uniform_is_the_documented_function_of_philox(stream, seed):
    positions = [0, 1, 2**32 - 1, 2**32, 123456789012, MAX_POSITION]
    u = uniform(seed, torch.tensor(positions, dtype=torch.int64), stream)
    assert u.dtype == torch.float64
    for position, value in zip(positions, u.tolist()):
        c = position | STREAM_TAGS[stream]
        out = philox4x32((c & 0xFFFFFFFF, c >> 32, 0, 0), (seed & 0xFFFFFFFF, seed >> 32))
        assert value == (out[0] + 0.5) / 2**32


@pytest.mark.parametrize("stream", sorted(STREAM_TAGS))
@pytest.mark.parametrize("seed", [0, 1, 0xDEADBEEF12345678, 2**64 - 1])
def test_uniform_at_is_uniform_on_the_host(stream, seed):
    positions = [0, 1, 2**32 - 1, 2**32, 123456789012, MAX_POSITION]
    expected = uniform(seed, torch.tensor(positions, dtype=torch.int64), stream).tolist()
    assert [uniform_at(seed, p, stream) for p in positions] == expected


@pytest.mark.parametrize("position, stream, match", [(-1, "pick", "position"), (MAX_POSITION + 1, "pick", "position"),
                                                     (True, "pick", "position"), (3, "nope", "stream")])
def test_uniform_at_rejects_bad_arguments(position, stream, match):
    with pytest.raises(ValueError, match=match):
        uniform_at(1, position, stream)


def test_token_id_goes_in_counter_word_two():
    positions = torch.tensor([5, 5, 5], dtype=torch.int64)
    token_ids = torch.tensor([0, 1, 70000], dtype=torch.int64)
    u = uniform(42, positions, "pick", token_ids=token_ids)
    for t, value in zip(token_ids.tolist(), u.tolist()):
        out = philox4x32((5, 0, t, 0), (42, 0))
        assert value == (out[0] + 0.5) / 2**32
    assert u[0] == uniform(42, positions[:1])[0]  # t = 0 is the plain draw


def test_streams_are_separated():
    positions = torch.arange(4096, dtype=torch.int64)
    draws = {stream: uniform(99, positions, stream) for stream in STREAM_TAGS}
    names = sorted(draws)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not torch.equal(draws[a], draws[b])
            # independent streams: correlation near zero (|r| < 0.06 at n = 4096 is > 3.8 sigma)
            r = torch.corrcoef(torch.stack([draws[a], draws[b]]))[0, 1]
            assert abs(float(r)) < 0.06


def test_uniforms_lie_strictly_inside_unit_interval_and_look_uniform():
    u = uniform(2024, torch.arange(200_000, dtype=torch.int64))
    assert float(u.min()) > 0 and float(u.max()) < 1
    # mean 0.5, sd 1/sqrt(12 n) = 6.5e-4: a 6-sigma band
    assert abs(float(u.mean()) - 0.5) < 0.004
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    assert float((counts - 20_000).abs().max()) < 800  # binomial sd ~134 per bin


def test_seed_tensor_matches_integer_seeds_including_top_bit():
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF]
    positions = torch.full((len(seeds),), 31, dtype=torch.int64)
    batched = uniform(torch.tensor([seed_as_int64(s) for s in seeds], dtype=torch.int64), positions, "accept")
    for seed, value in zip(seeds, batched.tolist()):
        assert value == float(uniform(seed, positions[:1], "accept")[0])


def test_same_inputs_same_draws_and_positions_differ():
    positions = torch.arange(64, dtype=torch.int64)
    assert torch.equal(uniform(3, positions), uniform(3, positions.clone()))
    assert not torch.equal(uniform(3, positions), uniform(4, positions))
    assert len(set(uniform(3, positions).tolist())) == 64


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"positions": torch.tensor([-1])}, "positions"),
        ({"positions": torch.tensor([2**61])}, "positions"),
        ({"positions": torch.tensor([1.0])}, "dtype"),
        ({"stream": "bogus"}, "stream"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    args = {"seed": 1, "positions": torch.tensor([0]), "stream": "pick"} | kwargs
    with pytest.raises(ValueError, match=match):
        uniform(args["seed"], args["positions"], args["stream"])


def test_philox_rejects_words_out_of_range():
    with pytest.raises(ValueError, match="uint32"):
        philox4x32((2**32, 0, 0, 0), (0, 0))


@pytest.mark.parametrize("num_draws", [1, 5, FEW_DRAWS, 257])
def test_the_host_computes_the_tensor_version_s_words(num_draws):
    # uniform on CPU tensors runs plain integers (a few draws) or numpy; on CUDA
    # philox4x32_tensor: the same u, including per-token draws and per-row seeds with the
    # top bit set.
    generator = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 2**61, (num_draws,), generator=generator)
    token_ids = torch.randint(0, 200_000, (num_draws,), generator=generator)
    seeds = torch.tensor([seed_as_int64(s) for s in [0, 7, 2**63 + 5, 2**64 - 1]]).repeat_interleave(65)[:num_draws]
    for stream, tag in STREAM_TAGS.items():
        for seed, ids in ((0xFEEDFACECAFEBEEF, None), (seeds, None), (12345, token_ids)):
            k0 = (seed & 0xFFFFFFFF) if isinstance(seed, int) else seed & 0xFFFFFFFF
            k1 = (seed >> 32) if isinstance(seed, int) else (seed >> 32) & 0xFFFFFFFF
            c2 = torch.zeros_like(positions) if ids is None else ids
            words = torch.broadcast_tensors(positions & 0xFFFFFFFF, (positions >> 32) | (tag >> 32), c2,
                                            torch.as_tensor(k0), torch.as_tensor(k1))
            out0 = philox4x32_tensor((*words[:3], torch.zeros_like(positions)), words[3:])[0]
            assert torch.equal(uniform(seed, positions, stream, token_ids=ids), (out0.double() + 0.5) / 2**32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (checked on the GPU machine)")
def test_cpu_and_cuda_bit_identical():
    positions = torch.arange(0, 2**40, 2**40 // 100_003, dtype=torch.int64)
    token_ids = torch.randint(0, 200_000, positions.shape, dtype=torch.int64)
    for stream in STREAM_TAGS:
        cpu = uniform(0xFEEDFACECAFEBEEF, positions, stream, token_ids=token_ids)
        gpu = uniform(0xFEEDFACECAFEBEEF, positions.cuda(), stream, token_ids=token_ids.cuda())
        assert torch.equal(cpu, gpu.cpu())
