"""linear_recurrence (dtree/ops/linear_recurrence/interface.py) on a GPU: the ``fla`` backend checked
against the float64 recurrence by the flash-attention rule, and packed siblings timed
against one call per sibling. ``benchmarks/hybrid_gpu.py`` runs both as its part 1;
alone: ``python benchmarks/bench_linear_recurrence.py [--all-kernels]`` (without fla: the
chunked backend; CPU: tiny sizes).

Check: a varlen call of three segments with random initial states; outputs, final
states and every gradient (inputs and initial states) of the backend in bf16 (gated
DeltaNet's q, k, v, beta, as the adapters pass them; Mamba2's in float32) against
float64, at most 2x (forward) / 3x (gradients) the error of the all-bf16 torch
recurrence, plus a floor.

Timing: a GRPO-shaped gated-DeltaNet call (fwd + bwd), 16 answers of 512 tokens that
start from one prompt's state on the state stack: one varlen kernel call for the
level (what dtree runs), against one call per answer (a per-segment loop).
"""

from __future__ import annotations

import functools
import json
import sys
import time

import numpy as np
import torch


def _kernel_inputs(kind: str, device, gen) -> tuple[tuple, list[torch.Tensor]]:
    """((q, k, v, g, beta, initial, cu_seqlens, scale, l2norm) in float64, three segments;
    random weights of the outputs and final states in the checked loss)."""
    h, hk, dk, dv = (8, 4, 64, 64) if kind in ("gdn", "kda") else (8, 8, 64, 32)
    cu = np.array([0, 37, 150, 213])
    t = int(cu[-1])

    def rand(*shape, scale=1.0, draw=torch.randn):
        return (draw(*shape, generator=gen, dtype=torch.float64) * scale).to(device)

    q, k, v = rand(t, hk, dk), rand(t, hk, dk), rand(t, h, dv)
    g = -rand(t, h, dk, scale=0.2, draw=torch.rand) if kind in ("kda", "gla") else -rand(t, h, scale=0.5,
                                                                                        draw=torch.rand)
    beta = rand(t, h, draw=torch.rand) if kind in ("gdn", "kda") else None
    if kind in ("ssd", "gla"):
        q, k = q * dk**-0.5, k * dk**-0.5
    initial = rand(3, h, dk, dv, scale=0.1)
    inputs = (q, k, v, g, beta, initial, cu, dk**-0.5 if beta is not None else 1.0, beta is not None)
    return inputs, [rand(t, h, dv), rand(3, h, dk, dv)]


def _run_kernel(fn, inputs, weights):
    q, k, v, g, beta, initial, cu, scale, l2 = inputs
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g, initial)]
    b = None if beta is None else beta.detach().requires_grad_(True)
    out, final = fn(*leaves[:4], b, cu, leaves[4], scale, l2)
    loss = (out.double() * weights[0]).sum() + (final.double() * weights[1]).sum()
    grads = torch.autograd.grad(loss, leaves + ([b] if b is not None else []))
    return [out.double(), final.double()] + [x.double() for x in grads]


def check_kernels(device, kinds, backend: str) -> list[dict]:
    """Each recurrence: ``backend`` in bf16 against float64, held to the all-bf16 torch recurrence."""
    from dtree.ops.linear_recurrence import BACKENDS, recurrence_reference

    kernel = BACKENDS.function(backend)

    def torch_in(dtype):
        return functools.partial(recurrence_reference, dtype=dtype)

    rows = []
    for kind in kinds:
        x64, weights = _kernel_inputs(kind, device, torch.Generator().manual_seed(0))
        exact = _run_kernel(torch_in(torch.float64), x64, weights)
        # as the adapters give them: gated DeltaNet's q, k, v, beta in the model dtype, Mamba2's
        # (x dt, B, C) in float32; gates and states in float32
        q, k, v, g, beta, initial = x64[:6]
        cast = torch.float32 if kind in ("ssd", "gla") else torch.bfloat16
        low = (*(x.to(cast) for x in (q, k, v)), g.float(), None if beta is None else beta.to(cast), initial.float(),
               *x64[6:])
        ref = _run_kernel(torch_in(torch.bfloat16), low, weights)
        got = _run_kernel(kernel, low, weights)
        names = ["out", "final", "dq", "dk", "dv", "dg", "dinitial"] + (["dbeta"] if beta is not None else [])
        for i, name in enumerate(names):
            e_got = (got[i] - exact[i]).abs().max().item()
            e_ref = (ref[i] - exact[i]).abs().max().item()
            bound = (2 if i < 2 else 3) * e_ref + 1e-3 * max(1e-3, exact[i].abs().max().item())
            rows.append({"kernel": kind, "tensor": name, "err": e_got, "bf16_torch_err": e_ref, "bound": bound,
                         "ok": e_got <= bound})
    return rows


def time_packing(device, backend: str, smoke: bool) -> dict:
    """ms of one GRPO-shaped gated-DeltaNet call (fwd + bwd): its answers start from one prompt's
    state on the stack, run packed (one varlen kernel call) or one call per answer."""
    from dtree.ops.linear_recurrence import linear_recurrence
    from dtree.ops.segment_states import LayerStates, StateLayout
    from dtree.stacks.state_stack import StateStack

    n, length, hk, h, d = (4, 32, 2, 4, 16) if smoke else (16, 512, 16, 32, 128)
    stack = StateStack([(0, "recurrent", (h, d, d))], 1, device=device)
    stack.zero_grad(0, 1)
    t, low = n * length, torch.bfloat16 if device.type == "cuda" else torch.float32
    x = [torch.randn(t, *shape, device=device, dtype=low, requires_grad=True) for shape in ((hk, d), (hk, d), (h, d))]
    g, beta = (-torch.rand(t, h, device=device) * 0.1).requires_grad_(), torch.rand(t, h, device=device, dtype=low)
    one = np.full(n, -1)
    packed = [(StateLayout(np.arange(n + 1) * length, one, 0 * one, one), 0, t)]
    loop = [(StateLayout(np.array([0, length]), one[:1], 0 * one[:1], one[:1]), i * length, (i + 1) * length)
            for i in range(n)]
    times = {}
    for label, calls in (("packed", packed), ("per_segment", loop)):
        for rep in range(3):
            torch.cuda.synchronize() if device.type == "cuda" else None
            t0 = time.perf_counter()
            for layout, a, b in calls:
                states = LayerStates(layout, stack, 0, backend=backend)
                o = linear_recurrence(*(y[a:b] for y in x), g[a:b], beta[a:b], states, scale=d**-0.5, qk_l2norm=True)
                o.float().square().mean().backward()
            torch.cuda.synchronize() if device.type == "cuda" else None
            times[f"{label}_ms"] = (time.perf_counter() - t0) * 1e3  # the last of three (the first compiles)
    return {"segments": n, "tokens_per_segment": length, **times}



def main(argv: list[str] | None = None) -> int:
    from dtree.ops.backends import Target
    from dtree.ops.linear_recurrence.fla_backend import fla_unavailable

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "chunked" if fla_unavailable(Target(device)) else "fla"
    kinds = ["gdn", "ssd"] + (["kda", "gla"] if "--all-kernels" in (argv or sys.argv[1:]) else [])
    rows = check_kernels(device, kinds, backend)
    print(json.dumps({"backend": backend, "failed": [r for r in rows if not r["ok"]],
                      "packing": time_packing(device, backend, device.type != "cuda")}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
