"""Static draft trees: a topology given as paths, turned (host-side, once) into index tables.

A tree is written the way vLLM's ``speculative_token_tree`` writes it: one tuple per node, listing
the child ranks on the way from the root (0 = the proposer's most likely child, 1 = the next, ...).
The root is implicit: it is the row's last token, which the target has not seen yet. The seed
text's example, nodes [r, a, b, c, d] with a, b candidates after r and c, d candidates after a::

    paths = ((0,), (1,), (0, 0), (0, 1))

              r            node  path    parent  depth  sees (ancestor mask row)
             / \\           0 r   ()      -1      0      r
            a   b          1 a   (0,)     0      1      r a
           / \\             2 b   (1,)     0      1      r . b
          c   d            3 c   (0, 0)   1      2      r a . c
                           4 d   (0, 1)   1      2      r a . . d

Nodes are numbered breadth first (by depth, then by path), so each depth is a contiguous range
and a parent always comes before its children. Every node attends to its ancestors and itself
only, and sits at position ``length + depth``, not ``length + index``: c and d are both the second
token after r. A chain of γ drafts is the tree ((0,), (0, 0), ...) with γ nodes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

MAX_NODES = 64  # non-root nodes: the target verifies MAX_NODES + 1 positions per round
MAX_DEPTH = 16


def _as_paths(paths) -> tuple[tuple[int, ...], ...]:
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence):
        raise ValueError(f"tree must be a list of paths (lists of child ranks), got {paths!r}")
    out = []
    for p in paths:
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise ValueError(f"tree path {p!r} is not a list of child ranks")
        if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) and r >= 0
                   for r in p):
            raise ValueError(f"tree path {list(p)!r} must hold ints >= 0 (child ranks)")
        out.append(tuple(int(r) for r in p))
    return tuple(out)


def _frozen(table: np.ndarray) -> np.ndarray:
    table.setflags(write=False)
    return table


@dataclasses.dataclass(frozen=True)
class Tree:
    """A validated tree topology and its index tables (numpy, read-only, computed once per tree;
    static in compiled programs).

    paths     N-1 paths, breadth-first order (node i + 1 is paths[i]; node 0 is the root)
    parents   [N] int32, -1 for the root
    depths    [N] int32, 0 for the root
    ranks     [N] int32, the node's rank among its siblings (0 for the root)
    ancestors [N, N] bool, ancestors[i, j]: node j is node i or one of its ancestors
    children  [N, C] int32, node i's children in rank order, -1 padded (C = most children)
    levels    per depth d >= 1, the (start, stop) node range at that depth
    ranks_under(d): candidates the nodes at depth d need (highest child rank + 1)
    """

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        paths = _as_paths(self.paths)
        if not paths:
            raise ValueError("tree has no nodes: give at least one path, e.g. [[0]]")
        if any(len(p) == 0 for p in paths):
            raise ValueError("tree paths must not be empty: the root is implicit")
        if len(paths) > MAX_NODES:
            raise ValueError(f"tree has {len(paths)} nodes; at most {MAX_NODES} are supported")
        depth = max(len(p) for p in paths)
        if depth > MAX_DEPTH:
            raise ValueError(f"tree depth {depth} exceeds the supported {MAX_DEPTH}")
        seen = set()
        for p in paths:
            if p in seen:
                raise ValueError(f"tree path {list(p)} appears twice")
            seen.add(p)
        for p in paths:
            if len(p) > 1 and p[:-1] not in seen:
                raise ValueError(f"tree path {list(p)} has no parent: {list(p[:-1])} is not in "
                                 f"the tree (every prefix of a path must be a node)")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
                raise ValueError(f"tree path {list(p)} skips a rank: {list(p[:-1] + (p[-1] - 1,))}"
                                 f" is missing (child ranks must be 0, 1, 2, ... without gaps)")
        object.__setattr__(self, "paths", tuple(sorted(paths, key=lambda p: (len(p), p))))

    @classmethod
    def chain(cls, gamma: int) -> Tree:
        return cls(tuple((0,) * d for d in range(1, gamma + 1)))

    @property
    def num_nodes(self) -> int:
        """N: nodes including the root (the target verifies N positions per round)."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        """The deepest path: the most drafts a round can accept."""
        return max(len(p) for p in self.paths)

    @functools.cached_property
    def index(self) -> dict:
        """path -> node index (the root, (), is 0)."""
        return {(): 0, **{p: i + 1 for i, p in enumerate(self.paths)}}

    @functools.cached_property
    def parents(self) -> np.ndarray:
        index = self.index
        return _frozen(np.array([-1] + [index[p[:-1]] for p in self.paths], np.int32))

    @functools.cached_property
    def depths(self) -> np.ndarray:
        return _frozen(np.array([0] + [len(p) for p in self.paths], np.int32))

    @functools.cached_property
    def ranks(self) -> np.ndarray:
        return _frozen(np.array([0] + [p[-1] for p in self.paths], np.int32))

    @functools.cached_property
    def ancestors(self) -> np.ndarray:
        N, parents = self.num_nodes, self.parents
        mask = np.eye(N, dtype=bool)
        for i in range(1, N):  # parents come first, so their rows are complete
            mask[i] |= mask[parents[i]]
        return _frozen(mask)

    @functools.cached_property
    def children(self) -> np.ndarray:
        index = self.index
        kids = [[] for _ in range(self.num_nodes)]
        for p in self.paths:
            kids[index[p[:-1]]].append(index[p])  # paths are sorted, so ranks come in order
        width = max(len(k) for k in kids)
        out = np.full((self.num_nodes, width), -1, np.int32)
        for i, k in enumerate(kids):
            out[i, :len(k)] = k
        return _frozen(out)

    @functools.cached_property
    def levels(self) -> tuple[tuple[int, int], ...]:
        depths = self.depths
        return tuple((int(np.argmax(depths == d)), int(np.sum(depths <= d)))
                     for d in range(1, self.depth + 1))

    def ranks_under(self, d: int) -> int:
        """How many ranked candidates the nodes at depth d (0: the root) need: one more than
        the highest child rank at depth d + 1 (0 below the deepest level). A drafter ranks or
        draws only that many at each level, not the tree's widest fan-out everywhere."""
        if d >= self.depth:
            return 0
        start, stop = self.levels[d]
        return int(self.ranks[start:stop].max()) + 1

    def expanded(self, d: int) -> int:
        """How many leading nodes of depth d + 1 (``levels[d]``) a drafter expands: up to the
        last one with children (0 for the deepest level). The leaves after it have nothing under
        them, so no draft forward needs their entries or their candidates."""
        start, stop = self.levels[d]
        parents = np.flatnonzero(self.children[start:stop, 0] >= 0)
        return int(parents[-1]) + 1 if parents.size else 0

    def to_json(self) -> list[list[int]]:
        return [list(p) for p in self.paths]

    def __repr__(self) -> str:
        return f"Tree({self.to_json()})"
