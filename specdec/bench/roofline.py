"""SPIRe's performance model (arXiv 2504.06419; ALGORITHMS.md section 5), for our sizes.

A forward pass over B rows of n new tokens each, reading a model's weights once and each row's
keys and values at c positions, costs
    max(FLOPs / peak FLOP/s, (weight bytes + KV bytes) / memory bandwidth)
and speculative decoding with k drafted tokens and mean tokens per step tau runs at
    multiplier = tau / ((k * t_draft + t_verify) / t_target)
times plain decoding, where t_draft is one draft pass (one token a row), t_verify the target's
pass over k + 1 tokens a row and t_target its pass over one. The paper models only; the long-
context bench puts these numbers next to the measured ones.

Costs are per pass; the model ignores launch overheads and host time (what the measurement adds).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    flops: float  # peak FLOP/s of the dtype's matrix units
    bandwidth: float  # bytes/s of memory reads


@dataclass(frozen=True)
class PassCost:
    """What one pass of a model reads and computes."""

    weight_bytes: float  # read once per pass (the embedding table excluded: it is gathered, not read)
    flops_per_token: float  # 2 x the parameters a token multiplies (head included)
    kv_bytes_per_position: float  # keys and values of one cached position, all layers
    attention_flops_per_position: float  # per new token and cached position: 4 x layers x heads x head_dim

    @classmethod
    def of_model(cls, model, element_bytes: float | None = None) -> "PassCost":
        """A transformers decoder's costs from its config and parameters."""
        config = model.config.get_text_config()
        element_bytes = element_bytes or next(model.parameters()).element_size()
        embedding = model.get_input_embeddings().weight.numel()
        params = sum(p.numel() for p in model.parameters())
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        multiplied = params - (0 if tied else embedding)  # the head multiplies; the embedding is a lookup
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        layers = config.num_hidden_layers
        return cls(weight_bytes=multiplied * element_bytes, flops_per_token=2.0 * multiplied,
                   kv_bytes_per_position=2.0 * layers * kv_heads * head_dim * element_bytes,
                   attention_flops_per_position=4.0 * layers * config.num_attention_heads * head_dim)

    def seconds(self, rows: int, tokens_per_row: int, positions_per_row: float, hardware: Hardware) -> float:
        """One pass: ``rows`` rows of ``tokens_per_row`` new tokens, each row reading
        ``positions_per_row`` cached positions."""
        tokens = rows * tokens_per_row
        flops = tokens * (self.flops_per_token + self.attention_flops_per_position * positions_per_row)
        read = self.weight_bytes + rows * positions_per_row * self.kv_bytes_per_position
        return max(flops / hardware.flops, read / hardware.bandwidth)


def multiplier(tau: float, k: int, draft_seconds: float, verify_seconds: float, target_seconds: float) -> float:
    """SPIRe's throughput multiplier over plain decoding."""
    return tau / ((k * draft_seconds + verify_seconds) / target_seconds)


def modelled_speedup(target: PassCost, draft: PassCost | None, draft_positions: float, batch: int, context: float,
                     k: int, tau: float, hardware: Hardware) -> float:
    """The multiplier for a draft model reading ``draft_positions`` cached positions a row (the
    context for a small dense draft; sink + window + k for sparse ones); draft None: plain
    decoding (1.0)."""
    target_seconds = target.seconds(batch, 1, context, hardware)
    if draft is None or k == 0:
        return 1.0
    verify_seconds = target.seconds(batch, k + 1, context + k, hardware)
    draft_seconds = draft.seconds(batch, 1, draft_positions, hardware)
    return multiplier(tau, k, draft_seconds, verify_seconds, target_seconds)
