"""Build the compressed tries of a batch of sequences: the tree layout of a Forest.

The build runs in named phases, each a function of the previous phases' results:

1. :func:`_insert_sorted`: consecutive sequences in lexicographic order share exactly
   their longest common prefix, so one pass over the sorted sequences, with a stack
   of the current path, creates every node (no per-token dicts);
2. :func:`_merge_single_child_chains`: a sequence that ends inside another leaves a
   node with one child; merging such chains makes every inner node a branch point;
3. :func:`_subtree_tokens`: tokens below every node (children are ordered by it);
4. :func:`_preorder`: depth-first preorder, children by subtree size (largest last,
   which keeps the DFS stack low; docs/design.md section 2), ties by first token;
5. :func:`_node_layout`: the node arrays in preorder;
6. :func:`_unique_tokens`: token ids, depths and predecessors of the unique tokens;
7. :func:`_linearized_to_unique`: every sequence walked down its trie, one node at a
   time, mapping each of its tokens to its unique token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["NodeLayout", "TrieLayout", "build_trie"]


@dataclass(frozen=True, eq=False)
class NodeLayout:
    """The trie's nodes (``M`` nodes, ``T`` trees) in depth-first preorder; see
    :class:`dtree.forest.forest.Forest` for each array."""

    node_start: np.ndarray  # [M]
    node_length: np.ndarray  # [M]
    node_parent: np.ndarray  # [M]
    node_depth: np.ndarray  # [M]
    node_subtree_end: np.ndarray  # [M]
    child_offsets: np.ndarray  # [M+1]
    child_index: np.ndarray  # [M-T]
    tree_roots: np.ndarray  # [T]


@dataclass(frozen=True, eq=False)
class TrieLayout(NodeLayout):
    """The whole tree layout: the nodes, their ``U`` unique tokens, and the map from the
    ``N`` linearized tokens to them; see :class:`dtree.forest.forest.Forest` for each array."""

    tokens: np.ndarray  # [U]
    positions: np.ndarray  # [U]
    predecessor: np.ndarray  # [U]
    lin_unique: np.ndarray  # [N]


def build_trie(seqs: list[np.ndarray]) -> TrieLayout:
    """The compressed tries of ``seqs`` (1-D int64 arrays, at least one token each)."""
    raw = _insert_sorted(seqs)
    _merge_single_child_chains(raw)
    order = _preorder(raw, seqs, _subtree_tokens(raw))
    nodes = _node_layout(raw, order)
    tokens, positions, predecessor = _unique_tokens(raw, order, nodes, seqs)
    lin_unique = _linearized_to_unique(seqs, nodes, tokens, positions)
    assert np.array_equal(tokens[lin_unique], np.concatenate(seqs)), "trie construction is inconsistent"
    return TrieLayout(
        tokens=tokens, positions=positions, predecessor=predecessor, lin_unique=lin_unique, **vars(nodes)
    )


@dataclass
class _RawTrie:
    """Phases 1-2: nodes in creation order. Node ``n`` holds depths ``[d0[n], d1[n])``
    of sequence ``rep[n]``; ``merged[n]``: absorbed into its parent (phase 2)."""

    rep: list[int]
    d0: list[int]
    d1: list[int]
    parent: list[int]
    children: list[list[int]]
    merged: list[bool]

    def add(self, rep: int, d0: int, d1: int, parent: int, children: list[int]) -> int:
        self.rep.append(rep)
        self.d0.append(d0)
        self.d1.append(d1)
        self.parent.append(parent)
        self.children.append(children)
        self.merged.append(False)
        return len(self.rep) - 1

    def first_token(self, seqs: list[np.ndarray], n: int) -> int:
        return int(seqs[self.rep[n]][self.d0[n]])


def _insert_sorted(seqs: list[np.ndarray]) -> _RawTrie:
    """Phase 1: insert the sequences in lexicographic order, splitting the node on top
    of the path where the next sequence leaves it midway."""
    raw = _RawTrie([], [], [], [], [], [])
    path: list[int] = []
    prev: np.ndarray | None = None
    for s in sorted(range(len(seqs)), key=lambda i: seqs[i].tolist()):
        cur = seqs[s]
        if prev is None:
            lcp = 0
        else:
            m = min(len(prev), len(cur))
            neq = np.flatnonzero(prev[:m] != cur[:m])
            lcp = int(neq[0]) if neq.size else m
        while path and raw.d0[path[-1]] >= lcp:
            path.pop()
        if path and raw.d1[path[-1]] > lcp:  # the new sequence leaves the top node midway: split it
            top = path[-1]
            low = raw.add(raw.rep[top], lcp, raw.d1[top], top, raw.children[top])
            for c in raw.children[low]:
                raw.parent[c] = low
            raw.children[top] = [low]
            raw.d1[top] = lcp
        if len(cur) > lcp:
            node = raw.add(s, lcp, len(cur), path[-1] if path else -1, [])
            if path:
                raw.children[path[-1]].append(node)
            path.append(node)
        prev = cur
    return raw


def _merge_single_child_chains(raw: _RawTrie) -> None:
    """Phase 2: a node with a single child absorbs it (repeatedly)."""
    for node in range(len(raw.rep)):
        if raw.merged[node]:
            continue
        while len(raw.children[node]) == 1:
            only = raw.children[node][0]
            raw.d1[node], raw.rep[node], raw.children[node] = raw.d1[only], raw.rep[only], raw.children[only]
            for c in raw.children[node]:
                raw.parent[c] = node
            raw.merged[only] = True


def _subtree_tokens(raw: _RawTrie) -> np.ndarray:
    """Phase 3: [nodes] tokens in each subtree. A split can re-parent older nodes under
    newer ones, so creation order is not a post-order; start depth is (a child starts
    where its parent ends)."""
    tokens = np.array(raw.d1, dtype=np.int64) - np.array(raw.d0, dtype=np.int64)
    for node in sorted(range(len(raw.rep)), key=lambda n: -raw.d0[n]):
        if not raw.merged[node] and raw.parent[node] >= 0:
            tokens[raw.parent[node]] += tokens[node]
    return tokens


@dataclass(frozen=True)
class _Preorder:
    """Phase 4: ``old[i]`` is the raw node numbered ``i``; ``new_id`` the inverse (-1:
    merged away); ``children[i]``: node ``i``'s children, largest subtree last; ``roots``:
    the trees' root nodes in order of their first token's first appearance."""

    old: list[int]
    new_id: np.ndarray
    children: list[list[int]]
    roots: list[int]


def _preorder(raw: _RawTrie, seqs: list[np.ndarray], subtree_tokens: np.ndarray) -> _Preorder:
    """Phase 4: number the nodes in depth-first preorder, iteratively (tries can be
    deeper than Python's recursion limit), so every subtree is a contiguous range."""
    first_seen: dict[int, int] = {}
    for i, s in enumerate(seqs):
        first_seen.setdefault(int(s[0]), i)
    roots = [n for n in range(len(raw.rep)) if raw.parent[n] < 0]
    roots.sort(key=lambda n: first_seen[raw.first_token(seqs, n)])  # trees in order of first appearance
    new_id = np.full(len(raw.rep), -1, dtype=np.int64)
    old: list[int] = []
    old_children: list[list[int]] = []
    todo = list(reversed(roots))
    while todo:
        n = todo.pop()
        new_id[n] = len(old)
        old.append(n)
        kids = sorted(raw.children[n], key=lambda c: (int(subtree_tokens[c]), raw.first_token(seqs, c)))
        old_children.append(kids)
        todo.extend(reversed(kids))
    children = [[int(new_id[c]) for c in kids] for kids in old_children]
    return _Preorder(old, new_id, children, [int(new_id[r]) for r in roots])


def _node_layout(raw: _RawTrie, order: _Preorder) -> NodeLayout:
    """Phase 5: starts, lengths, parents, depths and subtree ranges of the nodes in
    preorder, their children (CSR) and the trees' roots."""
    pre = np.array(order.old, dtype=np.int64)
    num_nodes = len(pre)
    node_length = (np.array(raw.d1, dtype=np.int64) - np.array(raw.d0, dtype=np.int64))[pre]
    node_start = np.zeros(num_nodes, dtype=np.int64)
    np.cumsum(node_length[:-1], out=node_start[1:])
    raw_parent = np.array(raw.parent, dtype=np.int64)[pre]
    node_parent = np.where(raw_parent >= 0, order.new_id[np.maximum(raw_parent, 0)], -1)
    node_depth = np.zeros(num_nodes, dtype=np.int64)
    for i in range(num_nodes):  # parents precede children in preorder
        p = node_parent[i]
        node_depth[i] = 0 if p < 0 else node_depth[p] + 1
    sizes = np.ones(num_nodes, dtype=np.int64)
    for i in range(num_nodes - 1, -1, -1):
        if node_parent[i] >= 0:
            sizes[node_parent[i]] += sizes[i]
    child_offsets = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum([len(k) for k in order.children], out=child_offsets[1:])
    child_index = np.array([c for kids in order.children for c in kids], dtype=np.int64)
    node_subtree_end = np.arange(num_nodes, dtype=np.int64) + sizes
    tree_roots = np.array(order.roots, dtype=np.int64)
    return NodeLayout(
        node_start, node_length, node_parent, node_depth, node_subtree_end, child_offsets, child_index, tree_roots
    )


def _unique_tokens(
    raw: _RawTrie, order: _Preorder, nodes: NodeLayout, seqs: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Phase 6: ([U] token ids, [U] depths, [U] predecessor: the unique token before it
    on its path, -1 at a root), node after node in preorder."""
    node_start, node_length, node_parent = nodes.node_start, nodes.node_length, nodes.node_parent
    total = int(node_length.sum())
    tokens = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    for i, old in enumerate(order.old):
        a, b = node_start[i], node_start[i] + node_length[i]
        tokens[a:b] = seqs[raw.rep[old]][raw.d0[old] : raw.d1[old]]
        positions[a:b] = np.arange(raw.d0[old], raw.d1[old])
    predecessor = np.arange(total, dtype=np.int64) - 1
    parent = np.maximum(node_parent, 0)
    predecessor[node_start] = np.where(node_parent >= 0, node_start[parent] + node_length[parent] - 1, -1)
    return tokens, positions, predecessor


def _linearized_to_unique(
    seqs: list[np.ndarray], nodes: NodeLayout, tokens: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    """Phase 7: [N] unique-token index of every token of every sequence, in input order."""
    node_start, node_length = nodes.node_start, nodes.node_length
    child_by_token: list[dict[int, int]] = [dict() for _ in range(len(node_start))]
    for n in range(len(node_start)):
        for c in nodes.child_index[nodes.child_offsets[n] : nodes.child_offsets[n + 1]]:
            child_by_token[n][int(tokens[node_start[c]])] = int(c)
    root_by_token = {int(tokens[node_start[r]]): int(r) for r in nodes.tree_roots}
    lin_unique = np.empty(sum(len(s) for s in seqs), dtype=np.int64)
    offset = 0
    for seq in seqs:
        node = root_by_token[int(seq[0])]
        depth = 0
        while True:
            nd0 = positions[node_start[node]]
            end = min(len(seq), nd0 + node_length[node])
            lin_unique[offset + depth : offset + end] = node_start[node] + np.arange(depth - nd0, end - nd0)
            depth = int(end)
            if depth >= len(seq):
                break
            node = child_by_token[node][int(seq[depth])]
        offset += len(seq)
    return lin_unique
