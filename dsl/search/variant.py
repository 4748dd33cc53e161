"""One choice of the search written into the program: syntax in, syntax out.

A choice is applied to the parsed files (:func:`apply_choice`), not to the checked Program,
so every variant goes through the same checker and passes as `dhelix check` (divisibility,
stage splits, the pipelines' ``require``, deadlock freedom) and the winner prints back as a
canonical `.dhx` file (:func:`variant_text`) that `check` and `run` take as it is. The
blocks a choice changes (mesh, train, fold, pipeline; cluster when the GPU count changes) must
be written in the main file: :func:`require_main_blocks` says which is not.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.frontend.fmt import find_comments, format_module
from dhelix.dsl.frontend.imports import STDLIB_PREFIX, resolve_import
from dhelix.dsl.frontend.pipelinecheck import reads_name
from dhelix.dsl.core.mesh import MESH_AXES
from dhelix.dsl.core.options import option
from dhelix.dsl.search.space import Choice

#: The train settings a choice writes (the others stay as written; and the first and last
#: stages' layers, from the layout's ``stage_ends``).
_TRAIN_SET = ("micro_batch", "microbatches", "zero", "recompute", "recompute_layers", "shard", "param_gather", "si",
              "offload")
#: The train settings' declared defaults (a layout's shard and recompute_layers 0: none), left
#: out of a written block.
_DEFAULTS = {**{key: option(key).default for key in _TRAIN_SET if option(key).default is not None}, "shard": 0,
             "recompute_layers": 0}


#: A config block's settings (a cluster block's may hold its levels block).
_Settings = tuple[s.Setting | s.Levels, ...]


def require_main_blocks(modules: list[s.Module], path: str) -> None:
    """UsageError unless the main file (the last module) writes the mesh, train, pipeline
    and cluster statements that a choice rewrites."""
    main = modules[-1].items
    have = {item.kind for item in main if isinstance(item, s.ConfigBlock)}
    have |= {"pipeline" for item in main if isinstance(item, s.PipelineRef)}
    missing = [kind for kind in ("cluster", "mesh", "train", "pipeline") if kind not in have]
    if missing:
        raise UsageError(f"{path}: dhelix tune rewrites the {', '.join(missing)} statement"
                         f"{'s' if len(missing) > 1 else ''} of the file it is given, and they come from an import; "
                         "write them in this file")


def apply_choice(modules: list[s.Module], choice: Choice, pipelines: dict[str, s.PipelineDef],
                 gpus_per_node: int, world: int, partition: s.PartitionDef | None = None,
                 reads: frozenset[str] | None = None, blocks: dict | None = None) -> list[s.Module]:
    """``modules`` with the main file's mesh, train, fold and pipeline statements set to
    ``choice`` (a fold statement added when the file has none; ``launch`` and
    ``launch_backward`` dropped from the train block when the pipeline does not read them),
    the cluster's nodes set to hold ``world`` GPUs of ``gpus_per_node``, and, when the
    choice's partition is ``auto``, ``partition`` in place of the main file's partition block
    (at the end when it has none). ``reads``: :func:`launch_reads` of the choice's pipeline,
    when the caller keeps it (a search applies thousands of choices to a few pipelines).
    ``blocks``: a dict the caller keeps, where the mesh and train blocks written are kept by
    what they are written from (the block, the layout, SI and ``reads``), so that the
    choices of one layout share the very nodes (the checker builds a node once)."""
    main = modules[-1]
    items: list[s.Item] = []
    has_fold = False
    generated = choice.layout.partition == "auto"
    if reads is None:
        reads = launch_reads(pipelines[choice.pipeline])
    for item in main.items:
        if isinstance(item, s.ConfigBlock) and item.kind == "mesh":
            item = _written(blocks, (item, choice.layout), lambda block: attrs.evolve(
                block, settings=_mesh_settings(block.settings, choice)))
        elif isinstance(item, s.ConfigBlock) and item.kind == "train":
            item = _written(blocks, (item, choice.layout, choice.si, reads), lambda block: attrs.evolve(
                block, settings=_train_settings(block.settings, choice, reads)))
        elif isinstance(item, s.ConfigBlock) and item.kind == "cluster" and not _writes(item, "nodes",
                                                                                          world // gpus_per_node):
            # (a block that already says so stays the very node: the checker builds it once)
            item = attrs.evolve(item, settings=_replace(item.settings, {"nodes": world // gpus_per_node}))
        elif isinstance(item, s.Fold):
            item, has_fold = _fold(choice.fold, item.span), True
        elif isinstance(item, s.PipelineRef):
            item = attrs.evolve(item, name=choice.pipeline)
            if not has_fold:
                items.append(_fold(choice.fold, None))
                has_fold = True
        elif isinstance(item, s.PartitionDef) and generated:
            continue
        items.append(item)
    if generated and partition is not None:
        items.append(partition)
    return modules[:-1] + [attrs.evolve(main, items=tuple(items))]


def _written(blocks: dict | None, key: tuple, write) -> s.ConfigBlock:
    """``write(key[0])``, the block ``key[0]`` rewritten for what the rest of ``key`` says,
    kept in ``blocks`` (None: not kept) by the block's identity and the rest by value."""
    if blocks is None:
        return write(key[0])
    index = (id(key[0]),) + key[1:]
    found = blocks.get(index)
    if found is None or found[0] is not key[0]:
        found = blocks[index] = (key[0], write(key[0]))
    return found[1]


def launch_reads(pipeline: s.PipelineDef) -> frozenset[str]:
    """The launch builtins (``g``, ``gb``) that ``pipeline`` reads: a train block keeps
    ``launch`` (``launch_backward``) only for a pipeline that reads ``g`` (``gb``)."""
    return frozenset(name for name in ("g", "gb") if reads_name(pipeline, name))


def with_profile_setting(modules: list[s.Module], profile: str) -> list[s.Module]:
    """``modules`` with the main file's cluster block naming ``profile`` (a shipped name or an
    absolute path), as `--profile` asks."""
    main = modules[-1]
    items = tuple(attrs.evolve(item, settings=_replace(item.settings, {"profile": s.Str(profile)}))
                  if isinstance(item, s.ConfigBlock) and item.kind == "cluster" else item for item in main.items)
    return modules[:-1] + [attrs.evolve(main, items=items)]


def variant_text(modules: list[s.Module], source: str, header: str) -> str:
    """The main file of ``modules`` (a variant of the file whose text is ``source``) in
    canonical form, its comments kept where its statements kept their place, ``header``
    (comment lines) first."""
    body = format_module(modules[-1], find_comments(source))
    return "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines()) + "\n" + body


def _value(value) -> s.Expr | s.Str:
    """A setting's value node: a node as it is, a name for a string, else a number."""
    if isinstance(value, (s.Int, s.Name, s.BinOp, s.Neg, s.Call, s.Str)):
        return value
    return s.Name(value) if isinstance(value, str) else s.Int(value)


def _writes(block: s.ConfigBlock, key: str, value: int) -> bool:
    """Whether ``block`` sets ``key`` once, to the number ``value`` written as it is."""
    found = [st for st in block.settings if isinstance(st, s.Setting) and st.key == key]
    return len(found) == 1 and isinstance(found[0].value, s.Int) and found[0].value.value == value


def _replace(settings: _Settings, values: dict) -> _Settings:
    """``settings`` with the keys of ``values`` set (in place where written, else appended;
    a None value removes the setting)."""
    out: list[s.Setting | s.Levels] = []
    done = set()
    for setting in settings:
        if isinstance(setting, s.Setting) and setting.key in values:
            done.add(setting.key)
            if values[setting.key] is None:
                continue
            setting = attrs.evolve(setting, value=_value(values[setting.key]))
        out.append(setting)
    out += [s.Setting(key, _value(value)) for key, value in values.items() if key not in done and value is not None]
    return tuple(out)


def _mesh_settings(settings: _Settings, choice: Choice) -> _Settings:
    """The mesh block of ``choice``: its axes larger than 1 in the layout's order (innermost
    first; the file's order when it has none: the axes the file writes keep their place),
    then the others the file writes; an axis of size 1 it does not write stays out."""
    written = {setting.key for setting in settings}
    sizes = choice.layout.mesh()
    values = {axis: size if size > 1 or axis in written else None for axis, size in sizes.items()}
    if not any(values.values()):
        values["dp"] = 1  # a mesh block names at least one axis
    settings = _replace(settings, {axis: values[axis] for axis in MESH_AXES})
    order = choice.layout.order
    if not order:
        return settings
    placed = sorted((st for st in settings if st.key in order), key=lambda st: order.index(st.key))
    return tuple(placed) + tuple(st for st in settings if st.key not in order)


def _train_settings(settings: _Settings, choice: Choice, reads: frozenset[str]) -> _Settings:
    """The train block of ``choice`` (``si = off`` written for a choice with SI off): a
    setting at its default that the file does not write stays out; ``launch``
    (``launch_backward``) goes when the pipeline does not read ``g`` (``gb``), the names in
    ``reads``."""
    written = {setting.key for setting in settings}
    layout = {**attrs.asdict(choice.layout), "si": choice.si}
    values = {key: None if layout[key] == _DEFAULTS.get(key) and key not in written else layout[key]
              for key in _TRAIN_SET}
    values["first_stage_layers"], values["last_stage_layers"] = choice.layout.stage_ends
    for unset in ("shard", "recompute_layers", "first_stage_layers", "last_stage_layers"):  # 0: not written
        if values[unset] == 0:
            values[unset] = None
    # The share offloaded: written unless all (or none, or not chosen yet: checked alike).
    percent = choice.layout.offload_percent
    values["offload_percent"] = percent if choice.layout.offload != "none" and 0 < percent < 100 else None
    for name, setting in (("g", "launch"), ("gb", "launch_backward")):
        if name not in reads:
            values[setting] = None
    return _replace(settings, values)


def _fold(text: str, span) -> s.Fold:
    kind, _, arg = text.partition("(")
    return s.Fold(kind, s.Int(int(arg.rstrip(")"))) if arg else None, span=span)


def relocate(modules: list[s.Module], source: str, output: str) -> list[s.Module]:
    """``modules`` with the main file's relative paths (local imports, ``train { data }``,
    a cluster profile given as a file) rewritten from the folder of ``source`` (the file it
    was read from) to the folder of ``output`` (where it will be written), so the written
    file reads the same files."""
    source_dir = os.path.dirname(os.path.abspath(source))
    output_dir = os.path.dirname(os.path.abspath(output))
    if source_dir == output_dir:
        return modules

    def moved(path: str) -> str:
        if os.path.isabs(path):
            return path
        return os.path.relpath(os.path.join(source_dir, path), output_dir)

    items = []
    for item in modules[-1].items:
        if isinstance(item, s.Import) and resolve_import(item.path, Path(source)) is not None \
                and not _is_library(item.path, Path(source)):
            item = attrs.evolve(item, path=moved(item.path))
        elif isinstance(item, s.ConfigBlock) and item.kind in ("train", "cluster"):
            key = "data" if item.kind == "train" else "profile"
            item = attrs.evolve(item, settings=tuple(
                attrs.evolve(st, value=s.Str(moved(st.value.value)))
                if isinstance(st, s.Setting) and st.key == key and isinstance(st.value, s.Str)
                and _is_path(st.value.value, key) else st
                for st in item.settings))
        items.append(item)
    return modules[:-1] + [attrs.evolve(modules[-1], items=tuple(items))]


def _is_library(path: str, importer: Path) -> bool:
    """Whether the import ``path`` names a standard-library file (no local file shadows it)."""
    found = resolve_import(path, importer)
    return found is not None and found[1] == path and path.startswith(STDLIB_PREFIX)


def _is_path(value: str, key: str) -> bool:
    """Whether a string setting names a file: always for data, for a profile when it is not
    a shipped profile's name (it has a folder or a YAML suffix)."""
    return key == "data" or value.endswith((".yaml", ".yml")) or "/" in value or "\\" in value
