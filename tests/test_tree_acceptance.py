"""The token-tree acceptance rule (sampling.walk_tree / tree_verdict).

Exact oracle: for vocabularies of 2-6 tokens and trees of up to 7 nodes, the children's draws
(with replacement from q, without replacement from q, or chosen deterministically) and every
accept decision are enumerated with their probabilities, and the distribution of the emitted
tokens is computed exactly: each emitted token, given the ones before it, must follow the
target's distribution at that point to 1e-9 (total variation), over 1,200 random (p, q, tree)
cases that include p = q, disjoint supports, q = 0 where p > 0, one-hot q and top-k-cut p.
Injected decisions: a node's uniform of 0 accepts it whenever it can be accepted and 1 rejects it
whenever it can be rejected; each walk is weighted by the probabilities walk_tree reports.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specdec.sampling import chain_verdict, check_tree, tree_verdict, walk_tree
from specdec.types import PAD_ID, SamplingParams

SAMPLING = SamplingParams(temperature=1.0)


class RandomModel:
    """p(path) and q(path): a distribution per token path, drawn once per path, of one of several
    kinds, so that p and q meet every adversarial pairing."""

    def __init__(self, vocab: int, rng: np.random.Generator):
        self.vocab, self.rng, self.p, self.q = vocab, rng, {}, {}

    def _draw(self):
        kind = self.rng.integers(4)
        probs = self.rng.dirichlet(np.full(self.vocab, 0.7))
        if kind == 1:  # a top-k cut: zeros
            probs[np.argsort(probs)[: self.rng.integers(1, self.vocab)]] = 0.0
        elif kind == 2:  # one-hot
            probs = np.eye(self.vocab)[self.rng.integers(self.vocab)]
        return probs / probs.sum()

    def target(self, path):
        if path not in self.p:
            self.p[path] = self._draw()
        return self.p[path]

    def draft(self, path):
        if path not in self.q:
            kind = self.rng.integers(4)
            p = self.target(path)
            if kind == 0:
                self.q[path] = p.copy()  # p = q
            elif kind == 1 and (p == 0).any():  # support disjoint from p's where possible
                q = (p == 0).astype(float)
                self.q[path] = q / q.sum()
            else:
                self.q[path] = self._draw()  # may be 0 where p > 0, or one-hot
        return self.q[path]


def random_parents(num_nodes: int, rng: np.random.Generator) -> list[int]:
    return [-1 if i == 0 else int(rng.integers(-1, i)) for i in range(num_nodes)]


def child_assignments(parents, model: RandomModel, scheme: str):
    """Every way the children's tokens can come out, with its probability, and each node's q.
    deterministic: distinct tokens per sibling group, q one-hot (None); with / without: siblings
    drawn from q(parent's path) with or without replacement."""
    num_nodes, vocab = len(parents), model.vocab
    if scheme == "deterministic":  # one fixed choice: a random order of the tokens per parent
        tokens, seen = [], {}
        for node, parent in enumerate(parents):
            order = seen.setdefault(parent, list(model.rng.permutation(vocab)))
            if not order:
                return []
            tokens.append(int(order.pop(0)))
        return [(tokens, 1.0, None)]
    found = []

    def extend(tokens, prob, qs):
        node = len(tokens)
        if node == num_nodes:
            found.append((list(tokens), prob, np.array(qs)))
            return
        parent = parents[node]
        path = tuple(path_of(parents, tokens, parent))
        q = model.draft(path).copy()
        if scheme == "without":  # earlier siblings' tokens removed, renormalised
            for earlier in range(node):
                if parents[earlier] == parent:
                    q[tokens[earlier]] = 0.0
            if q.sum() <= 0:
                return
            q = q / q.sum()
        for token in np.flatnonzero(q > 0):
            extend(tokens + [int(token)], prob * q[token], qs + [q])

    extend([], 1.0, [])
    return found


def path_of(parents, tokens, node) -> list[int]:
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def emitted_distribution(parents, model: RandomModel, scheme: str) -> dict[tuple, float] | None:
    """Exact distribution of the emitted token sequences of one step over the tree; None when the
    tree's shape cannot always be drawn (more siblings than q has tokens, without replacement, or
    than the vocabulary, deterministically): a drafter builds no such tree."""
    num_nodes, vocab = len(parents), model.vocab
    rows, weights = [], []
    outcome = {}
    assignments = child_assignments(parents, model, scheme)
    if abs(sum(prob for _, prob, _ in assignments) - 1.0) > 1e-12:
        return None
    for tokens, prob, qs in assignments:
        slots = [model.target(())] + [model.target(tuple(path_of(parents, tokens, i))) for i in range(num_nodes)]
        for pattern in itertools.product([0.0, 1.0], repeat=num_nodes):
            rows.append((tokens, slots, qs, pattern))
            weights.append(prob)
    count = len(rows)
    token_ids = torch.tensor([r[0] for r in rows])
    parent_t = torch.tensor(parents).expand(count, -1)
    scores = torch.tensor(np.array([r[1] for r in rows]))
    draft = None if scheme == "deterministic" else torch.tensor(np.array([r[2] for r in rows]))
    accept_u = torch.tensor([r[3] for r in rows], dtype=torch.float64)
    path, num_accepted, _, residual, accept_probs = walk_tree(
        token_ids, parent_t, torch.full((count,), num_nodes), scores, draft, SAMPLING, accept_u)
    tried = ~torch.isnan(accept_probs)
    branch = torch.where(accept_u == 0.0, accept_probs, 1.0 - accept_probs)
    weight = torch.tensor(weights) * torch.where(tried, branch, 0.5).prod(dim=1)  # untried: each u counted twice
    final = (residual / residual.sum(dim=1, keepdim=True) * weight[:, None]).numpy()  # [rows, V]
    prefixes = torch.where(path >= 0, token_ids.gather(1, path.clamp(min=0)), -1).numpy()  # accepted tokens, -1 after
    unique, inverse = np.unique(prefixes, axis=0, return_inverse=True)
    summed = np.zeros((len(unique), vocab))
    np.add.at(summed, inverse.ravel(), final)
    for prefix, finals in zip(unique, summed):
        prefix = tuple(int(t) for t in prefix if t >= 0)
        for token in np.flatnonzero(finals > 0):
            outcome[prefix + (int(token),)] = outcome.get(prefix + (int(token),), 0.0) + float(finals[token])
    return outcome


def largest_error(outcome: dict[tuple, float], model: RandomModel) -> float:
    """The largest total-variation distance between the emitted token after a prefix (given that
    the step emits one there) and the target's distribution after that prefix, and the emitted
    sequences' missing total probability."""
    worst = abs(sum(outcome.values()) - 1.0)
    prefixes = {seq[:m] for seq in outcome for m in range(len(seq))}
    for prefix in prefixes:
        nxt = np.zeros(model.vocab)
        for seq, prob in outcome.items():
            if len(seq) > len(prefix) and seq[: len(prefix)] == prefix:
                nxt[seq[len(prefix)]] += prob
        if nxt.sum() > 1e-12:
            worst = max(worst, 0.5 * np.abs(nxt / nxt.sum() - model.target(prefix)).sum())
    return worst


@pytest.mark.parametrize("scheme,cases,max_vocab,max_nodes", [
    ("deterministic", 400, 6, 7), ("with", 400, 4, 5), ("without", 400, 4, 5)])
def test_every_scheme_emits_the_target_distribution_exactly(scheme, cases, max_vocab, max_nodes):
    rng = np.random.default_rng({"deterministic": 0, "with": 1, "without": 2}[scheme])
    worst, checked = 0.0, 0
    while checked < cases:
        vocab = int(rng.integers(2, max_vocab + 1))
        parents = random_parents(int(rng.integers(1, max_nodes + 1)), rng)
        model = RandomModel(vocab, rng)
        outcome = emitted_distribution(parents, model, scheme)
        if outcome is not None:
            worst, checked = max(worst, largest_error(outcome, model)), checked + 1
    assert worst < 1e-9


def test_deterministic_children_with_the_drafts_real_q_are_biased():
    """The negative control of the oracle (ALGORITHMS.md section 7): the argmax child of q accepted
    with min(1, p / q) using the real q gives [0.857, 0, 0.071, 0.071] instead of p."""
    p = np.array([0.6, 0.2, 0.1, 0.1])
    q = np.array([0.7, 0.2, 0.05, 0.05])
    scores = torch.tensor(np.array([p, p]))[None].expand(2, -1, -1)  # [2 decisions, 2 slots, V]
    _, num_accepted, _, residual, accept_probs = walk_tree(
        torch.tensor([[0], [0]]), torch.tensor([[-1], [-1]]), torch.tensor([1, 1]), scores,
        torch.tensor(q)[None, None].expand(2, 1, -1), SAMPLING, torch.tensor([[0.0], [1.0]], dtype=torch.float64))
    accept = float(accept_probs[0, 0])
    first = np.zeros(4)
    first[0] += accept
    first += (1 - accept) * (residual[1] / residual[1].sum()).numpy()
    np.testing.assert_allclose(first, [6 / 7, 0, 1 / 14, 1 / 14], atol=1e-12)
    assert 0.5 * np.abs(first - p).sum() > 0.25


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("point_mass", [True, False])
def test_a_chain_gets_exactly_the_chain_rules_verdict(greedy, point_mass):
    generator = torch.Generator().manual_seed(3)
    rows, k, vocab = 300, 5, 12
    params = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=0.9, top_k=8)
    logits = torch.randn(rows, k + 1, vocab, generator=generator) * 2
    draft_probs = None if point_mass else torch.softmax(torch.randn(rows, k, vocab, generator=generator), dim=-1)
    # drafts that often agree with the target, so that chains run deep
    agree = torch.rand(rows, k, generator=generator) < 0.7
    tokens = torch.where(agree, logits[:, :k].argmax(-1), torch.randint(0, vocab, (rows, k), generator=generator))
    num_nodes = torch.randint(0, k + 1, (rows,), generator=generator)
    tokens = torch.where(torch.arange(k)[None] < num_nodes[:, None], tokens, PAD_ID)
    seeds, positions = torch.arange(rows) * 7, torch.randint(5, 50, (rows,), generator=generator)
    chain = chain_verdict(tokens, num_nodes, logits, draft_probs, params, seeds, positions)
    parents = (torch.arange(k) - 1).expand(rows, -1)
    tree, path = tree_verdict(tokens, parents, num_nodes, logits, draft_probs, params, seeds, positions)
    assert torch.equal(tree.num_accepted, chain.num_accepted) and torch.equal(tree.num_emitted, chain.num_emitted)
    assert torch.equal(tree.token_ids, chain.token_ids)
    assert torch.equal(path, torch.where(torch.arange(k)[None] < chain.num_accepted[:, None], torch.arange(k), -1))
    assert 0 < chain.num_accepted.float().mean() < k  # both rules had work to do


def test_greedy_walks_the_longest_argmax_path():
    """Brute force: follow the target's argmax from the root through the matching child."""
    generator = torch.Generator().manual_seed(4)
    rng = np.random.default_rng(4)
    for _ in range(200):
        num_nodes, vocab = int(rng.integers(1, 8)), 5
        parents = random_parents(num_nodes, rng)
        tokens = [int(t) for t in rng.integers(0, vocab, num_nodes)]
        # siblings must differ: re-draw clashes
        for node in range(num_nodes):
            taken = {tokens[j] for j in range(node) if parents[j] == parents[node]}
            free = [t for t in range(vocab) if t not in taken]
            tokens[node] = int(rng.choice(free)) if tokens[node] in taken else tokens[node]
        logits = torch.randn(1, num_nodes + 1, vocab, generator=generator)
        expected, current = [], -1
        while True:
            best = int(logits[0, current + 1].argmax())
            child = next((i for i in range(num_nodes) if parents[i] == current and tokens[i] == best), None)
            expected.append(best)
            if child is None:
                break
            current = child
        verdict, _ = tree_verdict(torch.tensor([tokens]), torch.tensor([parents]), torch.tensor([num_nodes]), logits,
                                  None, SamplingParams(), torch.tensor([0]), torch.tensor([3]))
        assert verdict.token_ids[0, : int(verdict.num_emitted[0])].tolist() == expected


def test_malformed_trees_get_clear_errors():
    tokens, count = torch.tensor([[1, 2, 3]]), torch.tensor([3])
    with pytest.raises(ValueError, match="row 0: a node's parent is neither -1 .the root., an earlier node nor -2"):
        check_tree(tokens, torch.tensor([[-1, 1, 0]]), count, deterministic=True)
    with pytest.raises(ValueError, match="row 1: a node's parent is neither"):  # a parent below -2
        check_tree(tokens.repeat(2, 1), torch.tensor([[-1, 0, 0], [-1, -3, 0]]), count.repeat(2), deterministic=False)
    with pytest.raises(ValueError, match="two siblings carry the same token"):
        check_tree(torch.tensor([[4, 4, 3]]), torch.tensor([[-1, -1, 0]]), count, deterministic=True)
    with pytest.raises(ValueError, match="hangs under an empty slot"):
        check_tree(tokens, torch.tensor([[-1, -2, 1]]), count, deterministic=False)
    check_tree(torch.tensor([[4, 4, 3]]), torch.tensor([[-1, -1, 0]]), count, deterministic=False)  # drawn with replacement
    check_tree(torch.tensor([[4, 4, 3]]), torch.tensor([[-1, -2, 0]]), count, deterministic=True)  # an empty slot's token
    check_tree(tokens, torch.tensor([[-1, 1, 0]]), torch.tensor([1]), deterministic=True)  # beyond the row's nodes


@pytest.mark.parametrize("scheme", ["with", "without", "deterministic"])
def test_decisions_follow_the_reported_acceptance_probabilities(scheme):
    """The oracle above weights each walk by the probabilities walk_tree reports and decides at
    u = 0 or 1 only; here, at random u over many trees, each tried node is accepted exactly when
    its uniform falls below its reported probability."""
    rng = np.random.default_rng(5)
    generator = torch.Generator().manual_seed(5)
    compared = 0
    for _ in range(150):
        vocab = int(rng.integers(2, 5))
        parents = random_parents(int(rng.integers(1, 6)), rng)
        model = RandomModel(vocab, rng)
        assignments = child_assignments(parents, model, scheme)
        if not assignments:
            continue
        num_nodes = len(parents)
        tokens = torch.tensor([a[0] for a in assignments])
        count = len(assignments)
        scores = torch.tensor(np.array([[model.target(())] + [model.target(tuple(path_of(parents, a[0], i)))
                                                              for i in range(num_nodes)] for a in assignments]))
        draft = None if scheme == "deterministic" else torch.tensor(np.array([a[2] for a in assignments]))
        accept_u = torch.rand(count, num_nodes, generator=generator, dtype=torch.float64)
        path, num_accepted, _, _, accept_probs = walk_tree(
            tokens, torch.tensor(parents).expand(count, -1), torch.full((count,), num_nodes), scores, draft, SAMPLING,
            accept_u)
        tried = ~torch.isnan(accept_probs)
        on_path = torch.zeros(count, num_nodes, dtype=torch.bool)
        for row in range(count):
            on_path[row, path[row, : num_accepted[row]]] = True
        assert torch.equal(on_path[tried], (accept_u < accept_probs)[tried])
        compared += int(tried.sum())
    assert compared > 200
