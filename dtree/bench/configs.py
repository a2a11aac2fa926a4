"""Benchmark configurations: a method plus its options, named the way reports show them.

Grammar (``dtree bench --configs``)::

    CONFIGS := ITEM[,ITEM...]          ITEM := PRESET | METHOD[:PART[+PART...]]
    PART    := whole | splitN | ckpt | plain | default | recompute | low | KEY=VALUE

``splitN`` takes ``k`` for 1024 (``split16k`` = ``max_tokens_per_batch=16384``);
``whole`` is ``max_tokens_per_batch=None`` (tree-mask: the whole forest in one row);
``ckpt`` is ``checkpoint=True`` (the baselines' own per-layer checkpointing);
``plain`` and ``default`` add nothing; ``recompute`` is dtree's ``mode=recompute``;
``low`` is dtree's ``memory="low"`` (the fastest plan under the peak of every layer checkpointed,
8k calls and 512-row LM-head chunks).
``KEY=VALUE`` is any constructor option of the method (``dtree:group_tokens=4096``).

A bare ``METHOD`` runs with :data:`METHOD_DEFAULTS`. Presets (:data:`PRESETS`) expand to
several items, e.g. ``gpu`` (the GPU default: dtree and the strongest forms of both
baselines).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Iterable

from ..config import RuntimeConfig

__all__ = [
    "MethodConfig",
    "METHOD_DEFAULTS",
    "PRESETS",
    "parse_configs",
    "parse_value",
    "parse_assignments",
    "best_per_method",
]

# Options a bare METHOD runs with. tree-mask: packed rows of at most 32k tokens (whole
# trees; larger trees split the way AReaL does); without a budget it packs the whole
# forest into one row.
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {"tree-mask": {"max_tokens_per_batch": 32768}}

PRESETS: dict[str, tuple[str, ...]] = {
    # dtree's default and its low-memory setting against the strongest form of each
    # baseline (issue 11): tree-mask whole and checkpointed (as AReaL runs it), split into
    # 16k micro-batches, both; linearized with and without checkpointing
    "gpu": (
        "dtree",
        "dtree:low",
        "tree-mask:whole+ckpt",
        "tree-mask:split16k",
        "tree-mask:split16k+ckpt",
        "linearized",
        "linearized:ckpt",
    ),
    # one configuration per method, each at its defaults
    "basic": ("dtree", "linearized", "tree-mask"),
    # dtree's own knobs: the memory policy's default against its alternatives
    "dtree-modes": (
        "dtree",
        "dtree:low",
        "dtree:checkpoint_layers=false+group_tokens=16384",
        "dtree:checkpoint_layers=true+group_tokens=32768",
        "dtree:recompute",
    ),
}

_METHODS = ("dtree", "linearized", "tree-mask")


def parse_value(text: str) -> Any:
    """``"4096"`` -> 4096, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``"none"`` -> None,
    ``"512,4096"`` -> (512, 4096); anything else stays a string."""
    if "," in text:  # a range or a choice set, e.g. prompt_len=512,4096
        return tuple(parse_value(t.strip()) for t in text.split(",") if t.strip())
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() == "none":
        return None
    return text


def parse_assignments(items: list[str] | None, what: str) -> dict[str, Any]:
    """``["key=value", ...]`` (``--set`` / ``--opt`` arguments) as a dict of parsed values."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"{what} takes KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = parse_value(value.strip())
    return out


@dataclass
class MethodConfig:
    """One row of a benchmark: ``label`` (as given), ``method`` and its constructor options."""

    label: str
    method: str
    options: dict[str, Any] = field(default_factory=dict)


def _tokens(text: str) -> int:
    m = re.fullmatch(r"(\d+)(k?)", text)
    if not m:
        raise ValueError(f"expected a token count like 16384 or 16k, got {text!r}")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def _part(method: str, part: str) -> dict[str, Any]:
    baseline = method != "dtree"
    if part in ("plain", "default"):
        return {}
    if part == "ckpt":
        if not baseline:
            raise ValueError("dtree has no 'ckpt' (its own memory saver is 'recompute', or mode=recompute)")
        return {"checkpoint": True}
    if part == "whole":
        if method != "tree-mask":
            raise ValueError(f"'whole' is a tree-mask configuration (one row for the forest), not {method}'s")
        return {"max_tokens_per_batch": None}
    if part.startswith("split"):
        if not baseline:
            raise ValueError("dtree has no 'splitN': its call size is group_tokens=N")
        return {"max_tokens_per_batch": _tokens(part[len("split"):])}
    if part == "recompute":
        if baseline:
            raise ValueError(f"'recompute' is a dtree mode; the baselines' counterpart is 'ckpt' ({method})")
        return {"mode": "recompute"}
    if part == "low":
        if baseline:
            raise ValueError(f"'low' is dtree's low-memory setting (memory='low'); the baselines' counterpart is 'ckpt' ({method})")
        return {"memory": "low"}
    if "=" in part:
        key, value = part.split("=", 1)
        return {key.strip(): parse_value(value.strip())}
    raise ValueError(
        f"unknown configuration part {part!r} of {method}: use whole, splitN (e.g. split16k), ckpt, plain, "
        "default, recompute, low or KEY=VALUE"
    )


def _parse_item(item: str, base: dict[str, dict[str, Any]]) -> MethodConfig:
    method, _, rest = item.partition(":")
    method = method.strip()
    if method not in _METHODS:
        raise ValueError(f"unknown method {method!r} in {item!r}; choose from {', '.join(_METHODS)} or a preset "
                         f"({', '.join(PRESETS)})")
    options = {**METHOD_DEFAULTS.get(method, {}), **base.get(method, {})}
    for part in filter(None, (p.strip() for p in rest.split("+"))):
        options.update(_part(method, part))
    if method == "dtree":  # checked now, not when the configuration's turn comes
        _check_runtime_options(item, options)
    return MethodConfig(item.strip(), method, options)


def _check_runtime_options(item: str, options: dict[str, Any]) -> None:
    names = [f.name for f in fields(RuntimeConfig)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"{item!r}: dtree has no option {unknown}; its options are {names} (dtree.RuntimeConfig)")
    RuntimeConfig(**options)


def parse_configs(text: str | Iterable[str], base: dict[str, dict[str, Any]] | None = None) -> list[MethodConfig]:
    """Configurations from ``"dtree,tree-mask:whole+ckpt,gpu,..."`` (or a list of items).

    ``base``: per-method options applied under every configuration of that method
    (``dtree bench --opt``). Duplicate labels are dropped, first one kept.
    """
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text)]
    out: list[MethodConfig] = []
    for item in filter(None, items):
        expanded = PRESETS.get(item, (item,))
        for sub in expanded:
            config = _parse_item(sub, base or {})
            if all(c.label != config.label for c in out):
                out.append(config)
    if not out:
        raise ValueError("no configuration given")
    return out


def best_per_method(rows: list[dict], key: str = "step_time_s") -> dict[str, dict]:
    """Per method, the row with the lowest ``key`` among those that ran (status ok):
    the fastest configuration that fits."""
    best: dict[str, dict] = {}
    for r in rows:
        if r.get("status") != "ok" or r.get(key) is None:
            continue
        m = r["method"]
        if m not in best or r[key] < best[m][key]:
            best[m] = r
    return best
