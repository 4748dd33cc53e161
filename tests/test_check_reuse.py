"""check_program builds a model or cluster block it has built before without an error once
(`dhelix tune` checks thousands of variants that share these nodes), and a block with an
error every time, so that its errors are always reported."""

from __future__ import annotations

import attrs
import pytest

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.frontend import check
from dhelix.dsl.frontend.imports import load_modules, read_source
from dhelix.dsl.search.space import Choice, space_of
from dhelix.dsl.search.variant import apply_choice, launch_reads
from dhelix.dsl.passes import pipeline as passes

EXAMPLE = "examples/tiny_llama_cpu.dhx"


def counting(monkeypatch, name: str) -> list:
    calls: list = []
    real = getattr(check, name)
    monkeypatch.setattr(check, name, lambda *args: calls.append(args) or real(*args))
    return calls


def test_a_block_built_without_an_error_is_built_once(monkeypatch):
    modules = load_modules(read_source(EXAMPLE), EXAMPLE)
    check._BUILT.clear()
    models, clusters = counting(monkeypatch, "build_model"), counting(monkeypatch, "build_cluster")
    first = check.check_program(modules)
    base = passes.rerun(first, after="check")
    space = space_of(base)
    schedule = next(sched for sched in space.schedules if sched[:2] == ("none", "one_f_one_b"))
    choices = [Choice(layout, *schedule) for layout in list(space.layouts())[:3]]
    variants = [check.check_program(apply_choice(modules, c, {p.name: p for p in base.pipelines},
                                                 base.cluster.gpus_per_node, base.mesh.world)) for c in choices]
    assert len(models) == 1 and len(clusters) == 1  # the variants keep the very model and cluster nodes
    assert all(v.model == first.model and v.cluster == first.cluster and v.profile == first.profile
               for v in variants)


def test_a_block_with_an_error_reports_it_every_time(monkeypatch):
    modules = load_modules(read_source(EXAMPLE), EXAMPLE)
    main = modules[-1]
    items = tuple(attrs.evolve(item, settings=item.settings + (s.Setting("dtype", s.Name("bf16")),))
                  if isinstance(item, s.ModelDef) else item for item in main.items)
    broken = modules[:-1] + [attrs.evolve(main, items=items)]
    models = counting(monkeypatch, "build_model")
    messages = []
    for _ in range(2):
        with pytest.raises(DhelixError) as raised:
            check.check_program(broken)
        messages.append(raised.value.render())
    assert len(models) == 2 and messages[0] == messages[1] and "'dtype' is set twice" in messages[0]


def test_the_choices_of_a_layout_share_their_mesh_and_train_blocks():
    from dhelix.dsl.search.tune import Pricer

    modules = load_modules(read_source(EXAMPLE), EXAMPLE)
    base = passes.rerun(check.check_program(modules), after="check")
    pricer = Pricer(modules, base, base.mesh.world)
    space = space_of(base)
    layout = next(iter(space.layouts()))
    blocks = [[item for item in pricer.variant(Choice(layout, *schedule))[-1].items
               if isinstance(item, s.ConfigBlock) and item.kind in ("mesh", "train")]
              for schedule in [sched for sched in space.schedules
                               if sched[2] == "on" and not launch_reads(pricer.pipelines[sched[1]])][:4]]
    assert len(blocks) > 3  # (SI on, pipelines that read no launch builtin: one train block)
    assert all(len(found) == 2 and all(a is b for a, b in zip(found, blocks[0], strict=True)) for found in blocks)
    other = next(lay for lay in space.layouts() if lay.microbatches != layout.microbatches)
    train = [item for item in pricer.variant(Choice(other, *space.schedules[0]))[-1].items
             if isinstance(item, s.ConfigBlock) and item.kind == "train"]
    assert train[0] is not blocks[0][1] and train[0] != blocks[0][1]
