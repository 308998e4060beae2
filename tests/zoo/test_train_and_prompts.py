"""Training lowers the loss; models round-trip through save_pretrained; prompt files parse."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.zoo.build import make_model
from specdec.zoo.presets import Shape, get_recipe
from specdec.zoo.prompts import cut_at_line, heldout_prompts, read_prompts, write_jsonl
from specdec.zoo.train import (
    Schedule, acceptance_loss, distillation_loss, evaluate, mixed_loss, next_token_loss, random_windows, train,
)

RECIPE = get_recipe("tiny")


def patterned_stream(length=20_000, vocab=RECIPE.vocab_size):
    """A learnable stream: a repeating phrase with noise."""
    rng = np.random.default_rng(0)
    phrase = rng.integers(0, vocab, size=37)
    stream = np.resize(phrase, length)
    noise = rng.random(length) < 0.1
    stream[noise] = rng.integers(0, vocab, size=noise.sum())
    return stream.astype(np.int32)


def test_a_few_steps_lower_the_loss():
    torch.manual_seed(0)
    model = make_model(Shape(layers=1, hidden=32, heads=2, intermediate=64), RECIPE, eos_token_id=0)
    stream = patterned_stream()
    before = evaluate(model, stream, 32, 8, torch.device("cpu"))
    schedule = Schedule(steps=30, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=3)
    report = train({"m": model}, random_windows(stream, 8, 32, seed=0), schedule, torch.device("cpu"), progress=False)["m"]
    after = evaluate(model, stream, 32, 8, torch.device("cpu"))
    assert after < before - 1.0
    assert report.tokens_seen == 30 * 8 * 32


def test_distillation_moves_the_student_towards_the_teacher():
    torch.manual_seed(0)
    teacher = make_model(Shape(layers=1, hidden=32, heads=2, intermediate=64), RECIPE, eos_token_id=0)
    student = make_model(Shape(layers=1, hidden=16, heads=1, intermediate=32), RECIPE, eos_token_id=0)
    stream = patterned_stream()
    teach = Schedule(steps=30, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=3)  # a teacher with opinions
    train({"t": teacher}, random_windows(stream, 8, 32, seed=0), teach, torch.device("cpu"), progress=False)
    batch = torch.from_numpy(stream[:33 * 4].reshape(4, 33).astype(np.int64))[:, :-1]
    with torch.no_grad():
        alpha_before = -acceptance_loss(student(batch).logits, None, teacher(batch).logits).item()
    schedule = Schedule(steps=40, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=3)
    train({"s": student}, random_windows(stream, 8, 32, seed=1), schedule, torch.device("cpu"),
          loss_fn=distillation_loss, teacher=teacher, progress=False)
    with torch.no_grad():
        alpha_after = -acceptance_loss(student(batch).logits, None, teacher(batch).logits).item()
    assert alpha_before < 0.6 and alpha_after > alpha_before + 0.2


def test_losses_on_known_values():
    uniform = torch.zeros(1, 1, 4)
    peaked = torch.tensor([[[10.0, 0.0, 0.0, 0.0]]])
    assert next_token_loss(uniform, torch.tensor([[2]])).item() == pytest.approx(np.log(4))
    assert distillation_loss(uniform, None, uniform).item() == pytest.approx(np.log(4))
    assert acceptance_loss(uniform, None, uniform).item() == pytest.approx(-1.0)
    assert -acceptance_loss(uniform, None, peaked).item() == pytest.approx(0.25, abs=1e-3)
    assert mixed_loss(1.0)(uniform, None, peaked).item() == pytest.approx(distillation_loss(uniform, None, peaked).item())


def test_schedule_warms_up_then_decays():
    s = Schedule(steps=100, batch_size=1, seq_len=1, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    factors = [s.lr_factor(i) for i in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))
    assert factors[-1] == pytest.approx(0.1, abs=1e-3)


def test_save_and_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = make_model(Shape(layers=1, hidden=32, heads=2, intermediate=64), RECIPE, eos_token_id=0).eval()
    model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


class CharTokenizer:
    """One token per character, enough to test prompt cutting."""

    def __call__(self, texts, add_special_tokens=False):
        if isinstance(texts, str):
            return {"input_ids": list(texts)}
        return {"input_ids": [list(t) for t in texts]}


def test_prompts_are_cut_at_line_boundaries():
    text = "ab\ncdef\ngh\n"
    assert cut_at_line(text, CharTokenizer(), 8) == "ab\ncdef\n"
    assert cut_at_line(text, CharTokenizer(), 7) == "ab\n"
    assert cut_at_line(text, CharTokenizer(), 2) is None
    prompts = heldout_prompts([("a", text), ("b", "x\n" * 20)], CharTokenizer(), count=5, max_tokens=8, min_tokens=4)
    assert prompts == [{"id": "a", "prompt": "ab\ncdef\n"}, {"id": "b", "prompt": "x\n" * 4}]


def test_prompt_files_in_both_formats(tmp_path):
    ours = tmp_path / "ours.jsonl"
    write_jsonl([{"id": "f.py", "prompt": "import os\n"}, {"id": 2, "prompt": "x = 1\n"}], ours)
    assert read_prompts(ours) == [{"id": "f.py", "prompt": "import os\n"}, {"id": 2, "prompt": "x = 1\n"}]
    spec_bench = tmp_path / "question.jsonl"
    spec_bench.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Again."]}) + "\n\n")
    assert read_prompts(spec_bench) == [{"id": 81, "prompt": "Write a poem."}]


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "ok"}\n{"prompt": "unterminated\n', r"bad\.jsonl:2: not valid JSON"),
    ('{"text": "no prompt field"}\n', r"bad\.jsonl:1: needs a string field 'prompt'"),
    ('["a", "list"]\n', r"bad\.jsonl:1: expected a JSON object"),
    ('{"turns": []}\n', r"bad\.jsonl:1: needs a string field 'prompt' or a non-empty list"),
    ("\n", r"no prompts found"),
])
def test_malformed_prompt_files_say_where(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line)
    with pytest.raises(ValueError, match=message):
        read_prompts(path)


def test_the_shared_spec_bench_file_parses():
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"
    if not path.is_file():
        pytest.skip("the workspace's shared/ folder is not beside this checkout")
    prompts = read_prompts(path)
    assert len(prompts) == 480 and all(isinstance(p["prompt"], str) and p["prompt"] for p in prompts)
