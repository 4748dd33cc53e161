"""What `dhelix run` cannot execute though every other command accepts it, said at check time.

The planner and the simulator price every dtype of :data:`~dhelix.dsl.core.dtypes.DTYPES`;
the interpreter has kernels for :data:`~dhelix.dsl.core.dtypes.RUNNABLE_DTYPES` only, and runs
tensor parallelism in its sequence-parallel form only (a tp-sliced gemm reads an all_gather or
feeds a reduce_scatter: :func:`reads_tp_collective`, which the interpreter's weight sharding
reads too); and it sums fold bidir's two model copies' gradients only under ZeRO 0 and 1.
``check`` prints these as located warnings; ``run`` raises them as errors before any rank starts.
"""

from __future__ import annotations

from dhelix.dsl.core.dtypes import RUNNABLE_DTYPES
from dhelix.dsl.core.errors import DhelixWarning
from dhelix.dsl.core.mesh import base_axis
from dhelix.dsl.core.oplib import ROOTED_PART_OF
from dhelix.dsl.core.program import LayerDag, Op, Program


def unrunnable(program: Program) -> list[DhelixWarning]:
    """A warning, located at the model block, for each setting of ``program`` that the
    interpreter cannot run (a dtype it has no kernels for, tensor parallelism without its
    sequence-parallel form); [] for a library."""
    model = program.model
    if model is None:
        return []
    return [*_unrunnable_dtype(program), *_tp_without_sequence_parallelism(program), *_two_model_copies(program)]


def _two_model_copies(program: Program) -> list[DhelixWarning]:
    """A warning at the fold statement for a fold that places two model copies (fold bidir)
    under ZeRO-2 or ZeRO-3: the interpreter sums a stage's two copies' gradients (ranks r and
    p - 1 - r) at the step's end, and those stages hand each micro-batch's gradients over (or
    keep dp pieces of them) during the backward."""
    fold, train = program.fold, program.train
    if fold is None or fold.copies == 1 or train is None or train.zero < 2:
        return []
    return [DhelixWarning(
        f"fold {fold.text} with zero = {train.zero} can be checked, lowered, drawn, simulated and tuned, but not run: "
        f"the interpreter sums the {fold.copies} model copies' gradients (pipeline ranks r and p - 1 - r) at the "
        f"step's end, and ZeRO-{train.zero} hands them over during the backward",
        fold.span or (program.model.span if program.model else None),
        ["to train it, set zero = 0 or zero = 1"])]


def _unrunnable_dtype(program: Program) -> list[DhelixWarning]:
    model = program.model
    assert model is not None, "a model file"
    if model.dtype in RUNNABLE_DTYPES:
        return []
    return [DhelixWarning(
        f"model {model.name}: dtype = {model.dtype} can be checked, planned, drawn and simulated, but not run: "
        f"the interpreter runs {', '.join(RUNNABLE_DTYPES)}", model.span,
        [f"to train it, set dtype = bf16 (or {', '.join(d for d in RUNNABLE_DTYPES if d != 'bf16')})"])]


def _tp_without_sequence_parallelism(program: Program) -> list[DhelixWarning]:
    """A warning when a gemm holds a tp slice of its weight but is neither column-parallel
    (reads an all_gather over tp) nor row-parallel (feeds a reduce_scatter over tp): Megatron's
    all_reduce blocks (stdlib ``llama_tp``), whose substitution is not moved later."""
    if program.mesh is None or program.model is None or program.mesh.size("tp") == 1 or program.forward is None:
        return []
    from dhelix.dsl.passes.overrides import reference_dags  # the pass pipeline imports this module

    fwd, full_fwd = program.forward, reference_dags(program)[0]
    sliced = [op for op in fwd.ops if op.op == "gemm" and op.weight is not None and op.columns is None
              and op.unit_weight != full_fwd.op(op.weight_name).weight
              and not reads_tp_collective(fwd, op.inputs[0], "all_gather")
              and not any(reads_tp_collective(fwd, r.name, "reduce_scatter") for r in tp_readers(fwd, op.name))]
    if not sliced:
        return []
    reduces = [op.name for op in fwd.ops if op.op == "all_reduce" and op.axis and base_axis(op.axis) == "tp"]
    unmoved = [op.name for op in fwd.ops if op.op == "all_gather" and op.axis and base_axis(op.axis) == "tp"
               and any(reads_tp_collective(fwd, name, "reduce_scatter") for name in op.inputs)]
    # The statements name the layer's ops: a chunk's collective (ar2.c0) by its op's name (ar2).
    reduces, unmoved = (list(dict.fromkeys(name.split(".")[0] for name in names)) for names in (reduces, unmoved))
    fix = [f"substitute {name} as reduce_scatter + all_gather" for name in reduces]
    if reduces or unmoved:
        fix.append(f"move {' + '.join(reduces + unmoved)} later")
    one = len(sliced) == 1
    s, its = ("s", "its") if one else ("", "their")
    return [DhelixWarning(
        f"model {program.model.name}: layer {program.model.layer} can be checked, planned and simulated, but not "
        f"run: gemm {', '.join(op.name for op in sliced)} hold{s} a tp slice of {its} weight but neither "
        f"read{s} an all_gather over tp (column-parallel) nor feed{s} a reduce_scatter over tp (row-parallel); "
        "the interpreter runs tensor parallelism in its sequence-parallel form",
        program.model.span,
        [f"to train it, add to the partition block: {'; '.join(f'`{line}`' for line in fix)} "
         "(examples/tiny_llama_tp_to_sp_cpu.dhx)" if fix else
         "to train it, use a layer in the sequence-parallel form (stdlib llama)"])]


def reads_tp_collective(fwd: LayerDag, name: str, kind: str) -> bool:
    """Whether the value ``name`` of ``fwd`` is the result of a ``kind`` collective over tp
    (through the slices, concats and rooted parts that a partition puts between them)."""
    op = next((o for o in fwd.ops if o.name == name), None)
    if op is not None and op.op in ("slice", "rest", "others"):  # a chunk of a partitioned chain's input
        return reads_tp_collective(fwd, op.inputs[0], kind)
    if op is not None and op.op in ("concat", "merge", "pick"):  # the joined chunks or rooted parts of it
        return all(reads_tp_collective(fwd, part, kind) for part in op.inputs)
    # A group-partitioned collective's last stage (over tp.inter or tp.intra) completes it,
    # as do its reduces or broadcasts of distinct roots together.
    return op is not None and kind in (op.op, ROOTED_PART_OF.get(op.op)) and op.axis is not None \
        and base_axis(op.axis) == "tp"


def tp_readers(fwd: LayerDag, name: str) -> list[Op]:
    """The ops of ``fwd`` that read the value ``name``, seen through the concats, merges and
    slices that a partition puts between them."""
    # A partitioned op's chunks are read through the concat that joins them, and the chunks
    # of a chain that starts after it through the slices that cut its output.
    readers = []
    for op in fwd.ops:
        if name in op.inputs:
            readers += tp_readers(fwd, op.name) if op.op in ("concat", "merge", "slice", "rest", "others") else [op]
    return readers
