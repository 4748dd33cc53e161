"""Chrome trace (Trace Event Format) JSON for simulated and measured runs.

Both the simulator and the interpreter describe a run the same way: one event per piece of
work, given as ``(rank, lane, name, start, duration, args)`` with times in seconds. This
module turns such events into the JSON that Perfetto (ui.perfetto.dev) and chrome://tracing
open: a *process* per rank (``pid`` = rank), a *thread* per lane (``tid``: compute 0, local 1,
cross 2, other lanes after them in order of first use), complete events (``"ph": "X"``) with
microsecond ``ts`` / ``dur``, and metadata events (``"ph": "M"``) that name and order the
processes and threads. Counter events (``"ph": "C"``), e.g. live memory, draw as a graph
above the rank's threads.

The command line writes the text (``dhelix simulate --trace``, ``dhelix run --trace``).
Output is deterministic: events are sorted by (pid, tid, ts, longer first, name), times are
rounded to nanoseconds, and keys are written in a fixed order, so the same run gives the same
bytes (golden files and diffs stay clean).
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping

from dhelix.dsl.core.mesh import LANES
from dhelix.dsl.core.timeline import CounterSample, TraceEvent

_US = 1e6  # the format's unit is the microsecond


def chrome_trace(events: Iterable, *, counters: Iterable = (), process_name: str = "rank {rank}",
                 metadata: Mapping | None = None) -> dict:
    """The Trace Event Format object of ``events`` (TraceEvents or 6-tuples, seconds) and
    ``counters`` (CounterSamples or 4-tuples).

    ``process_name`` is formatted with ``rank`` to label each process; ``metadata`` goes
    into ``otherData`` (e.g. the program and the simulator's figures). Returns a dict ready
    for :func:`json.dumps`.
    """
    events = [TraceEvent(*event) for event in events]
    counters = [CounterSample(*sample) for sample in counters]
    lanes = _lane_ids(events)
    ranks = sorted({e.rank for e in events} | {c.rank for c in counters})
    body = _nested_tracks([_complete(event, lanes) for event in events], len(lanes))
    extra = sorted({(r["pid"], r["tid"]) for r in body if r["tid"] >= len(lanes)})
    body += [_counter(sample) for sample in counters]
    body.sort(key=_order)
    names = {tid: lane for lane, tid in lanes.items()}
    meta = []
    for rank in ranks:
        meta.append(_meta("process_name", rank, 0, {"name": process_name.format(rank=rank)}))
        meta.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
        tids = [*lanes.values(), *(tid for pid, tid in extra if pid == rank)]
        for tid in tids:
            name = names.get(tid) or f"{names[tid % _TRACKS_PER_LANE]} ({tid // _TRACKS_PER_LANE + 1})"
            meta.append(_meta("thread_name", rank, tid, {"name": name}))
            # An extra track sorts right below its lane.
            sort = (tid % _TRACKS_PER_LANE) * _TRACKS_PER_LANE + tid // _TRACKS_PER_LANE
            meta.append(_meta("thread_sort_index", rank, tid, {"sort_index": sort}))
    return {"traceEvents": meta + body, "displayTimeUnit": "ms",
            "otherData": dict(metadata or {})}


def trace_json(events: Iterable, **options) -> str:
    """:func:`chrome_trace` as JSON text (compact, one event per line, newline at the end)."""
    trace = chrome_trace(events, **options)
    lines = ",\n".join(json.dumps(event, separators=(",", ":")) for event in trace["traceEvents"])
    other = json.dumps(trace["otherData"], separators=(",", ":"), sort_keys=True)
    return ('{"traceEvents":[\n' + lines + '\n],"displayTimeUnit":"ms","otherData":' + other + "}\n")


def _lane_ids(events: list[TraceEvent]) -> dict[str, int]:
    # The three lanes keep fixed ids even when unused, so traces of different runs line up.
    lanes = {lane: tid for tid, lane in enumerate(LANES)}
    for event in events:
        lanes.setdefault(event.lane, len(lanes))
    return lanes


def _us(seconds: float) -> float:
    return round(seconds * _US, 3)


def _complete(event: TraceEvent, lanes: dict[str, int]) -> dict:
    # Both end points are rounded, not start and duration apart: an event that ends where the
    # next begins must not overlap it by a rounding step.
    start = _us(event.start)
    record = {"name": event.name, "cat": event.lane, "ph": "X", "ts": start,
              "dur": round(_us(event.start + event.duration) - start, 3), "pid": event.rank,
              "tid": lanes[event.lane]}
    if event.args:
        record["args"] = {str(key): _plain(value) for key, value in event.args.items()}
    return record


#: Thread ids of one lane's extra tracks are its id plus multiples of this.
_TRACKS_PER_LANE = 16


def _nested_tracks(records: list[dict], lanes: int) -> list[dict]:
    """``records`` with each one moved, where needed, to an extra track of its lane so that
    the events of every thread nest (viewers draw a thread as a stack of slices: partial
    overlaps, such as concurrent receives, would be drawn wrongly). Extra tracks of lane ``t``
    have thread ids ``t + 16 k``; the first track that can hold an event gets it."""
    stacks: dict[tuple[int, int], list[float]] = {}  # (pid, tid) -> ends of the open slices
    for record in sorted(records, key=_order):
        start, end = record["ts"], round(record["ts"] + record["dur"], 3)  # the rounded end point
        tid = record["tid"]
        while True:
            stack = stacks.setdefault((record["pid"], tid), [])
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                record["tid"] = tid
                break
            tid += _TRACKS_PER_LANE
    return records


def _counter(sample: CounterSample) -> dict:
    return {"name": sample.name, "ph": "C", "ts": _us(sample.time), "pid": sample.rank, "tid": 0,
            "args": {str(key): _plain(value) for key, value in sample.values.items()}}


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _order(record: dict) -> tuple:
    # Longer events first at equal start, so an enclosing slice precedes what it contains.
    return (record["pid"], record["tid"], record["ts"], -record.get("dur", 0.0), record["ph"], record["name"])


def _plain(value):
    """A JSON-ready copy of an argument value (tuples become lists, floats are rounded)."""
    if isinstance(value, float):
        return round(value, 9)
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    return value
