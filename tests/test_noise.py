"""Counter-based randomness: a pure function of (seed, position, purpose), uniform, and the same
on every device."""

import math

import pytest
import torch
from scipy import stats

from specdec import noise


def test_same_key_same_numbers_whatever_the_batch():
    seeds, positions = torch.tensor([3, 9, 27]), torch.tensor([0, 5, 11])
    together = noise.uniform(noise.stream_keys(seeds, positions, noise.ACCEPT))
    alone = torch.cat([noise.uniform(noise.stream_keys(seeds[i : i + 1], positions[i : i + 1], noise.ACCEPT)) for i in range(3)])
    assert torch.equal(together, alone)


def test_purposes_seeds_and_positions_give_different_streams():
    base = noise.stream_keys(torch.tensor([1]), torch.tensor([4]), noise.ACCEPT)
    assert base != noise.stream_keys(torch.tensor([1]), torch.tensor([4]), noise.TARGET)
    assert base != noise.stream_keys(torch.tensor([2]), torch.tensor([4]), noise.ACCEPT)
    assert base != noise.stream_keys(torch.tensor([1]), torch.tensor([5]), noise.ACCEPT)
    assert base != noise.stream_keys(torch.tensor([1 + 2**32]), torch.tensor([4]), noise.ACCEPT)


def test_uniforms_are_uniform_and_uncorrelated():
    """KS test at 1e-3 over 200,000 draws; lag-1 correlation below 4 standard errors."""
    n = 200_000
    u = noise.uniform(noise.stream_keys(torch.zeros(n, dtype=torch.long), torch.arange(n), noise.ACCEPT))
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]) < 4 / n**0.5
    assert u.min() > 0 and u.max() < 1


def test_exponential_noise_is_exponential():
    e = noise.exponential_noise(noise.stream_keys(torch.tensor([5]), torch.tensor([0]), noise.TARGET), 100_000)[0]
    assert stats.kstest(e.double().numpy(), "expon").pvalue > 1e-3


def lowbias32(x: int) -> int:
    """The same mixer on Python integers, as the reference."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_equals_the_plain_integer_reference():
    generator = torch.Generator().manual_seed(0)
    values = torch.cat([torch.tensor([0, 1, 2**32 - 1, 2**32, 2**63 - 1]),
                        torch.randint(0, 2**62, (2000,), generator=generator)])
    assert noise.hash32(values).tolist() == [lowbias32(v) for v in values.tolist()]


def test_noise_of_two_keys_is_never_a_shifted_copy():
    """A scheme hashing key * C + token makes key2 = key1 + 5 / C (mod 2**32) repeat key1's noise
    shifted by 5 tokens; the keys below are exactly such a pair."""
    multiplier = 0x27D4EB2F
    first = 123456789
    second = (first + 5 * pow(multiplier, -1, 2**32)) % 2**32
    shifted_scheme = [noise.hash32(torch.tensor([k]) * multiplier + torch.arange(1000)) for k in (first, second)]
    assert torch.equal(shifted_scheme[1][:-5], shifted_scheme[0][5:])  # the failure this guards against
    ours = noise.vocabulary_bits(torch.tensor([first, second]), 1000)
    for shift in range(-20, 21):
        a, b = (ours[0, shift:], ours[1, : 1000 - shift]) if shift >= 0 else (ours[0, :shift], ours[1, -shift:])
        assert (a == b).sum() <= 1


@pytest.mark.cuda
def test_cpu_and_cuda_draw_the_same_numbers():
    seeds, positions = torch.arange(100), torch.arange(100) * 7
    cpu_keys = noise.stream_keys(seeds, positions, noise.DRAFT)
    gpu_keys = noise.stream_keys(seeds.cuda(), positions.cuda(), noise.DRAFT)
    assert torch.equal(cpu_keys, gpu_keys.cpu())
    assert torch.equal(noise.uniform(cpu_keys), noise.uniform(gpu_keys).cpu())  # bit-identical
    # the exponential goes through log, whose last bit may differ between devices
    torch.testing.assert_close(noise.exponential_noise(cpu_keys, 64), noise.exponential_noise(gpu_keys, 64).cpu(), rtol=1e-6, atol=0)


def test_exponential_noise_is_finite_and_positive_at_every_scale_of_the_bits():
    """2**23 bit patterns spread over the whole 32-bit range, and both ends: the largest used to
    round u to 1.0 and give noise 0 (then 0 / 0 = NaN, which argmax picks)."""
    spread = torch.arange(2**23, dtype=torch.int64) << 9
    for bits in (spread, spread | 0x1FF, torch.tensor([0, 1, 2, 2**32 - 2, 2**32 - 1])):
        e = noise.exponential_from_bits(bits)
        assert torch.isfinite(e).all() and (e > 0).all()
    ends = noise.exponential_from_bits(torch.tensor([0, 2**32 - 1]))
    # the smallest noise is -log1p(-2**-33), about 2**-33: tokens down to about 1e-10 can win the race
    assert ends[0].item() == pytest.approx(2.0**-33, rel=1e-6)
    assert ends[1].item() == pytest.approx(33 * math.log(2), rel=1e-6)  # -log(2**-33)
    # a zero-probability token scores 0 against any noise, so it never wins the race
    probs = torch.tensor([0.0, 1.0, 0.0])
    assert (probs / noise.exponential_from_bits(torch.tensor([2**32 - 1, 0, 2**32 - 1]))).argmax() == 1


def test_the_noise_near_zero_has_the_resolution_of_all_32_bits():
    """A token of probability p beats a near-certain one when its noise falls below about p, so the
    noise's grid near 0 sets the rarest token the race can pick. Each of the 4,096 smallest bit
    patterns gives its own value, (b + 0.5) / 2**32 (-log1p(-x) = x to first order): a token of
    probability 2e-9 has about 9 winning patterns (a grid of 2**-23 or 2**-24 gave it none)."""
    bits = torch.arange(4096)
    e = noise.exponential_from_bits(bits).double()
    torch.testing.assert_close(e, (bits.double() + 0.5) / 2.0**32, rtol=1e-6, atol=0)
    assert int((e < 2e-9).sum()) == 9


def test_top_k_one_samples_the_argmax_at_a_large_vocabulary():
    """With top_k = 1 the processed distribution is one-hot, so every sample must be the argmax.
    800 draws at V = 32,000 (requests 400-1199): noise that could be 0 (the fault above) picked a
    zero-probability token in about 0.2% of draws, 3 of these."""
    from specdec.sampling import next_tokens
    from specdec.types import SamplingParams

    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_k=1)
    for first_seed in (400, 800):
        logits = torch.randn(400, 32_000, generator=generator)  # [R, V]
        seeds = torch.arange(first_seed, first_seed + 400)
        tokens, _ = next_tokens(logits, params, seeds, torch.full((400,), 3), noise.TARGET)
        assert torch.equal(tokens, logits.argmax(dim=-1))
