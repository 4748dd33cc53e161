"""Random valid-looking dhelix programs, built from the language's syntax, for the
differential fuzzer (tests/test_fuzz_programs.py, benchmarks/fuzz_programs.py).

:func:`program` writes a whole tiny program from a sequence of choices made by ``pick``
(``pick(options) -> one of them``): hypothesis's ``draw(sampled_from(...))`` in the test,
so failures shrink, or ``random.Random.choice`` in the long run. A program draws its layer
(a stdlib DAG — llama, llama_rope, llama_tp, gpt, moe — or a random DAG of attention, MLP
and norm blocks), a mesh over tp, cp, pp, dp, ep up to ``max_world`` ranks with the nodes
that hold them, a fold and a pipeline that declares it, micro-batches, the ZeRO stage,
recomputation, strands settings and partition statements. Most draws pass ``check``; the
rest are refused with a located error, which the fuzzer counts and moves past.
"""

from __future__ import annotations

from typing import Callable, Sequence

Pick = Callable[[Sequence], object]

HEADER = 'import "stdlib/layers.dhx"\nimport "stdlib/pipelines.dhx"\n'
#: Pipelines by the fold they are written for.
PIPELINES = {"none": ("gpipe", "one_f_one_b", "zb_h1"), "u": ("w_helix", "dualpipe_v"),
             "loop": ("interleaved_1f1b",)}
STDLIB_LAYERS = ("llama", "llama_rope", "llama_tp", "gpt", "moe")
#: Partition statements over the op names the stdlib's llama, llama_rope and gpt share.
LLAMA_OPS = ("ln1", "ag1", "qkv", "att", "prj", "rs1", "h1", "ln2", "ag2", "fc1", "act", "fc2", "rs2", "h2")
SUBSTITUTIONS = ("substitute ag1 as broadcast", "substitute rs1 as reduce", "substitute ag2 as broadcast",
                 "substitute rs2 as reduce", "substitute rs1 as auto", "substitute ag1 as auto")
#: Megatron's tensor parallelism (llama_tp) made sequence-parallel, the form the interpreter runs.
TP_TO_SP = ("partition {\n  substitute ar1 as reduce_scatter + all_gather\n"
            "  substitute ar2 as reduce_scatter + all_gather\n  move ar1 + ar2 later\n}\n")
#: What ``dhelix run --si-plan`` and ``dhelix simulate --si-plan`` take.
RUN_SI_PLANS = ("planned", "scheduled", "op_by_op", "sequential")
SIMULATE_SI_PLANS = ("planned", "scheduled")


def program(pick: Pick, *, max_world: int = 8) -> str:
    """The text of one tiny program drawn with ``pick``, on at most ``max_world`` ranks."""
    layer = pick(STDLIB_LAYERS + ("random",))
    mesh = _mesh(pick, max_world, moe=layer == "moe")
    world = mesh["tp"] * mesh["cp"] * mesh["pp"] * mesh["dp"]
    per_node = pick([n for n in (1, 2, 4, 8) if world % n == 0])
    fold = pick(("none", "u", "loop"))
    chunks = {"none": 1, "u": 2}.get(fold, 2)
    layers = pick((2, 4, 8)) * mesh.get("pp", 1) * chunks // 2 or 1
    # A declared topology of three levels (islands of 2 GPUs inside each node) where a node has
    # room for one; its level names are what `group … first` then takes.
    levels = per_node >= 4 and pick((False, False, True))
    parts = [HEADER, _model(layer, layers),
             f'cluster {{\n  nodes = {world // per_node}\n  gpus_per_node = {per_node}\n'
             + ("  levels {\n    island = 2\n  }\n" if levels else "") + '  profile = "a40"\n}\n',
             "mesh {\n" + "".join(f"  {axis} = {size}\n" for axis, size in mesh.items() if size > 1) + "}\n",
             _train(pick, mesh), f"fold {'loop(2)' if fold == 'loop' else fold}\n",
             f"pipeline {pick(PIPELINES[fold])}\n", _strands(pick, mesh)]
    if layer == "random":
        parts.append(_random_layer(pick))
    elif layer in ("llama", "llama_rope", "gpt") and pick((False, True)):
        parts.append(_partition(pick, mesh, levels))
    elif layer == "llama_tp" and mesh["tp"] > 1:  # as written, run refuses it (documented)
        parts.append(TP_TO_SP)
    return "\n".join(part for part in parts if part)


def _mesh(pick: Pick, max_world: int, *, moe: bool) -> dict:
    """tp, cp, pp, dp (their product at most ``max_world``), and ep inside dp (a divisor)."""
    sizes, world = {}, 1
    for axis, choices in (("tp", (1, 2, 4)), ("cp", (1, 1, 2)), ("pp", (1, 2, 4)), ("dp", (1, 2, 4))):
        sizes[axis] = pick([c for c in choices if world * c <= max_world] or [1])
        world *= sizes[axis]
    sizes["ep"] = pick([e for e in (1, 2, 4) if sizes["dp"] % e == 0]) if moe else 1
    return sizes


def _model(layer: str, layers: int) -> str:
    moe = {"moe": "  experts = 4\n  top_k = 2\n", "llama_rope": "  rope_theta = 10000\n  norm_inv_eps = 100000\n"
           }.get(layer, "")
    name = "fuzz_layer" if layer == "random" else layer
    return (f"model fuzz {{\n  layers = {layers}\n  hidden = 32\n  ffn = 64\n  heads = 4\n  kv_heads = 4\n"
            f"  seq = 16\n  vocab = 64\n{moe}  dtype = fp32\n  layer = {name}\n}}\n")


def _train(pick: Pick, mesh: dict) -> str:
    lines = [f"micro_batch = {pick((1, 2))}", f"microbatches = {pick((1, 2, 4, 8))}", "seed = 3"]
    zero = pick((0, 0, 1, 3))
    if zero:
        lines.append(f"zero = {zero}")
    if zero == 1 and pick((False, True)):
        lines.append("param_gather = forward")
    if pick((False, True)):
        lines.append(f"grad_reduce = {pick(('backward', 'step'))}")
    recompute = pick(("none", "none", "selective", "full"))
    if recompute != "none":
        lines.append(f"recompute = {recompute}")
    return "train {\n" + "".join(f"  {line}\n" for line in lines) + "}\n"


def _strands(pick: Pick, mesh: dict) -> str:
    lines = []
    axes = [axis for axis in ("tp", "cp", "ep") if mesh.get(axis, 1) > 1]
    if axes and pick((False, True)):
        lines.append("overlap " + ", ".join(axes[:len(axes) - pick(range(len(axes)))]))
    if pick((False, True)):
        lines.append(f"comm_with_comm {pick(('on', 'off'))}")
    if pick((False, True)):
        lines.append("movable wgrad")
    if pick((False, False, True)):
        lines.append("forbid attention.bwd with gemm")
    return "strands {\n" + "".join(f"  {line}\n" for line in lines) + "}\n" if lines else ""


def _partition(pick: Pick, mesh: dict, levels: bool = False) -> str:
    statements = []
    for _ in range(pick((1, 2))):
        kind = pick(("chunk", "chunk", "group", "substitute", "backward"))
        if kind == "chunk":
            start = pick(range(len(LLAMA_OPS)))
            ops = LLAMA_OPS[start:start + pick((1, 2, 3, 5))]
            along = pick(("", " along tokens", " along features", " along outputs"))
            statements.append(f"chunk {' + '.join(ops)}{along} by {pick(('2', '4', 'auto', 'stages', 'stages3'))}")
        elif kind == "group":
            firsts = ('', ' first island', ' first node', ' first cluster') if levels else \
                ('', ' first inter', ' first intra')
            statements.append(f"group {pick(('ag1', 'rs1', 'ag2', 'rs2', 'weights'))}{pick(firsts)}")
        elif kind == "substitute":
            statements.append(pick(SUBSTITUTIONS))
        else:
            statements.append(f"backward {pick(('dgrad', 'wgrad'))} first")
    return "partition {\n" + "".join(f"  {line}\n" for line in statements) + "}\n"


def _random_layer(pick: Pick) -> str:
    """A layer of 1 to 3 blocks, each an attention, MLP (SwiGLU or GeLU) or norm-and-add block
    in the sequence-parallel form, ending in a residual add."""
    lines, last = ["layer fuzz_layer {", "  in x [tokens / tp, hidden]"], "x"
    for index in range(pick((1, 2, 3))):
        block = pick(("attention", "mlp", "norm"))
        norm = pick(("rmsnorm", "layernorm"))
        n, g, a, b, o, r = (f"{kind}{index}" for kind in ("n", "g", "a", "b", "o", "r"))
        if block == "attention":
            lines += [f"  {n} = {norm}({last})", f"  {g} = all_gather({n}, tp)",
                      f"  {a} = gemm({g}, hidden, 3 * hidden / tp)",
                      f"  {b} = attention({a}, heads / tp, heads / tp, {pick(('causal', 'full'))}, cp)",
                      f"  {o} = gemm({b}, hidden / tp, hidden)", f"  {r} = reduce_scatter({o}, tp)"]
        elif block == "mlp":
            act = pick(("swiglu", "gelu"))
            width = "2 * ffn / tp" if act == "swiglu" else "ffn / tp"
            lines += [f"  {n} = {norm}({last})", f"  {g} = all_gather({n}, tp)", f"  {a} = gemm({g}, hidden, {width})",
                      f"  {b} = {act}({a})", f"  {o} = gemm({b}, ffn / tp, hidden)", f"  {r} = reduce_scatter({o}, tp)"]
        else:
            lines += [f"  {r} = {norm}({last})"]
        lines.append(f"  h{index} = add({r}, {last})")
        last = f"h{index}"
    return "\n".join([*lines, f"  out {last}", "}"]) + "\n"


def world_of(text: str) -> int:
    """The number of ranks of a drawn program (its mesh block's tp · cp · pp · dp)."""
    block = text.split("mesh {", 1)[1].split("}", 1)[0]
    world = 1
    for line in block.splitlines():
        axis, _, size = line.strip().partition(" = ")
        if axis in ("tp", "cp", "pp", "dp"):
            world *= int(size)
    return world


#: What ``dhelix tune`` may be told to keep in the fuzzer (None: nothing, search it all).
TUNE_KEEPS = (None, "mesh", "pipeline,fold", "partition", "zero,recompute", "si")


def differential(text: str, folder, *, simulate_si_plan: str = "planned", run_si_plan: str | None = None,
                 tune: tuple[str | None, bool] | None = None) -> tuple:
    """The fuzzer's properties on one program, written to ``folder``: ``check`` refuses it
    with a located error (("rejected", message)), or else ``fmt`` round-trips it, ``plan``
    and ``simulate --si-plan simulate_si_plan`` finish with no other error than a
    DhelixError and, with ``run_si_plan``, ``run --check --si-plan run_si_plan`` matches the
    reference; with ``tune`` = (what to ``--keep`` or None, whether ``--partitions``),
    ``tune -o`` exits 0 or with a located error, and what it writes checks and, where
    ``run_si_plan`` is given, runs one step of ``run --check`` too (it may differ in its
    ranks): ("passed", "") or ("failed", what went wrong)."""
    import contextlib
    import io
    import traceback
    from pathlib import Path

    from dhelix.cli.main import main
    from dhelix.dsl.core.errors import DhelixError
    from dhelix.dsl.frontend.fmt import format_source
    from dhelix.dsl.frontend.parser import parse
    from dhelix.dsl.passes.pipeline import check_text

    path = Path(folder) / "fuzz.dhx"
    path.write_text(text)
    try:
        check_text(text, str(path))
    except DhelixError as exc:
        return "rejected", exc.message
    except Exception:
        return "failed", "check: " + traceback.format_exc(limit=-3)
    try:
        formatted = format_source(text)
        if parse(formatted) != parse(text) or format_source(formatted) != formatted:
            return "failed", "fmt does not round-trip:\n" + formatted
    except Exception:
        return "failed", "fmt: " + traceback.format_exc(limit=-3)
    commands = [["plan", str(path)], ["simulate", str(path), "--si-plan", simulate_si_plan]]
    if run_si_plan is not None:
        commands.append(_run_check(path, run_si_plan))
    tuned = Path(folder) / "tuned.dhx"
    if tune is not None:
        keep, partitions = tune
        commands.append(["tune", str(path), "-o", str(tuned), "--top", "2"] + (["--keep", keep] if keep else [])
                        + (["--partitions"] if partitions else []))
    for argv in commands:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = main(argv)
        except BaseException:  # noqa: BLE001 - a traceback is the finding (SystemExit included)
            return "failed", f"{' '.join(argv[:1] + argv[2:])}: " + traceback.format_exc(limit=-3)
        if argv[0] == "run" and code != 0:
            return "failed", f"{' '.join(argv[2:])} (exit {code}):\n{out.getvalue()[-1500:]}"
        if argv[0] == "tune" and (code not in (0, 1) or code == 1 and ": " not in out.getvalue()):
            return "failed", f"{' '.join(argv[:1] + argv[2:])} (exit {code}):\n{out.getvalue()[-1500:]}"
        if argv[0] == "tune" and code == 0:
            written = tuned.read_text()
            try:
                check_text(written, str(tuned))
            except Exception:  # noqa: BLE001 - tune's output must check
                return "failed", f"tune's output does not check:\n{traceback.format_exc(limit=-3)}\n{written}"
            if run_si_plan is not None and world_of(written) <= 4:
                commands.append(_run_check(tuned, run_si_plan))
    return "passed", ""


def _run_check(path, si_plan: str) -> list[str]:
    return ["run", str(path), "--check", "--steps", "1", "--si-plan", si_plan, "--force", "--timeout", "120"]
