"""Check a loaded program and build its configured IR: definitions, model, cluster, mesh,
train, fold, pipeline, strands and profile.

Every layer and every pipeline defined is checked on its own (library files too); a program
with a model is checked against its mesh and fold (divisibility, layers per pipeline stage).
Instantiating the layer DAG, deriving its backward, resolving strand selectors and placing
the layers are the passes after this one (:mod:`dhelix.dsl.passes.pipeline`).

Errors are collected across all checks that can still run and raised together; checks
that depend on a failed one are skipped so one mistake does not cascade into many.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.frontend.config import (build_cluster, build_fold, build_mesh, build_model, build_strands,
                                        build_train)
from dhelix.dsl.core.errors import CheckError, DhelixError, ErrorCollector
from dhelix.dsl.frontend.layercheck import check_layer
from dhelix.dsl.frontend.modelcheck import check_divisibility, stage_split_error, tie_error
from dhelix.dsl.frontend.pipelinecheck import check_pipeline, reads_name
from dhelix.dsl.frontend.profiles import ProfileError, load_profile
from dhelix.dsl.core.program import Program
from dhelix.dsl.core.wording import did_you_mean, join_words

_SINGLE = {s.ModelDef: "model", s.Fold: "fold", s.PipelineRef: "pipeline", s.StrandsDef: "strands",
           s.PartitionDef: "partition"}


def check_program(modules: list[s.Module]) -> Program:
    """The configured Program of ``modules`` (dependency order, main file last): no layer
    DAG, strand selectors or placement yet. Raises CheckError or ErrorGroup with every
    problem found."""
    errors = ErrorCollector()
    layers = _definitions(modules, s.LayerDef, "layer", errors)
    pipelines = _definitions(modules, s.PipelineDef, "pipeline", errors)
    for layer in layers.values():
        for error in _definition_errors(layer, check_layer):
            errors.add(error)
    for pipeline in pipelines.values():
        for error in _definition_errors(pipeline, check_pipeline):
            errors.add(error)
    singles = _singletons(modules, errors)
    program = Program(tuple(m.span.source.path if m.span else "" for m in modules),
                      tuple(layers.values()), tuple(pipelines.values()))
    if "model" in singles:
        program = _configure(program, singles, layers, pipelines, errors)
    errors.raise_if_any()
    return program


#: Definitions found well formed, by identity (holding each keeps its id unique): `dhelix tune`
#: checks thousands of variants of one program, whose layer and pipeline definitions are the
#: same objects. Only the well formed are remembered, so an error is always built afresh.
_WELL_FORMED: dict[int, object] = {}
_REMEMBERED = 512


def _definition_errors(item, check) -> list[DhelixError]:
    """``check(item)``, the structural errors of a layer or pipeline definition; [] at once
    for the very object found well formed before."""
    if _WELL_FORMED.get(id(item)) is item:
        return []
    found = check(item)
    if not found:
        if len(_WELL_FORMED) >= _REMEMBERED:
            _WELL_FORMED.clear()
        _WELL_FORMED[id(item)] = item
    return found


#: The model, cluster, mesh and train blocks built without an error, by the identity of what
#: they are built from (each kept with what was built of it): `dhelix tune`'s variants of one
#: program share these very nodes. A block with an error is built afresh each time, so its
#: errors are always recorded.
_BUILT: dict[tuple, tuple] = {}


def _built(sources: tuple, build, errors: ErrorCollector):
    """``build(*sources, errors)``, once per tuple of source objects built without an error."""
    key = tuple(map(id, sources))
    found = _BUILT.get(key)
    if found is not None and all(kept is source for kept, source in zip(found[0], sources, strict=True)):
        return found[1]
    before = (len(errors.errors), errors.dropped)
    made = build(*sources, errors)
    if (len(errors.errors), errors.dropped) == before:
        if len(_BUILT) >= _REMEMBERED:
            _BUILT.clear()
        _BUILT[key] = (sources, made)
    return made


def _cluster_and_profile(node: s.ConfigBlock, errors: ErrorCollector) -> tuple:
    """The Cluster of the cluster block ``node`` and the profile it names."""
    cluster = build_cluster(node, errors)
    return cluster, _profile(node, cluster, errors)


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
        listing = join_words(words)
        errors.add(CheckError(f"model {model_node.name} needs {listing}", model_node.span_of("name"),
                              [f"e.g. {example}" for _, example in missing]))
    model, model_block = _built((model_node,), build_model, errors)
    cluster, profile = _built((singles["cluster"],), _cluster_and_profile, errors) if "cluster" in singles \
        else (None, None)
    _check_dtype_costed(model, model_block, profile, errors)
    mesh, mesh_block = _built((singles["mesh"], cluster), build_mesh, errors) if "mesh" in singles else (None, None)
    train = _built((singles["train"],), build_train, errors) if "train" in singles else None
    fold = build_fold(singles["fold"], errors) if "fold" in singles else build_fold(s.Fold("none", None), errors)
    pipeline = _pipeline(singles.get("pipeline"), pipelines, errors)
    _check_layer_name(model, model_block, layers, errors)
    strands = build_strands(singles.get("strands"), errors)
    program = attrs.evolve(program, model=model, cluster=cluster, mesh=mesh, train=train, fold=fold,
                           pipeline=pipeline, profile=profile, strands=strands,
                           partition=singles.get("partition"))
    if model is None or mesh is None or train is None or fold is None:
        return program
    for error in check_divisibility(model, model_block, mesh, mesh_block):
        errors.add(error)
    _check_stages(model, model_block, mesh, fold, train, errors)
    if train.offloads and profile is not None:
        try:
            profile.host_or_error(train.offload_span)
        except ProfileError as error:
            errors.add(error)
    if (tied := tie_error(model, model_block)) is not None:
        errors.add(tied)
    if train.shard is not None and _check_shard(train, mesh, errors):
        program = attrs.evolve(program, mesh=attrs.evolve(mesh, dp_shard=train.shard))
    _check_sharded_over_cp(train, mesh, errors)
    if train.launch is not None and pipeline is not None and not reads_name(pipeline, "g"):
        errors.add(CheckError(f"launch = {train.launch} sets g, which pipeline {pipeline.name} does not read",
                              train.launch_span or train.span,
                              ["launch is how many micro-batches run each model chunk in a row (g) in a pipeline "
                               f"that reads it: {_readers_of('g', pipelines)}", "remove launch, or pick such "
                               "a pipeline"]))
    if train.launch_backward is not None and pipeline is not None and not reads_name(pipeline, "gb"):
        errors.add(CheckError(f"launch_backward = {train.launch_backward} sets gb, which pipeline {pipeline.name} "
                              "does not read", train.launch_backward_span or train.span,
                              ["launch_backward is how many micro-batches run each model chunk's backward in a row "
                               f"(gb, Eq. 2's L2) in a pipeline that reads it: {_readers_of('gb', pipelines)}",
                               "remove launch_backward, or pick such a pipeline"]))
    return program


def _readers_of(name: str, pipelines: dict) -> str:
    """The pipelines the program has (its own and imported) that read builtin ``name``, each
    with its fold (``interleaved_1f1b for loop``), or a word saying none does."""
    found = [p.name + (f" (fold {p.fold})" if p.fold else "") for p in pipelines.values() if reads_name(p, name)]
    return join_words(found) if found else "none of the pipelines this program imports or defines does"


def _check_shard(train, mesh, errors: ErrorCollector) -> bool:
    """Whether ``shard`` cuts dp into hybrid-sharding groups (HSDP); else an error, located
    at the setting, saying why."""
    dp = mesh.size("dp")
    if 1 < train.shard < dp and dp % train.shard == 0:
        return True
    why = (f"shard = {train.shard} does not divide dp = {dp}" if dp % train.shard else
           f"shard = {train.shard} is the whole dp group (dp = {dp}): that is plain ZeRO-3" if train.shard == dp else
           "shard = 1 keeps whole weights on every rank: that is ZeRO-1 data parallelism")
    notes = [f"shard is the size of the groups of consecutive dp ranks that split the weights ({dp} ranks: "
             f"try {', '.join(str(k) for k in range(2, dp) if dp % k == 0) or 'none: dp is prime'})"
             if dp > 2 else "hybrid sharding needs dp of at least 4 (two groups of two)"]
    if train.shard == dp:
        notes = ["remove shard to shard over the whole dp group"]
    errors.add(CheckError(why, train.shard_span or train.span, notes))
    return False


def _check_sharded_over_cp(train, mesh, errors: ErrorCollector) -> None:
    """Record an error when ZeRO-3 with cp > 1 cannot shard over the dp × cp group (``dp.cp``,
    :meth:`~dhelix.dsl.core.mesh.Mesh.fsdp_axis`): cp and dp not neighbours in the mesh
    order, or hybrid sharding, whose shard groups would be joined with cp."""
    if train.zero != 3 or mesh.size("cp") == 1:
        return
    where = train.zero_span or train.span
    if train.shard is not None:
        errors.add(CheckError(f"zero = 3 with shard = {train.shard} and cp = {mesh.size('cp')} is not supported",
                              train.shard_span or where,
                              ["with cp > 1 ZeRO-3 shards each weight over dp x cp (a weight is replicated over cp "
                               "as over dp); hybrid sharding would shard it over its shard groups joined with cp",
                               "remove shard to shard over dp x cp, or use cp = 1 with shard"]))
        return
    joined = mesh.joined_cp()
    if isinstance(joined, str):
        errors.add(CheckError(f"zero = 3 with cp = {mesh.size('cp')} shards each weight over dp x cp, and {joined}",
                              where, ["ZeRO-3 gathers and reduce-scatters over one group of dp x cp ranks: list cp "
                                      "and dp next to each other in the mesh block (mesh { tp = … cp = … dp = … })"]))


def _check_stages(model, model_block, mesh, fold, train, errors: ErrorCollector) -> None:
    """Record an error when the layers do not split into the fold's pipeline stages, equal
    ones or those the train block's first and last stage sizes leave (the fold pass places
    them; the check is here so that it is reported with the other sizes')."""
    layers = model.get("layers")
    error = stage_split_error(fold.text, layers, mesh.size("pp"), fold.v, fold.span or model_block.span("layers"),
                              train.stage_ends, train.stages_span, copies=fold.copies)
    if error is not None:
        error.notes += (f"layers = {layers} is set at {model_block.span('layers')}",)
        errors.add(error)


def _profile(node: s.ConfigBlock | None, cluster, errors: ErrorCollector):
    """The hardware profile the cluster names, loaded (and validated) next to the program."""
    if node is None or cluster is None or cluster.profile is None:
        return None
    setting = next(st for st in node.settings if isinstance(st, s.Setting) and st.key == "profile")
    folder = Path(setting.span.source.path).parent if setting.span else Path.cwd()
    try:
        return load_profile(cluster.profile, search_dir=folder, span=setting.value.span)
    except DhelixError as exc:
        errors.add(exc)
        return None


def _check_dtype_costed(model, model_block, profile, errors: ErrorCollector) -> None:
    """Record an error, located at the model's dtype, when the cluster's profile has no peak
    for that dtype: nothing of the program could be costed (plan, simulate, run's prediction)."""
    if model is None or profile is None or model.dtype in profile.peak_tflops:
        return
    listed = ", ".join(profile.peak_tflops)
    errors.add(CheckError(f"dtype {model.dtype} cannot be costed: profile '{profile.name}' has no peak for it",
                          model_block.span("dtype"),
                          [f"'{profile.name}' lists {listed}; use one of them, or a profile with "
                           f"peak_tflops.{model.dtype}", f"profile file: {profile.path}"]))


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


def _check_layer_name(model, block, layers: dict, errors: ErrorCollector) -> None:
    """Record an error when the model names a layer that no file defines."""
    if model is None or model.layer in layers:
        return
    notes = did_you_mean(model.layer, layers)
    notes.append(f"layers: {', '.join(sorted(layers))}" if layers else
                 'no layer is defined; import "stdlib/layers.dhx" for llama, gpt and moe')
    errors.add(CheckError(f"unknown layer '{model.layer}'", block.nodes["layer"].value.span, notes))
