"""The serve bench end to end on the tiny zoo (CPU): every method serves every load, outputs
equal plain decoding's, and the report, the plot and the targets are written."""

import pytest

from specdec.bench.serve import ServeSettings, main, markdown, run, targets


def test_a_smoke_run_on_the_tiny_zoo(tiny_zoo_root, tmp_path):
    settings = ServeSettings(preset="tiny", device="cpu", num_requests=6, prompt_tokens=24, max_new_tokens=6,
                             max_rows=2, loads=(0.5, 2.0), methods=("k1", "goodput", "goodput-model"),  # plain first
                             zoo_dir=str(tiny_zoo_root / "tiny"), repeats=2, out=str(tmp_path))
    saved = []
    result = run(settings, log=lambda *_: None, save=lambda r: saved.append(len(r["rows"])))
    assert saved == [0, 4, 8]  # after the saturation runs, then after each rate
    assert [(r["load"], r["method"]) for r in result["rows"]] == [
        (load, method) for load in (0.5, 2.0) for method in ("plain", "k1", "goodput", "goodput-model")]
    assert all(r["identical"] and r["requests"] == 12 for r in result["rows"])  # 6 requests in each of 2 traces
    for r in result["rows"]:  # pooled over equal-sized traces: the mean is the mean of the traces' means
        assert len(r["trace_mean_latency_s"]) == 2
        assert r["latency_s"]["mean"] == pytest.approx(sum(r["trace_mean_latency_s"]) / 2)
    assert all(r["identical"] for r in result["saturation"])
    for r in result["rows"] + result["saturation"]:  # what the steps did, from the engine's own counts
        costs = r["costs"]
        assert 1 <= costs["rows_per_step"] <= 2 and costs["prefill_passes"] >= 1
        if r["method"] == "plain":
            assert costs["draft_per_row_step"] == 0 and costs["tau"] == 1
        if r["method"] == "k1":
            assert 0 < costs["draft_per_row_step"] <= 1 and 1 <= costs["tau"] <= 2
    assert "What a step did" in markdown(result)
    from specdec.policies import CostModel

    assert CostModel.from_dict(result["cost_model"]).num_drafters == 1  # GoodputPolicy's, kept for analysis
    assert result["capacity_requests_per_s"] > 0
    half = [r for r in result["rows"] if r["load"] == 0.5]
    assert all(r["rate"] == pytest.approx(0.5 * result["capacity_requests_per_s"]) for r in half)
    names = {t["target"] for t in result["targets"]}
    assert "load 0.50: GoodputPolicy >= 1.5x faster than plain decoding" in names
    assert "k1: engine saturated throughput >= static generate() batches" in names
    assert "| 2.00 |" in markdown(result)


def test_targets_compare_goodput_with_the_best_other_method_at_each_load():
    def row(load, method, latency):
        return dict(load=load, method=method, latency_s={"mean": latency})

    result = dict(rows=[row(0.1, "plain", 3.0), row(0.1, "k3", 1.5), row(0.1, "goodput", 1.56),
                        row(0.1, "goodput-model", 1.0),  # a diagnostic of GoodputPolicy, not an "other" method
                        row(1.0, "plain", 9.0), row(1.0, "k3", 12.0), row(1.0, "goodput", 9.9)],
                  saturation=[dict(method="k3", engine_tokens_per_s=90.0, static_tokens_per_s=100.0)])
    found = {t["target"]: t for t in targets(result)}
    assert found["load 0.10: GoodputPolicy mean latency within 5% of the best other"]["met"]  # 1.56 / 1.5 = 1.04
    assert found["load 0.10: GoodputPolicy >= 1.5x faster than plain decoding"]["value"] == round(3.0 / 1.56, 3)
    assert not found["load 1.00: GoodputPolicy mean latency within 5% of the best other"]["met"]  # 9.9 / 9.0
    assert not found["k3: engine saturated throughput >= static generate() batches"]["met"]


def test_unknown_methods_are_refused():
    with pytest.raises(SystemExit):
        main(["--methods", "plain,k7"])
    with pytest.raises(SystemExit):
        main(["--repeats", "0"])


def test_the_model_only_goodput_policy_never_corrects_its_cost_model():
    """"goodput-model" weighs drafting as profiled, whatever the steps measured."""
    import numpy as np

    from specdec.bench.serve import model_only_goodput
    from specdec.policies import CostModel
    from specdec.policies.step_time import LinearStepTime
    model = CostModel.from_coefficients(c_fixed=2.0, c_tok=0.01, c_kv=0.0, c_row=0.0,
                                        drafters=[{"fixed": 0.4, "steps": 0.2, "tokens": 0.01}])
    policy = model_only_goodput(model)
    step_time = LinearStepTime.from_cost_model(model, np.full(2, 50))
    k = np.array([3, 3])
    for _ in range(3):  # drafting measured 3x dearer than modelled, beside plain steps as modelled
        policy.calibration.observe(step_time, np.zeros(2, dtype=np.int64), [step_time.base] * 4)
        policy.calibration.observe(step_time, k, [step_time.base + 3 * float(step_time.extra(k))] * 4)
    assert policy.calibration.extra_scale  # the measurements were taken in
    corrected = policy.calibration.apply(step_time, 2)
    assert float(corrected(k)) == float(step_time(k)) and not policy.calibration.wants_plain_probe(2)
