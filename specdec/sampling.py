"""Logits to probabilities, and the lossless acceptance rules.

Vocabulary (used everywhere in specdec): a draft token is **accepted** when the rule keeps it;
at the first rejection a **recovered** token is sampled from the residual distribution; when
every draft token is accepted a **bonus** token is sampled from the target's next distribution;
**emitted** = accepted + one recovered or bonus token, so every step emits at least one token.

Rules (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318):
- greedy (temperature 0): accept while the draft token equals the target's argmax; the
  emitted token at the first mismatch (or after the last draft token) is the target's argmax.
  The output is token-identical to the target's own greedy decoding.
- chain rejection sampling: accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i));
  at the first rejection j sample from normalise(max(0, p_j - q_j)); after k acceptances sample
  the bonus from p_{k+1}. The output is distributed exactly as the processed target
  distribution p.
- point mass (a drafter that returns no probabilities): q is one-hot on the draft token, so
  accept with probability p_i(x_i) and on rejection sample from p_j with x_j removed.
- trees (walk_tree, tree_verdict): greedy (the longest argmax path) and recursive rejection
  sampling over siblings drawn with replacement (SpecInfer), without (RSD, Sequoia) or chosen
  deterministically (q one-hot); a chain gets exactly the chain rule's verdict.

Every random number comes from ``noise.py``, keyed by (request seed, token position, purpose);
no rule synchronises with the host.

Rows with different sampling parameters (types.RowSampling) share one pass: ``process_logits``
then processes each row with its own, and gives a greedy row the point mass on its argmax, so
the sampled rules above reduce to the greedy rule on that row (accept exactly the argmax, emit
the argmax). Rows sharing one SamplingParams take the uniform paths, unchanged.
"""

from __future__ import annotations

import torch

from . import noise
from .types import PAD_ID, RowSampling, SamplingParams, Verdict

Sampling = SamplingParams | RowSampling  # one SamplingParams for every row, or each row's own


def process_logits(logits: torch.Tensor, params: Sampling) -> torch.Tensor:
    """Temperature, then top-k, then top-p; returns float32 probabilities.

    logits: [..., V] -> probs [..., V]; under a RowSampling, [R, ..., V], each row with its own
    parameters, a greedy row's distribution being the point mass on its argmax. Not for greedy
    params (there is no distribution).
    """
    if params.greedy:
        raise ValueError("process_logits needs temperature > 0; greedy decoding uses argmax")
    if isinstance(params, RowSampling):
        return _process_rows(logits, params)
    scores = logits.float() / params.temperature  # [..., V]
    vocab_size = scores.shape[-1]
    if params.top_k is not None and params.top_k < vocab_size:
        kth_best = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        scores = _cut_top_p(scores, params.top_p)
    return scores.softmax(dim=-1)


def _cut_top_p(scores: torch.Tensor, top_p) -> torch.Tensor:
    """scores [..., V] with every token outside the smallest set reaching probability top_p (a
    number, or a tensor broadcasting against [..., 1]) set to -inf."""
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)  # [..., V]
    sorted_probs = sorted_scores.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
    drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)
    return scores.masked_fill(drop, float("-inf"))


def _process_rows(logits: torch.Tensor, params: RowSampling) -> torch.Tensor:
    """process_logits with per-row parameters [R]: the same operations on each row as its own
    SamplingParams would run (a neutral value where it cuts nothing), so that a row's numbers
    are bit-for-bit those it gets alone. logits: [R, ..., V] -> [R, ..., V]."""
    scores = params.divide(logits.float(), params.temperature, params.inv_temperature)  # [R, ..., V]
    vocab_size = scores.shape[-1]
    if params.cuts_top_k:
        kth = params.per_row(params.top_k.clamp(max=vocab_size) - 1, logits)  # [R, 1, ..., 1]
        sorted_scores = torch.sort(scores, dim=-1, descending=True).values  # [R, ..., V]
        kth_best = sorted_scores.gather(-1, kth.expand(*scores.shape[:-1], 1))  # [R, ..., 1]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.cuts_top_p:  # an infinite top_p drops nothing
        scores = _cut_top_p(scores, params.per_row(params.top_p, logits))
    probs = scores.softmax(dim=-1)
    if not params.some_greedy:
        return probs
    argmax = torch.nn.functional.one_hot(logits.argmax(dim=-1), vocab_size).to(probs.dtype)  # from the logits' own dtype
    return torch.where(params.per_row(params.is_greedy, logits), argmax, probs)


def sample(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One token per distribution by the exponential race. probs: [..., V], keys: [...] -> [...]."""
    race = probs / noise.exponential_noise(keys, probs.shape[-1])  # [..., V]
    return race.argmax(dim=-1)


def next_tokens(
    logits: torch.Tensor, params: Sampling, seeds: torch.Tensor, positions: torch.Tensor, purpose: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Choose one token per row from its logits: argmax when greedy, else a keyed sample (a
    greedy row of a RowSampling: its argmax, with the point mass on it as its probabilities).

    logits: [R, V], seeds: [R], positions: [R] (position the token will take) ->
    (token_ids [R], probs [R, V] or None when greedy).
    """
    if params.greedy:
        return logits.argmax(dim=-1), None
    probs = process_logits(logits, params)  # [R, V]
    return sample(probs, noise.stream_keys(seeds, positions, purpose)), probs


def chain_verdict(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: Sampling,
    seeds: torch.Tensor,
    first_positions: torch.Tensor,
    logprobs: bool = False,
) -> Verdict:
    """Apply the chain acceptance rule to every row at once.

    draft_token_ids: [R, K] (PAD_ID beyond num_draft_tokens), num_draft_tokens: [R],
    target_logits: [R, K+1, V] (slot j scores the token at first_positions + j),
    draft_probs: [R, K, V] or None (point mass), seeds: [R], first_positions: [R]
    (position of the first draft token) -> Verdict with token_ids [R, K+1], and with each emitted
    token's log-probability when ``logprobs`` (emitted_logprobs, from the same processed p).
    """
    num_rows, max_draft = draft_token_ids.shape
    device = target_logits.device
    slots = torch.arange(max_draft + 1, device=device)  # [K+1]
    is_draft_slot = slots[:max_draft] < num_draft_tokens[:, None]  # [R, K]
    safe_draft_ids = draft_token_ids.clamp(min=0)  # [R, K]

    if params.greedy:
        target_choice = target_logits.argmax(dim=-1)  # [R, K+1]
        accepted = (safe_draft_ids == target_choice[:, :max_draft]) & is_draft_slot  # [R, K]
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [R]
        # Accepted drafts equal the target's argmax, so the emitted tokens are its argmax.
        emitted_candidates = target_choice  # [R, K+1]
    else:
        positions = first_positions[:, None] + slots  # [R, K+1]
        target_probs = process_logits(target_logits, params)  # [R, K+1, V]
        target_at_draft = target_probs[:, :max_draft].gather(-1, safe_draft_ids[..., None])[..., 0]  # [R, K]
        if draft_probs is None:
            draft_at_draft = torch.ones_like(target_at_draft)
        else:
            draft_at_draft = draft_probs.gather(-1, safe_draft_ids[..., None])[..., 0]  # [R, K]
        accept_u = noise.uniform(noise.stream_keys(seeds[:, None], positions[:, :max_draft], noise.ACCEPT))
        accepted = (accept_u * draft_at_draft.double() < target_at_draft.double()) & is_draft_slot  # [R, K]
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [R]
        residual = _residual_probs(target_probs, draft_probs, safe_draft_ids, is_draft_slot)  # [R, K+1, V]
        recovered = sample(residual, noise.stream_keys(seeds[:, None], positions, noise.TARGET))  # [R, K+1]
        draft_then_pad = torch.cat([safe_draft_ids, safe_draft_ids.new_zeros(num_rows, 1)], dim=1)
        emitted_candidates = torch.where(slots < num_accepted[:, None], draft_then_pad, recovered)

    num_emitted = num_accepted + 1  # [R]
    token_ids = emitted_candidates.masked_fill(slots >= num_emitted[:, None], PAD_ID)  # [R, K+1]
    verdict = Verdict(token_ids=token_ids, num_emitted=num_emitted, num_accepted=num_accepted)
    if logprobs:
        verdict.logprobs = emitted_logprobs(target_logits, token_ids, params, None if params.greedy else target_probs)
    return verdict


def emitted_logprobs(target_logits: torch.Tensor, token_ids: torch.Tensor, params: Sampling,
                     target_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probability of each emitted token under the target's processed distribution at its
    slot: log-softmax of the logits when greedy (as transformers' transition scores), the log of
    ``process_logits`` otherwise (``target_probs`` [R, K+1, V] when already processed); row by
    row under a RowSampling. target_logits: [R, K+1, V], token_ids: [R, K+1] (PAD_ID beyond the
    emitted ones, which get 0) -> [R, K+1] float32."""
    if params.greedy:
        log_probs = target_logits.float().log_softmax(dim=-1)  # [R, K+1, V]
    else:
        log_probs = (process_logits(target_logits, params) if target_probs is None else target_probs).log()
        if isinstance(params, RowSampling) and params.some_greedy:
            log_probs = torch.where(params.per_row(params.is_greedy, log_probs),
                                    target_logits.float().log_softmax(dim=-1), log_probs)
    chosen = log_probs.gather(-1, token_ids.clamp(min=0)[..., None])[..., 0]  # [R, K+1]
    return chosen.masked_fill(token_ids == PAD_ID, 0.0)


def _residual_probs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_ids: torch.Tensor, is_draft_slot: torch.Tensor
) -> torch.Tensor:
    """Distribution to sample from at each slot if the chain stops there (unnormalised).

    At a draft slot: max(0, p - q) (point mass: p with the draft token removed). After the last
    draft token (the bonus slot): p itself. target_probs: [R, K+1, V] -> [R, K+1, V].
    """
    max_draft = draft_ids.shape[1]
    at_drafts = target_probs[:, :max_draft]  # [R, K, V]
    if draft_probs is None:
        residual = at_drafts.scatter(-1, draft_ids[..., None], 0.0)
    else:
        residual = (at_drafts - draft_probs).clamp(min=0.0)
    # A residual with no mass can only arise from rounding (p == q); fall back to p there.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(is_draft_slot[..., None] & ~empty, residual, at_drafts)
    return torch.cat([residual, target_probs[:, max_draft:]], dim=1)


# --- token trees -----------------------------------------------------------------------------
# A row's tree: nodes 0..N-1 stored parents first, node i's parent parents[i] < i (-1: the root,
# the row's last committed token; DETACHED: an empty slot, whose own children must be DETACHED too). Slot 0 of the target's scores follows the root, slot i + 1
# follows node i. Children of a node are tried in index order.
DETACHED = -2  # the parent of a draft slot that holds no node of the tree: the rule never tries it
SIBLING_PURPOSE_STRIDE = 8  # the k-th sibling tried at a node draws its accept uniform for purpose ACCEPT + 8k


def tree_reach(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """[R, N] parent indices (-1 root), [R] real nodes -> [R, N, N] bool: node j is node i itself or
    one of its ancestors (root excluded). Log2(N) boolean products, no loop over nodes; a pad
    node (beyond num_nodes) or a parent that does not point earlier counts as a root child."""
    num_rows, num_tree = parents.shape
    nodes = torch.arange(num_tree, device=parents.device)
    sound = (parents >= 0) & (parents < nodes[None, :]) & (nodes[None, :] < num_nodes[:, None])  # [R, N]
    step = torch.zeros(num_rows, num_tree, num_tree, dtype=torch.float32, device=parents.device)
    step.scatter_(2, parents.clamp(min=0)[:, :, None], sound[:, :, None].float())  # [R, N, N] parent links
    reach = step + torch.eye(num_tree, device=parents.device)
    for _ in range(max(num_tree - 1, 1).bit_length()):  # paths of length up to 2^t after t squarings
        reach = (torch.bmm(reach, reach) > 0).float()
    return reach > 0


def node_depths(parents: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """[R, N] parent indices (-1 root) -> [R, N] depths (a root child is at depth 1)."""
    if num_nodes is None:
        num_nodes = torch.full(parents.shape[:1], parents.shape[1], device=parents.device)
    return tree_reach(parents, num_nodes).sum(dim=2)


def tree_masks(reach: torch.Tensor) -> torch.Tensor:
    """[R, N, N] tree_reach -> [R, N] int64 bitmask per node: bit j set when node j is the node or
    one of its ancestors (what the node attends to within the tree; N <= 64)."""
    bits = torch.ones(reach.shape[-1], dtype=torch.int64, device=reach.device) << torch.arange(
        reach.shape[-1], device=reach.device)  # 1 << 63 wraps to the sign bit: still that bit
    return (reach.long() * bits).sum(dim=2)


def sibling_ordinals(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """[R, N] -> [R, N] how many earlier nodes share each node's parent (its place among siblings)."""
    nodes = torch.arange(parents.shape[1], device=parents.device)
    real = nodes[None, :] < num_nodes[:, None]  # [R, N]
    same_parent = (parents[:, :, None] == parents[:, None, :]) & real[:, None, :]  # [R, N, N]
    earlier = nodes[None, :] < nodes[:, None]  # [N, N]: j before i
    return (same_parent & earlier).sum(dim=2)


def tree_accept_uniforms(parents: torch.Tensor, num_nodes: torch.Tensor, seeds: torch.Tensor,
                         first_positions: torch.Tensor, reach: torch.Tensor | None = None) -> torch.Tensor:
    """[R, N] the uniform that accepts or rejects each node, keyed by (seed, the node's position,
    its place among its siblings): a chain's nodes draw exactly the chain rule's uniforms.
    reach: tree_reach of the same tree, when the caller has it."""
    depths = node_depths(parents, num_nodes) if reach is None else reach.sum(dim=2)  # [R, N]
    positions = first_positions[:, None] + depths - 1  # [R, N] the position each node would take
    purposes = noise.ACCEPT + SIBLING_PURPOSE_STRIDE * sibling_ordinals(parents, num_nodes)  # [R, N]
    return noise.uniform(noise.stream_keys(seeds[:, None], positions, purposes))


def walk_tree(token_ids: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, target_scores: torch.Tensor,
              draft_probs: torch.Tensor | None, params: Sampling, accept_u: torch.Tensor | None,
              max_tried: int | None = None):
    """Walk every row's tree from the root: try the children of the current node in order, descend
    into the first one accepted, stop where none is.

    Greedy: a child is accepted when it is the target's argmax there (the longest path of argmax
    tokens). Otherwise recursive rejection sampling (SpecInfer, Miao et al. 2023, arXiv 2305.09781;
    RSD, Jeon et al. 2024, arXiv 2402.14160; Sequoia, Chen et al. 2024): with r the current residual
    (the processed target p on arriving at a node), child x, drawn from q, is accepted with
    probability min(1, r(x) / q(x)); on a rejection r becomes normalise(max(0, r - q)). ``draft_probs``
    [R, N, V] holds for each node the q it was drawn from: its parent's distribution for siblings
    drawn with replacement (SpecInfer), the parent's with the earlier siblings removed and
    renormalised for siblings drawn without (RSD); None means q = one-hot on each child, the rule
    for children chosen deterministically (top-k, a trie), which must never be paired with the
    draft's real q (biased: ALGORITHMS.md section 7). Each rule reproduces p exactly.

    token_ids, parents: [R, N]; num_nodes: [R]; target_scores: [R, N + 1, V] processed probabilities
    (logits when greedy), slot 0 after the root and i + 1 after node i; accept_u: [R, N] uniforms
    (ignored when greedy) -> (path [R, N] accepted nodes in order, -1 beyond; num_accepted [R];
    final_slot [R] the slot the last token is drawn at; residual [R, V] unnormalised distribution to
    draw it from, None when greedy; accept_probs [R, N] each tried node's probability of acceptance,
    NaN for nodes not tried). max_tried: a bound on the nodes one walk can try (a tree of depth D
    with at most C children a node tries at most D * C), when the caller knows one. One round of
    tensor operations per node tried (N + 1 rounds without a bound), no host synchronisation.
    """
    num_rows, num_tree = token_ids.shape
    device = token_ids.device
    rows = torch.arange(num_rows, device=device)
    nodes = torch.arange(num_tree, device=device)
    greedy = params.greedy
    current = torch.full((num_rows,), -1, dtype=torch.long, device=device)  # node walked to (-1 root)
    start = torch.zeros(num_rows, dtype=torch.long, device=device)  # first node index still to try there
    done = torch.zeros(num_rows, dtype=torch.bool, device=device)
    path = torch.full((num_rows, num_tree), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(num_rows, dtype=torch.long, device=device)
    accept_probs = torch.full((num_rows, num_tree), float("nan"), dtype=torch.float64, device=device)
    residual = None if greedy else target_scores[:, 0].double()  # [R, V]
    residual_mass = torch.ones(num_rows, dtype=torch.float64, device=device)  # sum of residual (p: taken as 1)
    rounds = num_tree + 1 if max_tried is None else min(num_tree, max_tried) + 1  # the last finds no child
    for _ in range(rounds):
        candidates = ((parents == current[:, None]) & (nodes[None, :] >= start[:, None])
                      & (nodes[None, :] < num_nodes[:, None]) & ~done[:, None])  # [R, N]
        has_child = candidates.any(dim=1)
        child = candidates.long().argmax(dim=1)  # the first candidate (0 where there is none)
        token = token_ids[rows, child].clamp(min=0)
        slot = current + 1
        if greedy:
            accepted = has_child & (token == target_scores[rows, slot].argmax(dim=-1))
        else:
            r_x = residual[rows, token]
            q = (torch.nn.functional.one_hot(token, residual.shape[1]).double() if draft_probs is None
                 else draft_probs[rows, child].double())  # [R, V]
            q_x = q[rows, token]
            accepted = has_child & (accept_u[rows, child] * q_x * residual_mass < r_x)
            ratio = torch.where(q_x > 0, r_x / (q_x * residual_mass), torch.where(r_x > 0, 1.0, 0.0)).clamp(max=1.0)
            # one write per row, no boolean indexing (it would synchronise): rows without a child rewrite a value
            accept_probs[rows, child] = torch.where(has_child, ratio, accept_probs[rows, child])
            rejected = has_child & ~accepted
            reduced = (residual / residual_mass[:, None] - q).clamp(min=0.0)  # [R, V]
            mass = reduced.sum(dim=1)
            fallback = mass <= 0  # only rounding leaves nothing (p == q, accepted with certainty)
            reduced = torch.where(fallback[:, None], target_scores[rows, slot].double(), reduced)
            mass = torch.where(fallback, 1.0, mass)
            residual = torch.where(rejected[:, None], reduced, residual)
            residual_mass = torch.where(rejected, mass, residual_mass)
            fresh = target_scores[rows, child + 1].double()  # p after an accepted child
            residual = torch.where(accepted[:, None], fresh, residual)
            residual_mass = torch.where(accepted, 1.0, residual_mass)
        if num_tree:
            depth = num_accepted.clamp(max=num_tree - 1)
            path[rows, depth] = torch.where(accepted, child, path[rows, depth])
        num_accepted = num_accepted + accepted.long()
        current = torch.where(accepted, child, current)
        start = torch.where(has_child, child + 1, start)
        done = done | ~has_child
    return path, num_accepted, current + 1, residual, accept_probs


def greedy_tree_path(token_ids: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                     target_logits: torch.Tensor, reach: torch.Tensor | None = None):
    """The greedy rule over a tree in a fixed number of tensor operations: a node is on the
    accepted path when it and every ancestor carry the target's argmax after their parent. With
    distinct siblings (check_tree) those nodes form one path from the root; its deepest node ends
    it. token_ids, parents: [R, N]; target_logits: [R, N + 1, V] -> (path [R, N], num_accepted [R],
    final_slot [R]) as walk_tree gives them."""
    num_rows, num_tree = token_ids.shape
    device = token_ids.device
    nodes = torch.arange(num_tree, device=device)
    if reach is None:
        reach = tree_reach(parents, num_nodes)  # [R, N, N]
    argmax = target_logits.argmax(dim=-1)  # [R, N + 1]
    real = (nodes[None, :] < num_nodes[:, None]) & (parents >= -1)
    matches = real & (token_ids == argmax.gather(1, parents.clamp(min=-1) + 1))  # [R, N]
    on_path = ~(reach & ~matches[:, None, :]).any(dim=2)  # [R, N]: no ancestor-or-self misses
    depths = reach.sum(dim=2)  # [R, N]
    num_accepted = (on_path * depths).amax(dim=1) if num_tree else torch.zeros(num_rows, dtype=torch.long, device=device)
    last = (on_path * depths).argmax(dim=1) if num_tree else num_accepted
    final_slot = torch.where(num_accepted > 0, last + 1, 0)
    path = torch.full((num_rows, num_tree + 1), -1, dtype=torch.long, device=device)  # a spare column for off-path nodes
    column = torch.where(on_path, depths - 1, num_tree)  # [R, N]
    path.scatter_(1, column, torch.where(on_path, nodes[None, :].expand(num_rows, -1), -1))
    return path[:, :num_tree], num_accepted, final_slot


def tree_verdict(token_ids: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, target_logits: torch.Tensor,
                 draft_probs: torch.Tensor | None, params: Sampling, seeds: torch.Tensor,
                 first_positions: torch.Tensor, logprobs: bool = False,
                 reach: torch.Tensor | None = None, max_tried: int | None = None) -> tuple[Verdict, torch.Tensor]:
    """The tree acceptance rule for every row at once (greedy_tree_path, walk_tree), with keyed
    randomness.

    token_ids, parents: [R, N] (PAD_ID / anything beyond num_nodes [R]); target_logits:
    [R, N + 1, V]; draft_probs: [R, N, V] or None (children chosen deterministically); seeds,
    first_positions: [R]; reach: tree_reach when the caller has it; max_tried: as for walk_tree
    -> (Verdict with token_ids
    [R, N + 1]: the accepted path's tokens, then the recovered or bonus token, and with their
    log-probabilities when ``logprobs``; path [R, N]: the accepted nodes, for the cache to keep).
    A chain (parents [-1, 0, 1, ...]) gets exactly chain_verdict's verdict. Trees are checked
    (check_tree) where they are built, on the host, not here in the step.
    """
    if params.greedy:
        path, num_accepted, final_slot = greedy_tree_path(token_ids, parents, num_nodes, target_logits, reach)
        scores = None
    else:
        scores = process_logits(target_logits, params)  # [R, N + 1, V]
        accept_u = tree_accept_uniforms(parents, num_nodes, seeds, first_positions, reach)
        path, num_accepted, final_slot, residual, _ = walk_tree(token_ids, parents, num_nodes, scores, draft_probs,
                                                               params, accept_u, max_tried)
    rows = torch.arange(token_ids.shape[0], device=token_ids.device)
    if params.greedy:
        last = target_logits[rows, final_slot].argmax(dim=-1)
    else:  # the final node's position: first_positions + its depth (the number of accepted nodes)
        last = sample(residual.float(), noise.stream_keys(seeds, first_positions + num_accepted, noise.TARGET))
    width = token_ids.shape[1] + 1
    emitted = torch.full((len(rows), width), PAD_ID, dtype=torch.long, device=token_ids.device)
    on_path = path >= 0
    emitted[:, :-1] = torch.where(on_path, token_ids.gather(1, path.clamp(min=0)), PAD_ID)
    emitted[rows, num_accepted] = last
    verdict = Verdict(token_ids=emitted, num_emitted=num_accepted + 1, num_accepted=num_accepted)
    if logprobs:  # emitted token j was scored at the slot after the path's node j - 1 (slot 0: after the root)
        slots = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1).clamp(min=0)  # [R, N + 1]
        slot_logits = target_logits.gather(1, slots[..., None].expand(-1, -1, target_logits.shape[-1]))
        slot_scores = None if scores is None else scores.gather(1, slots[..., None].expand(-1, -1, scores.shape[-1]))
        verdict.logprobs = emitted_logprobs(slot_logits, emitted, params, slot_scores)
    return verdict, path


TREE_PROBLEMS = {
    1: "a node's parent is neither -1 (the root), an earlier node nor -2 (an empty slot)",
    2: "two siblings carry the same token, which children chosen without probabilities (top-k, a trie, greedy "
       "decoding) must not",
    3: "a node hangs under an empty slot (parent -2); an empty slot's children must be empty slots too",
}


def tree_problems(token_ids: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                  deterministic: bool) -> torch.Tensor:
    """[R] the TREE_PROBLEMS code of each row's tree (0: sound), on the device, without a host
    synchronisation: the verifier copies it with the verdict. deterministic: children chosen
    without probabilities (q one-hot, or greedy decoding), whose siblings must differ."""
    nodes = torch.arange(parents.shape[1], device=parents.device)
    real = nodes[None, :] < num_nodes[:, None]  # [R, N]
    bad_parent = (real & ((parents >= nodes[None, :]) | (parents < DETACHED))).any(dim=1)
    detached = parents == DETACHED
    orphan = (real & (parents >= 0) & detached.gather(1, parents.clamp(min=0, max=max(parents.shape[1] - 1, 0)))).any(dim=1)
    code = torch.where(bad_parent, 1, torch.where(orphan, 3, 0))
    if deterministic:
        live = real & ~detached
        twins = (live[:, :, None] & live[:, None, :] & (parents[:, :, None] == parents[:, None, :])
                 & (token_ids[:, :, None] == token_ids[:, None, :]) & (nodes[None, :] < nodes[:, None])[None])
        code = torch.where((code == 0) & twins.flatten(1).any(dim=1), 2, code)
    return code


def check_tree(token_ids: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, deterministic: bool) -> None:
    """Raise a clear ValueError for the first malformed row (tree_problems), on the host: for a
    tree built by hand or in a test; the loop reads tree_problems from the verdict instead."""
    codes = tree_problems(token_ids, parents, num_nodes, deterministic)
    if codes.any():
        row = int(torch.nonzero(codes)[0])
        raise ValueError(f"tree row {row}: {TREE_PROBLEMS[int(codes[row])]}")
