"""The backward kernels of the fused ``triton`` stack-attention backend: the row deltas,
dK/dV over own and prefix work items (with dq fused in, or not), and dq (see
:mod:`dtree.ops.stack_attention.triton_autograd` for the design).
"""

from __future__ import annotations

from .triton_common import _load_tile, _logits, _own_span, _prefix_span, _q_block, _store_tile, _visible, tl, triton


@triton.jit(do_not_specialize=["T"])
def _delta_kernel(
    O, DO, DELTA, DQ_ACC, stride_ot, stride_oh, stride_dot, stride_doh, stride_dqt, stride_dqh, T,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, ZERO_DQ: tl.constexpr,
):
    """delta[h, r] = sum_d O[r, h, d] * dO[r, h, d] in fp32. Grid (cdiv(T, BLOCK_M), Hq).
    ZERO_DQ: also zero the fp32 dq accumulator ``DQ_ACC [T, Hq, HEAD_DIM]`` of the fused
    backward (its rows are visited here anyway: no memset launch of its own)."""
    head = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    offs_dv = tl.arange(0, BLOCK_DV)
    o = _load_tile(O + head * stride_oh, rows, stride_ot, row_ok, offs_dv, V_DIM, BLOCK_DV)
    do = _load_tile(DO + head * stride_doh, rows, stride_dot, row_ok, offs_dv, V_DIM, BLOCK_DV)
    tl.store(DELTA + head * T + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=row_ok)
    if ZERO_DQ:
        offs_d = tl.arange(0, BLOCK_D)
        _store_tile(DQ_ACC + head * stride_dqh, rows, stride_dqt, row_ok, offs_d,
                    tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), HEAD_DIM)


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, Q, DO, LSE, DELTA, DQ, head, rows, row_ok, cols, col_ok, col_seg_end, is_prefix, dist_t, masked,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh, T, offs_d, offs_dv, qk_scale, sm_scale,
    cap_in, cap_out, slope, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr,
    FUSED_DQ: tl.constexpr,
):
    """dK/dV (transposed: keys x rows) of one row tile of query head ``head``.
    ``col_seg_end`` is 0 for prefix keys, whose mask is only the window. FUSED_DQ: also
    add this tile's dq (ds @ k, scaled) into the fp32 accumulator ``DQ`` with atomics."""
    q = _load_tile(Q + head * stride_qh, rows, stride_qt, row_ok, offs_d, HEAD_DIM, BLOCK_D)
    do = _load_tile(DO + head * stride_doh, rows, stride_dot, row_ok, offs_dv, V_DIM, BLOCK_DV)
    lse = tl.load(LSE + head * T + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + head * T + rows, mask=row_ok, other=0.0)
    s_t, t_t = _logits(tl.dot(k, tl.trans(q), input_precision=DOT_PREC), dist_t, qk_scale, cap_in, cap_out, slope,
                       HAS_SOFTCAP, HAS_ALIBI)
    p_t = tl.math.exp2(s_t - lse[None, :])
    if masked:
        visible = (rows[None, :] >= cols[:, None]) & (rows[None, :] < col_seg_end[:, None])
        # prefix items (col_seg_end 0) are masked only for a window or ALiBi's last tile;
        # the plain kernel keeps the two terms out of its registers
        if FUSED_DQ:
            # dq reads every key column of the tile: columns past the item's keys (k = 0,
            # so p = exp2(-lse) there, which may overflow: inf * 0 in ds @ k) must be 0
            visible = (visible | is_prefix) & col_ok[:, None]
            if HAS_WINDOW:
                visible = visible & row_ok[None, :] & (dist_t < window)
            elif HAS_ALIBI:
                visible = visible & row_ok[None, :]
        elif HAS_WINDOW:
            visible = (visible | (col_seg_end[:, None] == 0)) & row_ok[None, :] & (dist_t < window)
        elif HAS_ALIBI:
            visible = (visible | (col_seg_end[:, None] == 0)) & row_ok[None, :]
        p_t = tl.where(visible, p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    ds_t = p_t * (dp_t - delta[None, :])
    if HAS_SOFTCAP:
        ds_t = ds_t * (1.0 - t_t * t_t)
    ds_t = ds_t.to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PREC)
    if FUSED_DQ:
        dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PREC)
        dq_ptrs = DQ + head * stride_dqh + rows.to(tl.int64)[:, None] * stride_dqt + offs_d[None, :]
        tl.atomic_add(dq_ptrs, dq * sm_scale, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["T", "window", "ITEMS", "SEG_START", "SEG_END"])
def _dkdv_kernel(
    Q, K, V, SK, SV, DO, LSE, DELTA, DK, DV, GK, GV, DQ, ITEMS, SEG_START, SEG_END, ALIBI_SLOPES, TICKETS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_skt, stride_skh, stride_svt, stride_svh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_gkt, stride_gkh, stride_gvt,
    stride_gvh, stride_dqt, stride_dqh,
    T, qk_scale, sm_scale, cap_in, cap_out, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, DETERMINISTIC: tl.constexpr,
    FUSED_DQ: tl.constexpr, STACK_GRAD: tl.constexpr,
):
    """Grid (work items, kv heads). ITEMS[i] = (kind, c0, c1, q0, q1, kshift, plen, turn):
    keys ``[c0, c1)`` (at most BLOCK_N; own rows of ``K, V`` or stack slots of ``SK, SV``
    at depths ``c + kshift``, inside one BLOCK_N cell of the stack) and the query rows
    ``[q0, q1)`` that may see them (of a run with ``plen`` prefix slots). Own items store
    dK/dV into ``DK, DV``; prefix items add them into ``GK, GV`` with atomics. dK/dV
    are accumulated transposed (keys x rows), as in FlashAttention-2.

    FUSED_DQ (the fused backward): every row tile also adds its dq = ds @ k into the
    fp32 accumulator ``DQ [T, Hq, HEAD_DIM]`` (zeroed by the delta kernel) with float
    atomics, as FlashAttention-2 does: 5 matmuls per (row, key) pair in one kernel
    instead of the split backward's 4 here and 3 in the dq kernel, whose QK^T and
    dO V^T are this kernel's again. Every tile with fewer than BLOCK_N keys is masked
    then (see :func:`_dkdv_tile`). Without STACK_GRAD (a stack without gradient
    buffers) the prefix items run only for their dq.

    DETERMINISTIC: the prefix items of one stack cell add one at a time, in their
    ``turn`` (0, 1, ... in work-table order): each waits until the cell's ticket in
    ``TICKETS`` ([cells, kv heads] int32, zero at launch) equals its turn, adds, and
    passes the ticket on, so every slot sums its terms in the table's order: bitwise
    reproducible. No deadlock: turns follow the program ids and blocks start in
    program-id order, so the item a block waits for has started (FlashAttention-2/3's
    deterministic backward relies on the same order)."""
    item = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    kind = tl.load(ITEMS + 8 * item)
    c0 = tl.load(ITEMS + 8 * item + 1)
    c1 = tl.load(ITEMS + 8 * item + 2)
    q0 = tl.load(ITEMS + 8 * item + 3)
    q1 = tl.load(ITEMS + 8 * item + 4)
    kshift = tl.load(ITEMS + 8 * item + 5)
    plen = tl.load(ITEMS + 8 * item + 6)
    is_prefix = kind == 1
    is_own = kind == 0

    cols = c0 + tl.arange(0, BLOCK_N)
    col_ok = cols < c1
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # a select of base and stride rather than an if/else around two loads: one copy of
    # the load keeps the tile's registers down
    k_base = tl.where(is_prefix, SK + kv_head * stride_skh, K + kv_head * stride_kh)
    v_base = tl.where(is_prefix, SV + kv_head * stride_svh, V + kv_head * stride_vh)
    k = _load_tile(k_base, cols, tl.where(is_prefix, stride_skt, stride_kt), col_ok, offs_d, HEAD_DIM, BLOCK_D)
    v = _load_tile(v_base, cols, tl.where(is_prefix, stride_svt, stride_vt), col_ok, offs_dv, V_DIM, BLOCK_DV)
    # own key c is seen by rows [c, seg_end[c]); 0 for prefix items and columns past c1
    col_seg_end = tl.load(SEG_END + cols, mask=col_ok & is_own, other=0)
    kpos = cols + kshift  # own items: kshift = 0 and positions are rows

    # Row tiles start on the grid q0 + j * BLOCK_M (q0 = c0 for own items). A tile
    # starting at s is unmasked when s >= c1 - 1 (every row is at or after every key),
    # s + BLOCK_M <= seg_end[c0] (every row is in the segment of every key) and, with
    # a window, s + BLOCK_M <= c0 + window: the tiles in [fa, fb). Own rows past
    # c1 - 1 + window see none of the keys. Prefix items see every row: [fa, fb) =
    # [q0, q1), and their padded rows past q1 read q = dO = lse = delta = 0, so
    # p = exp2(-slope * dist) <= 1 there (dist > 0) and both products below vanish;
    # with ALiBi the tile holding q1 is masked anyway, against negative slopes.
    # Columns past c1 read k = v = 0; whatever they accumulate stays in their own rows
    # of dk/dv, which are never stored.
    se_min = tl.load(SEG_END + c0, mask=is_own, other=0)
    fb_end = se_min
    if HAS_WINDOW:
        q1 = tl.where(is_own, tl.minimum(q1, c1 - 1 + window), q1)
        fb_end = tl.minimum(se_min, c0 + window)
    fa = tl.where(is_prefix, q0, tl.minimum(c0 + (c1 - 1 - c0 + BLOCK_M - 1) // BLOCK_M * BLOCK_M, q1))
    fb = tl.where(is_prefix, q1, tl.maximum(fa, c0 + (fb_end - c0) // BLOCK_M * BLOCK_M))
    k_first = c0 + kshift
    k_last = c1 - 1 + kshift
    partial = c1 - c0 < BLOCK_N  # fused: masked tiles (unused otherwise)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(ALIBI_SLOPES + head)
        for start in range(q0, q1, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < q1
            row_seg_start = tl.load(SEG_START + rows, mask=row_ok & is_prefix, other=0)
            qpos = tl.where(is_prefix, plen + rows - row_seg_start, rows)
            dist_t = qpos[None, :] - kpos[:, None]
            masked = (start < fa) | (start >= fb)
            if FUSED_DQ:
                masked = masked | partial
            if HAS_ALIBI:
                masked = masked | (start + BLOCK_M > q1)
            if HAS_WINDOW:
                # a run's rows restart at depth plen in every segment, so bound each tile
                q_lo = tl.min(tl.where(row_ok, qpos, 1 << 30), 0)
                q_hi = tl.max(tl.where(row_ok, qpos, -(1 << 30)), 0)
                masked = masked | (q_hi - k_first >= window)
                if q_lo - k_last < window:  # some row of the tile sees some key
                    dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, DQ, head, rows, row_ok, cols, col_ok,
                                        col_seg_end, is_prefix, dist_t, masked, stride_qt, stride_qh, stride_dot,
                                        stride_doh, stride_dqt, stride_dqh, T, offs_d, offs_dv, qk_scale, sm_scale,
                                        cap_in, cap_out, slope, window, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV,
                                        DOT_PREC, HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW, FUSED_DQ)
            else:
                dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, DQ, head, rows, row_ok, cols, col_ok, col_seg_end,
                                    is_prefix, dist_t, masked, stride_qt, stride_qh, stride_dot, stride_doh,
                                    stride_dqt, stride_dqh, T, offs_d, offs_dv, qk_scale, sm_scale, cap_in, cap_out,
                                    slope, window, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV, DOT_PREC, HAS_SOFTCAP,
                                    HAS_ALIBI, HAS_WINDOW, FUSED_DQ)
    dk = dk * sm_scale

    if is_prefix:
        if STACK_GRAD:
            _add_prefix_grads(GK, GV, TICKETS, ITEMS, item, c0, cols, col_ok, kv_head, offs_d, offs_dv, dk, dv,
                              stride_gkt, stride_gkh, stride_gvt, stride_gvh, HEAD_DIM, V_DIM, BLOCK_N, DETERMINISTIC)
    else:
        _store_tile(DK + kv_head * stride_dkh, cols, stride_dkt, col_ok, offs_d, dk, HEAD_DIM)
        _store_tile(DV + kv_head * stride_dvh, cols, stride_dvt, col_ok, offs_dv, dv, V_DIM)


@triton.jit
def _add_prefix_grads(
    GK, GV, TICKETS, ITEMS, item, c0, cols, col_ok, kv_head, offs_d, offs_dv, dk, dv,
    stride_gkt, stride_gkh, stride_gvt, stride_gvh,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DETERMINISTIC: tl.constexpr,
):
    """Add a prefix item's dK/dV into the stack's fp32 gradients (see :func:`_dkdv_kernel`)."""
    # Other runs of this call, and later calls' descendants, add into the same slots.
    gk_offs = cols.to(tl.int64)[:, None] * stride_gkt + kv_head * stride_gkh + offs_d[None, :]
    gv_offs = cols.to(tl.int64)[:, None] * stride_gvt + kv_head * stride_gvh + offs_dv[None, :]
    gk_mask = col_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    gv_mask = col_ok[:, None] & (offs_dv < V_DIM)[None, :]
    if DETERMINISTIC:  # wait for this item's turn among the prefix items of its stack cell
        ticket = TICKETS + (c0 // BLOCK_N) * tl.num_programs(1) + kv_head
        turn = tl.load(ITEMS + 8 * item + 7)
        while tl.atomic_cas(ticket, turn, turn, sem="acquire") != turn:
            pass
    tl.atomic_add(GK + gk_offs, dk.to(GK.dtype.element_ty), mask=gk_mask, sem="relaxed")
    tl.atomic_add(GV + gv_offs, dv.to(GV.dtype.element_ty), mask=gv_mask, sem="relaxed")
    if DETERMINISTIC:
        tl.debug_barrier()  # every thread's adds are issued before the ticket moves on
        tl.atomic_xchg(ticket, turn + 1, sem="release")


@triton.jit
def _dq_inner(
    dq, q, do, lse, delta, K, V, stride_kt, stride_vt, kv_lo, kv_hi, full_lo, full_hi, rows, row_seg_start, qpos,
    kshift, offs_d, offs_dv, qk_scale, cap_in, cap_out, slope, window,
    OWN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """dQ (unscaled) over keys ``[kv_lo, kv_hi)``, tiles as :func:`.triton_forward._fwd_inner`. Masked
    probabilities are replaced by 0 after exp2, which also drops an overflow from a
    zero-filled column (ds * k would be inf * 0)."""
    for start in range(kv_lo, kv_hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_hi
        k = _load_tile(K, cols, stride_kt, col_ok, offs_d, HEAD_DIM, BLOCK_D)
        v = _load_tile(V, cols, stride_vt, col_ok, offs_dv, V_DIM, BLOCK_DV)
        dist = qpos[:, None] - (cols + kshift)[None, :]
        s, t = _logits(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), dist, qk_scale, cap_in, cap_out, slope,
                       HAS_SOFTCAP, HAS_ALIBI)
        p = tl.math.exp2(s - lse[:, None])
        if (start < full_lo) | (start + BLOCK_N > full_hi):
            p = tl.where(_visible(cols, col_ok, rows, row_seg_start, dist, window, OWN, HAS_WINDOW), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit(do_not_specialize=["T", "window", "QBLOCKS", "RANGE_LO", "RANGE_HI", "SEG_START"])
def _dq_kernel(
    Q, K, V, SK, SV, O, DO, LSE, DELTA, DQ, QBLOCKS, RANGE_LO, RANGE_HI, SEG_START, ALIBI_SLOPES,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_skt, stride_skh, stride_svt, stride_svh,
    stride_ot, stride_oh, stride_dot, stride_doh, stride_dqt, stride_dqh,
    T, qk_scale, sm_scale, cap_in, cap_out, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """Grid (q blocks, q heads), same work table and key tiles as :func:`.triton_forward._fwd_kernel`.
    Also stores ``DELTA`` = rowsum(O * dO) of its rows, which the dK/dV kernel (launched
    after it) reads: no launch of its own. Sinks need nothing here: they are in ``LSE``."""
    blk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    r0, r1, g0, g1, plen, ss_min, ss_max, q_min, q_max = _q_block(QBLOCKS, SEG_START, blk)

    rows = r0 + tl.arange(0, BLOCK_M)
    row_ok = rows < r1
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(Q + head * stride_qh, rows, stride_qt, row_ok, offs_d, HEAD_DIM, BLOCK_D)
    do = _load_tile(DO + head * stride_doh, rows, stride_dot, row_ok, offs_dv, V_DIM, BLOCK_DV)
    lse = tl.load(LSE + head * T + rows, mask=row_ok, other=0.0)
    o = _load_tile(O + head * stride_oh, rows, stride_ot, row_ok, offs_dv, V_DIM, BLOCK_DV)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + head * T + rows, delta, mask=row_ok)
    row_seg_start = tl.load(SEG_START + rows, mask=row_ok, other=0)
    qpos = plen + rows - row_seg_start
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI_SLOPES + head)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    SKh = SK + kv_head * stride_skh
    SVh = SV + kv_head * stride_svh
    depth = g0 * 0
    for g in range(g0, g1):
        lo = tl.load(RANGE_LO + g)
        hi = tl.load(RANGE_HI + g)
        first, full = _prefix_span(lo, hi, depth, q_min, q_max, window, HAS_WINDOW)
        dq = _dq_inner(dq, q, do, lse, delta, SKh, SVh, stride_skt, stride_svt, first, hi, full, hi, rows,
                       row_seg_start, qpos, depth - lo, offs_d, offs_dv, qk_scale, cap_in, cap_out, slope, window,
                       False, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV, BLOCK_N, DOT_PREC, HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW)
        depth += hi - lo
    first, full = _own_span(ss_min, ss_max, r0, r1, window, HAS_WINDOW)
    dq = _dq_inner(dq, q, do, lse, delta, K + kv_head * stride_kh, V + kv_head * stride_vh, stride_kt, stride_vt,
                   first, r1, full, r0 + 1, rows, row_seg_start, rows, 0, offs_d, offs_dv, qk_scale, cap_in, cap_out,
                   slope, window, True, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV, BLOCK_N, DOT_PREC, HAS_SOFTCAP, HAS_ALIBI,
                   HAS_WINDOW)
    _store_tile(DQ + head * stride_dqh, rows, stride_dqt, row_ok, offs_d, dq * sm_scale, HEAD_DIM)
