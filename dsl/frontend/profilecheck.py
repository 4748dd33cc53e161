"""Does a profile's ``measured:`` section belong to this program?

`dhelix profile` measures one program: its op names, at its shard shapes, on its mesh, in
its dtype. The planner matches measured times by op name, so a measured section taken on
another program (other shapes, another mesh or dtype, another layer) would silently price
the wrong ops. Such a profile is a **stale** one, and a located error at the program's
``profile = "…"`` setting: re-measure, or delete the ``measured:`` section to keep only the
profile's derived rates (peak, links, OEF, slowdown, launch gap), which hold for any program
on the machine.

What is compared: the dtype; the mesh (when the section records one); and the signature
(:func:`op_signature`) of every forward op the section names. Backward ops are derived from
the forward ones, so their shapes follow; a measured name that is neither a forward op nor
derived from one (``qkv.dgrad`` from ``qkv``) belongs to another layer.
"""

from __future__ import annotations

from dhelix.dsl.core.errors import DhelixWarning
from dhelix.dsl.core.mesh import COMM_LANES, Mesh
from dhelix.dsl.core.oplib import END_OPS
from dhelix.dsl.core.program import LayerDag, Op
from dhelix.dsl.core.wording import did_you_mean
from dhelix.dsl.frontend.profile_reader import ProfileError
from dhelix.dsl.frontend.profiles import Measured

#: Mismatching ops listed in the notes of a stale-profile error at most.
SHOWN = 4


def op_signature(op: Op) -> str:
    """What an op's time depends on, as one line: input and output shapes, the weight,
    the group and lane of a communicating op, and the op's parameters, e.g.
    ``[32, 64] -> [64, 64] over tp 2 local`` or ``[64, 64] -> [64, 32] heads=2 … seq=32``."""
    text = f"{', '.join(_shape(s) for s in op.in_shapes)} -> {_shape(op.shape)}"
    if op.weight:
        text += f" weight {_shape(op.weight)}"
    if op.kind == "comm":
        text += f" over {op.axis} {op.group_size} {op.lane}"
    return text + "".join(f" {key}={value}" for key, value in op.params if key != "axis")


def _shape(shape) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """The mesh's axes larger than 1, innermost first (what ``measured.mesh`` records)."""
    return {axis: size for axis, size in zip(mesh.order, mesh.sizes, strict=True) if size > 1}


def ends_signature(program) -> str | None:
    """What the model's end ops (:data:`END_OPS`: embedding, LM head) take time over, as one
    line: tokens per micro-batch, hidden, vocabulary and its tp split; None without a vocab."""
    vocab, hidden = program.model.get("vocab"), program.model.get("hidden")
    if not vocab or not hidden or program.forward is None:
        return None
    tp = program.mesh.size("tp")
    return f"tokens {program.forward.input_shape[0] * tp}, hidden {hidden}, vocab {vocab} over tp {tp}"


def stale_notes(measured: Measured, forward: LayerDag, mesh: Mesh, dtype: str, ends: str | None = None) -> list[str]:
    """Why ``measured`` was not taken on a program with this ``forward`` DAG, ``mesh``,
    ``dtype`` and :func:`ends_signature` ``ends``: one note per difference (the first
    :data:`SHOWN` ops), [] when it fits."""
    notes = []
    if measured.dtype != dtype:
        notes.append(f"measured in {measured.dtype}, the program trains in {dtype}")
    sizes = mesh_sizes(mesh)
    if measured.mesh and measured.mesh != sizes:
        notes.append(f"measured on mesh {_mesh(measured.mesh)}, the program's mesh is {_mesh(sizes)}")
    ops = {op.name: op for op in forward.ops}
    here = {name: op_signature(op) for name, op in ops.items()}
    here.update({name: ends for name in END_OPS if ends is not None})
    changed = [f"{name}: measured {sig}, here {here[name]}"
               for name, sig in sorted(measured.shapes.items()) if name in here and sig != here[name]]
    named = set(measured.ops) | set(measured.shapes) | {n for p in measured.pairs for n in p.fwd + p.bwd}
    foreign = sorted(name for name in named if not _of_layer(name, ops))
    notes += changed[:SHOWN] + ([f"… and {len(changed) - SHOWN} more ops differ"] if len(changed) > SHOWN else [])
    if foreign:
        shown = ", ".join(foreign[:SHOWN]) + (f" and {len(foreign) - SHOWN} more" if len(foreign) > SHOWN else "")
        notes.append(f"{shown} {'is not an op' if len(foreign) == 1 else 'are not ops'} of layer {forward.name}")
    return notes


def _of_layer(name: str, ops: dict) -> bool:
    """Whether ``name`` is a forward op, a backward op derived from one (``fc1.wgrad``) or
    one of the model's end ops."""
    return name in ops or name in END_OPS or any(name.startswith(f"{op}.") for op in ops)


def _mesh(sizes: dict) -> str:
    return " × ".join(f"{axis} {size}" for axis, size in sizes.items()) or "1 rank"


def check_measured(program) -> None:
    """Raise ProfileError, located at the program's ``profile = "…"`` setting, when its
    profile's measured section was taken on another program (``program`` has its forward
    layer DAG: this runs in the shapes pass)."""
    profile, cluster = program.profile, program.cluster
    if profile is None or profile.measured is None or program.forward is None:
        return
    notes = stale_notes(profile.measured, program.forward, program.mesh, program.model.dtype,
                        ends_signature(program))
    if notes:
        span = cluster.profile_span
        raise StaleProfileError(
            f"profile '{cluster.profile}' was measured on another program", span,
            notes + ["re-measure it on this program, or delete its measured: section to keep only the derived "
                     "rates (peak, links, OEF, slowdown, launch gap)"],
            program=program.files[-1] if program.files else "")


def undeclared_links(program) -> list[DhelixWarning]:
    """A warning per link of the program's profile (``links.<level>``) for a level its cluster
    does not declare (``cluster { levels { … } }``), located at the program's ``profile``
    setting and naming the profile file: such a link prices nothing (the level's stages would
    take it), which a misspelt level name or a profile written for another topology would
    otherwise leave unseen. A warning, not an error: a profile describes the machine, which a
    program may use without declaring every level of it."""
    profile, cluster = program.profile, program.cluster
    if profile is None or cluster is None:
        return []
    declared = [level for level, _ in program.mesh.levels] if program.mesh is not None else []
    warnings = []
    for level in [name for name in profile.links if name not in COMM_LANES and name not in declared]:
        notes = did_you_mean(level, declared) + [
            f"the program's levels: {', '.join(declared)}" if declared else
            "the program declares no levels: cluster { levels { " + f"{level} = N" + " } } would use it",
            f"profile file: {profile.path or cluster.profile}"]
        warnings.append(DhelixWarning(f"profile '{cluster.profile}' has a link for level '{level}', which the "
                                      "cluster does not declare: it is not used", cluster.profile_span, notes))
    return warnings


class StaleProfileError(ProfileError):
    """A profile whose measured section was taken on another program; ``program`` is the
    file whose cluster block names it (the command line says how to re-measure it)."""

    def __init__(self, message: str, span=None, notes=(), *, program: str = ""):
        super().__init__(message, span, notes)
        self.program = program
