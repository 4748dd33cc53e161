"""`dhelix export --torch-csv`: torch.distributed.pipelining reads the CSV back action for action,
and its runtime executes it on two gloo ranks with the loss and gradients of a plain
single-process run.

Every stdlib pipeline is exported in both forms (compute_only, compute_comms); torch 2.13's
``_PipelineScheduleRuntime`` runs all of them, SI blocks as OVERLAP_F_B (one after the other).
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest

from dhelix.cli import main
from dhelix.dsl.core.errors import ScheduleError
from dhelix.dsl.render.torch_csv import check_p2p_order, torch_csv
from dhelix.dsl.passes.overrides import Overrides, load_file
from dhelix.dsl.core.schedule import Compute, Interleaved

torch = pytest.importorskip("torch")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

from distributed import join, run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "tiny_llama_cpu.dhx")  # 4 layers, pp 2, fold u, w_helix

#: (pipeline, fold override) of every stdlib schedule; the fold follows the pipeline otherwise.
PIPELINES = [("gpipe", None), ("one_f_one_b", None), ("zb_h1", None),
             ("interleaved_1f1b", "loop(2)"), ("w_helix", None), ("dualpipe_v", None),
             ("looped_bfs", "loop(2)"), ("interleaved_zb", "loop(2)"), ("zbv", None)]
FORMS = ("compute_only", "compute_comms")


def exported(pipeline: str, fold: str | None, ranks: int = 2, microbatches: int = 4):
    """The program of the tiny example lowered with ``pipeline`` at p = ranks, m = microbatches."""
    layers = 4 if ranks == 2 else 2 * ranks  # two stages per rank (fold u, v) also split evenly
    return load_file(EXAMPLE, Overrides(ranks=ranks, microbatches=microbatches, layers=layers,
                                        pipeline=pipeline, fold=fold))


# --- the CSV form and its golden --------------------------------------------------------------

def test_w_helix_csv_golden(golden):
    lowered = exported("w_helix", None).lowered
    golden("export/w_helix_p2_m4_compute_only.csv", torch_csv(lowered, "compute_only"))
    golden("export/w_helix_p2_m4_compute_comms.csv", torch_csv(lowered, "compute_comms"))


def _expected_actions(lowered, with_comms: bool):
    """torch _Action lists built directly from the lowered schedule, independently of export.py."""
    A, C = schedules._Action, schedules._ComputationType
    kinds = {"F": C.FORWARD, "B": C.BACKWARD_INPUT if lowered.split else C.FULL_BACKWARD,
             "W": C.BACKWARD_WEIGHT}
    rows = {}
    for rank, row in enumerate(lowered.actions):
        out = []
        for action in row:
            if isinstance(action, Compute):
                out.append(A(lowered.stage_of(rank, action.chunk), kinds[action.kind], action.microbatch))
            elif isinstance(action, Interleaved):
                parts = tuple(A(lowered.stage_of(rank, p.chunk), kinds[p.kind], p.microbatch)
                              for p in action.parts)
                out.append(A(-1, C.OVERLAP_F_B, None, parts))
            elif with_comms:
                out.append(A(lowered.stage_of(rank, action.chunk),
                             C(f"{action.kind}_{action.data}"), action.microbatch))
        rows[rank] = out
    return rows


def _runtime(lowered):
    # The schedule only reads these four attributes of its stages until it runs.
    stages = [SimpleNamespace(num_stages=len(lowered.stages), group_size=lowered.ranks,
                              group_rank=0, stage_index_to_group_rank=None)]
    return schedules._PipelineScheduleRuntime(stages, lowered.microbatches)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("pipeline,fold", PIPELINES)
def test_torch_load_csv_reads_every_action_back(tmp_path, pipeline, fold, ranks):
    lowered = exported(pipeline, fold, ranks, 2 * ranks).lowered
    path = tmp_path / "schedule.csv"
    path.write_text(torch_csv(lowered, "compute_only"))
    runtime = _runtime(lowered)
    runtime._load_csv(str(path))
    assert runtime.pipeline_order == _expected_actions(lowered, with_comms=False)
    assert runtime.stage_index_to_group_rank == {s: rank for s, (rank, _) in enumerate(lowered.stages)}
    # torch adds the transfers itself: they must be the very ones dhelix lowered, per rank.
    C = schedules._ComputationType
    comm_types = {C.SEND_F, C.RECV_F, C.SEND_B, C.RECV_B}
    ours = _expected_actions(lowered, with_comms=True)
    for rank in range(lowered.ranks):
        theirs = [a for a in runtime.pipeline_order_with_comms[rank] if a.computation_type in comm_types]
        assert sorted(map(str, theirs)) == sorted(str(a) for a in ours[rank] if a.computation_type in comm_types)


@pytest.mark.parametrize("pipeline,fold", PIPELINES)
def test_torch_load_csv_reads_the_compute_comms_form_back(tmp_path, pipeline, fold):
    lowered = exported(pipeline, fold).lowered
    path = tmp_path / "schedule.csv"
    path.write_text(torch_csv(lowered, "compute_comms"))
    runtime = _runtime(lowered)
    runtime._load_csv(str(path), format="compute_comms")
    C = schedules._ComputationType
    for rank, actions in _expected_actions(lowered, with_comms=True).items():
        loaded = [a for a in runtime.pipeline_order_with_comms[rank] if a.computation_type != C.REDUCE_GRAD]
        assert loaded == actions
        reduced = [a.stage_index for a in runtime.pipeline_order_with_comms[rank]
                   if a.computation_type == C.REDUCE_GRAD]
        assert sorted(reduced) == sorted(s for s, (r, _) in enumerate(lowered.stages) if r == rank)


@pytest.mark.parametrize("ranks, microbatches", [(3, 8), (4, 8), (4, 10)])
def test_dualpipe_v_is_lowered_in_fifo_order_and_exports_with_comms(ranks, microbatches):
    # DualPipeV at p >= 3 has a gradient overtake an activation between two ranks; lowering
    # hoists the receive of what was sent first, so untagged P2P (NCCL, torch's runtime) pairs
    # every message right.
    from dhelix.dsl.passes.validate import check_fifo

    lowered = exported("dualpipe_v", None, ranks=ranks, microbatches=microbatches).lowered
    assert check_fifo(lowered) == []
    check_p2p_order(lowered)
    assert "SEND_F" in torch_csv(lowered, "compute_comms")


def test_compute_comms_refuses_receives_out_of_send_order():
    import attrs

    lowered = exported("dualpipe_v", None, ranks=4, microbatches=8).lowered
    row = list(lowered.actions[1])
    first = next(i for i, a in enumerate(row) if str(a) == "RECV_F6.0<0")  # hoisted before RECV_B0.1<0
    row.insert(first + 1, row.pop(first))  # put it back after: the receives cross again
    crossed = attrs.evolve(lowered, actions=(lowered.actions[0], tuple(row), *lowered.actions[2:]))
    with pytest.raises(ScheduleError) as info:
        check_p2p_order(crossed)
    assert "rank 1 receives the gradient of micro-batch 0 from rank 0 before the activation" in str(info.value)
    assert torch_csv(crossed, "compute_only")  # the default form is fine


# --- the command line -----------------------------------------------------------------------

def test_export_cli_writes_the_csv(tmp_path, capsys):
    out = tmp_path / "w.csv"
    assert main(["export", EXAMPLE, "--torch-csv", str(out), "--microbatches", "4"]) == 0
    assert out.read_text() == torch_csv(exported("w_helix", None).lowered)
    assert "w_helix, p = 2, m = 4, 4 stages, compute_only" in capsys.readouterr().err


@pytest.mark.parametrize("argv,code,message", [
    (["--torch-format", "bogus", "--torch-csv", "{tmp}/x.csv"], 2, "unknown form 'bogus'"),
    ([], 2, "nothing to export"),
    (["--torch-csv", "{tmp}/missing/x.csv"], 2, "the folder '{tmp}/missing' does not exist"),
    (["--torch-csv", "{tmp}/x.csv", "--pipeline", "w_helx"], 2, "did you mean 'w_helix'"),
    (["--torch-csv", "{tmp}/x.csv", "--microbatches", "1"], 1, "w_helix needs m >= p"),
])
def test_export_cli_errors(tmp_path, capsys, argv, code, message):
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    assert main(["export", EXAMPLE, *argv]) == code
    assert message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err


# --- torch runs it: two gloo ranks against a single-process reference ------------------------

HIDDEN, BATCH = 8, 8


def _model():
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
                               for _ in range(4))


def _data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, HIDDEN, generator=generator), torch.randn(BATCH, HIDDEN, generator=generator)


def _run_schedule(rank, job):
    """Run one exported schedule on this rank; returns its per-micro-batch losses and the
    gradients of the layers it holds."""
    from torch.distributed.pipelining import PipelineStage

    path, form, microbatches, stages = job
    model, (x, y) = _model(), _data()
    mine, held = [], {}
    rows = BATCH // microbatches
    for index, (owner, first, stop) in enumerate(stages):
        if owner != rank:
            continue
        module = torch.nn.Sequential(*(copy.deepcopy(model[i]) for i in range(first, stop)))
        held[index] = (first, module)
        # Static shapes: torch's dynamic shape inference sends pickled objects, which needs numpy.
        mine.append(PipelineStage(module, index, len(stages), torch.device("cpu"),
                                  input_args=torch.empty(rows, HIDDEN, requires_grad=index > 0),
                                  output_args=torch.empty(rows, HIDDEN, requires_grad=True)))
    runtime = schedules._PipelineScheduleRuntime(mine, microbatches, loss_fn=torch.nn.functional.mse_loss)
    runtime._load_csv(path, format=form)
    losses = []
    last = len(stages) - 1 in held
    runtime.step(*((x,) if 0 in held else ()), target=y if last else None, losses=losses if last else None)
    grads = {first + i: [p.grad.clone() for p in layer.parameters()]
             for first, module in held.values() for i, layer in enumerate(module)}
    return {"losses": [loss.detach() for loss in losses], "grads": grads}


def _worker(rank: int, world: int, port: int, jobs: dict, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    join(rank, world, port, timeout=30.0)
    try:
        results = {name: _run_schedule(rank, job) for name, job in sorted(jobs.items())}
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(jobs: dict, out_dir: Path, timeout: float = 90.0) -> None:
    run_ranks(_worker, 2, jobs, str(out_dir), timeout=timeout)


def _reference(microbatches: int):
    """Loss per micro-batch and gradients of one process running the whole model; the loss
    of a step is the mean over micro-batches, as torch's scale_grads makes it."""
    model, (x, y) = _model(), _data()
    losses = []
    for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
        loss = torch.nn.functional.mse_loss(_forward(model, xs), ys)
        (loss / microbatches).backward()
        losses.append(loss.detach())
    return losses, {i: [p.grad for p in layer.parameters()] for i, layer in enumerate(model)}


def _forward(model, x):
    for layer in model:
        x = layer(x)
    return x


def test_torch_runs_every_exported_schedule_like_one_process(tmp_path):
    jobs = {}
    for pipeline, fold in PIPELINES:
        program = exported(pipeline, fold)
        stages = [(s.rank, s.first_layer, s.stop_layer) for s in program.placement.stages]
        for form in FORMS:
            path = tmp_path / f"{pipeline}_{form}.csv"
            assert main(["export", EXAMPLE, "--torch-csv", str(path), "--torch-format", form,
                         "--microbatches", "4", "--pipeline", pipeline]
                        + (["--fold", fold] if fold else [])) == 0
            jobs[f"{pipeline}/{form}"] = (str(path), form, 4, stages)
    _spawn(jobs, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    want_losses, want_grads = _reference(4)
    assert all(grad.abs().sum() > 0 for grads in want_grads.values() for grad in grads)
    for name in jobs:
        losses = [loss for rank in ranks for loss in rank[name]["losses"]]
        torch.testing.assert_close(losses, want_losses, msg=f"{name}: losses")
        grads = {layer: g for rank in ranks for layer, g in rank[name]["grads"].items()}
        assert sorted(grads) == sorted(want_grads), name
        for layer, pieces in grads.items():
            for got, want in zip(pieces, want_grads[layer], strict=True):
                torch.testing.assert_close(got, want, msg=f"{name}: gradient of layer {layer}")
