"""Whether a linear layer can be replaced by its weights: :func:`is_plain_linear`.

dtree folds a projection into a fused kernel (the LM head's log-probs, the lean MLP's
down projection) only when calling the module would do nothing but ``F.linear``;
anything else (an adapter, a hook, a quantized subclass) is called as a module.
"""

from __future__ import annotations

import torch

__all__ = ["is_plain_linear"]


def is_plain_linear(head: torch.nn.Module) -> bool:
    """True for an ``nn.Linear`` that does exactly ``F.linear(x, weight, bias)`` when
    called: not a subclass (quantized, parametrized, adapter-wrapped), no hooks, no
    patched ``forward``, plain parameters. Anything else goes through the module."""
    from torch.nn.modules import module as nn_module

    global_hooks = any(
        getattr(nn_module, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks")
    )
    return (
        type(head) is torch.nn.Linear
        and not head._forward_hooks
        and not head._forward_pre_hooks
        and not global_hooks
        and "forward" not in vars(head)
        and type(head.weight) is torch.nn.Parameter
        and (head.bias is None or type(head.bias) is torch.nn.Parameter)
    )
