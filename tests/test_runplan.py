"""The run compiled once (dsl/simulator/runplan.py): the command builds a RunPlan, the
simulator prices it, the ranks run it and never parse or run a pass again."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from dhelix.dsl.planner.si_plan import SIMode, op_by_op_plan, sequential_plan
from dhelix.dsl.simulator.events import block_orders, planned_pairs, simulate
from dhelix.dsl.simulator.runplan import BlockOrders, SegmentPairs, build_run_plan, price

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "tiny_llama_cpu.dhx")
def _plan(mode: str = "planned", interleave: bool = True, text: str | None = None, path: str = EXAMPLE):
    return build_run_plan(text if text is not None else Path(path).read_text(), path, mode=mode,
                          interleave=interleave)


def test_each_mode_has_its_one_typed_plan():
    planned, scheduled = _plan("planned"), _plan("scheduled")
    assert isinstance(planned.si, SegmentPairs) and planned.mode == SIMode.PLANNED
    assert planned.si.pairs == planned_pairs(planned.program) and planned.si.planned is not None
    assert isinstance(scheduled.si, BlockOrders) and scheduled.mode == SIMode.SCHEDULED
    assert scheduled.si.orders() == block_orders(scheduled.program)
    op_by_op = _plan("op_by_op")
    assert op_by_op.si == SegmentPairs(SIMode.OP_BY_OP, op_by_op_plan(op_by_op.program.forward,
                                                                      op_by_op.program.backward))


def test_without_a_profile_the_planned_modes_fall_back_to_op_by_op_and_without_si_nothing_is_planned():
    text = Path(EXAMPLE).read_text()
    assert '  profile = "a40"\n' in text
    for mode in ("planned", "scheduled"):
        run = _plan(mode, text=text.replace('  profile = "a40"\n', ""))
        assert run.program.profile is None and run.si.mode == SIMode.OP_BY_OP
    off = _plan("scheduled", interleave=False)
    assert off.si == SegmentPairs(SIMode.SCHEDULED, sequential_plan(off.program.forward, off.program.backward))


def test_the_simulator_prices_the_plan_the_ranks_run():
    for mode, scheduled in (("planned", False), ("scheduled", True), ("op_by_op", False)):
        run = _plan(mode)
        assert price(run) == simulate(run.program, scheduled=scheduled), mode
    off = _plan("planned", interleave=False)
    assert price(off, zero1=True) == simulate(off.program, si=False, zero1=True)


def test_a_run_plan_travels_to_the_ranks_whole():
    run = _plan("scheduled")
    assert pickle.loads(pickle.dumps(run)) == run


# -- the ranks never compile ---------------------------------------------------------------

def _refuse(*args, **kwargs):
    raise AssertionError("a rank parsed or ran a pass: it must run the command's RunPlan")


def guarded_train(options, device, heartbeat=None):
    """:func:`train` in a rank whose parser, checker and pass pipeline fail when called
    (their code replaced, so every name bound to them fails alike), and so do the
    derivations the executor reads from the RunPlan's facts (the B action's ops, selective
    recomputation's drops, the SI plan's check, the transfers' keys and order, a layer's
    issue order run alone, ZeRO-3's facts)."""
    from dhelix.dsl.core import oplib
    from dhelix.dsl.frontend import check, imports, parser
    from dhelix.dsl.passes import fsdp, pipeline, validate
    from dhelix.dsl.planner import pair_order, si_plan
    from dhelix.interpreter.training import train

    for module, name in ((parser, "parse"), (imports, "load_modules"), (check, "check_program"),
                         (pipeline, "run_until"), (pipeline, "rerun"), (oplib, "selective_drops"),
                         (si_plan, "backward_ops"), (si_plan, "check_plan"), (validate, "transfer_key"),
                         (validate, "check_fifo"), (pair_order, "order_pair"), (fsdp, "is_fsdp"),
                         (fsdp, "shard_axis"), (fsdp, "replicas_substituted")):
        getattr(module, name).__code__ = _refuse.__code__
    return train.train(options, device, heartbeat)


@pytest.mark.parametrize("mode, recompute, example", [("scheduled", "", None),
                                                      ("planned", "  recompute = selective\n", None),
                                                      ("planned", "", "tiny_llama_fsdp_cpu.dhx")])
def test_ranks_run_the_commands_plan_and_never_parse_or_run_a_pass(monkeypatch, capsys, tmp_path, mode, recompute,
                                                                    example):
    pytest.importorskip("torch")
    from conftest import ROOT, tiny_example_text

    from dhelix.cli.main import main
    from dhelix.interpreter.training import train

    program = tmp_path / "tiny.dhx"
    text = tiny_example_text() if example is None else (ROOT / "examples" / example).read_text()
    program.write_text(text.replace("train {\n", "train {\n" + recompute).replace('"../', f'"{ROOT}/'))
    monkeypatch.setattr(train, "train", guarded_train)  # what cmd_run hands to the spawner
    assert main(["run", str(program), "--steps", "2", "--check", "--si-plan", mode, "--timeout", "60"]) == 0
    out = capsys.readouterr().out
    assert out.count("step ") >= 2, out


def test_the_plan_holds_every_issue_order_the_ranks_run():
    from dhelix.dsl.planner.pair_order import BlockOrder
    from dhelix.dsl.planner.si_plan import backward_ops

    for mode in ("planned", "op_by_op"):
        run = _plan(mode)
        program = run.program
        for barrier in (False, True):
            held = run.si.issue_order(barrier)
            fresh = BlockOrder.build(run.si.pairs, program.forward.ops,
                                     backward_ops(program.backward, program.lowered.split), barrier,
                                     (program.forward.output, program.backward.output))
            assert held.barrier == barrier and held.plan == run.si.pairs
            for forward, backward in ((True, True), (True, False), (False, True)):
                for led in (False, True):
                    for back_led in (False, True):
                        key = (forward, backward, led and forward and bool(held.lead),
                               back_led and backward and bool(held.back_lead))
                        assert key in held._orders, (mode, barrier, key)  # computed by the command
                        assert held.pairs(forward, backward, led=led, back_led=back_led) == \
                            fresh.pairs(forward, backward, led=led, back_led=back_led)
    assert _plan("scheduled").si.issue_order(False) is None  # blocks run whole in their orders


def _refuse_ordering(*args, **kwargs):
    raise AssertionError("a rank ordered a segment pair's issues: they come with the RunPlan")


def issue_guarded_train(options, device, heartbeat=None):
    """:func:`train` in a rank whose pair orderer fails when called: the issue orders come
    with the RunPlan."""
    from dhelix.dsl.planner import pair_order
    from dhelix.interpreter.training import train

    pair_order.plan_order.__code__ = _refuse_ordering.__code__
    return train.train(options, device, heartbeat)


def test_ranks_take_the_pair_issue_orders_from_the_plan(monkeypatch, capsys):
    pytest.importorskip("torch")
    from dhelix.cli.main import main
    from dhelix.interpreter.training import train

    monkeypatch.setattr(train, "train", issue_guarded_train)
    assert main(["run", EXAMPLE, "--steps", "1", "--check", "--si-plan", "planned", "--timeout", "60"]) == 0
    assert "step " in capsys.readouterr().out


# -- under torchrun: one compile for the world ------------------------------------------------

#: A torchrun rank's entry point whose parser, checker and pass pipeline fail outside global
#: rank 0 (their code replaced, so every name bound to them fails alike): rank 0 compiles for
#: the whole world, the others run what it hands them.
TORCHRUN_RANK = '''
import os, sys
from dhelix.dsl.frontend import check, imports, parser
from dhelix.dsl.passes import pipeline

if os.environ["RANK"] != "0":
    def refuse(*args, **kwargs):
        raise AssertionError("a rank other than 0 parsed or ran a pass: rank 0 compiles for the world")
    for module, name in ((parser, "parse"), (imports, "load_modules"), (check, "check_program"),
                         (pipeline, "run_until"), (pipeline, "rerun")):
        getattr(module, name).__code__ = refuse.__code__
    try:
        parser.parse("model m {}", "m.dhx")
    except AssertionError:
        print(f"rank {os.environ['RANK']} cannot parse", file=sys.stderr, flush=True)
from dhelix.cli.main import leave, main
leave(main(sys.argv[1:]))
'''


def test_under_torchrun_rank_0_compiles_once_for_the_world(tmp_path):
    pytest.importorskip("torch")
    import os
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text(TORCHRUN_RANK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(script), "run", EXAMPLE, "--steps", "2", "--timeout", "30"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr
    # The guard bites on ranks 1-3 (their lines may interleave: four processes share stderr).
    assert sorted(re.findall(r"rank (\d+) cannot parse", done.stderr)) == ["1", "2", "3"], done.stderr
    assert "a rank other than 0 parsed" not in done.stderr
    assert done.stdout.count("; training, 2 step(s)") == 1, done.stdout


def test_under_torchrun_an_error_of_rank_0s_compile_reaches_every_rank_and_is_said_once(tmp_path):
    # The other ranks wait for rank 0's RunPlan: its error must reach them, not leave them waiting.
    pytest.importorskip("torch")
    import os
    import subprocess
    import sys

    from conftest import tiny_example_text

    program = tmp_path / "typo.dhx"
    program.write_text(tiny_example_text().replace("pipeline w_helix", "pipeline w_helx"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           "-m", "dhelix", "run", str(program), "--steps", "1", "--timeout", "30"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert done.returncode != 0
    assert done.stderr.count("w_helx") >= 1 and done.stderr.count("unknown pipeline") == 1, done.stderr
    # No rank's traceback (torchrun's own report of the failed ranks is torch's code).
    assert not [line for line in done.stderr.splitlines() if line.lstrip().startswith('File "')
                and "torch" not in line and "runpy" not in line], done.stderr
