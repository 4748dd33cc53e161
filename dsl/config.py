"""Evaluate the configuration blocks (model, cluster, mesh, train, fold) into program IR.

Settings are evaluated in order, each over the ones before it in the same block (the model
block may write ``ffn = 4 * hidden``). Every problem is collected; the caller raises once.
"""

from __future__ import annotations

import attrs

from . import syntax as s
from .errors import CheckError, ErrorCollector
from .exprs import evaluate
from .mesh import DIMENSIONS, Mesh
from .program import Cluster, FoldSpec, Model, Train
from .suggest import did_you_mean

DTYPES = ("fp32", "bf16", "fp16", "fp8")
MODEL_REQUIRED = ("layers", "hidden", "heads", "seq", "vocab")
MODEL_NAMES = ("dtype", "layer")  # settings whose value is a name, not a number
CLUSTER_KEYS = ("nodes", "gpus_per_node", "profile")
MESH_KEYS = ("tp", "cp", "ep", "dp", "pp")
TRAIN_KEYS = ("micro_batch", "microbatches", "seed", "steps", "lr")
FOLD_KINDS = ("none", "u", "loop")


@attrs.define
class BlockValues:
    """The evaluated settings of one block: ints and names, with each setting's node."""

    values: dict = attrs.field(factory=dict)
    nodes: dict = attrs.field(factory=dict)

    def span(self, key: str):
        node = self.nodes.get(key)
        return node.span if node is not None else None


def evaluate_block(settings, errors: ErrorCollector, allowed=None, names=(), strings=()) -> BlockValues:
    """Evaluate ``settings`` in order; ``allowed`` limits the keys (None: any integer key),
    ``names`` are keys whose value is a bare name, ``strings`` keys that take a string."""
    out = BlockValues()
    for setting in settings:
        key = setting.key
        if key in out.nodes:
            errors.add(CheckError(f"'{key}' is set twice", setting.span_of("key"),
                                  [f"first set at {out.nodes[key].span_of('key')}"]))
            continue
        if allowed is not None and key not in allowed:
            errors.add(CheckError(f"unknown setting '{key}'", setting.span_of("key"),
                                  did_you_mean(key, allowed) + [f"settings here: {', '.join(allowed)}"]))
            continue
        value = _setting_value(setting, out.values, names, strings, errors)
        if value is not None:
            out.values[key] = value
            out.nodes[key] = setting
    return out


def _setting_value(setting, env, names, strings, errors):
    value = setting.value
    if setting.key in names:
        if isinstance(value, s.Name):
            return value.id
        errors.add(CheckError(f"'{setting.key}' takes a name, e.g. {setting.key} = bf16", value.span))
        return None
    if isinstance(value, s.Str) or setting.key in strings:
        if setting.key in strings:
            return value.value if isinstance(value, s.Str) else getattr(value, "id", None)
        errors.add(CheckError(f"'{setting.key}' takes an integer, not a string", value.span))
        return None
    try:
        return evaluate(value, {k: v for k, v in env.items() if isinstance(v, int)}, "setting")
    except CheckError as exc:
        errors.add(exc)
        return None


def build_model(node: s.ModelDef, errors: ErrorCollector) -> tuple[Model | None, BlockValues]:
    """The Model of a model block; missing or bad settings are recorded in ``errors``."""
    block = evaluate_block(node.settings, errors, names=MODEL_NAMES)
    values = block.values
    written = {st.key for st in node.settings}
    missing = [k for k in MODEL_REQUIRED + MODEL_NAMES if k not in written]
    for key in missing:
        near = [n for other in values if (n := did_you_mean(key, [other]))]
        errors.add(CheckError(f"model {node.name} has no '{key}' setting", node.span_of("name"),
                              (near[0] if near else []) + [f"a model sets {', '.join(MODEL_REQUIRED + MODEL_NAMES)}"]))
    _check_positive(block, [k for k, v in values.items() if isinstance(v, int)], errors)
    dtype = values.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        errors.add(CheckError(f"unknown dtype '{dtype}'", block.nodes["dtype"].value.span,
                              did_you_mean(dtype, DTYPES) + [f"dtypes: {', '.join(DTYPES)}"]))
    # A key written but not evaluated already has its own error.
    if any(k not in values for k in MODEL_REQUIRED + MODEL_NAMES):
        return None, block
    ints = tuple((k, v) for k, v in values.items() if isinstance(v, int))
    ints += (("kv_heads", values["heads"]),) if "kv_heads" not in values else ()
    return Model(node.name, ints, values["dtype"], values["layer"], span=node.span), block


def _check_positive(block: BlockValues, keys, errors: ErrorCollector) -> None:
    for key in keys:
        if block.values[key] <= 0:
            errors.add(CheckError(f"'{key}' must be positive, got {block.values[key]}", block.span(key)))


def build_cluster(node: s.ConfigBlock, errors: ErrorCollector) -> Cluster | None:
    """The Cluster of a cluster block (nodes and gpus_per_node are required)."""
    block = evaluate_block(node.settings, errors, CLUSTER_KEYS, strings=("profile",))
    _check_positive(block, [k for k in ("nodes", "gpus_per_node") if k in block.values], errors)
    if not _require(node, block, ("nodes", "gpus_per_node"), "cluster { nodes = 1  gpus_per_node = 4 }", errors):
        return None
    v = block.values
    return Cluster(v["nodes"], v["gpus_per_node"], v.get("profile"), span=node.span)


def build_train(node: s.ConfigBlock, errors: ErrorCollector) -> Train | None:
    """The Train of a train block (micro_batch and microbatches are required)."""
    block = evaluate_block(node.settings, errors, TRAIN_KEYS)
    _check_positive(block, [k for k in ("micro_batch", "microbatches", "steps") if k in block.values], errors)
    if not _require(node, block, ("micro_batch", "microbatches"), "train { micro_batch = 1  microbatches = 8 }", errors):
        return None
    return Train(block.values["micro_batch"], block.values["microbatches"], span=node.span)


def build_mesh(node: s.ConfigBlock, cluster: Cluster | None, errors: ErrorCollector) -> tuple[Mesh | None, BlockValues]:
    """The Mesh of a mesh block; axes not written have size 1 and follow in Megatron order."""
    block = evaluate_block(node.settings, errors, MESH_KEYS)
    _check_positive(block, list(block.values), errors)
    if any(v <= 0 for v in block.values.values()):
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
    mesh = Mesh(order, sizes, ep, per_node)
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
        errors.add(CheckError(f"unknown fold '{node.kind}'", node.span_of("kind"),
                              did_you_mean(node.kind, FOLD_KINDS) + ["folds: none, u, loop(v)"]))
        return None
    if (node.kind == "loop") != (node.arg is not None):
        need = "needs its chunk count, e.g. fold loop(2)" if node.kind == "loop" else "takes no argument"
        errors.add(CheckError(f"fold {node.kind} {need}", node.span))
        return None
    if node.kind != "loop":
        return FoldSpec(node.kind, 1 if node.kind == "none" else 2, span=node.span)
    try:
        v = evaluate(node.arg, {}, "name (fold loop takes a number)")
    except CheckError as exc:
        errors.add(exc)
        return None
    if v < 1:
        errors.add(CheckError(f"fold loop needs at least 1 chunk per rank, got {v}", node.arg.span))
        return None
    return FoldSpec("loop", v, span=node.span)


def _require(node, block: BlockValues, keys, example: str, errors: ErrorCollector) -> bool:
    written = {st.key for st in node.settings}
    missing = [k for k in keys if k not in block.values]
    for key in missing:
        if key not in written:
            errors.add(CheckError(f"{node.kind} block has no '{key}' setting", node.span,
                                  [f"e.g. {example}"]))
    return not missing
