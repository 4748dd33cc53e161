"""A segment pair, or a layer run alone, compiled once into one function of straight-line code.

:func:`~.si.run_pair` walks a segment pair's issues (:class:`~.si.Flat`) one by one: for each
it tests whether the op is plain, picks its run, calls its compiled op (:mod:`.layer_calls`),
whose function checks its run again and fetches the run's dicts again. Where nothing can
block (every collective complete at its issue, or no filler) and nothing is traced, all of
that is known when the pair is resolved, so :func:`compile_pair` writes it out once: one
function per segment pair (and :func:`compile_alone`, one per layer run alone) whose lines are
the pair's ops' bodies one after another, in the issue order, each on its run (``frun`` or
``brun``), the runs checked once at the top. The ops a filler may hold (the backward's wgrads),
the next layers' leads and the ops without a compiled call keep the loop's logic, written out
for that op: the same tests in the same order (:func:`~.si.run_pair`'s), the op's own call.

The function does exactly what the loop would: the same ops on the same runs in the same
order. It returns False, having run nothing, when a run its inlined ops need cannot take
compiled calls (:attr:`~.layer_exec.LayerRun.fast` false): the loop runs the pair then.
The generated text joins :attr:`~.layer_calls.LayerCalls.source` (a traceback through a
pair shows its lines).
"""

from __future__ import annotations

from typing import Callable, Sequence

from .layer_calls import LayerCalls, on_run

#: Run names in a pair's function, by strand.
_RUNS = {"F": "frun", "B": "brun"}


def compile_pair(issues: Sequence, calls: LayerCalls) -> Callable | None:
    """``pair(frun, brun, filler, layer, ahead, led) -> bool``: the segment pair of resolved
    ``issues`` (:class:`~.si.Flat`, made with ``calls``) as :func:`~.si.run_pair` runs it where
    no op blocks and nothing is traced; False (nothing run) when a run cannot take the
    compiled calls. None when ``issues`` is empty."""
    if not issues:
        return None
    module, lines, checked, fetched, bumps = calls.module, [], [], [], {}
    for issue in issues:
        key = (issue.forward, issue.op.name, issue.comm)
        run = _RUNS[issue.strand]
        lines.append(f"# {issue.name}" + (" (ahead)" if issue.ahead else ""))
        if issue.plain:
            if run not in checked:
                checked.append(run)
            lines += _inlined(on_run(calls.bodies[key], run), fetched, bumps, run)
            continue
        bound = module.bind(f"pair_{issue.strand}_{issue.op.name}", issue)
        if issue.ahead:  # the strand's next layer's run, started by ahead
            lines.append(f"run = led[{issue.strand!r}] = ahead({issue.strand!r})")
            run = "run"
        step = _step(issue, bound, run, calls)
        if issue.wgrad:  # a filler holds it once the run's backward has started
            lines += ["if filler is not None and " + run + ".backward_started:",
                      f"    filler.held.append((layer, {run}, {bound}))", "else:"]
            step = ["    " + line for line in step]
        lines += step
    head = [line for run in checked for line in (f"if not {run}.fast:", "    return False")] + fetched
    tail = [f"{run}.version += {count}" for run, count in bumps.items()]
    name = module.add("pair", head + lines + tail + ["return True"], params="frun, brun, filler, layer, ahead, led")
    return module.load()[name]


#: The first lines of an op's body that fetch a dict of its run (:func:`on_run` with ``{run}``):
#: a fast run keeps them for its life (only a recomputing run's replay replaces its acts).
_FETCHES = ("acts = {run}.acts", "fwd_left = {run}._fwd_left", "bgrads = {run}.bgrads",
            "bwd_left = {run}._bwd_left", "users = {run}._saved_left")


def _inlined(body: list[str], fetched: list[str], bumps: dict[str, int], run: str) -> list[str]:
    """An op's ``body`` on ``run`` inlined: its fetches of the run's dicts moved to the top
    (into ``fetched``, once each), its last line (the run's version counted up) to the end
    (``bumps``: by run, how many)."""
    fetches = [fetch.format(run=run) for fetch in _FETCHES]
    assert body[-1] == f"{run}.version += 1", body[-1]
    for line in body:
        if line in fetches and line not in fetched:
            fetched.append(line)
    bumps[run] = bumps.get(run, 0) + 1
    return [line for line in body[:-1] if line not in fetches]


def _step(issue, bound: str, run: str, calls: LayerCalls) -> list[str]:
    # An op that is not plain, after a filler's take: what it reads held runs first, then its call.
    lines = []
    if issue.reads_held:
        lines += ["if filler is not None and filler.held:", f"    filler.before({run}, {bound})"]
    if issue.call is not None:
        lines.append(f"{calls.names[(issue.forward, issue.op.name, issue.comm)]}({run})")
    else:
        method = "forward_op" if issue.forward else "backward_op"
        lines.append(f"{run}.{method}({bound}.op, {bound}.comm)")
    return lines


def compile_alone(issues: Sequence, calls: LayerCalls) -> Callable | None:
    """``alone(run) -> bool``: one layer's resolved ``issues`` run alone on ``run``, as
    :func:`~.si.run_alone` runs them (each op's compiled call or its run's method, in order);
    False (nothing run) when ``run`` cannot take the compiled calls. None when no op has a call."""
    if not any(issue.call is not None for issue in issues):
        return None
    module, lines, fetched, bumps = calls.module, [], [], {}
    for issue in issues:
        lines.append(f"# {issue.name}")
        key = (issue.forward, issue.op.name, issue.comm)
        if issue.call is not None:
            lines += _inlined(on_run(calls.bodies[key], "run"), fetched, bumps, "run")
        else:
            bound = module.bind(f"alone_{issue.strand}_{issue.op.name}", issue)
            method = "forward_op" if issue.forward else "backward_op"
            lines.append(f"run.{method}({bound}.op, {bound}.comm)")
    tail = [f"run.version += {count}" for count in bumps.values()]
    name = module.add("alone", ["if not run.fast:", "    return False", *fetched, *lines, *tail, "return True"])
    return module.load()[name]
