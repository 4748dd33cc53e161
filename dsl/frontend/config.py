"""Evaluate the configuration blocks (model, cluster, mesh, train, fold, strands) into program IR.

Settings are evaluated in order, each over the ones before it in the same block (the model
block may write ``ffn = 4 * hidden``). Every problem is collected; the caller raises once.
"""

from __future__ import annotations

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.dtypes import DTYPES
from dhelix.dsl.core.errors import CheckError, ErrorCollector
from dhelix.dsl.frontend.exprs import UnknownName, evaluate
from dhelix.dsl.frontend.levels import build_levels
from dhelix.dsl.frontend.limits import MAX_CHUNKS, range_error
from dhelix.dsl.core.mesh import DIMENSIONS, MESH_AXES, Mesh
from dhelix.dsl.core.options import option, train_keys, train_options
from dhelix.dsl.core.program import (AUTO, FOLD_KINDS, OVERLAP_KINDS, Cluster, FoldSpec, Model, Strands, Train,
                                     unknown_fold)
from dhelix.dsl.core.wording import close_matches, did_you_mean, join_words

MODEL_REQUIRED = ("layers", "hidden", "heads", "seq", "vocab")
MODEL_NAMES = ("dtype", "layer")  # settings whose value is a name, not a number
CLUSTER_KEYS = ("nodes", "gpus_per_node", "profile")
#: The train block's keys, as :mod:`dhelix.dsl.core.options` declares them.
TRAIN_KEYS = train_keys()
#: What ``train { recompute = … }`` accepts: keep every saved activation (``none``), drop the
#: outputs of the cheap operators and compute them again when the layer's backward starts
#: (``selective``, :data:`~dhelix.dsl.core.oplib.SELECTIVE_RECOMPUTE`), or keep only each
#: layer's input, running the layer's forward again before its backward (``full``).
RECOMPUTE = option("recompute").choices
#: When ZeRO-1's all-gather of the updated weights runs (``train { param_gather = … }``):
#: right after the optimizer (``step``), or under the next step's forward, each model chunk's
#: weights waited for before its first forward (``forward``: Megatron's
#: ``--overlap-param-gather``, Centauri's model-level overlap of the all-gather, §3.2.3).
PARAM_GATHER = option("param_gather").choices
#: When the data-parallel gradient reduction runs (``train { grad_reduce = … }``): each
#: layer's as soon as the step's last backward of that layer has finished, beside the rest of
#: the backward (``backward``, the default: PyTorch DDP's bucketed overlap, Megatron's
#: ``--overlap-grad-reduce``, Centauri's model-level overlap of the reduce-scatter, §3.2.3),
#: or all of it after the step's last backward (``step``).
GRAD_REDUCE = option("grad_reduce").choices
#: What ``train { si = … }`` accepts: the schedule's SI blocks co-execute their strands
#: (``on``, the default) or each runs its forward, then its backward (``off``: the schedule
#: as written without SI, what `dhelix simulate --compare` calls "without SI").
SI_SETTINGS = option("si").choices
#: Where ``train { offload = … }`` keeps the optimizer's fp32 masters and AdamW moments: on
#: the device (``none``) or in host memory (``optimizer``: the step's gradients go to the host,
#: AdamW runs on its CPU, the updated weights come back; the profile's ``host`` link prices it).
OFFLOAD = option("offload").choices
#: The ZeRO stages ``train { zero = N }`` accepts: 0 (replicated optimizer states), 1 (optimizer
#: states sharded over data parallelism, Megatron's distributed optimizer) and 3 (FSDP: the
#: layers' weights and gradients sharded too, gathered and reduce-scattered per layer).
ZERO_STAGES = option("zero").choices


#: The example a name-valued setting's message shows.
NAME_EXAMPLES = {"dtype": "bf16", "layer": "llama", "si": "off"}


@attrs.define
class BlockValues:
    """The evaluated settings of one block: ints and names, with each setting's node;
    ``failed`` holds the keys written but rejected (unknown, or a value with an error)."""

    values: dict = attrs.field(factory=dict)
    nodes: dict = attrs.field(factory=dict)
    failed: list = attrs.field(factory=list)

    def span(self, key: str):
        node = self.nodes.get(key)
        return node.span if node is not None else None


def evaluate_block(settings, errors: ErrorCollector, allowed=None, names=(), strings=(), autos=()) -> BlockValues:
    """Evaluate ``settings`` in order; ``allowed`` limits the keys (None: any integer key),
    ``names`` are keys whose value is a bare name, ``strings`` keys that take a string,
    ``autos`` integer keys that may also be ``auto`` (left to the planner)."""
    out = BlockValues()
    last = {st.key: (i, st) for i, st in enumerate(settings)}  # one pass: blocks may be long
    for index, setting in enumerate(settings):
        key = setting.key
        if key in out.nodes:
            errors.add(CheckError(f"'{key}' is set twice", setting.span_of("key"),
                                  [f"first set at {out.nodes[key].span_of('key')}"]))
            continue
        if allowed is not None and key not in allowed:
            out.failed.append(key)
            unset = [a for a in allowed if a not in {st.key for st in settings}]  # a typo is of a missing key
            errors.add(CheckError(f"unknown setting '{key}'", setting.span_of("key"),
                                  did_you_mean(key, unset) + [f"settings here: {', '.join(allowed)}"]))
            continue
        later = _Later(last, index)
        value = AUTO if key in autos and isinstance(setting.value, s.Name) and setting.value.id == AUTO else \
            _setting_value(setting, out, later, names, strings, errors)
        if value is None:
            out.failed.append(key)
        else:
            out.values[key] = value
            out.nodes[key] = setting
    return out


class _Later:
    """The settings written after position ``index`` of a block, by key (the last of a key
    written twice), as a read-only mapping built from one shared index."""

    def __init__(self, last: dict, index: int):
        self._last, self._index = last, index

    def __contains__(self, key: str) -> bool:
        return key in self._last and self._last[key][0] > self._index

    def __getitem__(self, key: str):
        return self._last[key][1]

    def __iter__(self):
        return (key for key, (i, _) in self._last.items() if i > self._index)


def _setting_value(setting, block: BlockValues, later, names, strings, errors):
    value, key = setting.value, setting.key
    if key in names:
        if isinstance(value, s.Name):
            return value.id
        if isinstance(value, s.Str):
            errors.add(CheckError(f"'{key}' takes a name without quotes: {key} = {value.value}", value.span))
        else:
            errors.add(CheckError(f"'{key}' takes a name, e.g. {key} = {NAME_EXAMPLES.get(key, 'bf16')}", value.span))
        return None
    if key in strings:
        if isinstance(value, (s.Str, s.Name)):
            return value.value if isinstance(value, s.Str) else value.id
        errors.add(CheckError(f"'{key}' takes a string, e.g. {key} = \"a40\"", value.span))
        return None
    if isinstance(value, s.Str):
        errors.add(CheckError(f"'{key}' takes an integer, not a string", value.span,
                              [f"write {key} = {value.value}" if value.value.isdigit() else
                               "a setting's value is an integer expression over the settings before it"]))
        return None
    ints = {k: v for k, v in block.values.items() if isinstance(v, int)}
    try:
        return evaluate(value, ints, "name")
    except UnknownName as exc:
        if exc.name not in block.failed:  # an earlier setting with its own error
            errors.add(exc if errors.full else _unknown_in_setting(exc, ints, later))
    except CheckError as exc:
        errors.add(exc)
    return None


def _unknown_in_setting(exc: UnknownName, env, later) -> CheckError:
    """Say why a name is unknown in a setting: written after it, or not in this block."""
    if exc.name in later:
        where = later[exc.name].span_of("key")
        return CheckError(f"'{exc.name}' is used before it is set", exc.span,
                          [f"'{exc.name}' is set later, at {where}; a setting may only use the "
                           "settings written before it in its block, so move it up"])
    scope = f" (here: {', '.join(env)})" if env else ""
    return CheckError(f"unknown name '{exc.name}'", exc.span,
                      did_you_mean(exc.name, [*env, *later])
                      + [f"a setting may only use the settings written before it in its block{scope}"])


def build_model(node: s.ModelDef, errors: ErrorCollector) -> tuple[Model | None, BlockValues]:
    """The Model of a model block; missing or bad settings are recorded in ``errors``."""
    block = evaluate_block(node.settings, errors, names=MODEL_NAMES)
    values = block.values
    _report_missing_model_keys(node, errors)
    positive = _check_positive("model", block, [k for k, v in values.items() if isinstance(v, int)], errors)
    dtype = values.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        errors.add(CheckError(f"unknown dtype '{dtype}'", block.nodes["dtype"].value.span,
                              did_you_mean(dtype, DTYPES) + [f"dtypes: {', '.join(DTYPES)}"]))
    # A rejected setting already has its own error, and checks built on a model without it
    # would only echo it; a zero would divide below.
    if not positive or block.failed or any(k not in values for k in MODEL_REQUIRED + MODEL_NAMES):
        return None, block
    ints = tuple((k, v) for k, v in values.items() if isinstance(v, int))
    ints += (("kv_heads", values["heads"]),) if "kv_heads" not in values else ()
    return Model(node.name, ints, values["dtype"], values["layer"], span=node.span), block


def _report_missing_model_keys(node: s.ModelDef, errors: ErrorCollector) -> None:
    """One error for every required model setting not written. A written key that looks
    like a misspelling of a missing one (``hiden``) is where the error points."""
    written = [st.key for st in node.settings]
    missing = [k for k in MODEL_REQUIRED + MODEL_NAMES if k not in written]
    if not missing:
        return
    misspelt = {key: near[0] for key in missing
                if (near := close_matches(key, [w for w in written if w not in MODEL_REQUIRED + MODEL_NAMES]))}
    notes = [f"'{wrong}' is set: is it a misspelling of '{key}'?" for key, wrong in misspelt.items()]
    notes.append(f"a model needs {join_words(MODEL_REQUIRED + MODEL_NAMES)}; e.g. {_model_example(missing)}")
    keys = {st.key: st for st in node.settings}
    span = keys[next(iter(misspelt.values()))].span_of("key") if len(misspelt) == 1 else node.span_of("name")
    what = f"setting '{missing[0]}'" if len(missing) == 1 else "settings " + join_words([f"'{k}'" for k in missing])
    errors.add(CheckError(f"model {node.name} is missing the {what}", span, notes))


def _model_example(missing: list[str]) -> str:
    example = {"layers": "layers = 32", "hidden": "hidden = 4096", "heads": "heads = 32", "seq": "seq = 8192",
               "vocab": "vocab = 128256", "dtype": "dtype = bf16", "layer": "layer = llama"}
    return "  ".join(example[k] for k in missing)


def _check_positive(kind: str, block: BlockValues, keys, errors: ErrorCollector, lowest: int | float = 1) -> bool:
    """Record an error for each of ``keys`` whose value is below ``lowest`` or past its limit
    (frontend.limits); True if all are within."""
    found = [error for key in keys if (error := range_error(kind, key, block.values[key], block.span(key), lowest))]
    for error in found:
        errors.add(error)
    return not found


def build_cluster(node: s.ConfigBlock, errors: ErrorCollector) -> Cluster | None:
    """The Cluster of a cluster block (nodes and gpus_per_node are required), with the
    topology of its levels block when it has one (:mod:`dhelix.dsl.frontend.levels`)."""
    levels = [item for item in node.settings if isinstance(item, s.Levels)]
    block = evaluate_block([item for item in node.settings if not isinstance(item, s.Levels)], errors, CLUSTER_KEYS,
                           strings=("profile",))
    positive = _check_positive("cluster", block, [k for k in ("nodes", "gpus_per_node") if k in block.values], errors)
    if not _require(node, block, ("nodes", "gpus_per_node"), "cluster { nodes = 1  gpus_per_node = 4 }", errors):
        return None
    if not positive:
        return None
    v = block.values
    for extra in levels[1:]:
        first = levels[0].span.line if levels[0].span else "?"
        errors.add(CheckError("a second levels block", extra.span, [f"the first is at line {first}"]))
    topology = build_levels(evaluate_block(levels[0].settings, errors), v["nodes"], v["gpus_per_node"], errors) \
        if levels else ()
    profile_span = block.nodes["profile"].value.span if "profile" in block.nodes else None
    return Cluster(v["nodes"], v["gpus_per_node"], v.get("profile"), topology, span=node.span,
                   profile_span=profile_span)


def build_train(node: s.ConfigBlock, errors: ErrorCollector) -> Train | None:
    """The Train of a train block (micro_batch and microbatches are required)."""
    declared = train_options()
    block = evaluate_block(node.settings, errors, train_keys(), names=[o.train for o in declared if o.kind is str
                                                                       and not o.path],
                           strings=[o.train for o in declared if o.path], autos=[o.train for o in declared if o.auto])
    for lowest in sorted({o.lowest for o in declared if o.lowest is not None}, reverse=True):
        _check_positive("train", block, [o.train for o in declared if o.lowest == lowest and o.train in block.values
                                         and block.values[o.train] != AUTO], errors, lowest=lowest)
    if not _require(node, block, ("micro_batch", "microbatches"), "train { micro_batch = 1  microbatches = 8 }", errors):
        return None
    v = block.values
    zero = v.get("zero", option("zero").default)
    if zero not in ZERO_STAGES:
        errors.add(CheckError(f"'zero' must be 0, 1, 2 or 3, got {zero}", block.span("zero"),
                              ["zero = 1 shards the optimizer states over data parallelism (ZeRO-1); "
                               "zero = 2 the gradients too, each micro-batch's reduce-scattered after its "
                               "backward (ZeRO-2); zero = 3 the layers' weights too (FSDP)"]))
        return None
    recompute = v.get("recompute", option("recompute").default)
    if recompute not in RECOMPUTE:
        notes = did_you_mean(recompute, RECOMPUTE) + ["none keeps every activation the backward reads; selective "
                                                      "drops the norms', activations' and adds' outputs and computes "
                                                      "them again; full keeps each layer's input and runs its forward "
                                                      "again"]
        errors.add(CheckError(f"unknown recompute '{recompute}' (none, selective or full)", block.span("recompute"),
                              notes))
        return None
    if "recompute_layers" in v and recompute != "full":
        errors.add(CheckError(f"recompute_layers = {v['recompute_layers']} needs recompute = full, not recompute = "
                              f"{recompute}", block.span("recompute_layers"),
                              ["recompute_layers = N recomputes the first N layers of each model chunk in full "
                               "(Megatron's recompute_num_layers with recompute_method block) and lets the "
                               "others keep their activations: add recompute = full, or remove recompute_layers"]))
        return None
    param_gather = v.get("param_gather", option("param_gather").default)
    if param_gather not in PARAM_GATHER:
        errors.add(CheckError(f"unknown param_gather '{param_gather}' (step or forward)", block.span("param_gather"),
                              did_you_mean(param_gather, PARAM_GATHER)
                              + ["step all-gathers ZeRO-1's updated weights right after the optimizer; forward "
                                 "overlaps it with the next step's forward, layer by layer"]))
        return None
    if param_gather != option("param_gather").default and zero not in (1, 2):
        errors.add(CheckError(f"param_gather = {param_gather} needs zero = 1 or 2, not zero = {zero}",
                              block.span("param_gather"),
                              ["it moves ZeRO-1's all-gather of the updated weights under the next forward; "
                               + ("without ZeRO-1 the weights are all-reduced and updated in place: there is "
                                  "no such all-gather" if zero == 0 else
                                  "ZeRO-3 gathers each layer's weights before use already")]))
        return None
    grad_reduce = v.get("grad_reduce", option("grad_reduce").default)
    if grad_reduce not in GRAD_REDUCE:
        errors.add(CheckError(f"unknown grad_reduce '{grad_reduce}' (backward or step)", block.span("grad_reduce"),
                              did_you_mean(grad_reduce, GRAD_REDUCE)
                              + ["backward reduces each layer's gradients over data parallelism as soon as its "
                                 "last backward of the step has finished; step reduces them all after the "
                                 "step's last backward"]))
        return None
    if grad_reduce != option("grad_reduce").default and zero == 2:
        errors.add(CheckError(f"grad_reduce = {grad_reduce} with zero = 2", block.span("grad_reduce"),
                              ["ZeRO-2 reduce-scatters each micro-batch's gradients after its backward (it keeps "
                               "no full gradient across micro-batches): remove grad_reduce, or use zero = 1 to "
                               "reduce once per step"]))
        return None
    reduce_dtype = v.get("grad_reduce_dtype", option("grad_reduce_dtype").default)
    if reduce_dtype != option("grad_reduce_dtype").default and zero == 3:
        errors.add(CheckError(f"grad_reduce_dtype = {reduce_dtype} with zero = 3", block.span("grad_reduce_dtype"),
                              ["ZeRO-3 reduce-scatters each layer's gradient pieces in the model's dtype already "
                               "(the option sets the dtype of the fp32 main gradients' reductions, which ZeRO-3's "
                               "layers do not have): remove grad_reduce_dtype, or use zero = 0, 1 or 2"]))
        return None
    offload = v.get("offload", option("offload").default)
    if offload not in OFFLOAD:
        errors.add(CheckError(f"unknown offload '{offload}' (none or optimizer)", block.span("offload"),
                              did_you_mean(offload, OFFLOAD)
                              + ["none keeps the optimizer's fp32 master weights and AdamW moments on the device; "
                                 "optimizer keeps them in host memory and runs AdamW on the host's CPU"]))
        return None
    if "offload_percent" in v and offload == "none":
        errors.add(CheckError(f"offload_percent = {v['offload_percent']} needs offload = optimizer",
                              block.span("offload_percent"),
                              ["offload_percent = P keeps the optimizer's states of P % of each part's parameters "
                               "in host memory and the rest on the device (Megatron-LM's optimizer offload "
                               "fraction): add offload = optimizer, or remove offload_percent"]))
        return None
    si = v.get("si")
    if si is not None and si not in SI_SETTINGS:
        errors.add(CheckError(f"unknown si '{si}' (on or off)", block.span("si"),
                              did_you_mean(si, SI_SETTINGS)
                              + ["on co-executes the strands of each SI block (the default); off runs each SI "
                                 "block's forward, then its backward"]))
        return None
    if "shard" in v and zero != 3:
        errors.add(CheckError(f"shard = {v['shard']} needs zero = 3, not zero = {zero}", block.span("shard"),
                              ["shard is the size of the groups ZeRO-3 shards the weights over (hybrid sharding, "
                               "HSDP: replicated across the groups); add zero = 3, or remove shard"]))
        return None
    data_span = block.nodes["data"].value.span if "data" in block.nodes else None
    for o in declared:  # a run option's name outside its declared choices (the compiler's own are checked above)
        if o.field and o.choices and o.train is not None and o.train in v and v[o.train] not in o.choices:
            errors.add(CheckError(f"unknown {o.train} '{v[o.train]}' ({join_words(o.choices, 'or')})",
                                  block.span(o.train), did_you_mean(str(v[o.train]), o.choices)))
            return None
    run = tuple((o.train, v[o.train]) for o in declared if o.field and o.train is not None and o.train in v)
    return Train(v["micro_batch"], v["microbatches"], v.get("data"), zero, recompute, param_gather, v.get("shard"),
                 v.get("launch"), grad_reduce, v.get("launch_backward"), si, run,
                 recompute_layers=v.get("recompute_layers"), first_stage_layers=v.get("first_stage_layers"),
                 last_stage_layers=v.get("last_stage_layers"), offload=offload,
                 offload_percent=v.get("offload_percent"), span=node.span,
                 offload_span=block.span("offload") if "offload" in block.nodes else None,
                 stages_span=next((block.span(k) for k in ("first_stage_layers", "last_stage_layers")
                                   if k in block.nodes), None),
                 launch_span=block.span("launch") if "launch" in block.nodes else None,
                 launch_backward_span=block.span("launch_backward") if "launch_backward" in block.nodes else None,
                 data_span=data_span, zero_span=block.span("zero") if "zero" in block.nodes else None,
                 shard_span=block.span("shard") if "shard" in block.nodes else None)


def build_mesh(node: s.ConfigBlock, cluster: Cluster | None, errors: ErrorCollector) -> tuple[Mesh | None, BlockValues]:
    """The Mesh of a mesh block; axes not written have size 1 and follow in Megatron order."""
    block = evaluate_block(node.settings, errors, MESH_AXES)
    # A rejected setting (tq = 2) has its error; a mesh without that axis would only echo it.
    if not _check_positive("mesh", block, list(block.values), errors) or block.failed:
        return None, block
    written = [k for k in block.values if k != "ep"]
    order = tuple(written + [d for d in DIMENSIONS if d not in written])
    sizes = tuple(block.values.get(axis, 1) for axis in order)
    ep = block.values.get("ep", 1)
    dp = block.values.get("dp", 1)
    if dp % ep:
        errors.add(CheckError(f"ep = {ep} does not divide dp = {dp}", block.span("ep"),
                              ["expert-parallel groups are carved out of the data-parallel groups"]))
        return None, block
    per_node = cluster.gpus_per_node if cluster else 1
    mesh = Mesh(order, sizes, ep, per_node, levels=cluster.levels if cluster else (),
                spans={axis: block.span(axis) for axis in block.values})
    if cluster is not None and mesh.world != cluster.nodes * cluster.gpus_per_node:
        product = " x ".join(f"{a} {n}" for a, n in zip(order, sizes) if n > 1) or "1"
        errors.add(CheckError(f"the mesh has {mesh.world} ranks ({product}) but the cluster has "
                              f"{cluster.nodes * cluster.gpus_per_node} GPUs "
                              f"({cluster.nodes} node{'s' if cluster.nodes != 1 else ''} x {cluster.gpus_per_node})", node.span,
                              ["make tp * cp * dp * pp equal nodes * gpus_per_node"]))
    return mesh, block


def build_fold(node: s.Fold, errors: ErrorCollector) -> FoldSpec | None:
    """The FoldSpec of a fold statement: none, u (two chunks) or loop(v)."""
    if node.kind not in FOLD_KINDS:
        errors.add(unknown_fold(node.kind, node.span_of("kind")))
        return None
    takes_count = FOLD_KINDS[node.kind] is None
    if takes_count != (node.arg is not None):
        need = f"needs its chunk count, e.g. fold {node.kind}(2)" if takes_count else "takes no argument"
        errors.add(CheckError(f"fold {node.kind} {need}", node.span))
        return None
    if not takes_count or node.arg is None:  # (a count where none is taken was refused above)
        return FoldSpec.of(node.kind, span=node.span)
    try:
        v = evaluate(node.arg, {}, "name")
    except CheckError as exc:
        errors.add(CheckError(exc.message, exc.span, list(exc.notes) + (
            ["fold loop takes a number: the chunks per rank, e.g. fold loop(2)"]
            if isinstance(exc, UnknownName) else [])))
        return None
    if v < 1:
        errors.add(CheckError(f"fold {node.kind} needs at least 1 chunk per rank, got {v}", node.arg.span))
        return None
    if v > MAX_CHUNKS:
        errors.add(CheckError(f"fold {node.kind} takes at most {MAX_CHUNKS} chunks per rank, got {v}", node.arg.span))
        return None
    return FoldSpec.of(node.kind, v, span=node.span)


def build_strands(node: s.StrandsDef | None, errors: ErrorCollector) -> Strands:
    """The Strands of a strands block (defaults when absent). Unknown communication kinds
    and comm_with_comm values are recorded in ``errors``; whether each selector names an
    operator of the layer is the strands pass's check (it needs the layer's DAGs)."""
    if node is None:
        return Strands()
    overlap: list[str] = []
    comm_with_comm = True
    movable: list[s.Selector] = []
    forbid: list[tuple[s.Selector, s.Selector]] = []
    for st in node.body:
        if isinstance(st, s.Overlap):
            overlap += _overlap_kinds(st, errors)
        elif isinstance(st, s.CommWithComm):
            if st.value not in ("on", "off"):
                errors.add(CheckError(f"comm_with_comm is 'on' or 'off', not '{st.value}'", st.span_of("value"),
                                      did_you_mean(st.value, ("on", "off"))))
            comm_with_comm = st.value != "off"
        elif isinstance(st, s.Movable):
            movable += st.selectors
        elif isinstance(st, s.Forbid):
            forbid.append((st.first, st.second))
    return Strands(tuple(dict.fromkeys(overlap)), comm_with_comm, tuple(movable), tuple(forbid), span=node.span)


def _overlap_kinds(st: s.Overlap, errors: ErrorCollector) -> list[str]:
    good = []
    for i, kind in enumerate(st.kinds):
        if kind in OVERLAP_KINDS:
            good.append(kind)
            continue
        notes = did_you_mean(kind, OVERLAP_KINDS)
        if kind == "pp":
            notes = ["pp communication happens between layers (pipeline send/recv); SI pairs the "
                     "operators inside a layer"]
        errors.add(CheckError(f"unknown communication kind '{kind}'", st.span_of(f"kinds.{i}"),
                              notes + [f"SI can hide {join_words(OVERLAP_KINDS)} communication (dp: the "
                                       "weight gathers and gradient reduce-scatters of zero = 3)"]))
    return good


def _require(node, block: BlockValues, keys, example: str, errors: ErrorCollector) -> bool:
    written = {st.key for st in node.settings}
    missing = [k for k in keys if k not in block.values]
    unset = [k for k in missing if k not in written]
    # A misspelt key (micro_bach) has its own "did you mean"; do not report it twice.
    guessed = {near[0] for key in block.failed if (near := close_matches(key, unset))}
    for key in unset:
        if key not in guessed:
            errors.add(CheckError(f"{node.kind} block has no '{key}' setting", node.span,
                                  [f"e.g. {example}"]))
    return not missing
