"""Check a loaded program and build its IR: definitions, configuration and layer DAGs.

Errors are collected across all stages that can still run and raised together; stages
that depend on a failed one are skipped so one mistake does not cascade into many.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.frontend.config import build_cluster, build_fold, build_mesh, build_model, build_train
from dhelix.dsl.passes.shapes import instantiate
from dhelix.dsl.core.errors import CheckError, DhelixError, ErrorCollector
from dhelix.dsl.passes.fold import placement_for
from dhelix.dsl.frontend.layercheck import check_layer
from dhelix.dsl.frontend.modelcheck import check_divisibility, layer_env
from dhelix.dsl.frontend.profilecheck import stale_notes
from dhelix.dsl.frontend.profiles import ProfileError, load_profile
from dhelix.dsl.core.program import Program
from dhelix.dsl.passes.strands import build_strands
from dhelix.dsl.core.wording import did_you_mean

_SINGLE = {s.ModelDef: "model", s.Fold: "fold", s.PipelineRef: "pipeline", s.StrandsDef: "strands"}


def check_program(modules: list[s.Module]) -> Program:
    """The Program of ``modules`` (dependency order, main file last), instantiated up to
    the forward layer DAG. Raises CheckError or ErrorGroup with every problem found."""
    errors = ErrorCollector()
    layers = _definitions(modules, s.LayerDef, "layer", errors)
    pipelines = _definitions(modules, s.PipelineDef, "pipeline", errors)
    for layer in layers.values():
        for error in check_layer(layer):
            errors.add(error)
    singles = _singletons(modules, errors)
    program = Program(tuple(m.span.source.path if m.span else "" for m in modules),
                      tuple(layers.values()), tuple(pipelines.values()))
    if "model" in singles:
        program = _configure(program, singles, layers, pipelines, errors)
    errors.raise_if_any()
    return program


def _definitions(modules, kind, word: str, errors: ErrorCollector) -> dict:
    found: dict = {}
    for module in modules:
        for item in module.items:
            if not isinstance(item, kind):
                continue
            if item.name in found:
                errors.add(CheckError(f"{word} '{item.name}' is defined twice", item.span_of("name"),
                                      [f"first defined at {found[item.name].span_of('name')}"]))
                continue
            found[item.name] = item
    return found


def _singletons(modules, errors: ErrorCollector) -> dict:
    found: dict = {}
    for module in modules:
        for item in module.items:
            key = _SINGLE.get(type(item)) or (item.kind if isinstance(item, s.ConfigBlock) else None)
            if key is None:
                continue
            if key in found:
                errors.add(CheckError(f"a program has one '{key}' statement; this is a second one", item.span,
                                      [f"the first is at {found[key].span}"]))
                continue
            found[key] = item
    return found


_NEEDED = (("cluster", "cluster { nodes = 1  gpus_per_node = 4 }"), ("mesh", "mesh { tp = 2  pp = 2 }"),
           ("train", "train { micro_batch = 1  microbatches = 8 }"),
           ("pipeline", 'import "stdlib/pipelines.dhx" and write `pipeline one_f_one_b`'))


def _configure(program: Program, singles: dict, layers: dict, pipelines: dict, errors) -> Program:
    model_node = singles["model"]
    missing = [(key, example) for key, example in _NEEDED if key not in singles]
    if missing:
        words = [f"a {key} block" if key != "pipeline" else "a pipeline statement" for key, _ in missing]
        listing = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
        errors.add(CheckError(f"model {model_node.name} needs {listing}", model_node.span_of("name"),
                              [f"e.g. {example}" for _, example in missing]))
    model, model_block = build_model(model_node, errors)
    cluster = build_cluster(singles["cluster"], errors) if "cluster" in singles else None
    profile = _profile(singles.get("cluster"), cluster, errors)
    mesh, mesh_block = build_mesh(singles["mesh"], cluster, errors) if "mesh" in singles else (None, None)
    train = build_train(singles["train"], errors) if "train" in singles else None
    fold = build_fold(singles["fold"], errors) if "fold" in singles else build_fold(s.Fold("none", None), errors)
    pipeline = _pipeline(singles.get("pipeline"), pipelines, errors)
    layer = _layer(model, model_block, layers, errors)
    program = attrs.evolve(program, model=model, cluster=cluster, mesh=mesh, train=train, fold=fold,
                           pipeline=pipeline, profile=profile)
    if None in (model, mesh, train, fold):
        return program
    for error in check_divisibility(model, model_block, mesh, mesh_block):
        errors.add(error)
    program = attrs.evolve(program, placement=_placement(model, model_block, mesh, fold, errors))
    if errors.errors or layer is None:
        return program
    env = layer_env(model, mesh, train, model_block)
    try:
        forward = instantiate(layer, env, mesh)
    except DhelixError as exc:
        errors.add(exc)
        return attrs.evolve(program, env=tuple(env.items()))
    strands = build_strands(singles.get("strands"), forward, errors)
    _check_measured(singles.get("cluster"), profile, forward, mesh, model, errors)
    return attrs.evolve(program, env=tuple(env.items()), forward=forward, strands=strands)


def _placement(model, model_block, mesh, fold, errors: ErrorCollector):
    """Where each pipeline stage lives under the fold, or None (error recorded) if the layers
    do not split."""
    layers = model.get("layers")
    span = fold.span or model_block.span("layers")
    try:
        return placement_for(fold.kind, fold.v if fold.kind == "loop" else None, layers,
                             mesh.size("pp"), span=span)
    except CheckError as exc:
        errors.add(CheckError(exc.message, exc.span, exc.notes + (
            f"layers = {layers} is set at {model_block.span('layers')}",)))
        return None


def _profile(node: s.ConfigBlock | None, cluster, errors: ErrorCollector):
    """The hardware profile the cluster names, loaded (and validated) next to the program."""
    if cluster is None or cluster.profile is None:
        return None
    setting = next(st for st in node.settings if st.key == "profile")
    folder = Path(setting.span.source.path).parent if setting.span else Path.cwd()
    try:
        return load_profile(cluster.profile, search_dir=folder, span=setting.value.span)
    except DhelixError as exc:
        errors.add(exc)
        return None


def _check_measured(node: s.ConfigBlock | None, profile, forward, mesh, model, errors: ErrorCollector) -> None:
    """A located error when the profile's measured section was taken on another program
    (see :mod:`dhelix.dsl.frontend.profilecheck`)."""
    if profile is None or profile.measured is None:
        return
    notes = stale_notes(profile.measured, forward, mesh, model.dtype)
    if notes:
        setting = next(st for st in node.settings if st.key == "profile")
        errors.add(ProfileError(
            f"profile '{setting.value.value}' was measured on another program", setting.value.span,
            notes + [f"re-measure it: dhelix profile {setting.span.source.path if setting.span else 'FILE'}",
                     "or delete its measured: section to keep only the derived rates (peak, links, OEF, "
                     "slowdown, launch gap)"]))


def _pipeline(ref: s.PipelineRef | None, pipelines: dict, errors: ErrorCollector):
    if ref is None:
        return None
    if ref.name in pipelines:
        return pipelines[ref.name]
    notes = did_you_mean(ref.name, pipelines)
    if not pipelines:
        notes.append('no pipeline is defined; import "stdlib/pipelines.dhx" for the standard schedules')
    else:
        notes.append(f"pipelines: {', '.join(sorted(pipelines))}")
    errors.add(CheckError(f"unknown pipeline '{ref.name}'", ref.span_of("name"), notes))
    return None


def _layer(model, block, layers: dict, errors: ErrorCollector):
    if model is None:
        return None
    if model.layer in layers:
        layer = layers[model.layer]
        return layer if not check_layer(layer) else None
    notes = did_you_mean(model.layer, layers)
    notes.append(f"layers: {', '.join(sorted(layers))}" if layers else
                 'no layer is defined; import "stdlib/layers.dhx" for llama, gpt and moe')
    errors.add(CheckError(f"unknown layer '{model.layer}'", block.nodes["layer"].value.span, notes))
    return None
