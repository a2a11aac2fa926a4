"""flash-attn-4's compiled varlen kernels, launched without its per-call Python.

flash-attn-4's ``_flash_attn_fwd`` / ``_flash_attn_bwd`` (4.0.0b36, pinned by the
``flash`` extra) spend ~0.35-0.4 ms of CPU per call before they launch anything:
argument checks, tile heuristics, the compile key, scratch allocation (H100,
``benchmarks/results/h100/kernel_session3/attention_host_*``). The ``flash-attn``
backend makes one forward and one backward call per region per layer, a dozen regions
per call on agentic trees, so this Python is most of its host cost.

A *call class* (forward or backward; causal or not; ragged (``seqused``) or not;
deterministic; dtype, heads, head dims, softmax scale, device, broadcast (stride-0)
modes; more than 256 sequences or not) reaches the same compiled kernels on every call once the max lengths are
bucketed (:func:`bucket_len`: flash-attn-4 keys single-block variants on them). So the
first call of a class runs the interface while its compile caches record what it
launches (:func:`recording`), and later calls launch the recorded kernels directly,
with the argument lists rebuilt here (:func:`_forward_steps`, :func:`_backward_steps`:
the interface's SM90 varlen path, scratch shapes and initial values included).

Checked, not assumed: the lists rebuilt for the recorded call are compared with the
recorded ones (the caller's tensors by address, scratch tensors by shape, strides and
dtype, every other argument by value). A class whose lists differ keeps calling the
interface: another architecture (Blackwell's kernels take more arguments), more than
256 sequences (the interface adds scheduler tables computed from ``cu_seqlens``), or
another flash-attn-4 version. The kernels check their arguments' shapes and dtypes at
every call (TVM FFI).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Flash4Calls", "bucket_len"]

# The compile caches whose launches a recording call logs (those present in the
# installed version: the last two run only above 256 sequences).
_CACHED = ("_flash_attn_fwd", "_flash_attn_bwd", "_bwd_preprocess", "_bwd_postprocess_convert",
           "_compute_tile_cumsum", "_compute_blocks_to_batch")
_MANY_SEQS = 256  # flash-attn-4's BIN_BATCH_SEARCH_THRESH: more sequences take scheduler tables
_MISSING = object()


def bucket_len(n: int) -> int:
    """``max_seqlen`` to pass for a true maximum ``n``: the next power of two, at least
    256. flash-attn-4 compiles separate single-block kernels when the max lengths fit
    one tile (forward: max_q x q heads per kv head <= 128; backward: max_q <= its 64-
    or 80-row tile, max_k <= 128), so fresh forests whose small regions cross those
    lines compiled new kernels mid-training; on Hopper the lengths enter nothing else
    but grid bounds and (deterministic) semaphore counts, which a larger value only
    pads."""
    return max(256, 1 << max(0, int(n) - 1).bit_length())


class _Recorder:
    """Stands in for a flash-attn-4 compile cache while one call runs: lookups return
    the compiled function wrapped so that each launch is logged as ``(fn, args)``."""

    def __init__(self, cache, log: list):
        self.cache, self.log = cache, log

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __setitem__(self, key, fn) -> None:
        self.cache[key] = fn

    def __getitem__(self, key):
        fn = self.cache[key]

        def launch(*args):
            self.log.append((fn, args))
            return fn(*args)

        return launch


_RECORD_LOCK = threading.Lock()


@contextlib.contextmanager
def recording(interface, log: list):
    """Log every compiled launch of ``interface`` (flash_attn.cute.interface) inside."""
    with _RECORD_LOCK:
        swapped = []
        try:
            for name in _CACHED:
                fn = getattr(interface, name, None)
                if fn is not None and hasattr(fn, "compile_cache"):
                    swapped.append((fn, fn.compile_cache))
                    fn.compile_cache = _Recorder(fn.compile_cache, log)
            yield
        finally:
            for fn, cache in swapped:
                fn.compile_cache = cache


@dataclass
class _Steps:
    """Rebuilt argument lists of one call, one per launch, and the ids of the tensors
    allocated for it (scratch: compared by layout, not by address)."""

    args: list[list]
    scratch: set[int]


def _same(recorded: Any, rebuilt: Any, scratch: set[int]) -> bool:
    if isinstance(recorded, torch.Tensor) or isinstance(rebuilt, torch.Tensor):
        if not (isinstance(recorded, torch.Tensor) and isinstance(rebuilt, torch.Tensor)):
            return False
        layout = (recorded.shape, recorded.stride(), recorded.dtype, recorded.device)
        if layout != (rebuilt.shape, rebuilt.stride(), rebuilt.dtype, rebuilt.device):
            return False
        return id(rebuilt) in scratch or recorded.data_ptr() == rebuilt.data_ptr()
    if isinstance(recorded, (tuple, list)) and isinstance(rebuilt, (tuple, list)):
        return (type(recorded) is type(rebuilt) and len(recorded) == len(rebuilt)
                and all(_same(a, b, scratch) for a, b in zip(recorded, rebuilt)))
    return type(recorded) is type(rebuilt) and recorded == rebuilt


def _matching_kernels(log: list, steps: _Steps) -> tuple | None:
    """The recorded compiled functions, if ``steps`` rebuilds every recorded launch."""
    if len(log) != len(steps.args):
        return None
    for (_, recorded), rebuilt in zip(log, steps.args):
        if not _same(list(recorded), rebuilt, steps.scratch):
            return None
    return tuple(fn for fn, _ in log)


class Flash4Calls:
    """flash-attn-4's varlen forward and backward for the region kernel, replayed per
    call class (see the module docstring). ``interface``: ``flash_attn.cute.interface``.

    ``tables``: int32 ``cu_q``, ``cu_k`` [B+1] and, for ragged calls, ``used_q``,
    ``used_k`` [B], each 16-byte aligned (the interface's backward copies misaligned
    ones)."""

    def __init__(self, interface):
        self.fi = interface
        self.kernels: dict = {}  # call class -> recorded compiled functions, or None: the interface
        self.hopper = None  # whether the rebuilt lists apply (SM90), decided at the first call

    def _class(self, kind: str, tensors: tuple, tables: dict, scale: float, *flags) -> tuple:
        """``tensors``: q, k, v (and dout); their stride-0 (broadcast) modes are compiled in."""
        q, k, v = tensors[:3]
        many = tables["cu_q"].shape[0] - 1 > _MANY_SEQS
        broadcast = tuple(0 in x.stride() for x in tensors)
        return (kind, q.dtype, q.device, q.shape[1], k.shape[1], q.shape[2], v.shape[2], float(scale),
                "used_q" in tables, many, broadcast, *flags)

    def _run(self, key: tuple, interface_call, rebuild) -> None:
        if self.hopper is None:
            self.hopper = self.fi._get_device_arch() // 10 == 9
        kernels = self.kernels.get(key, _MISSING) if self.hopper else None
        if kernels is _MISSING:
            log: list = []
            with recording(self.fi, log):
                interface_call()
            self.kernels[key] = _matching_kernels(log, rebuild())
        elif kernels is None:
            interface_call()
        else:
            for fn, args in zip(kernels, rebuild().args):
                fn(*args)

    def forward(self, q, k, v, tables: dict, max_q: int, max_k: int, scale: float, causal: bool, out, lse) -> None:
        """Writes ``out`` [T, Hq, Dv] and the natural log-sum-exp ``lse`` [Hq, T]."""

        def interface_call():
            self.fi._flash_attn_fwd(
                q, k, v, softmax_scale=scale, causal=causal, out=out, lse=lse, cu_seqlens_q=tables["cu_q"],
                cu_seqlens_k=tables["cu_k"], seqused_q=tables.get("used_q"), seqused_k=tables.get("used_k"),
                max_seqlen_q=max_q, max_seqlen_k=max_k,
            )

        key = self._class("fwd", (q, k, v), tables, scale, causal)
        self._run(key, interface_call, lambda: _forward_steps(self.fi, q, k, v, out, lse, tables, scale))

    def backward(self, q, k, v, out, dout, lse, tables: dict, max_q: int, max_k: int, scale: float, causal: bool,
                 deterministic: bool, dq, dk, dv) -> None:
        """Writes ``dq``, ``dk``, ``dv`` (the inputs' shapes and dtype) from the merged
        ``out`` and ``lse``."""

        def interface_call():
            self.fi._flash_attn_bwd(
                q, k, v, out, dout, lse, scale, causal, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
                cu_seqlens_q=tables["cu_q"], cu_seqlens_k=tables["cu_k"], seqused_q=tables.get("used_q"),
                seqused_k=tables.get("used_k"), max_seqlen_q=max_q, max_seqlen_k=max_k,
            )

        key = self._class("bwd", (q, k, v, dout), tables, scale, causal, deterministic)
        self._run(key, interface_call, lambda: _backward_steps(
            self.fi, q, k, v, out, dout, lse, tables, max_q, max_k, scale, causal, deterministic, dq, dk, dv))


# --------------------------------------------------------------------------- rebuilt argument lists
# What flash-attn-4 4.0.0b36's _flash_attn_fwd / _flash_attn_bwd pass to their compiled
# kernels on SM90 for plain varlen attention (no softcap, window, sinks, block
# sparsity; at most 256 sequences), in order.


def _aligned(fi, x: torch.Tensor, copies: set[int], detach: bool = False) -> torch.Tensor:
    """``x`` as the interface passes it (its own canonicalization: a copy only where the
    pointer or strides are misaligned); a copy's id joins ``copies`` (compared by layout,
    like scratch, since the recorded call made its own)."""
    a = fi.maybe_contiguous(x)
    copied = a is not x
    a = a.detach() if detach else a
    if copied:
        copies.add(id(a))
    return a


def _forward_steps(fi, q, k, v, out, lse, tables: dict, scale: float) -> _Steps:
    copies: set[int] = set()
    q, k, v = (_aligned(fi, x, copies, detach=True) for x in (q, k, v))
    args = [q, k, v, out.detach(), lse, scale, tables["cu_q"], tables["cu_k"], tables.get("used_q"),
            tables.get("used_k"), None, None, None, None, None, fi.AuxData(None, None), None, None]
    return _Steps([args], copies)


def _backward_steps(fi, q, k, v, out, dout, lse, tables: dict, max_q: int, max_k: int, scale: float, causal: bool,
                    deterministic: bool, dq, dk, dv) -> _Steps:
    """Preprocess (delta, lse in base 2, dq accumulator zeroed), the main kernel, the
    dq postprocess and, with GQA, the dK and dV postprocesses."""
    copies: set[int] = set()
    out, dout, lse = (_aligned(fi, x, copies) for x in (out, dout, lse))
    q, k, v = (_aligned(fi, x, copies, detach=True) for x in (q, k, v))
    hq, d = q.shape[1:]
    hkv, dvv = v.shape[1:]
    cfg = fi._tile_size_bwd_sm90(d, dvv, causal, False)
    m, n = cfg.m_block_size, cfg.n_block_size
    mult = 64 if cfg.dKV_swapAB else 32
    d_r, dv_r = -(-d // mult) * mult, -(-dvv // mult) * mult
    cu_q, cu_k, used_q, used_k = tables["cu_q"], tables["cu_k"], tables.get("used_q"), tables.get("used_k")
    b = cu_q.shape[0] - 1
    rows = (q.shape[0] + (b + 1) * m - 1) // m * m  # every sequence padded to whole tiles
    f32 = dict(dtype=torch.float32, device=q.device)
    i32 = dict(dtype=torch.int32, device=q.device)
    dq_accum = torch.empty(hq, rows * d_r, **f32)  # zeroed by the preprocess
    dpsum, lse_log2 = torch.empty(hq, rows, **f32), torch.empty(hq, rows, **f32)
    scratch = [dq_accum, dpsum, lse_log2]
    gqa = hq > hkv
    dk_out, dv_out = dk, dv
    if gqa:  # q heads of a group add into fp32 dK/dV accumulators, converted afterwards
        keys = (k.shape[0] + (b + 1) * n - 1) // n * n
        dk_out, dv_out = torch.zeros(hkv, keys * d_r, **f32), torch.zeros(hkv, keys * dv_r, **f32)
        scratch += [dk_out, dv_out]
    sems = [None, None, None]
    if deterministic:
        sems[0] = torch.zeros(b, hq, -(-max_q // m), 1, **i32)
        if gqa:
            sems[1], sems[2] = (torch.zeros(b, hkv, -(-max_k // n), 2, **i32) for _ in range(2))
        scratch += [s for s in sems if s is not None]
    args = [
        [out, dout, dpsum, lse, lse_log2, dq_accum, cu_q, used_q, None, None, None, 1.0, None, None],
        [q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, scale, cu_q, cu_k,
         used_q, used_k, None, None, *sems, fi.AuxData(None, None), None, None],
        [dq_accum, dq, scale, cu_q, used_q, None, None],
    ]
    if gqa:
        args += [[dk_out, dk, scale, cu_k, used_k, None, None], [dv_out, dv, 1.0, cu_k, used_k, None, None]]
    return _Steps(args, {id(x) for x in scratch} | copies)
