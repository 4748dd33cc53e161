"""The pipelines `dhelix tune` writes per layout: the zero-bubble scheduler's.

The zero-bubble paper's automatic schedules, ZB-1p and ZB-2p, are the heuristic's
(:mod:`~dhelix.dsl.planner.zero_bubble`) under an in-flight limit of p and 2p − 1 micro-batches
per rank. Each depends on the layout: its p and m, and one stage's F, B and W times and the
pipeline transfer, which the cost model gives (:func:`stage_costs`), and the share of a
micro-batch's activations that only its weight gradient reads (:func:`w_share`). So the search offers
``zb_1p`` and ``zb_2p`` (fold none) as pipeline names whose definition is written for each
layout (:func:`generated_pipeline`) into the main file, where the checker, the passes and the
simulator take it as any pipeline, and where the winner's file keeps it.
"""

from __future__ import annotations

from fractions import Fraction

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.program import Program
from dhelix.dsl.frontend.parser import parse
from dhelix.dsl.passes.unittime import Costs
from dhelix.dsl.planner.zero_bubble import generate, pipeline_text
from dhelix.dsl.simulator.costs import cost_of, step_costs
from dhelix.dsl.simulator.memory import layer_activations

#: Generated pipeline name → its in-flight limit per rank, in p.
GENERATED = {"zb_1p": lambda p: p, "zb_2p": lambda p: max(1, 2 * p - 1)}


def stage_costs(program: Program) -> Costs:
    """One pipeline stage's F, B and W times (seconds, as exact fractions) and the transfer
    time of ``program`` (through its fold pass, with a profile), from the cost model: its
    largest stage's, where the train block sets the first and last stages' layers; no SI plan
    (the scheduler writes no SI)."""
    assert program.model is not None and program.mesh is not None, "a checked model"
    assert program.train is not None and program.placement is not None, "a program through its fold pass"
    costs = step_costs(program, None, cost_of(program))
    per_stage = max(len(stage.layers) for stage in program.placement.stages)
    again = program.train.recomputed_of(per_stage)  # the stage's layers that recompute first

    def exact(seconds: float, layers: int = per_stage) -> Fraction:
        return (Fraction(seconds).limit_denominator(10 ** 12) * layers).limit_denominator(10 ** 12)

    layer = costs.layer
    b = exact(layer.backward_input_of(True).seconds, again) + exact(layer.backward_input.seconds, per_stage - again)
    return Costs(exact(layer.forward.seconds), b, exact(layer.weight.seconds),
                 Fraction(costs.p2p_seconds).limit_denominator(10 ** 12))


def w_share(program: Program) -> Fraction:
    """The share of one layer's saved activations that only its weight-gradient ops read
    (what a split backward keeps from B to W: the paper's M_W / (M_B + M_W)), of ``program``
    through its autodiff pass."""
    assert program.forward is not None and program.backward is not None and program.model is not None, \
        "a program through autodiff"
    acts = layer_activations(program.forward, program.backward, program.model.dtype, split=True)
    return Fraction(acts.at_weight / acts.total).limit_denominator(1000) if acts.total else Fraction(0)


def placeholder(name: str) -> s.PipelineDef:
    """A stand-in definition of generated pipeline ``name`` (fold none, no SI, reads neither
    g nor gb): what the search reasons about before a layout's own is written."""
    return parse(f"pipeline {name} for none {{\n  repeat m {{ F }}\n  repeat m {{ B W }}\n}}\n", "generated.dhx",
                 start="pipeline_def")


def generated_pipeline(name: str, program: Program) -> s.PipelineDef:
    """Generated pipeline ``name`` for ``program`` (a layout of the searched program, through
    its fold pass): the heuristic's schedule for its p and m under :data:`GENERATED`'s limit,
    its :func:`stage_costs` and its :func:`w_share`."""
    assert program.mesh is not None and program.train is not None, "a checked model"
    ranks, microbatches = program.mesh.size("pp"), program.train.microbatches
    costs = stage_costs(program)
    limit = GENERATED[name](ranks)
    share = w_share(program)
    text = pipeline_text(generate(ranks, microbatches, costs, limit, share), name,
                         f"{name}: the zero-bubble heuristic's schedule for p = {ranks}, m = {microbatches}, at most "
                         f"{limit} micro-batches of activations per rank (a W keeping {float(share):.2g}),\n"
                         f"from one stage's F {float(costs.f):.4g} s, "
                         f"B {float(costs.b):.4g} s, W {float(costs.w):.4g} s, transfer {float(costs.transfer):.4g} s")
    return parse(text, "generated.dhx", start="pipeline_def")
