"""Hotwords: phrases a request expects (product names, people, jargon) made likelier during greedy search.

Each row of a batch may bring its own phrases (``decoding.types.Hotword``: token sequences, each with its own
bonus or the default). They are kept as prefix trees in one table: a node's children are the tokens that continue
a phrase from it. While a row's last labels spell a phrase's beginning, the tokens that continue it get the
phrase's bonus added to their logits (the largest, where phrases share the step), so greedy search takes them
where the audio leaves it in doubt, and leaves them where it does not. A phrase's first token gets only
``PHRASE_START_SHARE`` of it: greedy search cannot take a token back, and a phrase begun where it was not said
pulls the next tokens after it (half the bonus there kept WER as without hotwords, the whole raised it:
docs/benchmarks.md). Emitting a token moves the row down the tree; a token that continues nothing starts over
from the row's root (the token itself may begin a phrase).

Rows without phrases sit on node 0, which has no children: nothing changes for them. The search's scores
(decoding.scores) are the model's own, without the bonus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .types import Hotwords

NULL_NODE = 0  # no phrases: no children, and every token leads back to it
PHRASE_START_SHARE = 0.5  # of the bonus, for the token that begins a phrase
SPREAD_MAX_ENTRIES = 1 << 24  # node x token tables beyond this (about 200 MB) are not spread out (BoostTable.spread)


@dataclass
class BoostTable:
    """Prefix trees of a batch's phrases, as tensors on the decoding device. N nodes, K children at most."""

    child_token: Tensor  # (N, K) long: the tokens that continue a phrase from each node (-1: none)
    child_node: Tensor  # (N, K) long: where each leads
    root_of: Tensor  # (N,) long: the root of the node's tree (a row starts over there)
    roots: Tensor  # (B,) long: each row's root (NULL_NODE for rows without phrases)
    child_bonus: Tensor  # (N, K) float: what each child gets (0 where none; a share of it from a root)

    @property
    def shape(self) -> tuple[int, int]:
        """(nodes, children per node)."""
        return self.child_token.shape[0], self.child_token.shape[1]

    @classmethod
    def empty(cls, nodes: int, width: int, rows: int, device: torch.device) -> BoostTable:
        """A table of fixed capacity with no phrases, for ``load`` to copy batches' tables into (CUDA graphs read
        their tensors where they stay)."""
        return cls(child_token=torch.full((nodes, width), -1, dtype=torch.long, device=device),
                   child_node=torch.zeros((nodes, width), dtype=torch.long, device=device),
                   root_of=torch.zeros(nodes, dtype=torch.long, device=device),
                   roots=torch.zeros(rows, dtype=torch.long, device=device),
                   child_bonus=torch.zeros((nodes, width), device=device))

    def fits(self, table: BoostTable) -> bool:
        nodes, width = table.shape
        return nodes <= self.shape[0] and width <= self.shape[1] and len(table.roots) <= len(self.roots)

    def load(self, table: BoostTable) -> None:
        """Copy a smaller table in. The rest stays without phrases: no children (-1, no bonus), rows past the
        batch on NULL_NODE. Search with it equals search with ``table`` bit for bit: a child that is not there
        never matches a label, and its bonus adds 0."""
        nodes, width = table.shape
        for mine, theirs, pad in ((self.child_token, table.child_token, -1), (self.child_node, table.child_node, 0),
                                  (self.child_bonus, table.child_bonus, 0)):
            mine.fill_(pad)
            mine[:nodes, :width].copy_(theirs)
        self.root_of.zero_()
        self.root_of[:nodes].copy_(table.root_of)
        self.roots.zero_()
        self.roots[: len(table.roots)].copy_(table.roots)

    def bonus(self, node: Tensor, n_classes: int) -> Tensor:
        """(B,) current nodes -> (B, n_classes) logit bonus on each token that continues a phrase."""
        tokens = self.child_token.index_select(0, node)  # (B, K)
        values = self.child_bonus.index_select(0, node)
        return torch.zeros(len(node), n_classes, device=node.device).scatter_add_(1, tokens.clamp(min=0), values)

    def advance(self, node: Tensor, label: Tensor) -> Tensor:
        """(B,) nodes and the labels just emitted -> the nodes after them: the label's child if it continues a
        phrase, else the root's child for it (it may begin one), else the root."""
        found, child = self._child(node, label)
        root = self.root_of.index_select(0, node)
        root_found, root_child = self._child(root, label)
        return torch.where(found, child, torch.where(root_found, root_child, root))

    def spread(self, n_classes: int) -> SpreadBoost | None:
        """The table spread over the vocabulary, as ``bonus`` and ``advance`` read it: a search step then takes one
        row of each instead of walking the node's children (a handful of kernels a step fewer). None when
        nodes x ``n_classes`` is over SPREAD_MAX_ENTRIES (thousands of distinct phrases in one batch)."""
        nodes, _ = self.shape
        if nodes * n_classes > SPREAD_MAX_ENTRIES:
            return None
        spare = n_classes  # the column a missing child (-1) is written to, dropped at the end
        columns = torch.where(self.child_token >= 0, self.child_token, spare)
        # every token leads to the node's root, the root's children where it has them, the node's own before those
        next_of = self.root_of.unsqueeze(1).repeat(1, n_classes + 1)
        next_of.scatter_(1, columns.index_select(0, self.root_of), self.child_node.index_select(0, self.root_of))
        next_of.scatter_(1, columns, self.child_node)
        bonus_of = torch.zeros(nodes, n_classes + 1, device=columns.device).scatter_(1, columns, self.child_bonus)
        return SpreadBoost(bonus_of[:, :n_classes].contiguous(), next_of[:, :n_classes].contiguous())

    def _child(self, node: Tensor, label: Tensor) -> tuple[Tensor, Tensor]:
        """Whether each node has a child for its row's label, and which (meaningless where it has none)."""
        match = self.child_token.index_select(0, node) == label.unsqueeze(1)  # (B, K)
        child = self.child_node.index_select(0, node).gather(1, match.long().argmax(1, keepdim=True)).squeeze(1)
        return match.any(1), child


@dataclass
class SpreadBoost:
    """A BoostTable spread over the vocabulary (``BoostTable.spread``): the same ``bonus`` and ``advance``."""

    bonus_of: Tensor  # (N, C) float: each node's bonus on every token
    next_of: Tensor  # (N, C) long: the node each token leads to from each node

    def bonus(self, node: Tensor) -> Tensor:
        return self.bonus_of.index_select(0, node)

    def advance(self, node: Tensor, label: Tensor) -> Tensor:
        return self.next_of[node, label]


def build_boost_table(hotwords_by_row: list[Hotwords], weight: float, device: torch.device) -> BoostTable | None:
    """The table for a batch: ``hotwords_by_row[b]`` is row b's hotwords (empty: none), ``weight`` the bonus of a
    token that continues one that brings none of its own. Rows with the same hotwords share one tree. None when no
    row has any (decode as without)."""
    if not any(hotwords_by_row):
        return None
    children: list[dict[int, int]] = [{}]  # node -> {token: child}; node 0 is NULL_NODE
    bonuses: list[dict[int, float]] = [{}]  # node -> {token: the bonus of taking it from there}
    root_of = [NULL_NODE]
    trees: dict[Hotwords, int] = {}
    roots = []
    for hotwords in hotwords_by_row:
        if not hotwords:
            roots.append(NULL_NODE)
            continue
        if hotwords not in trees:
            root = trees[hotwords] = len(children)
            children.append({})
            bonuses.append({})
            root_of.append(root)
            for phrase in hotwords:
                bonus = weight if phrase.boost is None else phrase.boost
                node = root
                for token in phrase.tokens:
                    if token not in children[node]:
                        children[node][token] = len(children)
                        children.append({})
                        bonuses.append({})
                        root_of.append(root)
                    step = bonus * PHRASE_START_SHARE if node == root else bonus
                    bonuses[node][token] = max(bonuses[node].get(token, 0.0), step)
                    node = children[node][token]
        roots.append(trees[hotwords])
    width = max(1, max(len(c) for c in children))
    child_token = torch.full((len(children), width), -1, dtype=torch.long)
    child_node = torch.zeros((len(children), width), dtype=torch.long)
    child_bonus = torch.zeros((len(children), width))
    for node, kids in enumerate(children):
        for k, (token, child) in enumerate(kids.items()):
            child_token[node, k], child_node[node, k], child_bonus[node, k] = token, child, bonuses[node][token]
    return BoostTable(child_token.to(device), child_node.to(device), torch.tensor(root_of, device=device),
                      torch.tensor(roots, device=device), child_bonus.to(device))
