"""What runs but likely not as meant is said before it runs (issue 31): a mesh axis the layer
never uses (a warning of `dhelix check` and `dhelix run`), and data too short for one step's
global batch (a warning of `dhelix run`, before any rank starts)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_example_text

from dhelix.cli import main
from dhelix.dsl.passes.axisuse import unused_axes
from dhelix.dsl.passes.pipeline import check_text

PLAIN = """import "stdlib/pipelines.dhx"

layer plain {
  in x [tokens, hidden]
  ln1 = rmsnorm(x)
  fc1 = gemm(ln1, hidden, ffn)
  fc2 = gemm(fc1, ffn, hidden)
  h = add(fc2, x)
  out h
}

model m {
  layers = 2  hidden = 64  ffn = 128  heads = 4  kv_heads = 2  seq = 32  vocab = 256  dtype = fp32  layer = plain
}
cluster { nodes = 1  gpus_per_node = 2  profile = "a40" }
mesh {
  tp = 2
}
train { micro_batch = 1  microbatches = 2 }
pipeline gpipe
"""


def test_a_mesh_axis_the_layer_never_uses_is_a_located_warning_of_check(tmp_path, capsys):
    path = tmp_path / "plain.dhx"
    path.write_text(PLAIN)
    assert main(["check", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{path}: ok")
    assert captured.err == (
        f"{path}:17:3: warning: tp = 2, but no operation of layer 'plain' runs over tp: each group of 2 tp ranks "
        "computes the same thing\n"
        "  17 |   tp = 2\n"
        "     |   ^^^^^^\n"
        "  note: use tp in the layer (all_gather and reduce_scatter over tp, as stdlib's llama does), or set tp = 1 "
        "and give the ranks to dp\n")


def test_axes_the_layers_use_are_not_warned_about():
    text = tiny_example_text()
    assert unused_axes(check_text(text, "tiny.dhx")) == []
    # cp through ring attention, tp split in node-local and cross-node stages by a group partition.
    for name in ("llama39b_cp2_a40.dhx", "tiny_llama_group_cpu.dhx", "phi31b_a40.dhx"):
        path = Path(__file__).resolve().parent.parent / "examples" / name
        assert unused_axes(check_text(path.read_text(), str(path))) == [], name


def test_data_shorter_than_one_batch_is_warned_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    corpus = tmp_path / "short.txt"
    corpus.write_text("x" * 200)  # 167 bytes after the held-out 33: 5 windows of 33 for a batch of 16
    _no_ranks(monkeypatch)
    example = Path(__file__).resolve().parent.parent / "examples" / "tiny_llama_cpu.dhx"
    with pytest.raises(SystemExit):
        main(["run", str(example), "--data", str(corpus)])
    assert (f"warning: the data '{corpus}' (given by --data) holds 5 training sequence(s) of seq + 1 tokens, fewer "
            "than one step's global batch of 16: every step repeats them") in capsys.readouterr().err


def _no_ranks(monkeypatch):
    import dhelix.interpreter.launch.spawn as spawn

    def refuse(*args, **kwargs):
        raise SystemExit("no ranks in this test")

    monkeypatch.setattr(spawn, "run_local", refuse)


def test_a_run_predicted_not_to_fit_this_machine_is_refused_before_any_rank_starts(monkeypatch, capsys):
    pytest.importorskip("torch")
    import dhelix.cli.launch as launch

    _no_ranks(monkeypatch)
    monkeypatch.setattr(launch, "available_memory", lambda: (1e6, "available"))  # a 1 MB machine
    example = str(Path(__file__).resolve().parent.parent / "examples" / "tiny_llama_cpu.dhx")
    assert main(["run", example]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{example}:5:1: the simulator predicts ") and "GB per rank at its peak" in err, err
    assert "for the 4 rank(s) this machine would run; this machine has 0.00 GB available" in err
    assert "or give --force to start anyway" in err
    with pytest.raises(SystemExit):  # --force: said, then the ranks start
        main(["run", example, "--force"])
    assert "starting anyway (--force)" in capsys.readouterr().err


def test_the_tiny_example_fits_this_machine():
    pytest.importorskip("torch")
    from dhelix.cli.launch import check_memory

    example = Path(__file__).resolve().parent.parent / "examples" / "tiny_llama_cpu.dhx"
    assert check_memory(check_text(example.read_text(), str(example)), 4, "gloo") is None


def test_fp8_is_a_warning_of_check_and_an_error_of_run_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    path = tmp_path / "fp8.dhx"
    path.write_text(tiny_example_text().replace("dtype = fp32", "dtype = fp8").replace('"a40"', '"h100"'))
    assert main(["check", str(path)]) == 0
    captured = capsys.readouterr()
    assert "warning: model tiny_llama: dtype = fp8 can be checked, planned, drawn and simulated, but not run" \
        in captured.err and captured.out.startswith(f"{path}: ok")
    pytest.importorskip("torch")
    _no_ranks(monkeypatch)
    assert main(["run", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:5:1: model tiny_llama: dtype = fp8" in err and "set dtype = bf16" in err


def test_check_names_the_models_layer_count_and_what_the_file_defines(tmp_path, capsys):
    path = tmp_path / "twelve.dhx"
    path.write_text(tiny_example_text().replace("layers = 4", "layers = 12"))
    assert main(["check", str(path)]) == 0
    program = check_text(path.read_text(), str(path))  # the stdlib's definitions, however many
    assert capsys.readouterr().out == (
        f"{path}: ok (model tiny_llama: 12 layers of llama, fp32; mesh tp 2 × pp 2, pipeline w_helix, fold u; "
        f"{len(program.layers)} layer DAGs and {len(program.pipelines)} pipelines defined with the imports)\n")


@pytest.mark.parametrize("pipeline, si", [("fold u\npipeline w_helix", "SI on (planned plan)"),
                                          ("fold none\npipeline one_f_one_b",
                                           "SI none (the schedule has no SI blocks)")])
def test_run_says_what_runs_before_the_ranks_start(pipeline, si, tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    _no_ranks(monkeypatch)
    path = tmp_path / "tiny.dhx"
    path.write_text(tiny_example_text().replace("fold u\npipeline w_helix", pipeline))
    with pytest.raises(SystemExit):
        main(["run", str(path), "--steps", "3"])
    out = capsys.readouterr().out
    assert f"dhelix run: {path}: {pipeline.split()[-1]}, tp 2 × pp 2 on 4 gloo rank(s), {si}; training, 3 step(s)" \
        in out


TP_TO_SP = Path(__file__).resolve().parent.parent / "examples" / "tiny_llama_tp_to_sp_cpu.dhx"


@pytest.mark.parametrize("partition, fix", [
    ("", "`substitute ar1 as reduce_scatter + all_gather`; `substitute ar2 as reduce_scatter + all_gather`; "
         "`move ar1 + ar2 later`"),
    ("substitute ar1 as reduce_scatter + all_gather\n  substitute ar2 as reduce_scatter + all_gather",
     "`move ar1 + ar2 later`"),
    ("substitute ar1 as auto\n  substitute ar2 as auto", "`move ar1 + ar2 later`"),
])
def test_tensor_parallelism_without_its_sequence_parallel_form_is_a_warning_of_check(tmp_path, capsys, monkeypatch,
                                                                                      partition, fix):
    # Megatron's all_reduce blocks (stdlib llama_tp) pass check but run refuses them (issue 53):
    # check says so, naming the statements that make them runnable; run refuses before any rank.
    text = TP_TO_SP.read_text()
    text = text[:text.index("partition {")] + (f"partition {{\n  {partition}\n}}\n" if partition else "")
    path = tmp_path / "tp.dhx"
    path.write_text(text.replace('import "stdlib', 'import "stdlib'))
    assert main(["check", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"{path}:13:1: warning: model tiny_llama: layer llama_tp can be checked, planned and simulated, but " \
           "not run: gemm" in err, err
    assert fix in err, err
    pytest.importorskip("torch")
    _no_ranks(monkeypatch)
    assert main(["run", str(path)]) == 1
    assert "layer llama_tp can be checked, planned and simulated, but not run" in capsys.readouterr().err


def test_the_runnable_tp_to_sp_example_has_no_such_warning(capsys):
    assert main(["check", str(TP_TO_SP)]) == 0
    assert "not run" not in capsys.readouterr().err


def test_run_says_what_the_planner_chose_for_auto_settings_in_its_header(capsys, monkeypatch):
    pytest.importorskip("torch")
    _no_ranks(monkeypatch)
    example = Path(__file__).resolve().parent.parent / "examples" / "tiny_llama_launch_cpu.dhx"
    with pytest.raises(SystemExit):
        main(["run", str(example), "--steps", "1"])
    header = capsys.readouterr().out.splitlines()
    assert header[0].startswith(f"dhelix run: {example}: compiling")  # at once (issue 53, item 14)
    assert header[1].startswith(f"dhelix run: {example}:")
    assert header[2].startswith("  chosen by the planner: train launch = auto: "), header


def test_a_paper_scale_run_is_refused_at_once_before_torch_is_imported_or_the_si_blocks_planned():
    # Issue 53, item 14: `run` said nothing for 15-25 s and refused llama39b on local ranks only
    # after importing torch and planning twice; `simulate` needs ~3 s. Its first line now comes
    # at once and the memory check before torch (gloo: known without it) and before plan_run.
    import subprocess
    import sys

    example = "examples/llama39b_a40.dhx"  # 39 GB a rank, 64 local ranks: no machine has 2.5 TB
    script = ("import sys\nimport dhelix.cli.run as run\n"
              "def planned(*a, **k):\n    raise AssertionError('planned before the memory check')\n"
              "run.plan_run = planned\n"
              "from dhelix.cli.main import main\n"
              f"code = main(['run', {example!r}, '--backend', 'gloo'])\n"
              "print('exit', code, 'torch imported' if 'torch' in sys.modules else 'no torch')\n")
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, env=env,
                          timeout=120)
    lines = done.stdout.splitlines()
    assert lines[0] == (f"dhelix run: {example}: compiling, then checking that it fits this machine's memory "
                        "before any rank starts"), done.stdout
    assert lines[-1] == "exit 1 no torch", done.stdout + done.stderr
    assert done.stderr.startswith(f"{example}:6:1: the simulator predicts 39.10 GB per rank"), done.stderr


def test_the_backend_is_known_without_torch_only_where_no_gpu_can_be_seen(monkeypatch):
    import dhelix.cli.launch as launch

    assert launch.backend_without_torch("nccl") == "nccl"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert launch.backend_without_torch(None) == "gloo"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(launch, "GPU_DEVICE_FILES", ("/dev/null",))  # a GPU driver's file present: torch tells
    assert launch.backend_without_torch(None) is None
    monkeypatch.setattr(launch, "GPU_DEVICE_FILES", ("/nonexistent/nvidiactl",))
    assert launch.backend_without_torch(None) == "gloo"
