"""Measured runs (dsl/fidelity/runs.py), the programs that predict them (predict.py), the
profiles fitted to them (fit.py) and `dhelix calibrate`."""

from __future__ import annotations

import json

import attrs
import pytest

from commands import dhelix_here
from dhelix.dsl.fidelity.fit import fit_profile
from dhelix.dsl.fidelity.predict import (
    counted_flops, measured_seconds, padded_layers, predict, program_text, run_case, run_profile,
)
from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.fidelity.runs import load_runs
from dhelix.dsl.frontend.kernel_terms import Kernels
from dhelix.dsl.frontend.profiles import load_profile
from dhelix.dsl.passes.pipeline import check_text

SOURCES = """sources:
  lab:
    cite: "A lab's own runs, notebook p. 3"
    flops_convention: hardware
    cross_gbps_per_gpu: 25
    flash_attention: false
runs:
"""


def row(id_="r1", source="lab", gpus=8, tp=8, pp=1, hidden=1024, layers=4, heads=16, gb=8, mb=1,
        figure="iteration_s: 1.5", extra=""):
    return f"""  - id: {id_}
    source: {source}
    where: "Table 1"
    quote: "the figure"
    gpu: a100-80gb
    gpus: {gpus}
    model: {{family: gpt, layers: {layers}, hidden: {hidden}, heads: {heads}, seq: 1024, vocab: 32000}}
    dtype: fp16
    tp: {tp}
    pp: {pp}
    micro_batch: {mb}
    global_batch: {gb}
    recompute: full
    measured: {{{figure}}}
{extra}"""


def write(tmp_path, text, name="runs.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_run_without_a_source_is_refused_at_its_line(tmp_path):
    text = SOURCES + row("good") + row("nosource", source="''") + row("stranger", source="elsewhere")
    with pytest.raises(DhelixError) as info:
        load_runs(write(tmp_path, text))
    message = str(info.value)
    assert "runs.yaml:22:" in message and "run 'nosource': no 'source'" in message
    assert "run 'stranger': source 'elsewhere' is not in the 'sources' section" in message


def test_a_source_without_a_citation_and_a_run_without_its_words_are_refused(tmp_path):
    text = "sources:\n  lab: {flops_convention: model}\nruns:\n" + row().replace('    quote: "the figure"\n', "")
    with pytest.raises(DhelixError) as info:
        load_runs(write(tmp_path, text))
    assert "source 'lab' has no 'cite'" in str(info.value)
    assert "no 'quote'" in str(info.value)


def test_layouts_and_figures_are_checked(tmp_path):
    text = SOURCES + row("sizes", gpus=16) + row("figure", figure="speed: 3") + row("twice") + row("twice")
    with pytest.raises(DhelixError) as info:
        load_runs(write(tmp_path, text))
    message = str(info.value)
    assert "tp × pp × cp × dp = 8, not gpus = 16" not in message  # dp is derived from gpus when absent
    assert "measured: none of iteration_s" in message and "unknown figure 'speed'" in message
    assert "run id 'twice' appears twice" in message


def test_sizes_that_are_not_whole_numbers_are_refused_not_a_traceback(tmp_path):
    text = SOURCES + row("words", gb="many") + row("half").replace("layers: 4", "layers: 4.5").replace(
        "micro_batch: 1", "micro_batch: two")
    with pytest.raises(DhelixError) as info:
        load_runs(write(tmp_path, text))
    message = str(info.value)
    assert "run 'words': global_batch must be a whole number ≥ 1" in message
    assert "micro_batch must be a whole number ≥ 1 or null" in message
    assert "model: layers must be a whole number ≥ 1" in message


def test_a_figure_becomes_seconds_by_the_sources_flop_count(tmp_path):
    (run,) = load_runs(write(tmp_path, SOURCES + row(figure="tflops_per_gpu: 100", gb=16)))
    program = check_text(program_text(run), "r.dhx")
    b, s, l, h, v = 16, 1024, 4, 1024, 32000
    # Narayanan et al. 2021, eq. (3): recomputation counted.
    narayanan = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert counted_flops(run, program) == pytest.approx(narayanan, rel=1e-12)
    assert measured_seconds(run, program, program.profile) == pytest.approx(narayanan / (100e12 * 8))
    model = attrs.evolve(run, source=attrs.evolve(run.source, flops_convention="model"))
    assert counted_flops(model, program) == pytest.approx(72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)))


def test_uneven_stages_are_padded_and_an_unstated_interleaving_is_the_fewest_chunks(tmp_path):
    text = SOURCES + row(gpus=32, tp=8, pp=4, layers=30, gb=16).replace("    recompute: full\n",
                                                                         "    recompute: full\n    vp: null\n")
    (run,) = load_runs(write(tmp_path, text))
    assert run.vp == 2  # 30 layers on 4 stages: 8 a stage padded, 2 chunks of 4
    assert padded_layers(run) == 32
    program = check_text(program_text(run), "r.dhx")
    assert program.model.get("layers") == 32 and program.fold.kind == "loop"


def test_a_tuned_source_s_unstated_interleaving_is_the_fastest_count(tmp_path):
    # Llama 3 (sec. 3.3.2) tunes an interleaved schedule whose V it does not state: the
    # prediction keeps the count that simulates fastest, equal to trying each one by hand.
    tuned = SOURCES.replace("    flash_attention: false\n", "    flash_attention: false\n    interleaving: tuned\n")
    text = tuned + row(gpus=32, tp=8, pp=4, layers=32, gb=8).replace(
        "    recompute: full\n", "    recompute: full\n    vp: null\n")
    (run,) = load_runs(write(tmp_path, text))
    assert not run.vp_stated and run.vp == 2
    by_hand = {vp: predict(attrs.evolve(run, vp=vp, vp_stated=True)).predicted_s for vp in (2, 4, 8)}
    assert len(set(by_hand.values())) == 3  # the counts price differently: the choice matters
    chosen = predict(run)
    assert chosen.run.vp == min(by_hand, key=by_hand.get)
    assert chosen.predicted_s == by_hand[chosen.run.vp]
    # Stated, or from a source that does not tune: the run's own count.
    assert predict(attrs.evolve(run, vp_stated=True)).run.vp == 2
    bad = write(tmp_path, tuned.replace("interleaving: tuned", "interleaving: best") + row(), "bad.yaml")
    with pytest.raises(DhelixError) as info:
        load_runs(bad)
    assert "bad.yaml:3:1: source 'lab': interleaving must be one of fewest, tuned" in str(info.value)


def test_the_cluster_facts_reach_the_profile(tmp_path):
    (run,) = load_runs(write(tmp_path, SOURCES + row()))
    profile = run_profile(run, load_profile("a100"))
    assert profile.links["cross"].bw_gbps == 25
    assert profile.kernels.attention == "materialized"
    assert profile.memory_gb == 80
    prediction = predict(run)
    assert prediction.measured_s == 1.5 and prediction.predicted_s > 0 and prediction.problem == ""



def test_a_source_s_gradient_reduce_dtype_reaches_the_program(tmp_path):
    # Megatron-LM of 2021 all-reduced fp16 models' gradients in fp16: half the bytes of fp32.
    fp16 = SOURCES.replace("    flash_attention: false\n", "    flash_attention: false\n    grad_reduce_dtype: fp16\n")
    text = row(gpus=32, tp=8, gb=32)
    (plain,) = load_runs(write(tmp_path, SOURCES + text))
    (halved,) = load_runs(write(tmp_path, fp16 + text, "fp16.yaml"))
    assert "grad_reduce_dtype = fp16" in program_text(halved) and "grad_reduce_dtype" not in program_text(plain)
    assert predict(halved).predicted_s < predict(plain).predicted_s
    # ZeRO-3's layers reduce in the model's dtype already: the setting stays out of the program.
    assert "grad_reduce_dtype" not in program_text(attrs.evolve(halved, zero=3))
    bad = write(tmp_path, fp16.replace("grad_reduce_dtype: fp16", "grad_reduce_dtype: fp12") + row(), "bad.yaml")
    with pytest.raises(DhelixError) as info:
        load_runs(bad)
    assert "bad.yaml:3:1: source 'lab': grad_reduce_dtype must be one of fp32, bf16, fp16" in str(info.value)

TRUE = {"gemm": 0.6, "overhead": 6.0, "local": 0.7}


def synthetic_runs(tmp_path, truth):
    """Runs whose measured seconds are what ``truth`` predicts: a spread of sizes and meshes."""
    shapes = [(8, 1, 1024, 16, 8), (8, 1, 4096, 32, 8), (4, 1, 2048, 16, 8), (1, 1, 512, 8, 16),
              (8, 2, 2048, 16, 32), (2, 1, 8192, 64, 8), (8, 1, 512, 8, 64), (1, 1, 4096, 32, 8)]
    text = SOURCES + "".join(row(f"r{i}", gpus=tp * pp * 1, tp=tp, pp=pp, hidden=h, heads=a, gb=gb)
                             for i, (tp, pp, h, a, gb) in enumerate(shapes))
    runs = load_runs(write(tmp_path, text))
    lines = [SOURCES]
    for i, run in enumerate(runs):
        case = run_case(run, truth)
        lines.append(row(f"r{i}", gpus=run.gpus, tp=run.tp, pp=run.pp, hidden=run.model["hidden"],
                         heads=run.model["heads"], gb=run.global_batch,
                         figure=f"iteration_s: {case.predicted_s(truth)!r}"))
    return write(tmp_path, "".join(lines), "synthetic.yaml")


def test_calibrate_recovers_the_profile_the_runs_were_simulated_with(tmp_path):
    base = attrs.evolve(load_profile("a100"), kernels=Kernels(sms=108))
    truth = base
    for knob, value in TRUE.items():
        from dhelix.dsl.fidelity.fit import KNOBS
        truth = KNOBS[knob].put(truth, value)
    runs = load_runs(synthetic_runs(tmp_path, truth))
    fit = fit_profile([run_case(run, base) for run in runs], base, tuple(TRUE), iterations=12)
    assert max(abs(e) for e in fit.before) > 0.1  # the start is far off
    for knob, value in TRUE.items():
        assert fit.values[knob] == pytest.approx(value, rel=2e-3), knob
    assert max(abs(e) for e in fit.after) < 1e-3
    assert max(abs(e) for e in fit.loo) < 2e-3  # left out, each run is still predicted


def test_calibrate_command_prints_each_run_and_writes_the_fitted_profile(tmp_path):
    base = load_profile("a100")
    truth = attrs.evolve(base, achieved={**base.achieved, "gemm": 0.5})
    runs_file = synthetic_runs(tmp_path, truth)
    out = tmp_path / "fitted.yaml"
    result = dhelix_here("calibrate", str(runs_file), "--knobs", "gemm", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "r7" in result.stdout and "leave-one-out: mean |error| 0.0%" in result.stdout
    assert f"gemm {base.achieved['gemm']:.4g} -> 0.5" in result.stdout
    fitted = load_profile(str(out))
    assert fitted.achieved["gemm"] == pytest.approx(0.5, rel=1e-3)
    assert "Fitted by `dhelix calibrate` on 8 measured runs" in out.read_text()


def test_calibrate_takes_a_runs_metrics_file(tmp_path):
    program = check_text(open("examples/tiny_llama_cpu.dhx").read(), "examples/tiny_llama_cpu.dhx")
    from dhelix.dsl.simulator.events import simulate
    step = simulate(program, trace=False).step_time
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"file": "examples/tiny_llama_cpu.dhx", "step_s": 1.25 * step}))
    result = dhelix_here("calibrate", str(metrics), "--knobs", "overhead", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["runs"][0]["error_start"] == pytest.approx(-0.2, abs=0.01)
    assert abs(data["runs"][0]["error_fitted"]) < 0.01
    assert data["knobs"]["overhead"]["fitted"] > 0


def test_calibrate_refuses_bad_knobs_and_mixed_gpus(tmp_path):
    result = dhelix_here("calibrate", "x.yaml", "--knobs", "gemm,speed")
    assert result.returncode == 2 and "unknown knob(s) speed" in result.stderr
    text = SOURCES + row("a") + row("b").replace("gpu: a100-80gb", "gpu: h100-sxm")
    result = dhelix_here("calibrate", str(write(tmp_path, text)))
    assert result.returncode == 2 and "one profile fits one GPU; choose one with --gpu" in result.stderr
    unknown = SOURCES + row("a") + row("b").replace("gpu: a100-80gb", "gpu: b200")
    result = dhelix_here("calibrate", str(write(tmp_path, unknown)), "--profile", "a100", "--knobs", "gemm")
    assert result.returncode == 0, result.stderr
    assert "b" in result.stdout and "skipped: run 'b': no shipped profile for GPU 'b200'" in result.stdout
    missing = dhelix_here("calibrate", str(tmp_path / "none.yaml"))
    assert missing.returncode == 1 and "cannot read" in missing.stderr and "Traceback" not in missing.stderr


def test_only_knobs_enough_runs_exercise_are_fitted(tmp_path):
    from dhelix.dsl.fidelity.fit import MIN_RUNS_PER_KNOB, identifiable

    text = SOURCES + "".join(row(f"r{i}", hidden=512 * (i + 1), heads=8) for i in range(MIN_RUNS_PER_KNOB))
    cases = [run_case(run) for run in load_runs(write(tmp_path, text))]
    # fp16 runs without flash attention: the fp16 GEMMs are priced, fp8 GEMMs and flash attention are not.
    assert identifiable(("gemm", "gemm_fp8", "attention", "overhead"), cases) == ("gemm", "overhead")
    assert identifiable(("gemm",), cases[1:]) == ()


def test_a_context_parallelism_dhelix_does_not_model_is_said_not_predicted(tmp_path):
    text = SOURCES + row(gpus=16, tp=8, extra="    cp: 2\n    cp_kind: all_gather\n")
    (run,) = load_runs(write(tmp_path, text))
    prediction = predict(run)
    assert prediction.predicted_s is None
    assert "all_gather context parallelism is not modelled" in prediction.problem
