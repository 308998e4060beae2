"""What Hugging Face users expect of generate() (issue 31): the model's generation_config EOS,
padded [B, T] tensors with an attention mask, stop sequences and streaming; each checked
against transformers' own greedy decoding and plain Python oracles, with a drafter too."""

from __future__ import annotations

import pytest
import torch

from specdec import SamplingParams, generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.policies import FixedPolicy
from specdec.verifiers import PaddedVerifier, PaddingFreeVerifier
from tests.tiny import hf_greedy, make_model, perturbed_copy, random_prompts

NEW = 16


@pytest.fixture(scope="module")
def target():
    return make_model("llama", num_layers=2)


@pytest.fixture(scope="module")
def drafter_model(target):
    return perturbed_copy(target, 0.05)


def drafters(drafter_model):
    return {"plain": (None, FixedPolicy(0)), "model": (ModelDrafter(drafter_model), FixedPolicy(3)),
            "lookup": (PromptLookupDrafter(), FixedPolicy(3))}


def hf_default_greedy(model, prompt):
    """transformers' greedy decoding with the model's own generation_config (no eos argument)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["plain", "model", "lookup"])
def test_the_generation_config_eos_stops_rows_when_none_is_given(target, drafter_model, kind):
    prompts = random_prompts(4, 96, seed=11, min_len=3)
    free = [hf_greedy(target, p, NEW) for p in prompts]
    eos = free[0][5]  # the first row stops at its sixth token
    target.generation_config.eos_token_id = eos
    try:
        expected = [hf_default_greedy(target, p) for p in prompts]  # transformers reads the same config
        drafter, policy = drafters(drafter_model)[kind]
        assert generate(target, prompts, drafter=drafter, policy=policy, max_new_tokens=NEW).sequences == expected
        assert len(expected[0]) <= 6 and expected[0][-1] == eos
        # [] never stops early, whatever the config says
        assert generate(target, prompts, eos_token_id=[], max_new_tokens=NEW).sequences == free
    finally:
        target.generation_config.eos_token_id = None


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_tensor_with_its_mask_decodes_as_the_unpadded_prompts(target, drafter_model, side):
    prompts = random_prompts(5, 96, seed=12, min_len=2, max_len=9)
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), 7)  # padding with a real token id: only the mask says it is padding
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        cols = slice(width - len(prompt), width) if side == "left" else slice(0, len(prompt))
        ids[row, cols], mask[row, cols] = torch.tensor(prompt), 1
    expected = [hf_greedy(target, p, NEW) for p in prompts]
    out = generate(target, ids, attention_mask=mask, drafter=ModelDrafter(drafter_model), policy=FixedPolicy(3),
                   max_new_tokens=NEW)
    assert out.sequences == expected
    # without a mask every column is a token: the pad ids are read as part of the prompt
    unmasked = generate(target, ids, max_new_tokens=NEW).sequences
    assert unmasked == [hf_greedy(target, row.tolist(), NEW) for row in ids]


def stop_oracle(prompt, free_running, stops):
    """The free-running output cut right after the first new token that completes a stop sequence."""
    full = list(prompt)
    for index, token in enumerate(free_running):
        full.append(token)
        if any(len(full) >= len(s) and full[-len(s):] == list(s) for s in stops):
            return free_running[: index + 1]
    return free_running


@pytest.mark.parametrize("kind", ["plain", "model", "lookup"])
def test_stop_sequences_end_rows_right_after_them(target, drafter_model, kind):
    prompts = random_prompts(4, 96, seed=13, min_len=3)
    free = [hf_greedy(target, p, NEW) for p in prompts]
    # one sequence taken from inside row 0's output (completed by a token mid-draft), one that
    # begins in row 1's prompt, and one that never occurs
    stops = [free[0][6:9], [prompts[1][-1], free[1][0]], [95, 95, 95, 95, 95]]
    expected = [stop_oracle(p, f, stops) for p, f in zip(prompts, free)]
    assert len(expected[0]) <= 9 and expected[1] == free[1][:1]
    drafter, policy = drafters(drafter_model)[kind]
    out = generate(target, prompts, drafter=drafter, policy=policy, max_new_tokens=NEW, stop_sequences=stops)
    assert out.sequences == expected


def test_streaming_hands_over_each_rows_new_tokens_after_every_step(target, drafter_model):
    prompts = random_prompts(3, 96, seed=14, min_len=3)
    pieces = []
    out = generate(target, prompts, drafter=ModelDrafter(drafter_model), policy=FixedPolicy(3), max_new_tokens=NEW,
                   stream=lambda index, tokens: pieces.append((index, tokens)))
    for row, sequence in enumerate(out.sequences):
        mine = [tokens for index, tokens in pieces if index == row]
        assert sum(mine, []) == sequence and all(mine)  # in order, nothing lost, no empty call
        assert len(mine) == out.stats.requests[row].steps  # one call per step the row took part in
    assert len(pieces) > len(prompts)


def hf_greedy_with(model, prompt, eos, **options):
    """transformers' greedy decoding with its own logits processors for ``options``."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                         eos_token_id=eos, pad_token_id=0, **options)
    return out[0, len(prompt):].tolist()


RULES = {"penalty": dict(repetition_penalty=1.6), "min_new": dict(min_new_tokens=6),
         "both": dict(repetition_penalty=0.7, min_new_tokens=6)}  # a penalty below 1 favours repeats


@pytest.mark.parametrize("rules", sorted(RULES))
@pytest.mark.parametrize("kind", ["plain", "model", "lookup"])
def test_repetition_penalty_and_min_new_tokens_match_transformers(target, drafter_model, kind, rules):
    prompts = random_prompts(4, 96, seed=15, min_len=3)
    options = RULES[rules]
    free = [hf_greedy_with(target, p, None, **{k: v for k, v in options.items() if k != "min_new_tokens"})
            for p in prompts]
    eos = free[0][1]  # early in row 0's output: min_new_tokens holds it back there
    expected = [hf_greedy_with(target, p, eos, **options) for p in prompts]
    if "min_new_tokens" in options:
        assert len(expected[0]) > 2  # the rule changed row 0's output
    if "repetition_penalty" in options:
        assert free != [hf_greedy_with(target, p, None) for p in prompts]  # and the penalty changes outputs
    drafter, policy = drafters(drafter_model)[kind]
    sampling = SamplingParams(repetition_penalty=options.get("repetition_penalty"))
    out = generate(target, prompts, drafter=drafter, policy=policy, max_new_tokens=NEW, eos_token_id=eos,
                   sampling=sampling, min_new_tokens=options.get("min_new_tokens", 0))
    assert out.sequences == expected


@pytest.mark.parametrize("penalty", [None, 1.6])
@pytest.mark.parametrize("kind", ["plain", "model", "lookup"])
def test_greedy_logprobs_equal_transformers_transition_scores(target, drafter_model, kind, penalty):
    prompts = random_prompts(3, 96, seed=16, min_len=3)
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                              pad_token_id=0, repetition_penalty=penalty, output_scores=True,
                              return_dict_in_generate=True)
        scores = target.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
        expected.append((out.sequences[0, len(prompt):].tolist(), scores.tolist()))
    drafter, policy = drafters(drafter_model)[kind]
    out = generate(target, prompts, drafter=drafter, policy=policy, max_new_tokens=NEW, return_logprobs=True,
                   sampling=SamplingParams(repetition_penalty=penalty))
    for (tokens, scores), sequence, logprobs in zip(expected, out.sequences, out.logprobs):
        assert sequence == tokens and len(logprobs) == len(tokens)
        assert logprobs == pytest.approx(scores, abs=1e-5)
        assert all(lp < 0 for lp in logprobs)


@pytest.mark.parametrize("arch", ["qwen2", "gpt_neox"])
@pytest.mark.parametrize("verifier", [PaddedVerifier, PaddingFreeVerifier])
def test_the_rules_hold_on_other_architectures_and_verifiers(arch, verifier):
    """The same rules (a penalty and min_new_tokens together) through both verifiers, at batch 1
    and 5, on two more architectures."""
    model = make_model(arch, num_layers=2)
    small = perturbed_copy(model, 0.05)
    prompts = random_prompts(5, 96, seed=17, min_len=2)
    eos = hf_greedy_with(model, prompts[0], None, repetition_penalty=1.4)[2]
    expected = [hf_greedy_with(model, p, eos, repetition_penalty=1.4, min_new_tokens=5) for p in prompts]
    options = dict(drafter=ModelDrafter(small), verifier=verifier(), policy=FixedPolicy(3), max_new_tokens=NEW,
                   eos_token_id=eos, min_new_tokens=5, sampling=SamplingParams(repetition_penalty=1.4))
    assert generate(model, prompts, **options).sequences == expected
    assert [generate(model, [p], **options).sequences[0] for p in prompts[:2]] == expected[:2]


PENALTY = 0.5


@pytest.mark.parametrize("verifier", [PaddedVerifier, PaddingFreeVerifier])
def test_a_drafter_that_copies_the_target_applies_the_same_rules(target, verifier):
    """The drafter adjusts its logits at each depth from the tokens before that position, as the
    target does at each slot: a drafter with the target's own weights has every draft accepted
    with both rules on (a shift of one token in either would cost acceptances). A penalty below 1
    favours the tokens seen, the one just drafted too, so a drafter that missed it would differ."""
    prompts = random_prompts(4, 96, seed=18, min_len=3)
    # an EOS that the rules hold back early in row 0 and that no row emits later: with no row cut
    # short, every accepted draft counts, so one rejection would show
    free = hf_greedy_with(target, prompts[0], None, repetition_penalty=PENALTY)
    ruled = {t: [hf_greedy_with(target, p, t, repetition_penalty=PENALTY, min_new_tokens=6) for p in prompts]
             for t in free[:6]}
    eos = next(t for t, outputs in ruled.items() if all(t not in o for o in outputs))
    out = generate(target, prompts, drafter=ModelDrafter(target), verifier=verifier(), policy=FixedPolicy(4),
                   max_new_tokens=NEW, eos_token_id=eos, min_new_tokens=6,
                   sampling=SamplingParams(repetition_penalty=PENALTY))
    assert out.stats.acceptance_rate == 1.0
    assert out.sequences == ruled[eos]


def test_a_tokenizers_padded_lists_with_their_mask(target):
    """What a tokenizer returns without return_tensors: equal-length lists and a list mask."""
    prompts = [[5, 6, 7, 8], [9, 10]]
    ids, mask = [[5, 6, 7, 8], [0, 0, 9, 10]], [[1, 1, 1, 1], [0, 0, 1, 1]]
    out = generate(target, ids, attention_mask=mask, max_new_tokens=6)
    assert out.sequences == [hf_greedy(target, p, 6) for p in prompts]
