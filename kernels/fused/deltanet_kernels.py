"""Triton kernel of kernels.fused.deltanet (imported only when a kernel runs)."""

import triton
import triton.language as tl


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _sigmoid_rounded(b):
    """sigmoid(b) in b's dtype (float32 math, one rounding, as torch's b.sigmoid()), as float32."""
    return (1.0 / (1.0 + tl.exp(-b.to(tl.float32)))).to(b.dtype).to(tl.float32)


@triton.jit
def _softplus(x):
    """torch's softplus (linear above 20), its log1p written out: the interpreter has no libdevice."""
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    # log1p(u) = log(w) * u / (w - 1): a few ulps also where 1 + u rounds away most of u
    log1p = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _conv_weights(w_ptr, c, ok, stride_w0, stride_w1):
    """The 4 taps (oldest input's first) of channels c of the conv kernel [C, 4], float32."""
    base = w_ptr + c * stride_w0
    return (tl.load(base, mask=ok, other=0.0).to(tl.float32),
            tl.load(base + stride_w1, mask=ok, other=0.0).to(tl.float32),
            tl.load(base + 2 * stride_w1, mask=ok, other=0.0).to(tl.float32),
            tl.load(base + 3 * stride_w1, mask=ok, other=0.0).to(tl.float32))


@triton.jit
def _history(base, c, ok, C: tl.constexpr):
    """Channels c of a conv state [3, C]: the 3 previous inputs, oldest first (model dtype)."""
    return (tl.load(base + c, mask=ok, other=0.0), tl.load(base + C + c, mask=ok, other=0.0),
            tl.load(base + 2 * C + c, mask=ok, other=0.0))


@triton.jit
def _store_history(base, c, ok, h0, h1, h2, C: tl.constexpr):
    tl.store(base + c, h0, mask=ok)
    tl.store(base + C + c, h1, mask=ok)
    tl.store(base + 2 * C + c, h2, mask=ok)


@triton.jit
def _conv_silu(h0, h1, h2, x, w0, w1, w2, w3):
    """silu(conv) of one row's channels, float32: the float32 sum and the silu each rounded to the
    model dtype, as the reference does."""
    acc = h0.to(tl.float32) * w0 + h1.to(tl.float32) * w1 + h2.to(tl.float32) * w2 + x.to(tl.float32) * w3
    acc = acc.to(x.dtype).to(tl.float32)
    return _silu(acc).to(x.dtype).to(tl.float32)


@triton.jit
def _gated_norm(o, z, norm_w, eps, DV: tl.constexpr, dtype: tl.constexpr):
    """rmsnorm(o) * norm_w * silu(z) over a head's DV values (o and z float32; masked lanes zero),
    each product rounded to the model dtype as the reference does."""
    y = (o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)).to(dtype).to(tl.float32)
    y = (norm_w * y).to(dtype).to(tl.float32)
    return (y * _silu(z)).to(dtype)


@triton.jit
def gated_delta_kernel(
    proj_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr, conv_ptr, rec_ptr, starts_ptr, in_ptr, dst_ptr, out_ptr,
    kept_conv_ptr, kept_rec_ptr, arrivals_ptr,
    stride_proj, stride_w0, stride_w1, stride_conv, stride_rec, stride_kept_conv, stride_kept_rec, q_scale,
    qk_eps, eps,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, V_SPLITS: tl.constexpr, KEEP_CONV: tl.constexpr, KEEP_REC: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):
    """Program (s, h, part): value head h of sequence s, over all its rows, its [DK, BLOCK_V] slice
    of the state (value columns part * BLOCK_V ...) in registers. With V_SPLITS > 1 a program
    stores its slice of o (model dtype) and counts itself in at arrivals[s, h]; the head's last
    program to arrive normalises the whole rows (rmsnorm over DV needs every slice) and resets
    the count. No program waits for another, so any order of execution is correct."""
    if PDL and not EARLY:  # wait for the predecessor kernel before touching anything it may write or read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    GROUP = HV // HK
    KEY_DIM = HK * DK
    C = 2 * KEY_DIM + HV * DV  # conv channels q|k|v; proj's z, b, a columns follow them
    s = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    kh = h // GROUP  # the key head of this value head
    # writes its key head's q/k conv inputs; the other programs of the group only read them
    owner = (h % GROUP == 0) & (part == 0)
    i = tl.arange(0, BLOCK_K)
    i_ok = i < DK
    j = part * BLOCK_V + tl.arange(0, BLOCK_V)
    j_ok = j < DV
    cq = kh * DK + i  # [BLOCK_K] q channels
    ck = KEY_DIM + kh * DK + i  # [BLOCK_K] k channels
    cv = 2 * KEY_DIM + h * DV + j  # [BLOCK_V] v channels
    rec_head = h * DK * DV + i[:, None] * DV + j[None, :]  # [BLOCK_K, BLOCK_V] offsets of the head's state
    ij_ok = i_ok[:, None] & j_ok[None, :]
    # (EARLY: the sequence's bounds and buffers are the host's inputs, the weights are weights, and the
    # states were written by kernels further back, never the one just before: read before the wait.)
    # The row count comes from memory, not from the launch: every row runs the same loop body.
    r0 = tl.load(starts_ptr + s).to(tl.int64)
    r1 = tl.load(starts_ptr + s + 1).to(tl.int64)
    live = r1 > r0  # an empty sequence reads no state and writes nothing
    src = tl.load(in_ptr + s, mask=live, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + s, mask=live, other=0).to(tl.int64)
    wq0, wq1, wq2, wq3 = _conv_weights(conv_w_ptr, cq, i_ok, stride_w0, stride_w1)
    wk0, wk1, wk2, wk3 = _conv_weights(conv_w_ptr, ck, i_ok, stride_w0, stride_w1)
    wv0, wv1, wv2, wv3 = _conv_weights(conv_w_ptr, cv, j_ok, stride_w0, stride_w1)
    decay_rate = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    norm_w = tl.load(norm_w_ptr + j, mask=j_ok, other=0.0).to(tl.float32)  # [BLOCK_V]
    conv_in = conv_ptr + src * stride_conv
    q0, q1, q2 = _history(conv_in, cq, i_ok & live, C)  # [BLOCK_K] each, model dtype
    k0, k1, k2 = _history(conv_in, ck, i_ok & live, C)
    v0, v1, v2 = _history(conv_in, cv, j_ok & live, C)  # [BLOCK_V] each
    state = tl.load(rec_ptr + src * stride_rec + rec_head, mask=ij_ok & live, other=0.0)  # [BLOCK_K, BLOCK_V] fp32
    if PDL and EARLY:  # proj comes from the kernel just before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if live:
        for t in range(r0, r1):
            row = proj_ptr + t * stride_proj
            xq = tl.load(row + cq, mask=i_ok, other=0.0)  # [BLOCK_K] model dtype
            xk = tl.load(row + ck, mask=i_ok, other=0.0)
            xv = tl.load(row + cv, mask=j_ok, other=0.0)  # [BLOCK_V]
            b = tl.load(row + C + HV * DV + h)
            a = tl.load(row + C + HV * DV + HV + h).to(tl.float32)
            dtype = xq.dtype
            # Masked lanes (past DK or DV) stay exact zeros throughout: they add nothing to the sums.
            q = _conv_silu(q0, q1, q2, xq, wq0, wq1, wq2, wq3)
            k = _conv_silu(k0, k1, k2, xk, wk0, wk1, wk2, wk3)
            v = _conv_silu(v0, v1, v2, xv, wv0, wv1, wv2, wv3)
            q0, q1, q2 = q1, q2, xq
            k0, k1, k2 = k1, k2, xk
            v0, v1, v2 = v1, v2, xv
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + qk_eps) * q_scale
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + qk_eps)
            beta = _sigmoid_rounded(b)
            g = decay_rate * _softplus(a + dt_bias)
            # The state products as elementwise multiplies and sums: IEEE float32, no tf32 dot.
            state = state * tl.exp(g)
            recalled = tl.sum(state * k[:, None], axis=0)  # [BLOCK_V]
            delta = beta * (v - recalled)
            state = state + k[:, None] * delta[None, :]
            o = tl.sum(state * q[:, None], axis=0).to(dtype)  # [BLOCK_V]
            if V_SPLITS == 1:
                z = tl.load(row + C + h * DV + j, mask=j_ok, other=0.0).to(tl.float32)
                tl.store(out_ptr + t * (HV * DV) + h * DV + j, _gated_norm(o.to(tl.float32), z, norm_w, eps, DV, dtype),
                         mask=j_ok)
            else:  # the slice of o, normalised below by the head's last program
                tl.store(out_ptr + t * (HV * DV) + h * DV + j, o, mask=j_ok)
            if KEEP_CONV:  # the conv state after row t
                kept = kept_conv_ptr + t * stride_kept_conv
                _store_history(kept, cq, i_ok & owner, q0, q1, q2, C)
                _store_history(kept, ck, i_ok & owner, k0, k1, k2, C)
                _store_history(kept, cv, j_ok, v0, v1, v2, C)
            if KEEP_REC:
                tl.store(kept_rec_ptr + t * stride_kept_rec + rec_head, state, mask=ij_ok)
        conv_out = conv_ptr + dst * stride_conv
        _store_history(conv_out, cq, i_ok & owner, q0, q1, q2, C)
        _store_history(conv_out, ck, i_ok & owner, k0, k1, k2, C)
        _store_history(conv_out, cv, j_ok, v0, v1, v2, C)
        tl.store(rec_ptr + dst * stride_rec + rec_head, state, mask=ij_ok)
        if V_SPLITS > 1:
            # (acq_rel at gpu scope: this program's stores of o are visible to the last one to
            # arrive, and the last one sees everyone's)
            arrived = tl.atomic_add(arrivals_ptr + s * HV + h, 1, sem="acq_rel")
            if arrived == V_SPLITS - 1:
                tl.store(arrivals_ptr + s * HV + h, 0)  # (the next launch counts from zero)
                jj = tl.arange(0, BLOCK_V * V_SPLITS)
                jj_ok = jj < DV
                w = tl.load(norm_w_ptr + jj, mask=jj_ok, other=0.0).to(tl.float32)
                for t in range(r0, r1):
                    at = out_ptr + t * (HV * DV) + h * DV + jj
                    o = tl.load(at, mask=jj_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
                    z = tl.load(proj_ptr + t * stride_proj + C + h * DV + jj, mask=jj_ok, other=0.0).to(tl.float32)
                    tl.store(at, _gated_norm(o, z, w, eps, DV, out_ptr.dtype.element_ty), mask=jj_ok)
