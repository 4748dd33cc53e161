"""Automatic resume: ``--resume auto`` starts afresh when ``--save DIR`` holds no save and
continues from its newest intact one after a rank is killed, with the local launcher and
under torchrun's ``--max-restarts``; either way the final weights equal an uninterrupted run's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from dhelix.interpreter.training.train import FAULT_ENV  # noqa: E402
from test_training import ROOT, dhelix, write_program  # noqa: E402

#: Rank 1 killed outright (SIGKILL) as it begins the third step, after the save of step 2.
KILL_AT_STEP_3 = "1:2:0:kill"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The dp 2 program and the final weights of its 4 steps run without a stop."""
    folder = tmp_path_factory.mktemp("whole")
    program = write_program(folder, "dp2")
    result = dhelix("run", program, "--steps", "4", "--export-weights", str(folder / "whole.pt"))
    assert result.returncode == 0, result.stderr
    return program, torch.load(folder / "whole.pt")


def _assert_same_weights(path, expected) -> None:
    got = torch.load(path)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_a_killed_run_resumed_with_auto_ends_with_the_uninterrupted_weights(uninterrupted, tmp_path):
    program, expected = uninterrupted
    saves, weights = tmp_path / "ck", tmp_path / "w.pt"
    command = ("run", program, "--steps", "4", "--save", str(saves), "--save-every", "2", "--resume", "auto",
               "--export-weights", str(weights))
    died = dhelix(*command, env={FAULT_ENV: KILL_AT_STEP_3})
    assert died.returncode == 1 and (saves / "latest").read_text() == "step-000002\n"
    assert f"--resume auto: no save in {saves} yet; starting from the first step" in died.stderr
    again = dhelix(*command)  # the same command line
    assert again.returncode == 0, again.stderr
    assert f"--resume auto: continuing from {saves / 'step-000002'}" in again.stderr
    assert f"resumed: from {saves / 'step-000002'}" in again.stdout
    _assert_same_weights(weights, expected)


def test_torchrun_restarts_resume_by_themselves(uninterrupted, tmp_path):
    program, expected = uninterrupted
    saves, weights = tmp_path / "ck", tmp_path / "w.pt"
    env = {**os.environ, FAULT_ENV: KILL_AT_STEP_3}  # the first attempt only (TORCHELASTIC_RESTART_COUNT 0)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "-m", "dhelix", "run", program, "--steps", "4", "--save", str(saves), "--save-every", "2",
         "--resume", "auto", "--export-weights", str(weights)],
        capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"--resume auto: continuing from {saves / 'step-000002'}" in result.stderr
    _assert_same_weights(weights, expected)
