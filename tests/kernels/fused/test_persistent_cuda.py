"""kernels.fused.persistent_cuda: the layer chain in one persistent CUDA kernel computes the torch
reference's function (same routes, bf16 roundings apart), a row's bits are its one-row chain's,
and neither the ring's slots nor relaunches (the counters' reset) nor a graph's replay change a
bit. The kernel needs a Hopper GPU (bulk copies); the shape checks run anywhere."""

import pytest
import torch

from kernels.fused.persistent_cuda import ChainLayer, LayerChain, reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the chain's bulk copies and mbarriers need sm_90")


def layers(device, num_layers=3, hidden=256, q_width=512, inter=64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(shape, generator=g) / shape[-1] ** 0.5).to(device, torch.bfloat16)

    return [ChainLayer(w(q_width, hidden), w(hidden, q_width), w(128, hidden), w(128, 2 * inter, hidden),
                       w(128, hidden, inter)) for _ in range(num_layers)]


def test_shapes_are_checked():
    good = layers("cpu", 1)[0]
    with pytest.raises(ValueError, match=r"layers\[0\]\.o: shape"):
        ChainLayer(good.qkv, good.o.T.contiguous(), good.router, good.gate_up, good.down).check(0)
    with pytest.raises(ValueError, match=r"layers\[0\]\.router: must be contiguous bf16"):
        ChainLayer(good.qkv, good.o, good.router.float(), good.gate_up, good.down).check(0)
    odd = layers("cpu", 1, hidden=384)[0]
    with pytest.raises(ValueError, match="widths H=384"):
        odd.check(0)
    with pytest.raises(ValueError, match="rows = 9"):
        LayerChain([good], 9)
    with pytest.raises(ValueError, match="layers: at least one"):
        LayerChain([], 1)


def test_reference_routes_ties_to_the_lower_expert():
    layer = layers("cpu", 1)[0]
    router = layer.router.clone()
    router[7] = router[3]  # experts 3 and 7 tie for every input
    tied = ChainLayer(layer.qkv, layer.o, router, layer.gate_up, layer.down)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    _, (ids,) = reference([tied], x)
    rows_with_7 = [row for row in ids.tolist() if 7 in row]
    assert rows_with_7  # (the seed gives some)
    for row in rows_with_7:
        assert 3 in row and row.index(3) < row.index(7)


@needs_hopper
@pytest.mark.parametrize("use_mma", [True, False], ids=["mma", "fma"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_chain_matches_reference(rows, use_mma):
    chain_layers = layers("cuda")
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to("cuda", torch.bfloat16)
    got = LayerChain(chain_layers, rows, use_mma=use_mma).run(x).float()
    want, _ = reference(chain_layers, x)
    assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())


@needs_hopper
def test_stream_only_takes_every_tile():
    chain_layers = layers("cuda")
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    chain = LayerChain(chain_layers, 2, stream_only=True)
    assert torch.equal(chain.run(x), torch.zeros_like(chain.out))  # (it returned: no tile was left waiting)
    torch.cuda.synchronize()


@needs_hopper
@pytest.mark.parametrize("use_mma", [True, False], ids=["mma", "fma"])
def test_rows_alone_slots_relaunch_and_graph_keep_the_bits(use_mma):
    chain_layers = layers("cuda", seed=2)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
    chain = LayerChain(chain_layers, 5, use_mma=use_mma)
    first = chain.run(x).clone()
    assert not chain.counters.any(), "the last block out did not set the counters back to zero"
    assert torch.equal(chain.run(x), first), "a relaunch changed the bits"
    for r in range(5):
        alone = LayerChain(chain_layers, 1, use_mma=use_mma).run(x[r:r + 1])[0]
        assert torch.equal(alone, first[r]), f"row {r} alone differs"
    for slots in (1, 2):
        assert torch.equal(LayerChain(chain_layers, 5, slots=slots, use_mma=use_mma).run(x), first), f"{slots} slots"
    assert torch.equal(LayerChain(chain_layers, 5, use_mma=use_mma, l2_prefetch=True).run(x), first), "L2 prefetch"
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        chain.run(x)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        chain.run(x)
    chain.out.zero_()
    graph.replay()
    graph.replay()
    assert torch.equal(chain.out, first)


@pytest.fixture(scope="module")
def nvrtc_compile():
    """compile_source(source, options) -> (ok, log) with the NVRTC of the test extra's nvidia-cuda-nvrtc-cu12
    (no GPU needed); skipped only where that extra does not install it (not Linux x86-64)."""
    import ctypes
    import platform
    from pathlib import Path

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("nvidia-cuda-nvrtc-cu12 is installed on Linux x86-64 only")
    found = list(Path(pytest.importorskip("nvidia.cuda_nvrtc").__path__[0]).glob("lib/libnvrtc.so.12"))
    if not found:  # (a CUDA 13 image has its own NVRTC: the GPU tests compile there)
        pytest.skip("no NVRTC 12 beside nvidia.cuda_nvrtc")
    lib = ctypes.CDLL(str(found[0]))

    def compile_source(source: str, options: list[str]) -> tuple[bool, str]:
        program = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"chain.cu", 0, None, None) == 0
        encoded = [o.encode() for o in options]
        result = lib.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log)
        lib.nvrtcDestroyProgram(ctypes.byref(program))
        return result == 0, log.value.decode()

    return compile_source


def test_kernels_compile_for_hopper_without_spills(nvrtc_compile):
    import re

    from kernels.fused.persistent_cuda import SOURCE, STATIC_SMEM, THREADS

    ok, log = nvrtc_compile(SOURCE.read_text(), ["--gpu-architecture=sm_90a", "--ptxas-options=-v"])
    assert ok, log
    entries = re.findall(r"Compiling entry function '(\w+)'", log)
    assert sorted(entries) == ["barrier_chain", "layer_chain_fma", "layer_chain_mma", "stream_ring"], log
    assert re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log) == [("0", "0")] * 4, log
    for registers in re.findall(r"Used (\d+) registers", log):
        assert int(registers) * THREADS <= 65536, f"{registers} registers a thread: a block no longer fits an SM"
    for static in re.findall(r"(\d+) bytes smem", log):
        assert int(static) <= STATIC_SMEM, f"static shared memory {static} B exceeds the {STATIC_SMEM} B reserved"
