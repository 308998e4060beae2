"""Checks of what a caller hands to generate(): every misuse gets an exception that says what
was wrong and what to do, before any model runs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .drafters.base import Drafter
from .runner import check_supported, device_of, vocab_size_of

MAX_SEED = 2**63 - 1


def normalise_prompts(prompts, vocab_size: int, attention_mask=None) -> list[np.ndarray]:
    """A list of token-id lists or 1-D tensors, or a [B, T] tensor or list of equal lists (padded
    on either side, with its ``attention_mask``) -> list of int64 arrays, each checked."""
    if attention_mask is not None and isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        try:  # a tokenizer's padded output without return_tensors: a list of equal-length lists
            prompts = torch.as_tensor(prompts)
        except (TypeError, ValueError) as error:
            raise TypeError("prompts with an attention_mask must form one padded [B, T] batch of token ids") from error
    if attention_mask is not None and isinstance(prompts, (torch.Tensor, np.ndarray)) and np.ndim(prompts) == 1:
        raise TypeError("prompts with an attention_mask must be a padded [B, T] batch; pass [tensor] for one prompt "
                        "(no mask needed)")
    if isinstance(prompts, (torch.Tensor, np.ndarray)) and np.ndim(prompts) != 1:
        prompts = _unpadded_rows(prompts, attention_mask)
    elif attention_mask is not None:
        raise TypeError("attention_mask goes with prompts as one padded [B, T] tensor; prompts given as a list "
                        "need no mask (each prompt has its own length)")
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        raise TypeError(
            "prompts must be a list of token-id lists or 1-D tensors (one per request, any lengths), or a [B, T] "
            f"tensor; got one tensor of shape {tuple(prompts.shape)}: pass [tensor] for one prompt"
        )
    if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
        raise TypeError(f"prompts must be a list of token-id lists or 1-D tensors, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
    arrays = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex():
                raise TypeError(
                    f"prompt {index} must be a 1-D integer tensor of token ids, got shape "
                    f"{tuple(prompt.shape)} and dtype {prompt.dtype}"
                )
            array = prompt.detach().cpu().numpy().astype(np.int64)
        elif isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
                raise TypeError(
                    f"prompt {index} must be a 1-D integer array of token ids, got shape {prompt.shape} "
                    f"and dtype {prompt.dtype}"
                )
            array = prompt.astype(np.int64)
        elif isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(
                f"prompt {index} must be a list of token ids or a 1-D tensor, got {type(prompt).__name__}"
                + (": tokenize text first" if isinstance(prompt, str) else "")
            )
        else:
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
                raise TypeError(f"prompt {index} must hold integer token ids only")
            array = np.asarray(prompt, dtype=np.int64)
        if array.size == 0:
            raise ValueError(
                f"prompt {index} is empty; every prompt needs at least one token (for example a BOS token)"
            )
        bad = np.flatnonzero((array < 0) | (array >= vocab_size))
        if bad.size:
            raise ValueError(
                f"prompt {index} holds token id {int(array[bad[0]])} at index {int(bad[0])}, outside the "
                f"target's vocabulary [0, {vocab_size})"
            )
        arrays.append(array)
    return arrays


def _unpadded_rows(prompts, attention_mask) -> list[torch.Tensor]:
    """The rows of a [B, T] tensor, each cut to where ``attention_mask`` [B, T] is 1 (a row's ones
    must be contiguous: left or right padding), or whole without a mask."""
    tokens = torch.as_tensor(prompts)
    if tokens.dim() != 2:
        raise TypeError(f"prompts as one tensor must be 2-D [batch, tokens], got shape {tuple(tokens.shape)}")
    if attention_mask is None:
        return list(tokens)
    mask = torch.as_tensor(attention_mask).to("cpu")
    if mask.shape != tokens.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but prompts {tuple(tokens.shape)}: "
                         "pass the mask the tokenizer returned with these ids")
    if not torch.all((mask == 0) | (mask == 1)):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (a token)")
    rows = []
    for index, (row, keep) in enumerate(zip(tokens, mask.bool())):
        kept = torch.nonzero(keep).flatten()
        if len(kept) == 0:
            raise ValueError(f"prompt {index} is all padding (its attention_mask row has no 1)")
        first, last = int(kept[0]), int(kept[-1])
        if last - first + 1 != len(kept):
            raise ValueError(f"prompt {index}'s attention_mask has padding between tokens; only left or right "
                             "padding can be removed")
        rows.append(row[first : last + 1])
    return rows


def normalise_stop_sequences(stop_sequences, vocab_size: int) -> list[np.ndarray]:
    """None or a list of token-id lists (each non-empty) -> list of int64 arrays."""
    if stop_sequences is None:
        return []
    if isinstance(stop_sequences, (str, bytes, torch.Tensor)) or not isinstance(stop_sequences, Sequence):
        raise TypeError(f"stop_sequences must be a list of token-id lists, got {type(stop_sequences).__name__}")
    found = []
    for index, sequence in enumerate(stop_sequences):
        if isinstance(sequence, (int, np.integer)):
            raise TypeError(f"stop sequence {index} is one id ({sequence}); stop_sequences holds lists of ids: "
                            f"[[{sequence}]] for one token, or pass it as eos_token_id")
        if isinstance(sequence, torch.Tensor):
            sequence = sequence.tolist()
        if isinstance(sequence, (str, bytes)) or not isinstance(sequence, Sequence) or not all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < vocab_size for t in sequence):
            raise ValueError(f"stop sequence {index} must be a list of token ids in [0, {vocab_size}), got {sequence!r}")
        if len(sequence) == 0:
            raise ValueError(f"stop sequence {index} is empty")
        found.append(np.asarray(sequence, dtype=np.int64))
    return found


def check_min_new_tokens(min_new_tokens) -> int:
    if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, (int, np.integer)) or min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be an integer >= 0, got {min_new_tokens!r}")
    return int(min_new_tokens)


def check_max_new_tokens(max_new_tokens) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise TypeError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    return int(max_new_tokens)


def check_lengths_fit(target, prompts: list[np.ndarray], max_new_tokens: int) -> None:
    limit = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if limit is None:
        return
    for index, prompt in enumerate(prompts):
        if len(prompt) + max_new_tokens > limit:
            raise ValueError(
                f"prompt {index} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} it would reach "
                f"{len(prompt) + max_new_tokens} positions, beyond the model's maximum of {limit} "
                "(max_position_embeddings): shorten the prompt or lower max_new_tokens"
            )


def normalise_seeds(seed, num_rows: int) -> np.ndarray:
    """An int (request i gets seed + i) or one int per request -> [B] int64."""

    def valid(value) -> bool:
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value

    if valid(seed):
        if seed + num_rows - 1 > MAX_SEED:
            raise ValueError(f"seed must be at most {MAX_SEED - num_rows + 1} for {num_rows} prompts")
        return seed + np.arange(num_rows, dtype=np.int64)
    if isinstance(seed, Sequence) and not isinstance(seed, (str, bytes)):
        if len(seed) != num_rows or not all(valid(s) and s <= MAX_SEED for s in seed):
            raise ValueError(f"seed as a list needs one integer in [0, 2**63) per prompt ({num_rows})")
        return np.asarray(seed, dtype=np.int64)
    raise TypeError(f"seed must be an integer >= 0 or a list of them (one per prompt), got {seed!r}")


def normalise_eos(eos_token_id, vocab_size: int) -> np.ndarray:
    if eos_token_id is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(eos_token_id, (torch.Tensor, np.ndarray)):
        eos_token_id = eos_token_id.tolist()
    if isinstance(eos_token_id, (int, np.integer)):
        ids = [eos_token_id]
    elif isinstance(eos_token_id, (list, tuple, set, frozenset)):
        ids = list(eos_token_id)
    else:
        raise TypeError(f"eos_token_id must be a token id (int) or a list of them, got {eos_token_id!r}")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < vocab_size:
            raise ValueError(
                f"eos_token_id must be a token id (or a list of them) in [0, {vocab_size}), got {eos_token_id!r}"
            )
    return np.asarray(ids, dtype=np.int64)


def normalise_drafters(drafter) -> list[Drafter]:
    if drafter is None:
        return []
    drafters = list(drafter) if isinstance(drafter, (list, tuple)) else [drafter]
    for index, candidate in enumerate(drafters):
        if not isinstance(candidate, Drafter):
            hint = ": wrap a model as ModelDrafter(model)" if hasattr(candidate, "config") else ""
            raise TypeError(f"drafter {index} is a {type(candidate).__name__}, not a specdec Drafter{hint}")
        first = next(i for i, other in enumerate(drafters) if other is candidate)
        if first != index:
            raise ValueError(f"drafter {index} is the same object as drafter {first}: pass it once (a drafter keeps "
                             "one call's state), or make a second one, e.g. ModelDrafter(model) again")
    return drafters


def check_drafters(drafters: list[Drafter], target_vocab_size: int, prompts: list[np.ndarray],
                   max_new_tokens: int) -> None:
    """Drafters may sit on any device (their proposals are moved to the target's), but must have
    weights, share the target's vocabulary and handle the positions the call needs."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    for index, drafter in enumerate(drafters):
        drafter_device = drafter.device()
        if drafter_device is not None and torch.device(drafter_device).type == "meta":
            raise ValueError(f"drafter {index} ({drafter.describe()}) is on the meta device (no weights): load or "
                             "move its weights to a real device first")
        limit = drafter.max_positions()
        if limit is not None and longest > limit:
            raise ValueError(
                f"drafter {index} ({drafter.describe()}) handles at most {limit} positions, but the longest "
                f"prompt plus max_new_tokens={max_new_tokens} needs {longest}: shorten the prompts, lower "
                "max_new_tokens or use a drafter with more positions"
            )
        if drafter.vocab_size is not None and drafter.vocab_size != target_vocab_size:
            raise ValueError(
                f"drafter {index} ({drafter.describe()}) has a vocabulary of {drafter.vocab_size} tokens but the "
                f"target has {target_vocab_size}; a drafter must share the target's vocabulary"
            )


def check_component(value, expected: type, role: str) -> None:
    if isinstance(value, type) and issubclass(value, expected):
        raise TypeError(f"{role} must be an instance: pass {value.__name__}() rather than the class {value.__name__}")
    if not isinstance(value, expected):
        raise TypeError(f"{role} must be a specdec {expected.__name__}, got {type(value).__name__}")


def check_target(target) -> tuple[int, torch.device]:
    check_supported(target)
    device = device_of(target)
    devices = {p.device.type for p in target.parameters()}
    if devices == {"meta"}:  # all of them: offloading leaves some on meta
        raise ValueError("the target is on the meta device (no weights): load or move its weights to a real "
                         "device first (for example from_pretrained(...) without init on meta, or .to_empty() and "
                         "load_state_dict)")
    return vocab_size_of(target), device


def check_trees(drafters: list[Drafter], verifier, max_draft_tokens: int) -> None:
    """A drafter that grows token trees needs a verifier that verifies them, and its node budget
    (the policy's largest draft length) must fit the attention's ancestor masks."""
    from .runner import TREE_MASK_BITS

    growing = [f"drafter {i} ({d.describe()})" for i, d in enumerate(drafters) if d.makes_trees]
    if not growing:
        return
    observing = [f"drafter {i} ({d.describe()})" for i, d in enumerate(drafters) if d.target_hidden_layers()]
    if observing:
        raise ValueError(f"{observing[0]} reads the target's activations from chain verifications, which a token "
                         f"tree from {growing[0]} would replace with tree passes it cannot read: use them in separate "
                         "calls, or give the tree drafter no TreeSpec")
    if not getattr(verifier, "verifies_trees", False):
        raise ValueError(f"{growing[0]} proposes token trees, which {type(verifier).__name__} cannot verify: pass "
                         "verifier=TreeVerifier()")
    if max_draft_tokens > TREE_MASK_BITS:
        raise ValueError(f"{growing[0]} grows trees of up to the policy's {max_draft_tokens} draft tokens, over the "
                         f"{TREE_MASK_BITS} nodes the attention's ancestor masks hold: use a policy of at most "
                         f"{TREE_MASK_BITS} tokens")
