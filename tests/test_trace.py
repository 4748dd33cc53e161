"""Chrome trace export: valid Trace Event Format JSON, one process per rank, one thread per
lane, deterministic bytes, and a simulated trace whose lanes never run two things at once."""

from __future__ import annotations

import json
import random
from functools import lru_cache

import pytest

from dhelix.cli import main
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.simulator.events import simulate
from dhelix.dsl.core.timeline import CounterSample, TraceEvent
from dhelix.dsl.render.trace import LANES, chrome_trace, trace_json
from conftest import ROOT

EVENTS = [
    TraceEvent(0, "compute", "F0.0", 0.0, 0.002, {"kind": "F", "microbatch": 0, "chunk": 0}),
    TraceEvent(0, "cross", "SEND_F0.0>1", 0.002, 0.0005, {"kind": "SEND", "peer": 1}),
    (1, "compute", "F0.0", 0.0025, 0.002, {"kind": "F", "microbatch": 0, "chunk": 0}),  # a plain tuple
    TraceEvent(1, "local", "all_gather weights", 0.01, 0.001, None),
    TraceEvent(1, "nvme", "offload", 0.011, 0.001, {"bytes": 1e9, "shape": (2, 3)}),
]
REQUIRED = {"name", "ph", "ts", "dur", "pid", "tid"}


def test_complete_events_have_the_required_keys_in_microseconds():
    trace = json.loads(trace_json(EVENTS))
    assert set(trace) == {"traceEvents", "displayTimeUnit", "otherData"}
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(EVENTS)
    for event in complete:
        assert REQUIRED <= set(event)
    first = next(e for e in complete if e["pid"] == 0 and e["name"] == "F0.0")
    assert (first["ts"], first["dur"], first["tid"]) == (0.0, 2000.0, 0)
    assert first["args"] == {"kind": "F", "microbatch": 0, "chunk": 0}
    offload = next(e for e in complete if e["name"] == "offload")
    assert offload["args"]["shape"] == [2, 3]


def test_a_process_per_rank_and_a_thread_per_lane():
    trace = chrome_trace(EVENTS, process_name="pipeline rank {rank}")
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert processes == {0: "pipeline rank 0", 1: "pipeline rank 1"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    # The three lanes keep their ids; other lanes follow in order of first use.
    for pid in (0, 1):
        assert [threads[pid, tid] for tid in range(4)] == [*LANES, "nvme"]
    assert {e["name"] for e in meta} == {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


def test_output_is_deterministic_whatever_the_event_order():
    shuffled = list(EVENTS)
    random.Random(7).shuffle(shuffled)
    assert trace_json(shuffled) == trace_json(EVENTS)


def test_counters_and_metadata():
    trace = json.loads(trace_json(EVENTS, counters=[CounterSample(0, "activations", 0.001, {"GB": 1.5})],
                                  metadata={"program": "tiny"}))
    counter = next(e for e in trace["traceEvents"] if e["ph"] == "C")
    assert counter == {"name": "activations", "ph": "C", "ts": 1000.0, "pid": 0, "tid": 0, "args": {"GB": 1.5}}
    assert trace["otherData"] == {"program": "tiny"}


@lru_cache(maxsize=None)
def simulated(name: str):
    path = ROOT / "examples" / f"{name}.dhx"
    return simulate(check_text(path.read_text(), str(path)), zero1=True)


@pytest.mark.parametrize("name", ["llama39b_a40", "phi31b_a40", "tiny_llama_cpu"])
def test_a_simulated_lane_runs_one_thing_at_a_time(name):
    sim = simulated(name)
    trace = chrome_trace(sim.events, counters=sim.counters)
    by_thread: dict = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] >= 0 and event["pid"] < sim.shape[0]
            by_thread.setdefault((event["pid"], event["tid"]), []).append(event)
    assert {tid for _, tid in by_thread} <= {0, 1, 2}
    for events in by_thread.values():
        for before, after in zip(events, events[1:]):
            assert round(before["ts"] + before["dur"], 3) <= after["ts"]  # end points rounded: no 1 ns overlap


def assert_nested(trace: dict) -> None:
    """Every thread's complete events nest: each begins after, or ends within, the open ones."""
    by_thread: dict = {}
    for event in sorted((e for e in trace["traceEvents"] if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"])):
        by_thread.setdefault((event["pid"], event["tid"]), []).append(event)
    for (pid, tid), events in by_thread.items():
        open_ends: list = []
        for event in events:
            end = round(event["ts"] + event["dur"], 3)
            while open_ends and open_ends[-1] <= event["ts"]:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], f"{event} overlaps partially on thread {pid}/{tid}"
            open_ends.append(end)


def test_concurrent_transfers_get_their_own_track_and_every_thread_nests():
    events = [(0, "cross", "RECV_F0", 0.0, 3e-6), (0, "cross", "RECV_F1", 1e-6, 3e-6),
              (0, "cross", "RECV_F2", 2e-6, 0.5e-6), (0, "compute", "F0", 0.0, 1e-6), (0, "compute", "F1", 1e-6, 1e-6)]
    trace = chrome_trace(events)
    assert_nested(trace)
    tids = {e["name"]: e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert tids == {"RECV_F0": 2, "RECV_F1": 18, "RECV_F2": 2, "F0": 0, "F1": 0}  # F2 nests inside F0
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[18] == "cross (2)"


def test_compute_events_name_their_microbatch_chunk_and_kind():
    sim = simulated("llama39b_a40")
    compute = [e for e in sim.events if e.lane == "compute" and e.name != "optimizer"]
    assert {e.args["kind"] for e in compute} == {"F", "B", "SI"}
    block = next(e for e in compute if e.args["kind"] == "SI")
    assert block.name == f"SI({block.args['forward']},{block.args['backward']})"
    assert set(block.args) == {"kind", "forward", "backward", "microbatch", "chunk", "stage"}


def test_simulate_cli_writes_a_trace_that_loads(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert main(["simulate", "examples/tiny_llama_cpu.dhx", "--trace", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    trace = json.loads(path.read_text())
    assert trace["otherData"]["program"] == "tiny_llama"
    kinds = {e["ph"] for e in trace["traceEvents"]}
    assert kinds == {"M", "X", "C"}
    first = path.read_text()
    assert main(["simulate", "examples/tiny_llama_cpu.dhx", "--trace", str(path)]) == 0
    assert path.read_text() == first


def test_the_detailed_trace_shows_each_si_blocks_segment_pairs_and_the_collectives_they_hide():
    from dhelix.dsl.simulator.events import schedule_plan

    path = ROOT / "examples" / "llama39b_a40.dhx"
    program = check_text(path.read_text(), str(path))
    plan = schedule_plan(program)
    sim = simulate(program, plan, zero1=True, detail=True)
    plain = simulated("llama39b_a40")
    assert sim.step_time == plain.step_time  # the detail changes the trace, not the figures
    blocks = [e for e in sim.events if e.args and e.args.get("kind") == "SI"]
    pairs = [e for e in sim.events if e.args and e.args.get("kind") == "SI pair"]
    hidden = [e for e in sim.events if e.args and e.args.get("kind") == "SI collective"]
    block = blocks[0]
    inside = [e for e in pairs if e.rank == block.rank and block.start <= e.start < block.start + block.duration]
    assert [e.name for e in inside[:len(plan.pairs)]] == [f"SI pair {k}" for k in range(1, len(plan.pairs) + 1)]
    assert sum(e.duration for e in inside[:len(plan.pairs)]) == pytest.approx(plan.total)
    assert all(e.start + e.duration <= block.start + block.duration + 1e-12 for e in inside)
    # Every collective of the plan shows on its lane, by strand, with the compute it hides behind.
    ag1 = next(e for e in hidden if "β ag1" in e.name.split(", "))
    assert ag1.lane == "local" and ag1.args["hidden behind"]
    assert block.args["layer_comm_s"] > block.args["layer_comm_exposed_s"] >= 0
    assert_nested(chrome_trace(sim.events, counters=sim.counters))
