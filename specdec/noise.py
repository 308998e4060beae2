"""Counter-based random numbers keyed by (request seed, position, purpose).

Invariant: every random number specdec draws is a pure function of the request's seed, the
absolute position of the token it decides, what it is for (drafting, accepting, sampling the
target) and, for vocabulary-sized noise, the token id. A request's output therefore does not
depend on which other requests share its batch or on the batch order. The integer keys and
the uniforms are bit-identical on CPU and CUDA; the exponential noise goes through ``log``,
whose last bit may differ between the two (so a near-tie could, rarely, sample differently
across devices). Nothing here synchronises with the host, so it can run inside a
CUDA graph.

The hash is a 32-bit integer mixer evaluated in int64 arithmetic whose products never exceed
2**49, so no signed overflow occurs on any backend.
"""

from __future__ import annotations

import torch

DRAFT = 1  # a drafter sampling its proposal at a position
ACCEPT = 2  # the uniform that accepts or rejects a draft token at a position
TARGET = 3  # the target sampling a recovered or bonus token at a position

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32), exact in int64."""
    low = (x & 0xFFFF) * constant
    high = (((x >> 16) * constant) & 0xFFFF) << 16
    return (low + high) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche mixer on 32-bit values (the 'lowbias32' constants)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def stream_keys(seeds: torch.Tensor, positions: torch.Tensor, purpose: int | torch.Tensor) -> torch.Tensor:
    """One 32-bit key per (seed, position) for a purpose; shapes broadcast.

    seeds: [...] int64, positions: [...] int64, purpose: an int or [...] int64 -> keys [...]
    int64 in [0, 2**32).
    """
    seeds = seeds.to(torch.int64)
    key = hash32((seeds >> 32) + 0x9E3779B9 * purpose)  # high half of a 63-bit seed
    key = hash32(key ^ (seeds & _MASK32))
    return hash32(key ^ hash32(positions.to(torch.int64)))


def uniform(keys: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per key, as float64. keys: [...] -> [...]."""
    return (hash32(keys ^ 0x5BD1E995).to(torch.float64) + 0.5) / 2.0**32


def vocabulary_bits(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """32 random bits per (key, token id). keys: [...] -> [..., V] int64.

    key ^ hash(token): two keys coincide only on scattered single tokens, never on whole runs
    of the vocabulary shifted against each other.
    """
    token_ids = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)  # [V]
    return hash32(keys.unsqueeze(-1) ^ hash32(token_ids + 0x27D4EB2F))


def exponential_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Exp(1) from 32 random bits each: [...] int64 -> [...] float32, finite and > 0 for every input.

    u = (bits + 0.5) / 2**32 is exact in float64 and lies in [2**-33, 1 - 2**-33]; the noise
    -log1p(-u) (accurate at both ends) then lies in [1.2e-10, 22.9], and float32 holds it. Its
    smallest value bounds the rarest token the race can pick: a token of probability p beats a
    near-certain one only with noise below about p, so tokens below about 1e-10 are never drawn
    (their total mass is at most V * 1e-10). Computing u in float32 instead rounded the largest
    bit patterns to u = 1.0, whose noise 0 made ``0 / 0`` a NaN that argmax picked (a token of
    probability 0), and coarsened the grid near 0 so that tokens below about 1e-7 were lost.
    """
    u = (bits.to(torch.float64) + 0.5) / 2.0**32  # [...]
    return (-torch.log1p(-u)).to(torch.float32)


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise over the vocabulary for each key. keys: [...] -> [..., V] float32.

    ``argmax(probs / noise)`` is then a sample from ``probs`` (the exponential race), drawn
    without a host synchronisation. The noise is never 0, infinite or NaN, so a token of
    probability 0 scores exactly 0 and is never chosen while any token has probability > 0.
    """
    return exponential_from_bits(vocabulary_bits(keys, vocab_size))  # [..., V]
