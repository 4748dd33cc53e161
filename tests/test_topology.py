"""The nodes the ranks run on are checked against the cluster block (interpreter/launch/topology.py):
a pure check on made-up placements, and two local torchrun "nodes" launching a program that
says all four ranks share one node."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import tiny_example_text

from dhelix.dsl.core.errors import DhelixError
from dhelix.interpreter.launch.topology import Where, check_placement

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny_llama_cpu.dhx"


def test_the_cluster_blocks_nodes_pass():
    check_placement([Where(0, "a"), Where(0, "a"), Where(1, "b"), Where(1, "b")], gpus_per_node=2)


def test_four_ranks_on_a_node_said_to_hold_two_is_an_error_naming_ranks_and_hosts():
    with pytest.raises(DhelixError) as info:
        check_placement([Where(0, "a")] * 4, gpus_per_node=2)
    error = info.value
    assert error.message == ("the cluster block puts ranks 0 and 2 on different nodes (gpus_per_node = 2), but "
                             "they run on the same one: rank 0 on a (node 0), rank 2 on a (node 0)")
    assert error.notes == ("measured: ranks 0-3 on a (node 0)",
                           "set gpus_per_node = 4 in the cluster block, or launch 2 rank(s) per node")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun_nodes(program: Path, *args: str, timeout: float) -> list[tuple[int, str, str]]:
    """Two torchrun agents ("nodes" 0 and 1, 2 ranks each) meeting at one c10d rendezvous on
    this host, running ``dhelix run PROGRAM ARGS``; (exit code, stdout, stderr) per node. Past
    ``timeout`` both agents and their ranks are killed (none is left behind) and the test fails
    with what each said: an agent whose node finished waits in torchrun's exit barrier (300 s)
    for the other one."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    port = _free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                               str(node), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               f"127.0.0.1:{port}", "-m", "dhelix", "run", str(program), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                              start_new_session=True) for node in (0, 1)]
    outputs: dict[int, tuple[str, str]] = {}
    readers = [threading.Thread(target=lambda n=n, node=node: outputs.__setitem__(n, node.communicate()), daemon=True)
               for n, node in enumerate(nodes)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    if any(reader.is_alive() for reader in readers):
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)  # the agent and its ranks (its session)
        for reader in readers:
            reader.join(10)
        pytest.fail(f"the torchrun nodes did not finish within {timeout:.0f} s: "
                    + "; ".join(f"node {n} said: {outputs.get(n, ('', ''))[1][-2000:]}" for n in (0, 1)))
    return [(node.returncode, *outputs[n]) for n, node in enumerate(nodes)]


def test_two_torchrun_nodes_running_a_one_node_program_stop_with_the_error(tmp_path):
    pytest.importorskip("torch")
    program = tmp_path / "one_node.dhx"
    program.write_text(tiny_example_text().replace("nodes = 2", "nodes = 1 #").replace("gpus_per_node = 2",
                                                                                        "gpus_per_node = 4"))
    nodes = _torchrun_nodes(program, "--steps", "1", "--timeout", "20", timeout=120)
    assert [code for code, _, _ in nodes] != [0, 0]
    err = nodes[0][2]
    assert ("the cluster block puts ranks 0 and 2 on the same node (gpus_per_node = 4), but they run on "
            "different ones") in err, err
    assert "ranks 0, 1 on " in err and "(node 0); ranks 2, 3 on " in err


def test_ranks_started_with_master_addr_but_no_torchrun_agent_find_the_store_on_rank_0(tmp_path):
    # What a script or another launcher does (benchmarks/two_nodes.py): no agent hosts the store.
    pytest.importorskip("torch")
    program = tmp_path / "tp2.dhx"
    program.write_text(tiny_example_text().replace("nodes = 2", "nodes = 1 #").replace("pp = 2", "pp = 1"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK", "LOCAL_RANK"))}
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    # No --timeout: the store hosted on rank 0 takes the declared default (it once took None).
    ranks = [subprocess.Popen([sys.executable, "-m", "dhelix", "run", str(program), "--steps", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=ROOT)
             for rank in (1, 0)]  # rank 1 first: it waits for rank 0 to host the store
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert "dhelix run: " in outputs[1][0]  # rank 0 reports for the run


def test_measured_topology_from_ranks_laid_out_node_by_node():
    from dhelix.interpreter.launch.topology import measured_per_node

    assert measured_per_node([Where(0, "a")] * 4) == 4
    assert measured_per_node([Where(0, "a"), Where(0, "a"), Where(1, "b"), Where(1, "b")]) == 2
    with pytest.raises(DhelixError) as info:
        measured_per_node([Where(0, "a"), Where(1, "b"), Where(0, "a"), Where(1, "b")])
    assert info.value.message.startswith("the measured topology cannot be used: the ranks are not laid out as "
                                         "consecutive blocks of equal size per node")
    assert info.value.notes[0] == "measured: ranks 0, 2 on a (node 0); ranks 1, 3 on b (node 1)"


def test_two_torchrun_nodes_run_a_one_node_program_with_the_measured_topology(tmp_path):
    pytest.importorskip("torch")
    program = tmp_path / "one_node.dhx"
    program.write_text(tiny_example_text().replace("nodes = 2", "nodes = 1 #").replace("gpus_per_node = 2",
                                                                                        "gpus_per_node = 4"))
    nodes = _torchrun_nodes(program, "--steps", "2", "--timeout", "30", "--topology", "measured", "--json",
                            timeout=180)
    assert [code for code, _, _ in nodes] == [0, 0], nodes
    import json

    figures = json.loads(nodes[0][1])
    assert figures["topology"] == ("measured, 2 rank(s) per node on 2 node(s), used instead of the cluster "
                                   "block's gpus_per_node = 4 (lanes and prediction follow the measured nodes)")


@pytest.mark.parametrize("torchrun", [True, False])
def test_a_torchrun_rank_leaves_with_its_code_and_without_the_interpreters_clean_up(torchrun):
    # The C++ clean-up at exit sometimes aborted a finished torchrun rank ("terminate called
    # without an active exception"): its node failed, the other node's agent waited 300 s.
    script = ("import atexit\n" + ("import torch.distributed\n" if torchrun else "")
              + "from dhelix.cli.main import leave\natexit.register(print, 'cleaned up')\nleave(3)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if torchrun:
        pytest.importorskip("torch")
        env.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 3, done.stderr
    assert ("cleaned up" in done.stdout) is not torchrun


def test_the_measured_topology_is_for_torchrun(capsys):
    from dhelix.cli.main import main

    assert main(["run", str(EXAMPLE), "--topology", "measured"]) == 2
    assert "--topology measured applies under torchrun" in capsys.readouterr().err


def test_the_summary_line_says_whether_the_measured_nodes_differ():
    from dhelix.interpreter.launch.topology import describe_measured

    assert describe_measured(2, 4, 2) == "measured, 2 rank(s) per node on 2 node(s), as the cluster block says"
    assert describe_measured(4, 4, 2).startswith("measured, 4 rank(s) per node on 1 node(s), used instead of")


def test_a_one_host_torchrun_of_a_two_node_program_emulates_the_nodes():
    from dhelix.interpreter.launch.topology import emulated_nodes

    assert emulated_nodes([Where(0, "vm")] * 4, gpus_per_node=2) == (
        "emulated, the cluster block's 2 node(s) of 2 rank(s) on one host (vm), as the local launcher does; lanes "
        "and prediction follow the cluster block")
    assert emulated_nodes([Where(0, "vm")] * 4, gpus_per_node=4) == ""  # one node: nothing to emulate
    assert emulated_nodes([Where(0, "a"), Where(0, "a"), Where(1, "b"), Where(1, "b")], gpus_per_node=2) == ""


def test_the_placement_error_names_the_measured_topology(capsys):
    from dhelix.cli.main import _add_remedies
    from dhelix.interpreter.launch.topology import PlacementError

    with pytest.raises(PlacementError) as info:
        check_placement([Where(0, "a"), Where(1, "b"), Where(0, "a"), Where(1, "b")], gpus_per_node=2)
    _add_remedies(info.value)  # the command line names the option
    assert info.value.notes[-1].startswith("or run with --topology measured")


@pytest.mark.parametrize(("env", "placement", "started", "silent"), [
    ({}, False, False, False),  # not torchrun: this process is the reporter
    ({"RANK": "0", "LOCAL_RANK": "0"}, True, True, False),
    ({"RANK": "2", "LOCAL_RANK": "0"}, True, True, True),  # rank 0 reports the placement
    ({"RANK": "2", "LOCAL_RANK": "0"}, False, False, False),  # a node's local rank 0 reports its own
    ({"RANK": "3", "LOCAL_RANK": "1"}, False, False, True),
    ({"RANK": "3", "LOCAL_RANK": "1"}, False, True, False),  # a rank's own failure while training
])
def test_under_torchrun_an_error_every_rank_meets_is_reported_once(monkeypatch, env, placement, started, silent):
    from dhelix.cli.run import _reported_elsewhere
    from dhelix.interpreter.launch.topology import PlacementError

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {**env, **({"WORLD_SIZE": "4"} if env else {})}.items():
        monkeypatch.setenv(key, value)
    error = PlacementError("x") if placement else DhelixError("x")
    assert _reported_elsewhere(error, started) is silent


def test_torchrun_standalone_runs_the_two_node_demo_emulating_its_nodes(tmp_path):
    # The README's demo program under a plain one-host torchrun (issue 31): it runs as `dhelix run` does.
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           "-m", "dhelix", "run", str(EXAMPLE), "--steps", "2", "--timeout", "30"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "topology: emulated, the cluster block's 2 node(s) of 2 rank(s) on one host" in done.stdout
    # Said once, not per rank: the first line, what runs (before the ranks start), then the summary.
    assert done.stdout.count("dhelix run: ") == 3 and done.stdout.count("; training, 2 step(s)") == 1
    assert done.stdout.count(": compiling, then checking that it fits") == 1


def test_torchrun_of_the_wrong_world_size_says_so_once(tmp_path):
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "dhelix", "run", str(EXAMPLE), "--steps", "1"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert done.returncode != 0
    assert done.stderr.count("the mesh has 4 ranks (tp 2 × pp 2) but torchrun started 2") == 1, done.stderr
