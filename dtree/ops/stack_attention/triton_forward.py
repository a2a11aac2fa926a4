"""The forward kernel of the fused ``triton`` stack-attention backend (one program per
query block and head; see :mod:`dtree.ops.stack_attention.triton_autograd` for the
design and :mod:`.triton_common` for the conventions).
"""

from __future__ import annotations

from .triton_common import _load_tile, _logits, _own_span, _prefix_span, _q_block, _store_tile, _visible, tl, triton


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, K, V, stride_kt, stride_vt, kv_lo, kv_hi, full_lo, full_hi, rows, row_seg_start, qpos, kshift,
    offs_d, offs_dv, qk_scale, cap_in, cap_out, slope, window,
    OWN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Online-softmax update over keys ``[kv_lo, kv_hi)`` of ``K, V`` (already offset to
    the kv head), at positions ``cols + kshift``. Key tiles inside ``[full_lo, full_hi)``
    are seen whole by every row and skip the mask."""
    for start in range(kv_lo, kv_hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_hi
        k = _load_tile(K, cols, stride_kt, col_ok, offs_d, HEAD_DIM, BLOCK_D)
        dist = qpos[:, None] - (cols + kshift)[None, :]
        s, _ = _logits(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), dist, qk_scale, cap_in, cap_out, slope,
                       HAS_SOFTCAP, HAS_ALIBI)
        if (start < full_lo) | (start + BLOCK_N > full_hi):
            s = tl.where(_visible(cols, col_ok, rows, row_seg_start, dist, window, OWN, HAS_WINDOW), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(V, cols, stride_vt, col_ok, offs_dv, V_DIM, BLOCK_DV)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["T", "window", "QBLOCKS", "RANGE_LO", "RANGE_HI", "SEG_START"])
def _fwd_kernel(
    Q, K, V, SK, SV, O, LSE, QBLOCKS, RANGE_LO, RANGE_HI, SEG_START, SINK_LOGITS, ALIBI_SLOPES,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_skt, stride_skh, stride_svt, stride_svh,
    stride_ot, stride_oh,
    T, qk_scale, cap_in, cap_out, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """Grid (q blocks, q heads). QBLOCKS[b] = (r0, r1, g0, g1, plen): rows ``[r0, r1)`` of
    one run and its prefix ranges ``RANGE_LO/HI[g0:g1]`` of ``plen`` slots."""
    blk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    r0, r1, g0, g1, plen, ss_min, ss_max, q_min, q_max = _q_block(QBLOCKS, SEG_START, blk)

    rows = r0 + tl.arange(0, BLOCK_M)
    row_ok = rows < r1
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(Q + head * stride_qh, rows, stride_qt, row_ok, offs_d, HEAD_DIM, BLOCK_D)
    row_seg_start = tl.load(SEG_START + rows, mask=row_ok, other=0)
    qpos = plen + rows - row_seg_start
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI_SLOPES + head)

    # Finite start for the running max: a row that sees nothing in the first tiles
    # (a later segment of a packed tile) keeps alpha = exp2(0) and p = exp2(-inf) = 0
    # instead of exp2(-inf - -inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    SKh = SK + kv_head * stride_skh
    SVh = SV + kv_head * stride_svh
    depth = g0 * 0
    for g in range(g0, g1):
        lo = tl.load(RANGE_LO + g)
        hi = tl.load(RANGE_HI + g)
        first, full = _prefix_span(lo, hi, depth, q_min, q_max, window, HAS_WINDOW)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, SKh, SVh, stride_skt, stride_svt, first, hi, full, hi, rows,
                                   row_seg_start, qpos, depth - lo, offs_d, offs_dv, qk_scale, cap_in, cap_out, slope,
                                   window, False, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV, BLOCK_N, DOT_PREC, HAS_SOFTCAP,
                                   HAS_ALIBI, HAS_WINDOW)
        depth += hi - lo
    first, full = _own_span(ss_min, ss_max, r0, r1, window, HAS_WINDOW)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K + kv_head * stride_kh, V + kv_head * stride_vh, stride_kt,
                               stride_vt, first, r1, full, r0 + 1, rows, row_seg_start, rows, 0, offs_d, offs_dv,
                               qk_scale, cap_in, cap_out, slope, window, True, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV,
                               BLOCK_N, DOT_PREC, HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW)
    if HAS_SINKS:  # one more term of the denominator, with no value
        sink = tl.load(SINK_LOGITS + head)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new

    # every valid row sees at least its own key, so l_i > 0 there
    _store_tile(O + head * stride_oh, rows, stride_ot, row_ok, offs_dv, acc / l_i[:, None], V_DIM)
    tl.store(LSE + head * T + rows, m_i + tl.math.log2(l_i), mask=row_ok)
