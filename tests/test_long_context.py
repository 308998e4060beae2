"""Long-context workloads (specdec/long_context.py) and the zoo's "gpu-long" preset.

The workload checks run on held-out standard-library files (cut at 8,000 characters, as the zoo
keeps them) and a byte-level BPE tokenizer trained here on a few training files (about a second):
drawn lengths lie in their bounds and differ across rows, each prompt is whole lines of its files
in order, within its drawn length exactly, the prompts are a function of the seed, a short corpus
wraps around, and bad arguments are refused with a reason. The preset checks pin the earlier
presets' fingerprints (computed before "gpu-long" and its new optional fields were added), and
run a final long-window phase through the training loop on a tiny model on the CPU.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specdec.long_context import LongPrompt, long_context_prompts, summary
from specdec.zoo import corpus
from specdec.zoo.build import HELD_OUT_SAMPLE_CHARS, make_model
from specdec.zoo.presets import PRESETS, Recipe, Shape, get_recipe
from specdec.zoo.tokenizer import train_tokenizer
from specdec.zoo.train import (
    Schedule,
    evaluate_by_position,
    next_token_loss,
    random_windows,
    schedule_windows,
    train,
)


@pytest.fixture(scope="module")
def sources():
    train_files, held_files = corpus.split(corpus.find_sources())
    tokenizer = train_tokenizer([f.read() for f in corpus.shuffled(train_files)[:12]], vocab_size=400)
    texts = [(f.relative_path, f.read()[:HELD_OUT_SAMPLE_CHARS]) for f in corpus.shuffled(held_files)[:48]]
    return texts, tokenizer


def body(text: str) -> str:
    """What a prompt takes of a file: its whole lines, then an empty line."""
    end = text.rfind("\n")
    return (text[: end + 1] if end >= 0 else text + "\n") + "\n"


def check_prompt(prompt: LongPrompt, texts: dict[str, str], tokenizer) -> str:
    decoded = tokenizer.decode(list(prompt.token_ids))
    assert tokenizer(decoded, add_special_tokens=False)["input_ids"] == list(prompt.token_ids)
    assert len(prompt) <= prompt.target_tokens
    assert decoded.endswith("\n")  # cut at a line end
    assert "".join(body(texts[i]) for i in prompt.file_ids).startswith(decoded)  # whole lines of its files, in order
    assert decoded.startswith(body(texts[prompt.file_ids[0]])[:200].rsplit("\n", 1)[0])  # from a file's beginning
    return decoded


def test_lengths_lie_in_their_bounds_differ_by_row_and_each_prompt_is_whole_lines(sources):
    texts, tokenizer = sources
    prompts = long_context_prompts(texts, tokenizer, count=12, context_tokens=512, spread=0.5, seed=0)
    assert len(prompts) == 12
    targets = [p.target_tokens for p in prompts]
    assert all(256 <= t <= 768 for t in targets) and len(set(targets)) > 6  # ragged
    for prompt in prompts:
        check_prompt(prompt, dict(texts), tokenizer)
        assert len(prompt) >= prompt.target_tokens - 64 - 8  # short by less than one line (64 tokens at most here)
    assert len({p.file_ids[0] for p in prompts}) == 12  # a different first file per row
    report = summary(prompts)
    assert report["lengths"] == [len(p) for p in prompts] and report["drawn_tokens"]["max"] == max(targets)
    assert report["wrapped_rows"] == 0


def test_no_spread_gives_one_drawn_length_and_long_prompts_are_exact(sources):
    texts, tokenizer = sources
    prompts = long_context_prompts(texts, tokenizer, count=2, context_tokens=16384, spread=0.0, seed=1)
    assert [p.target_tokens for p in prompts] == [16384, 16384]
    for prompt in prompts:
        check_prompt(prompt, dict(texts), tokenizer)
        assert len(prompt) > 16384 - 300 and len(prompt.file_ids) > 3


def test_prompts_are_a_function_of_the_seed_and_share_first_files_across_lengths(sources):
    texts, tokenizer = sources
    a = long_context_prompts(texts, tokenizer, count=6, context_tokens=256, seed=3)
    b = long_context_prompts(texts, tokenizer, count=6, context_tokens=256, seed=3)
    c = long_context_prompts(texts, tokenizer, count=6, context_tokens=256, seed=4)
    assert a == b
    assert [p.token_ids for p in a] != [p.token_ids for p in c]
    assert [p.target_tokens for p in a] != [p.target_tokens for p in c]
    longer = long_context_prompts(texts, tokenizer, count=6, context_tokens=1024, seed=3)
    assert [p.file_ids[0] for p in longer] == [p.file_ids[0] for p in a]
    np.random.seed(0)  # global random state plays no part
    before = np.random.random()
    np.random.seed(0)
    assert long_context_prompts(texts, tokenizer, count=6, context_tokens=256, seed=3) == a
    assert np.random.random() == before


def test_max_tokens_caps_the_drawn_lengths(sources):
    texts, tokenizer = sources
    prompts = long_context_prompts(texts, tokenizer, count=16, context_tokens=512, spread=0.5, seed=0, max_tokens=600)
    assert all(256 <= p.target_tokens <= 600 and len(p) <= 600 for p in prompts)
    assert max(p.target_tokens for p in prompts) > 500
    with pytest.raises(ValueError, match="max_tokens must be"):
        long_context_prompts(texts, tokenizer, count=2, context_tokens=512, spread=0.5, max_tokens=200)


def test_a_short_corpus_wraps_around(sources):
    _, tokenizer = sources
    texts = [("a.py", "import os\nx = 1\n"), ("b.py", "def f(y):\n    return y + 1\n"),
             ("c.py", "class C:\n    pass\n# a last line cut mid-wa")]
    prompts = long_context_prompts(texts, tokenizer, count=4, context_tokens=300, spread=0.25, seed=0)
    for prompt in prompts:
        decoded = check_prompt(prompt, dict(texts), tokenizer)
        assert prompt.wrapped and len(prompt.file_ids) > 6
        assert 225 - 16 <= len(prompt) <= prompt.target_tokens <= 375
        assert "cut mid-wa" not in decoded  # a file's trailing partial line is left out
    assert summary(prompts)["wrapped_rows"] == 4


@pytest.mark.parametrize("arguments, message", [
    ({"count": 0}, "count must be"),
    ({"count": 2.5}, "count must be"),
    ({"context_tokens": 8}, "context_tokens must be"),
    ({"spread": 1.0}, "spread must lie in"),
    ({"spread": -0.1}, "spread must lie in"),
    ({"seed": -1}, "seed must be"),
])
def test_bad_arguments_are_refused_with_a_reason(sources, arguments, message):
    texts, tokenizer = sources
    with pytest.raises(ValueError, match=message):
        long_context_prompts(texts, tokenizer, **{"count": 2, "context_tokens": 256, **arguments})


def test_texts_that_make_no_prompt_are_refused_with_a_reason(sources):
    _, tokenizer = sources
    with pytest.raises(ValueError, match="no texts"):
        long_context_prompts([], tokenizer, count=1, context_tokens=256)
    with pytest.raises(ValueError, match="none of the 2 texts"):
        long_context_prompts([("empty.py", ""), ("blank.py", " \n\n")], tokenizer, count=1, context_tokens=256)
    with pytest.raises(ValueError, match="a line of more than"):  # one minified line, longer than the limit
        long_context_prompts([("min.js", "x=1;" * 2000 + "\n")], tokenizer, count=1, context_tokens=256)


# fingerprints of the presets before "gpu-long" and the optional fields it needs (rope_theta,
# Schedule.final_*) existed: the fields at their defaults must not change a build's name
FINGERPRINTS = {"tiny": "12a9944765dd9481", "cpu": "3f5bf52a5df27a6a", "gpu": "509c4d10cde0842c"}


def test_earlier_presets_keep_their_fingerprints():
    assert {name: PRESETS[name].fingerprint() for name in FINGERPRINTS} == FINGERPRINTS
    long = get_recipe("gpu-long")
    assert long.fingerprint() not in FINGERPRINTS.values()
    import dataclasses

    changed = dataclasses.replace(PRESETS["gpu"], rope_theta=500_000.0)  # a new field away from its default counts
    assert changed.fingerprint() != FINGERPRINTS["gpu"]


def test_gpu_long_is_gpu_shapes_with_long_positions_trained():
    gpu, long = get_recipe("gpu"), get_recipe("gpu-long")
    assert long.max_positions >= 16384 and long.rope_theta is not None
    assert long.target == gpu.target and long.drafters == gpu.drafters
    pairs = ((long.target_schedule, gpu.target_schedule), (long.distill_schedule, gpu.distill_schedule))
    for schedule, reference in pairs:
        assert schedule.longest_seq_len >= 8192 and schedule.final_seq_len == long.max_positions
        assert schedule.final_steps >= schedule.steps // 20  # a real phase, not a handful of steps
        tokens_per_step = reference.batch_size * reference.seq_len
        assert schedule.batch_size * schedule.seq_len == tokens_per_step
        assert schedule.final_batch_size * schedule.final_seq_len == tokens_per_step
        assert schedule.steps == reference.steps
    assert long.longest_seq_len == 16384
    assert long.train_tokens > 100 * long.longest_seq_len  # the stream holds many distinct long windows
    config = make_model(Shape(layers=1, hidden=32, heads=2, intermediate=64), long, eos_token_id=0).config
    assert config.rope_parameters["rope_theta"] == long.rope_theta and config.max_position_embeddings == 16384
    default = make_model(Shape(layers=1, hidden=32, heads=2, intermediate=64), gpu, eos_token_id=0).config
    assert default.rope_parameters["rope_theta"] == 10000.0


def test_schedule_windows_switch_shape_for_the_final_phase():
    tokens = np.arange(5000, dtype=np.int32)
    plain = Schedule(steps=5, batch_size=3, seq_len=16, lr=1e-3)
    expected = random_windows(tokens, 3, 16, seed=7)
    for batch in itertools.islice(schedule_windows(tokens, plain, seed=7), 8):  # without a final phase: as before
        assert torch.equal(batch, next(expected))
    phased = Schedule(steps=5, batch_size=3, seq_len=16, lr=1e-3, final_steps=2, final_batch_size=1, final_seq_len=48)
    shapes = [tuple(b.shape) for b in itertools.islice(schedule_windows(tokens, phased, seed=7), 5)]
    assert shapes == [(3, 17)] * 3 + [(1, 49)] * 2
    assert phased.tokens == 3 * 3 * 16 + 2 * 48 and phased.longest_seq_len == 48
    with pytest.raises(ValueError, match="final_batch_size and final_seq_len"):
        Schedule(steps=5, batch_size=3, seq_len=16, lr=1e-3, final_steps=2)
    with pytest.raises(ValueError, match="final_steps must lie"):
        Schedule(steps=5, batch_size=3, seq_len=16, lr=1e-3, final_steps=6, final_batch_size=1, final_seq_len=48)


def test_training_runs_a_final_long_phase_and_positions_are_evaluated():
    recipe = Recipe(name="t", vocab_size=64, tokenizer_bytes=0, train_tokens=0, eval_tokens=0, site_packages=False,
                    max_positions=128, target=Shape(layers=1, hidden=32, heads=2, intermediate=64),
                    target_schedule=Schedule(steps=6, batch_size=4, seq_len=16, lr=3e-3, warmup_steps=2,
                                             final_steps=2, final_batch_size=1, final_seq_len=64),
                    rope_theta=50_000.0)
    torch.manual_seed(0)
    model = make_model(recipe.target, recipe, eos_token_id=0)
    tokens = (np.arange(4000) * 7 % 64).astype(np.int32)
    schedule = recipe.target_schedule
    report = train({"t": model}, schedule_windows(tokens, schedule, seed=1), schedule, torch.device("cpu"),
                   loss_fn=next_token_loss, progress=False)["t"]
    assert report.tokens_seen == schedule.tokens == 4 * 4 * 16 + 2 * 64
    losses = evaluate_by_position(model, tokens, 64, [16, 32], torch.device("cpu"), max_windows=2)
    assert list(losses) == ["0-15", "16-31", "32-63"] and all(np.isfinite(v) for v in losses.values())
