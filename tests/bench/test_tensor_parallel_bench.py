"""benchmarks/tensor_parallel_bench.py (issue 35, point 3): the bandwidth floor's arithmetic
against hand computations, the shapes' parameter counts and divisibility checks, and the script
end to end under torchrun on tiny shapes, two gloo processes on the CPU, as
tests/test_distributed.py runs its tensor-parallel job: the target is sharded (DTensor
parameters, each rank caching half the KV heads, the same replicated weights everywhere),
speculative output equals plain decoding's (float32: exactly), and the JSON and markdown carry
the rows, the floors and the targets."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import benchmarks.tensor_parallel_bench as tp_bench
from benchmarks.tensor_parallel_bench import (SHAPES, TINY_SHAPES, Settings, check_shardable, floor_seconds,
                                              llama_parameters, markdown, measure, middle_call, step_bytes)
from specdec.bench import bandwidth
from specdec.bench.pipeline import random_model

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--batch-sizes", "1", "3", "--new-tokens", "6", "--prompt-tokens", "5", "--repeats", "1", "--k", "3"]
CONTEXT = 5 + 6 // 2  # prompt + half the new tokens: the positions a plain step reads on average


def test_the_floor_is_the_slowest_ranks_bytes_over_its_bandwidth():
    assert floor_seconds([100], [50.0]) == 2.0
    assert floor_seconds([100, 120], [10.0, 20.0]) == 10.0  # 100 / 10 against 120 / 20 = 6
    assert floor_seconds([100, 120], [20.0, 10.0]) == 12.0
    with pytest.raises(ValueError, match="one byte count and one bandwidth a rank"):
        floor_seconds([100, 120], [10.0])
    with pytest.raises(ValueError, match="positive"):
        floor_seconds([100], [0.0])


def test_step_bytes_of_an_unsharded_model_by_hand():
    """TINY_SHAPES["tiny"] (hidden 32, MLP 64, 2 layers, 4 heads of 8, 2 KV heads, vocab 96),
    float32: a layer holds q and o (32 x 32 each), k and v (32 x 16 each), three MLP matrices (32 x
    64) and two norms (32): 9280 parameters; with the table and head (96 x 32 each) and the final
    norm, 24736. A step of 3 rows reads all but the table, 3 of its rows, and 3 rows x 8 positions
    x (key, value) x 2 layers x 2 KV heads x 8 of cache."""
    shape = TINY_SHAPES["tiny"]
    assert llama_parameters(shape) == 2 * 96 * 32 + 2 * 9280 + 32 == 24736
    model = random_model(shape, "cpu", seed=0, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 24736
    assert step_bytes(model, batch=3, context=8) == {"weights": (24736 - 96 * 32 + 3 * 32) * 4,
                                                     "kv": 3 * 8 * 2 * 2 * 2 * 8 * 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(TINY_SHAPES))
def test_the_one_gpu_floor_is_bandwidth_pys(name, dtype):
    """Unsharded, step_bytes over one bandwidth is specdec.bench.bandwidth.floor_seconds (the
    convention of BENCHMARKS section 2: one table row a token, the head whole, each row's cache at
    the context given), at every batch size."""
    model = random_model(TINY_SHAPES[name], "cpu", seed=0, dtype=dtype)
    for batch in (1, 3, 16):
        counted = step_bytes(model, batch=batch, context=40)
        assert floor_seconds([counted["weights"] + counted["kv"]], [1e9]) == pytest.approx(
            bandwidth.floor_seconds(model, batch, 40, 1e9), rel=1e-12)


def test_the_reported_call_is_the_median_or_the_slower_middle_one(monkeypatch):
    """measure() reports the call at index repeats // 2 by step time, after a warm-up call it
    ignores; of an even number that is the slower middle call, and the report says so."""
    for times, picked in (([9.0, 3.0], 3.0), ([9.0, 3.0, 1.0], 3.0), ([9.0, 4.0, 1.0, 2.0, 3.0], 3.0),
                          ([0.5, 4.0, 1.0, 2.0, 3.0], 3.0)):
        calls = iter(times)
        monkeypatch.setattr(tp_bench, "timed_call", lambda *args: {"step_ms": next(calls)})
        settings = Settings(device="cpu", repeats=len(times) - 1)
        assert measure(None, [[1]], None, 0, settings, False)["step_ms"] == picked
    assert [middle_call(n) for n in (1, 2, 3, 4)] == ["one call", "the slower of 2 calls", "median of 3 calls",
                                                      "the slower middle call of 4"]


def test_parameter_counts_of_the_gpu_shapes():
    assert llama_parameters(SHAPES["llama-8B"]) == 8_030_261_248  # Llama 3 8B
    assert llama_parameters(SHAPES["llama-30B"]) == 32_528_943_616  # LLaMA-1 30B ("32.5B")


def test_shapes_that_do_not_split_are_refused_clearly():
    check_shardable("llama-30B", SHAPES["llama-30B"], 2)
    check_shardable("llama-8B", SHAPES["llama-8B"], 8)
    with pytest.raises(ValueError, match="num_attention_heads = 52 does not divide by the tensor-parallel size 8"):
        check_shardable("llama-30B", SHAPES["llama-30B"], 8)
    with pytest.raises(ValueError, match="num_key_value_heads = 8 does not divide by the tensor-parallel size 16"):
        check_shardable("x", {**SHAPES["llama-8B"], "num_attention_heads": 64}, 16)
    with pytest.raises(ValueError, match="52 attention heads do not group evenly over 8 KV heads"):
        check_shardable("x", {**SHAPES["llama-30B"], "num_key_value_heads": 8}, 2)


@pytest.mark.parametrize("field, value", [("batch_sizes", (0,)), ("k", 0), ("repeats", 0), ("preset", "huge"),
                                          ("device", "tpu")])
def test_bad_settings_are_refused(field, value):
    with pytest.raises(ValueError):
        Settings(**{"device": "cpu", field: value}).check()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The script's own command under torchrun: two gloo processes, the tiny preset."""
    pytest.importorskip("accelerate", reason="transformers' tensor-parallel loading needs accelerate ([test] extras)")
    out = tmp_path_factory.mktemp("tp_bench")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "benchmarks" / "tensor_parallel_bench.py"), "--device", "cpu", "--preset", "tiny",
               "--out", str(out), *ARGS]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    finished = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads((out / "tensor_parallel.json").read_text()), (out / "tensor_parallel.md").read_text()


def test_the_target_is_sharded_over_both_ranks(report):
    result, _ = report
    assert result["complete"]
    for name, shape in TINY_SHAPES.items():
        info = result["shapes"][name]
        assert info["tensor_parallel"] and info["dtensor_parameters"] > 0 and info["gpus"] == 2
        assert info["local_kv_heads"] == [shape["num_key_value_heads"] // 2] * 2
        assert info["replicated_checksums"][0] == info["replicated_checksums"][1]
        assert info["parameters"] == llama_parameters(shape)
        assert not info["graphs"]  # CUDA only


def test_speculative_output_equals_plain_decoding_on_the_sharded_target(report):
    result, _ = report
    speculative = [r for r in result["rows"] if r["decoding"] == "speculative k=3"]
    assert {(r["shape"], r["batch"]) for r in speculative} == {(s, b) for s in TINY_SHAPES for b in (1, 3)}
    for row in speculative:
        assert row["identical"] and row["agreement"] == 1.0 and row["same_on_every_rank"]
        assert row["gpus"] == 2 and row["mode"] == "eager" and row["tau"] >= 1.0 and row["step_ms"] > 0


def test_the_plain_rows_and_their_floors(report):
    """Per rank of the 2-way tiny target (by hand, float32): each sharded matrix halves, so a layer
    holds (2 x 32 x 32 + 2 x 16 x 32 + 3 x 64 x 32) / 2 = 4608 parameters and its norms 64: 4672,
    two layers 9344; the final norm 32 and half the head (96 x 32 / 2 = 1536); and of the table
    one row of 32 a token (replicated, or sharded by vocabulary: a row lives whole on one rank).
    KV: each row's 8 positions x (key, value) x 2 layers x its 1 KV head x 8."""
    result, _ = report
    bandwidths = result["bandwidth_bytes_per_s"]
    plain = {(r["shape"], r["gpus"], r["batch"]): r for r in result["rows"] if r["decoding"] == "plain"}
    assert set(plain) == {("tiny", 1, 1), ("tiny", 1, 3)} | {(s, 2, b) for s in TINY_SHAPES for b in (1, 3)}
    for batch in (1, 3):
        rank = {"weights": (9344 + 32 + 1536 + 32 * batch) * 4, "kv": batch * CONTEXT * 2 * 2 * 1 * 8 * 4}
        assert plain[("tiny", 2, batch)]["step_bytes_per_rank"] == [rank, rank]
    for row in plain.values():
        used = bandwidths[: row["gpus"]]
        expected = max((b["weights"] + b["kv"]) / bw for b, bw in zip(row["step_bytes_per_rank"], used))
        assert row["floor_ms"] == pytest.approx(1000 * expected)
        assert row["fraction_of_floor"] == pytest.approx(row["floor_ms"] / row["step_ms"])
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * 1000 / row["step_ms"])


def test_the_report_says_which_call_it_reports(report):
    """Of two timed calls measure() reports the slower (index 1 of 2 by step time): the report
    must not call it a median (as the run of ccc55a1's did, --repeats 2)."""
    result, text = report
    assert "; one call after a warm-up" in text  # --repeats 1
    two = {**result, "settings": {**result["settings"], "repeats": 2}}
    assert "the slower of 2 calls after a warm-up" in markdown(two) and "median of 2" not in markdown(two)


def test_the_report_names_its_run_and_the_targets(report):
    result, text = report
    env = result["environment"]
    assert {"torch", "transformers", "commit", "time"} <= set(env)
    assert env["command"].startswith("torchrun --standalone --nproc_per_node 2 benchmarks/tensor_parallel_bench.py")
    assert env["world_size"] == 2 and len(env["devices"]) == 2
    assert [t["target"].split(",")[0] for t in result["targets"]] == ["tiny-wide", "tiny", "tiny"]
    assert all(isinstance(t["met"], bool) and isinstance(t["value"], float) for t in result["targets"])
    assert "| shape | GPUs | mode | batch | decoding | ms/step | tok/s | tau | floor ms | of floor |" in text
    assert "| tiny | 2 | eager | 3 | speculative k=3 |" in text
    assert "| target | measured | met |" in text and ">= 60% of the 2-GPU bandwidth floor" in text
