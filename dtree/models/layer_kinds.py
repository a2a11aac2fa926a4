"""Which decoder layers of a transformers model attend, with which K/V shape, and which
carry recurrent states: the ``layer_kv`` and ``recurrent_states`` of its ModelSpec.

Per decoder layer:

* its adapted recurrent mixers (:mod:`dtree.models.mixers`) carry states, one set per
  layer (``conv``, ``recurrent``: whatever the adapter declares);
* it attends unless it has an adapted mixer or is a layer without a token mixer (a
  ``layer_types`` entry ``mlp`` or ``moe``: Nemotron-H's MLP and MoE layers), in which
  case it attends only if it also holds an attention module (Falcon-H1 runs attention
  and Mamba2 side by side in every layer);
* an attending layer's K/V shape is the config's, unless the attention modules say the
  layers differ (Gemma 4's global layers use another head dim, MiMo's sliding layers
  twice the K/V heads), or the config refuses a global read: then each layer's own
  (``num_attention_heads // num_key_value_groups``, ``head_dim``, ``v_head_dim`` or
  ``head_dim``).

A layer expected to attend that never calls the attention, and a recurrent mixer
without an adapter, are refused by the guard at the first model call, by name.
"""

from __future__ import annotations

import torch

from . import mixers

__all__ = ["layer_fields", "state_grads", "PER_LAYER_TYPES_WITHOUT_MIXER"]

# ``config.layer_types`` entries of layers without any token mixer
PER_LAYER_TYPES_WITHOUT_MIXER = ("mlp", "moe")


def _module_kv_shape(layer: torch.nn.Module, num_heads: int, skip: set[int]) -> tuple[int, int, int] | None:
    """(kv_heads, head_dim, v_head_dim) read off the layer's attention module, if it says."""
    for module in layer.modules():
        if id(module) in skip or "Attention" not in type(module).__name__:
            continue
        head_dim, groups = getattr(module, "head_dim", None), getattr(module, "num_key_value_groups", None)
        if isinstance(head_dim, int) and isinstance(groups, int) and groups > 0:
            return num_heads // groups, head_dim, int(getattr(module, "v_head_dim", None) or head_dim)
    return None


def _has_attention(layer: torch.nn.Module, skip: set[int]) -> bool:
    return any("Attention" in type(m).__name__ for m in layer.modules() if id(m) not in skip and m is not layer)


def layer_fields(
    layers: list[torch.nn.Module],
    config,
    num_heads: int,
    kv: tuple[int, int, int] | None,
    model_name: str,
) -> dict:
    """``{"layer_kv": ..., "recurrent_states": ...}`` for ModelSpec (empty when every layer
    attends with the config's shape ``kv``; ``kv`` None: the config has no global shape).

    Args:
        layers: the model's decoder layers ([] when they cannot be found).
        num_heads: query heads.
        kv: (kv_heads, head_dim, v_head_dim) from the config, or None."""
    if not layers:
        return {}
    layer_types = getattr(config, "layer_types", None)
    recurrent, expects, shapes = [], [], []
    for i, layer in enumerate(layers):
        found = [m for m in layer.modules() if mixers.adapter_of(m) is not None]
        inside = {id(sub) for m in found for sub in m.modules()}
        if len(found) > 1:
            raise ValueError(
                f"{model_name}: decoder layer {i} holds {len(found)} recurrent mixers "
                f"({', '.join(type(m).__name__ for m in found)}); dtree keeps one set of states per layer"
            )
        for m in found:
            recurrent += [(i, name, tuple(shape)) for name, shape in mixers.state_shapes(m, model_name).items()]
        mixer_free = isinstance(layer_types, (list, tuple)) and i < len(layer_types) and (
            layer_types[i] in PER_LAYER_TYPES_WITHOUT_MIXER
        )
        expects.append(_has_attention(layer, inside) if found or mixer_free else True)
        shapes.append(_module_kv_shape(layer, num_heads, inside) if expects[-1] else None)
    attending = [s for s, e in zip(shapes, expects) if e]
    uniform = kv is not None and len({s for s in attending if s is not None}) <= 1
    if uniform:
        layer_kv = tuple(kv if e else None for e in expects)
    elif all(s is not None for s in attending):
        layer_kv = tuple(shapes)
    else:
        raise ValueError(
            f"{model_name}: its layers have different attention shapes and dtree cannot read every layer's K/V shape "
            "off its attention module (head_dim, num_key_value_groups)"
        )
    if all(expects) and uniform:
        return {"recurrent_states": tuple(recurrent)} if recurrent else {}
    return {"layer_kv": layer_kv, "recurrent_states": tuple(recurrent)}


def state_grads(embedding: torch.nn.Module | None, layers: list[torch.nn.Module]) -> tuple[bool, ...]:
    """Per decoder layer: whether its recurrent states can need a gradient, i.e. whether a
    trainable parameter sits in the input embedding or in layers ``0..l`` (everything a
    layer-``l`` state is computed from). Conservative: a trainable parameter after the
    mixer inside layer ``l`` counts too, which only costs an unused gradient path."""
    trainable, out = False, []
    if embedding is not None:
        trainable = any(p.requires_grad for p in embedding.parameters())
    for layer in layers:
        trainable = trainable or any(p.requires_grad for p in layer.parameters())
        out.append(trainable)
    return tuple(out)
