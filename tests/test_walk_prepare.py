"""The walk prepares each call's attention tables ahead of its first layer
(``TreeWalk.prepare``: :func:`dtree.ops.stack_attention.prepare_stack_attention` right
after the previous call's kernels are queued): every group but the first forward one is
prepared once, before its model call, on the very layout object its call then uses (where
the backend finds the tables cached); a recomputed group keeps one layout for its forward
and its re-run; gradients stay exact in every mode, and the log-prob walk does the same."""

from __future__ import annotations

import pytest
from hf_models import make_model
from setups import SEQS, assert_exact, reference, run_dtree

import dtree
from dtree.engine import walk as walk_module


class _Spy:
    """Records, in order, ("prepare", layout) and ("call", stack slot, layout); holding the
    layouts keeps each one's identity unique (a freed one's id could be reused)."""

    def __init__(self, monkeypatch):
        self.events: list[tuple] = []
        original_prepare = walk_module.prepare_stack_attention
        original_group_attention = walk_module.GroupAttention
        spy = self

        def prepare(layout, backend, device, deterministic=False):
            spy.events.append(("prepare", layout))
            return original_prepare(layout, backend, device, deterministic)

        class Recorded(original_group_attention):
            def __init__(self, stacks, lo, hi, layout, *args, **kwargs):
                spy.events.append(("call", lo, layout))
                super().__init__(stacks, lo, hi, layout, *args, **kwargs)

        monkeypatch.setattr(walk_module, "prepare_stack_attention", prepare)
        monkeypatch.setattr(walk_module, "GroupAttention", Recorded)


@pytest.mark.parametrize("mode", ["retain", "recompute"])
@pytest.mark.parametrize("group_tokens", [0, 12])
def test_every_call_but_the_first_is_prepared_on_its_own_layout(monkeypatch, mode, group_tokens):
    model = make_model("qwen2")
    ref_model, ref_loss = reference(model)
    spy = _Spy(monkeypatch)
    seen_layouts: dict[int, list] = {}
    original_hidden = walk_module.TreeWalk.hidden

    def hidden(self, g, push, checkpoint=0):
        seen_layouts.setdefault(g, []).append(self.layout(g))
        return original_hidden(self, g, push, checkpoint)

    monkeypatch.setattr(walk_module.TreeWalk, "hidden", hidden)
    out, tree_model = run_dtree(model, mode=mode, group_tokens=group_tokens)
    assert_exact(tree_model, ref_model, out, ref_loss)
    assert out.num_model_calls > 2
    prepared = [(i, e[1]) for i, e in enumerate(spy.events) if e[0] == "prepare"]
    calls = [e for e in spy.events if e[0] == "call"]
    # one preparation per group whose forward is not the first, each before that group's first call,
    # on the layout that call uses
    assert len(prepared) == len(seen_layouts) - 1
    assert len({id(layout) for _, layout in prepared}) == len(prepared)
    for at, layout in prepared:
        first_call = next(i for i, e in enumerate(spy.events) if e[0] == "call" and e[2] is layout)
        assert at < first_call
    # a group's every model call (a recomputed group's forward and re-run) uses one layout
    assert all(all(x is layouts[0] for x in layouts) for layouts in seen_layouts.values())
    assert len(calls) == sum(len(layouts) for layouts in seen_layouts.values())
    if mode == "recompute":
        assert any(len(layouts) == 2 for layouts in seen_layouts.values())


def test_logprob_walk_prepares_too(monkeypatch):
    model = make_model("qwen2")
    spy = _Spy(monkeypatch)
    rt = dtree.TreeRuntime(model, group_tokens=12, chunk_size=8)
    forest = dtree.Forest.from_sequences(SEQS)
    logps = rt.logprobs(forest)
    assert len(logps) == len(SEQS)
    prepared = [e[1] for e in spy.events if e[0] == "prepare"]
    calls = [e[2] for e in spy.events if e[0] == "call"]
    assert len(calls) > 2 and len(prepared) == len(calls) - 1
    assert all(p is c for p, c in zip(prepared, calls[1:]))  # each call on the layout prepared for it
