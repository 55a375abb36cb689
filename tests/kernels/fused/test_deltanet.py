"""The fused Gated DeltaNet step (kernels.fused.deltanet): the Triton kernel against the torch
reference, the reference against the layer (shared.model.families.hybrid.deltanet.GatedDeltaNet) run row by
row, row invariance (a row alone from the state before it is the same bits as in its window),
kept states, empty sequences and untouched buffers, and argument checks."""

import pytest
import torch

from kernels.fused import pdl_supported
from kernels.fused.deltanet import gated_delta_step, gated_delta_step_reference
from shared.model.families.hybrid.deltanet import GatedDeltaNet, LinearState

from .conftest import tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The kernel has no tl.dot, so the interpreter runs it in bf16 too (its bf16 casts truncate,
# which the bf16 tolerance covers).
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
# Grouped value heads (two per key head, one of which owns the q/k conv inputs); and one value
# head per key head with dk != dv, dv not a power of two (masked lanes).
SHAPES = pytest.mark.parametrize("heads", [(2, 4, 16, 8), (2, 2, 16, 12)], ids=["grouped", "ungrouped"])
# The kernel with a program per value head, and split along dv (an arrivals buffer given: the
# shapes above give 2 and 4 programs a head, the last of the 4 slices all masked lanes).
KERNEL, SPLIT, REFERENCE = "kernel", "kernel split along dv", "reference"
IMPLS = pytest.mark.parametrize("impl", [KERNEL, SPLIT, REFERENCE])


def op_of(impl, num_seqs, num_v_heads):
    """The op as `impl` runs it: kwargs to add (a fresh arrivals buffer for SPLIT) and a check
    that the launch left the buffer as it found it (all zeros)."""
    if impl == REFERENCE:
        return gated_delta_step_reference, {}, lambda: None
    if impl == KERNEL:
        return gated_delta_step, {}, lambda: None
    arrivals = torch.zeros(num_seqs * num_v_heads + 3, dtype=torch.int32, device=DEVICE)

    def reset():
        assert not arrivals.any(), "the last program of each head resets its count"
    return gated_delta_step, {"arrivals": arrivals}, reset
EPS = 1e-6


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class Problem:
    """Random inputs of one layer: proj rows (with spare columns past the ones read, so the row
    stride is not the width), weights, and state buffers."""

    def __init__(self, heads, dtype, seed, rows, num_buffers):
        g = torch.Generator().manual_seed(seed)
        self.hk, self.hv, self.dk, self.dv = heads
        self.dtype = dtype
        self.channels = 2 * self.hk * self.dk + self.hv * self.dv
        width = self.channels + self.hv * self.dv + 2 * self.hv

        def rand(*shape, scale=1.0, dtype=dtype):
            return (scale * torch.randn(*shape, generator=g)).to(DEVICE, dtype)

        self.proj = rand(rows, width + 3)[:, :width]
        self.weights = dict(conv_weight=rand(self.channels, 4, scale=0.5), A_log=rand(self.hv, scale=0.5),
                            dt_bias=rand(self.hv), norm_weight=1 + rand(self.dv, scale=0.2))
        self.conv_states = rand(num_buffers, 3, self.channels)
        self.rec_states = rand(num_buffers, self.hv, self.dk, self.dv, scale=0.3, dtype=torch.float32)
        self.sizes = dict(num_k_heads=self.hk, num_v_heads=self.hv, head_k_dim=self.dk, head_v_dim=self.dv, eps=EPS)

    def run(self, impl, proj, starts, state_in, state_out, *, conv_states=None, rec_states=None, keep=False):
        """(out, conv_states, rec_states, kept_conv, kept_rec) on copies of the buffers."""
        conv = (self.conv_states if conv_states is None else conv_states).clone()
        rec = (self.rec_states if rec_states is None else rec_states).clone()
        kept_conv = kept_rec = None
        if keep:
            kept_conv = torch.full((proj.shape[0], 3, self.channels), float("nan"), dtype=self.dtype, device=DEVICE)
            kept_rec = torch.full((proj.shape[0], self.hv, self.dk, self.dv), float("nan"), device=DEVICE)
        op, extra, check = op_of(impl, len(state_in), self.hv)
        out = op(proj, **self.weights, conv_states=conv, rec_states=rec, seq_starts=tensor(starts, torch.int32),
                 state_in=tensor(state_in), state_out=tensor(state_out), kept_conv=kept_conv, kept_rec=kept_rec,
                 **self.sizes, **extra)
        check()
        return out, conv, rec, kept_conv, kept_rec


def tensor(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


@DTYPES
@SHAPES
@pytest.mark.parametrize("kernel", [KERNEL, SPLIT])
def test_kernel_matches_reference(dtype, heads, kernel):
    # Sequences of 3, 0, 1 and 3 rows.
    p = Problem(heads, dtype, seed=1, rows=7, num_buffers=8)
    args = (p.proj, [0, 3, 3, 4, 7], [0, 1, 2, 3], [4, 5, 6, 7])
    out, conv, rec, kept_conv, kept_rec = p.run(kernel, *args, keep=True)
    ref_out, ref_conv, ref_rec, ref_kept_conv, ref_kept_rec = p.run(REFERENCE, *args, keep=True)
    assert out.shape == (7, p.hv * p.dv) and out.dtype == dtype
    assert rel_err(out, ref_out) < tolerance(dtype)
    assert torch.equal(conv, ref_conv)  # the conv state holds inputs: copied, never rounded
    assert torch.equal(kept_conv, ref_kept_conv)
    assert rel_err(rec, ref_rec) < tolerance(dtype)
    assert rel_err(kept_rec, ref_kept_rec) < tolerance(dtype)
    assert torch.equal(rec[[0, 1, 2, 3, 5]], p.rec_states[[0, 1, 2, 3, 5]])  # read-only buffers, the empty one's


def make_layer(heads, dtype, seed):
    hk, hv, dk, dv = heads
    layer = GatedDeltaNet(hidden_size=32, num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv,
                          conv_kernel=4, eps=EPS, layout="split")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=g))
        layer.A_log.copy_(2 * torch.rand(hv, generator=g) - 1)
        layer.dt_bias.copy_(torch.randn(hv, generator=g))
        layer.norm.weight.copy_(1 + 0.2 * torch.randn(dv, generator=g))
    return layer.to(DEVICE, dtype).eval()


@DTYPES
@SHAPES
@IMPLS
def test_op_is_the_layer_run_row_by_row(dtype, heads, impl):
    """A ragged batch (3, 0, 1 and 4 rows) from distinct buffers against GatedDeltaNet.forward one
    row at a time from its LinearState: out_proj of the op's output is the layer's output."""
    layer = make_layer(heads, dtype, seed=5)
    hk, hv, dk, dv = heads
    channels = layer.conv_dim
    g = torch.Generator().manual_seed(6)
    lengths = [3, 0, 1, 4]
    x = torch.randn(sum(lengths), 32, generator=g).to(DEVICE, dtype)
    num_buffers = 2 * len(lengths)
    conv_states = torch.zeros(num_buffers, 3, channels, dtype=dtype, device=DEVICE)
    rec_states = torch.zeros(num_buffers, hv, dk, dv, device=DEVICE)
    starts, state_in, state_out = [0], [], []
    expected_out, expected_states, proj = [], {}, []
    for s, length in enumerate(lengths):  # (the layer runs in inference mode; its inputs too)
        start = starts[-1]
        starts.append(start + length)
        state_in.append(2 * s + 1)  # interleaved, written ones between read ones
        state_out.append(2 * s)
        state = LinearState(conv=(0.5 * torch.randn(channels, 3, generator=g)).to(DEVICE, dtype),
                            recurrent=(0.3 * torch.randn(hv, dk, dv, generator=g)).to(DEVICE))
        conv_states[2 * s + 1] = state.conv.T  # the layer's [C, K-1] as [K-1, C]
        rec_states[2 * s + 1] = state.recurrent
        for t in range(start, start + length):
            row = x[t : t + 1]
            with torch.inference_mode():
                proj.append(torch.cat([layer.in_proj_qkv(row), layer.in_proj_z(row), layer.in_proj_b(row),
                                       layer.in_proj_a(row)], dim=-1))
            out, state = layer(row, state)
            expected_out.append(out)
        if length:
            expected_states[2 * s] = state
    proj = torch.cat(proj)
    before_conv, before_rec = conv_states.clone(), rec_states.clone()
    op, extra, check = op_of(impl, len(lengths), hv)
    with torch.inference_mode():
        out = op(proj, layer.conv1d.weight[:, 0], layer.A_log, layer.dt_bias, layer.norm.weight, conv_states,
                 rec_states, tensor(starts, torch.int32), tensor(state_in), tensor(state_out),
                 num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, eps=EPS, **extra)
        check()
        assert rel_err(layer.out_proj(out), torch.cat(expected_out)) < tolerance(dtype)
    for buffer, state in expected_states.items():
        assert torch.equal(conv_states[buffer], state.conv.T)
        assert rel_err(rec_states[buffer], state.recurrent) < tolerance(dtype)
    untouched = [b for b in range(num_buffers) if b not in expected_states]  # read ones, the empty sequence's
    assert torch.equal(conv_states[untouched], before_conv[untouched])
    assert torch.equal(rec_states[untouched], before_rec[untouched])


@DTYPES
@SHAPES
@IMPLS
def test_rows_alone_and_prefixes_are_the_window_s_bits(dtype, heads, impl):
    """Row invariance and kept states. A window of 4 rows (sequence 0, launched with a 2-row
    sequence and an empty one): each row as a one-row step from the kept state of the row before
    gives the window's output and kept states bit for bit; and rows r0..t run alone end in kept[t]."""
    p = Problem(heads, dtype, seed=2, rows=6, num_buffers=8)
    out, conv, rec, kept_conv, kept_rec = p.run(impl, p.proj, [0, 4, 4, 6], [0, 1, 2], [3, 4, 5], keep=True)
    assert torch.equal(kept_conv[3], conv[3]) and torch.equal(kept_rec[3], rec[3])
    for t in range(4):
        # one row, from the state after row t - 1 placed in buffer 6 (row 0: the window's own buffer 0)
        before_conv, before_rec = p.conv_states.clone(), p.rec_states.clone()
        if t:
            before_conv[6], before_rec[6] = kept_conv[t - 1], kept_rec[t - 1]
        alone = p.run(impl, p.proj[t : t + 1].clone(), [0, 1], [6 if t else 0], [7], conv_states=before_conv,
                      rec_states=before_rec)
        assert torch.equal(alone[0][0], out[t])
        assert torch.equal(alone[1][7], kept_conv[t]) and torch.equal(alone[2][7], kept_rec[t])
        # rows 0..t alone, from the window's initial state
        prefix = p.run(impl, p.proj[: t + 1].clone(), [0, t + 1], [0], [7])
        assert torch.equal(prefix[0], out[: t + 1])
        assert torch.equal(prefix[1][7], kept_conv[t]) and torch.equal(prefix[2][7], kept_rec[t])


@IMPLS
def test_an_empty_sequence_writes_nothing_and_other_buffers_stay_untouched(impl):
    dtype = torch.float32
    p = Problem((2, 4, 16, 8), dtype, seed=3, rows=5, num_buffers=10)
    nan = float("nan")
    conv_states, rec_states = p.conv_states.clone(), p.rec_states.clone()
    conv_states[4:], rec_states[4:] = nan, nan  # the empty sequence's buffers (4 in, 5 out) and unused ones
    kept_conv = torch.full((7, 3, p.channels), nan, dtype=dtype, device=DEVICE)  # 2 rows more than the launch
    kept_rec = torch.full((7, p.hv, p.dk, p.dv), nan, device=DEVICE)
    before_conv, before_rec = conv_states.clone(), rec_states.clone()
    op, extra, check = op_of(impl, 3, p.hv)
    starts = tensor([0, 2, 2, 5])  # int64 this time
    out = op(p.proj, **p.weights, conv_states=conv_states, rec_states=rec_states, seq_starts=starts,
             state_in=tensor([0, 4, 1]), state_out=tensor([2, 5, 3]), kept_conv=kept_conv, kept_rec=kept_rec,
             **p.sizes, **extra)
    check()
    assert out.isfinite().all()
    assert conv_states[[2, 3]].isfinite().all() and rec_states[[2, 3]].isfinite().all()
    assert kept_conv[:5].isfinite().all() and kept_rec[:5].isfinite().all()
    assert kept_conv[5:].isnan().all() and kept_rec[5:].isnan().all()
    assert torch.equal(conv_states[:2], before_conv[:2]) and torch.equal(rec_states[:2], before_rec[:2])
    assert conv_states[4:].isnan().all() and rec_states[4:].isnan().all()


def test_arguments_are_checked():
    p = Problem((2, 4, 16, 8), torch.float32, seed=4, rows=3, num_buffers=4)
    good = dict(proj=p.proj, **p.weights, conv_states=p.conv_states, rec_states=p.rec_states,
                seq_starts=tensor([0, 3], torch.int32), state_in=tensor([0]), state_out=tensor([1]), **p.sizes)

    def raises(match, **changes):
        with pytest.raises(ValueError, match=match):
            gated_delta_step(**(good | changes))

    raises(r"conv_weight .*K = 3", conv_weight=p.weights["conv_weight"][:, :3], conv_states=p.conv_states[:, :2])
    raises("conv_weight", conv_weight=p.weights["conv_weight"][1:])
    raises("proj", proj=p.proj[:, :-1])
    raises("proj", proj=p.proj[0])
    raises("A_log", A_log=p.weights["A_log"][:3])
    raises("dt_bias", dt_bias=p.weights["dt_bias"][None])
    raises("norm_weight", norm_weight=torch.ones(16))
    raises("conv_states", conv_states=p.conv_states[:, :, 1:])
    raises("conv_states", conv_states=p.conv_states.to(torch.bfloat16))
    raises("conv_states", conv_states=p.conv_states.transpose(1, 2).contiguous().transpose(1, 2))
    raises("rec_states", rec_states=p.rec_states.to(torch.bfloat16))
    raises("rec_states", rec_states=p.rec_states[:, :2])
    raises("seq_starts", seq_starts=tensor([[0, 3]]))
    raises("state_in", state_in=tensor([0, 1]))
    raises("state_out", state_out=tensor([1, 2]))
    raises("kept_rec", kept_rec=torch.zeros(2, 4, 16, 8, device=DEVICE))
    raises("kept_conv", kept_conv=torch.zeros(3, 3, p.channels - 1, device=DEVICE))
    raises("num_v_heads", num_k_heads=3)
    raises("arrivals", arrivals=torch.zeros(p.hv - 1, dtype=torch.int32, device=DEVICE))
    raises("arrivals", arrivals=torch.zeros(p.hv, dtype=torch.int64, device=DEVICE))


@pytest.mark.skipif(not (torch.cuda.is_available() and pdl_supported("cuda")), reason="PDL needs a GPU of CC 9.0+")
@DTYPES
def test_dependent_launch_and_early_reads_give_the_same_bits(dtype, monkeypatch):
    import kernels.fused as fused_package

    p = Problem((2, 4, 16, 8), dtype, seed=7, rows=6, num_buffers=8)
    args = (p.proj, [0, 4, 4, 6], [0, 1, 2], [3, 4, 5])
    plain = p.run(KERNEL, *args, keep=True)
    for early in (False, True):
        monkeypatch.setattr(fused_package, "EARLY_READS", early)
        conv, rec = p.conv_states.clone(), p.rec_states.clone()
        kept_conv, kept_rec = torch.empty_like(plain[3]), torch.empty_like(plain[4])
        out = gated_delta_step(p.proj, **p.weights, conv_states=conv, rec_states=rec,
                               seq_starts=tensor(args[1], torch.int32), state_in=tensor(args[2]),
                               state_out=tensor(args[3]), kept_conv=kept_conv, kept_rec=kept_rec, pdl=True,
                               **p.sizes)
        torch.cuda.synchronize()
        for a, b in zip((out, conv, rec, kept_conv, kept_rec), plain):
            assert torch.equal(a, b)
