"""Every misuse gets an exception whose message says what was wrong and what to do."""

import pytest
import torch

from specdec import SamplingParams, UnsupportedModelError, generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.policies import FixedPolicy
from tests.tiny import make_model


@pytest.fixture(scope="module")
def target():
    return make_model("llama", max_positions=256)


def test_no_prompts(target):
    with pytest.raises(ValueError, match="prompts is empty"):
        generate(target, [])


def test_an_empty_prompt(target):
    with pytest.raises(ValueError, match="prompt 1 is empty.*at least one token"):
        generate(target, [[1, 2], []])


def test_token_id_outside_the_vocabulary(target):
    with pytest.raises(ValueError, match=r"prompt 0 holds token id 96 at index 2, outside the target's vocabulary \[0, 96\)"):
        generate(target, [[1, 2, 96]])
    with pytest.raises(ValueError, match="token id -3"):
        generate(target, [torch.tensor([-3, 1])])


def test_prompts_of_the_wrong_type(target):
    with pytest.raises(TypeError, match="tokenize text first"):
        generate(target, ["hello"])
    with pytest.raises(TypeError, match=r"must be 2-D \[batch, tokens\], got shape \(2, 3, 1\)"):
        generate(target, torch.ones(2, 3, 1, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        generate(target, [torch.ones(3)])


def test_drafter_with_another_vocabulary_size(target):
    other = make_model("llama", vocab_size=100)
    with pytest.raises(ValueError, match="vocabulary of 100 tokens but the target has 96"):
        generate(target, [[1, 2]], drafter=ModelDrafter(other))


def test_drafter_without_weights(target):
    drafter = ModelDrafter(make_model("llama"))
    drafter.device = lambda: torch.device("meta")
    with pytest.raises(ValueError, match="drafter 0 .* is on the meta device .no weights."):
        generate(target, [[1, 2]], drafter=drafter)


@pytest.mark.parametrize("value", [-1, -100])
def test_negative_max_new_tokens(target, value):
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        generate(target, [[1, 2]], max_new_tokens=value)


def test_max_new_tokens_not_an_integer(target):
    with pytest.raises(TypeError, match="max_new_tokens must be an integer"):
        generate(target, [[1, 2]], max_new_tokens=2.5)


def test_negative_temperature():
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-0.5)


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5])
def test_top_p_outside_zero_one(top_p):
    with pytest.raises(ValueError, match=r"top_p must lie in \(0, 1\]"):
        SamplingParams(temperature=1.0, top_p=top_p)


@pytest.mark.parametrize("top_k", [0, -2, 1.5])
def test_top_k_below_one(top_k):
    with pytest.raises(ValueError, match="top_k must be an integer >= 1"):
        SamplingParams(temperature=1.0, top_k=top_k)


def test_prompt_plus_new_tokens_beyond_max_positions():
    target = make_model("llama", max_positions=64)
    with pytest.raises(ValueError, match="prompt 1 has 60 tokens; with max_new_tokens=10 .* 70 positions, beyond the model's maximum of 64"):
        generate(target, [[1], [2] * 60], max_new_tokens=10)
    assert len(generate(target, [[2] * 60], max_new_tokens=4).sequences[0]) == 4  # exactly at the limit is fine


def test_policy_drafts_without_a_drafter(target):
    with pytest.raises(ValueError, match="no drafter was given"):
        generate(target, [[1, 2]], policy=FixedPolicy(3))


def test_policy_names_a_missing_drafter(target):
    with pytest.raises(ValueError, match="uses drafter 2 but generate\\(\\) was given 1"):
        generate(target, [[1, 2]], drafter=PromptLookupDrafter(), policy=FixedPolicy(3, drafter_index=2))


def test_a_model_passed_as_drafter(target):
    with pytest.raises(TypeError, match="wrap a model as ModelDrafter"):
        generate(target, [[1, 2]], drafter=make_model("llama"))


@pytest.mark.parametrize("seed", [-1, "x", [1, 2]])
def test_bad_seeds(target, seed):
    with pytest.raises((TypeError, ValueError), match="seed"):
        generate(target, [[1, 2]], seed=seed)


def test_eos_outside_the_vocabulary(target):
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        generate(target, [[1, 2]], eos_token_id=500)


def test_bad_fixed_policy():
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 0"):
        FixedPolicy(-1)


def test_numpy_inputs_are_accepted(target):
    import numpy as np

    as_lists = generate(target, [[1, 2, 3], [4]], max_new_tokens=5, eos_token_id=7)
    as_numpy = generate(target, [np.array([1, 2, 3]), np.array([4], dtype=np.int32)], max_new_tokens=5,
                        eos_token_id=torch.tensor(7))
    assert as_lists.sequences == as_numpy.sequences
    params = SamplingParams(temperature=np.float32(0.7), top_p=np.float64(0.9))
    assert params.temperature == pytest.approx(0.7) and params.top_p == pytest.approx(0.9)


def test_a_verifier_or_policy_class_instead_of_an_instance(target):
    from specdec.verifiers import PaddedVerifier

    with pytest.raises(TypeError, match=r"pass PaddedVerifier\(\) rather than the class"):
        generate(target, [[1, 2]], verifier=PaddedVerifier)
    with pytest.raises(TypeError, match="policy must be a specdec Policy, got int"):
        generate(target, [[1, 2]], policy=4)


class BrokenPolicy(FixedPolicy):
    def __init__(self, drafter_index, num_draft_tokens):
        super().__init__(2)
        self.bad = (drafter_index, num_draft_tokens)

    def plan(self, batch, num_drafters):

        plan = super().plan(batch, num_drafters)
        plan.drafter_index[:] = self.bad[0]
        plan.num_draft_tokens[:] = self.bad[1]
        return plan


@pytest.mark.parametrize("drafter_index,num_tokens,message", [(3, 2, "named a drafter outside the 1"),
                                                             (0, 5, r"outside \[0, max_draft_tokens=2\]"),
                                                             (0, -1, r"outside \[0, max_draft_tokens=2\]")])
def test_a_policy_plan_out_of_bounds(target, drafter_index, num_tokens, message):
    with pytest.raises(ValueError, match=message):
        generate(target, [[1, 2]], drafter=PromptLookupDrafter(), policy=BrokenPolicy(drafter_index, num_tokens))


def test_drafter_with_fewer_positions_than_needed(target):
    short = make_model("llama", max_positions=16)
    with pytest.raises(ValueError, match="handles at most 16 positions, but the longest prompt plus max_new_tokens=20 needs 22"):
        generate(target, [[1, 2]], drafter=ModelDrafter(short), max_new_tokens=20)


def test_chunked_attention_models_are_refused():
    from specdec import UnsupportedModelError

    model = make_model("llama")
    model.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        generate(model, [[1, 2]], max_new_tokens=2)


def test_compile_without_cuda_graphs(target):
    with pytest.raises(ValueError, match="cuda_graphs=True"):
        generate(target, [[1, 2, 3]], compile=True)
    with pytest.raises(TypeError, match="compile must be True or False"):
        generate(target, [[1, 2, 3]], compile="yes")


def _masked_lm():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    return BertForMaskedLM(config).eval()


def test_a_bidirectional_model_is_refused_as_target_and_as_drafter(target):
    with pytest.raises(UnsupportedModelError, match="BertForMaskedLM is not a causal decoder.*bidirectional"):
        generate(_masked_lm(), [[1, 2, 3]], max_new_tokens=2)
    with pytest.raises(UnsupportedModelError, match="not a causal decoder"):
        ModelDrafter(_masked_lm())


def test_a_target_without_weights():
    with torch.device("meta"):
        meta_target = make_model("llama", device="meta")
    with pytest.raises(ValueError, match="the target is on the meta device .no weights."):
        generate(meta_target, [[1, 2]], max_new_tokens=2)


@pytest.mark.parametrize("eos", [2.0, "2", b"2"])
def test_eos_of_the_wrong_type(target, eos):
    with pytest.raises(TypeError, match="eos_token_id must be a token id .int. or a list of them"):
        generate(target, [[1, 2]], eos_token_id=eos)


def test_one_1d_tensor_as_prompts_gets_the_right_hint(target):
    with pytest.raises(TypeError, match=r"pass \[tensor\] for one prompt"):
        generate(target, torch.ones(5, dtype=torch.long), max_new_tokens=2)


@pytest.mark.parametrize("mask,message", [
    (torch.ones(2, 4, dtype=torch.long), r"attention_mask has shape \(2, 4\) but prompts \(2, 3\)"),
    (torch.tensor([[1, 0, 1], [1, 1, 1]]), "prompt 0's attention_mask has padding between tokens"),
    (torch.tensor([[0, 0, 0], [1, 1, 1]]), "prompt 0 is all padding"),
    (torch.tensor([[2, 1, 1], [1, 1, 1]]), "only 0 .padding. and 1"),
])
def test_a_bad_attention_mask(target, mask, message):
    with pytest.raises(ValueError, match=message):
        generate(target, torch.ones(2, 3, dtype=torch.long), attention_mask=mask, max_new_tokens=2)


def test_an_attention_mask_with_prompts_that_are_no_padded_batch(target):
    with pytest.raises(TypeError, match="prompts with an attention_mask must form one padded"):
        generate(target, [[1, 2], [3]], attention_mask=[[1, 1], [1]], max_new_tokens=2)
    with pytest.raises(TypeError, match=r"must be a padded \[B, T\] batch; pass \[tensor\] for one prompt"):
        generate(target, torch.tensor([1, 2]), attention_mask=torch.ones(2), max_new_tokens=2)


@pytest.mark.parametrize("stops,error,message", [
    ([3], TypeError, r"stop sequence 0 is one id \(3\).*\[\[3\]\]"),
    ([[]], ValueError, "stop sequence 0 is empty"),
    ([[1, 500]], ValueError, r"stop sequence 0 must be a list of token ids in \[0, 96\)"),
    ("ab", TypeError, "stop_sequences must be a list of token-id lists"),
])
def test_bad_stop_sequences(target, stops, error, message):
    with pytest.raises(error, match=message):
        generate(target, [[1, 2]], stop_sequences=stops, max_new_tokens=2)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_min_new_tokens(target, value):
    with pytest.raises(ValueError, match="min_new_tokens must be an integer >= 0"):
        generate(target, [[1, 2]], min_new_tokens=value, max_new_tokens=2)


def test_a_stream_that_is_not_a_function(target):
    with pytest.raises(TypeError, match="stream must be a function"):
        generate(target, [[1, 2]], stream=[], max_new_tokens=2)
