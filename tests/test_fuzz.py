"""Token-level mutation fuzzing: a broken program gives a located dhelix error, never a crash.

Mutants are made from the samples below and the shipped ``.dhx`` files by dropping,
duplicating, swapping, replacing or inserting tokens with a seeded generator, plus every
number of the samples set to 0 in turn. Each mutant is either accepted or rejected with a
:class:`DhelixError` whose rendering starts with ``path:line:col:`` inside the text; any other
exception is a bug in the front end. The front end is ``passes.check_text`` (parse, resolve,
checks, shapes, autodiff) where it exists, else the parser.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

import pytest

from dhelix.dsl.core.errors import DhelixError, ErrorGroup
from dhelix.dsl.frontend.fmt import find_comments, format_source
from dhelix.dsl.frontend.parser import parse
from strategies import TOKEN

try:  # the full front end (parse, resolve, checks, shapes, autodiff), once it exists
    from dhelix.dsl.passes.pipeline import check_text as process
except ImportError:
    process = parse

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted([*ROOT.glob("stdlib_schedules/**/*.dhx"), *ROOT.glob("examples/**/*.dhx")])
TOTAL_MUTANTS = 360

SAMPLE_DENSE = '''\
# a dense 8B model on 16 GPUs
model llama8b {
  layers = 32   hidden = 4096   ffn = 14336   heads = 32   kv_heads = 8
  seq = 8192    vocab = 128256  dtype = bf16
  layer = llama                       # the layer below
}
cluster { nodes = 2  gpus_per_node = 8  profile = "a40" }
mesh    { tp = 4  cp = 1  pp = 2  dp = 2 }
train   { micro_batch = 1  microbatches = 8  seed = 0 }
fold u
pipeline one_f_one_b

layer llama {
  in   x [seq / cp / tp, hidden]
  ln1  = rmsnorm(x)
  ag1  = all_gather(ln1, tp)
  qkv  = gemm(ag1, hidden, (heads + 2 * kv_heads) * hidden / heads / tp)
  att  = attention(qkv, heads / tp, kv_heads / tp, causal, ring = cp)
  prj  = gemm(att, hidden / tp, hidden)
  rs1  = reduce_scatter(prj, tp)
  h1   = add(rs1, x)
  ln2  = rmsnorm(h1)
  ag2  = all_gather(ln2, tp)
  up   = gemm(ag2, hidden, 2 * ffn / tp)
  act  = swiglu(up)
  down = gemm(act, ffn / tp, hidden)
  rs2  = reduce_scatter(down, tp)
  h2   = add(rs2, h1)
  out  h2
}

pipeline one_f_one_b {
  warm = min(p - r - 1, m)
  require m >= p
  repeat warm      { F }
  repeat m - warm  { F B }
  repeat warm      { B }
}

strands {
  overlap tp, cp
  comm_with_comm on
  movable wgrad
  forbid attention.bwd with gemm
}
'''

SAMPLE_INTERLEAVED = '''\
model tiny { layers = 8  hidden = 256  heads = 4  seq = 512  vocab = 1000  dtype = fp32  layer = mlp }
cluster { nodes = 1  gpus_per_node = 4 }
mesh { tp = 1  pp = 4 }
train { micro_batch = 2  microbatches = 8 }
fold loop(2)
pipeline interleaved

layer mlp {
  in x
  n = layernorm(x)
  u = gemm(n, hidden, 4 * hidden)
  g = gelu(u)
  d = gemm(g, 4 * hidden, hidden)
  y = add(d, x)
  out y
}

pipeline interleaved {
  require m % p == 0
  warm = (p - r - 1) * 2 + (v - 1) * p
  repeat warm // 2 { F F[1] }
  repeat m * v - warm { SI(F[1], B) W }
  repeat warm { B[1] W[1] }
}
'''

SAMPLE_MOE = '''\
model moe {
  layers = 16  hidden = 2048  heads = 16  kv_heads = 4  seq = 4096  vocab = 32000
  experts = 8  top_k = 2  ffn = 1408  dtype = bf16  layer = moe_layer
}
cluster { nodes = 1  gpus_per_node = 8  profile = "h100" }
mesh { tp = 2  ep = 2  dp = 2  pp = 2 }
train { micro_batch = 1  microbatches = 4 }
fold none
pipeline w_helix

layer moe_layer {
  in x [seq / tp, hidden]
  s = router(x, experts)
  p = permute(x, s, top_k)
  a = all_to_all(p, ep)
  e = grouped_gemm(a, hidden, ffn, experts / ep)
  f = grouped_gemm(e, ffn, hidden, experts / ep)
  b = all_to_all(f, ep)
  y = unpermute(b, s, top_k)
  out y
}

pipeline w_helix {
  half = max(m / 2, 1)
  repeat half { F SI(F, B) W }
  repeat m - half { B W }
}

strands { overlap ep  comm_with_comm off  movable wgrad, gemm.dgrad  forbid router with all_to_all }
'''

JUNK = ("}", "{", "(", ")", "[", "@", ";", "=", ",", ".", "F", "SI", "layer", "in", "repeat",
        "1/0", "0", '"', "#", "model", "zz_unknown", "-", "//")


def sources() -> list[tuple[str, str]]:
    """(path, text) of the programs to mutate: the samples above and every shipped file.

    The samples stay even when files ship: they cover every block kind in one file each.
    """
    samples = [("dense.dhx", SAMPLE_DENSE), ("interleaved.dhx", SAMPLE_INTERLEAVED),
               ("moe.dhx", SAMPLE_MOE)]
    return samples + [(str(path), path.read_text()) for path in SHIPPED]


def mutate(text: str, rng: random.Random) -> str:
    """``text`` with one to three random token mutations, or (half the time) one replacement.

    Most structural mutations stop at the parser; single replacements mostly keep the syntax
    and so reach the checks behind it.
    """
    tokens = TOKEN.findall(text)
    if rng.random() < 0.5:
        i = rng.choice([i for i, token in enumerate(tokens) if not token.isspace()])
        tokens[i] = _replacement(tokens, tokens[i], rng)
        return "".join(tokens)
    for _ in range(rng.randint(1, 3)):
        solid = [i for i, token in enumerate(tokens) if not token.isspace()]
        i = rng.choice(solid)
        kind = rng.choice(("drop", "duplicate", "swap", "insert", "insert", "replace", "replace"))
        if kind == "replace":
            tokens[i] = _replacement(tokens, tokens[i], rng)
        elif kind == "drop":
            del tokens[i]
        elif kind == "duplicate":
            tokens.insert(i, tokens[i] + rng.choice(("", " ")))
        elif kind == "swap":
            later = [j for j in solid if j > i]
            if later:
                tokens[i], tokens[later[0]] = tokens[later[0]], tokens[i]
        else:
            junk = rng.choice(JUNK + (f"n{rng.randrange(100)}",))
            tokens.insert(i, junk + rng.choice(("", " ")))
    return "".join(tokens)


def _replacement(tokens: list[str], token: str, rng: random.Random) -> str:
    # A word for another word of the file, or a number for a small one: mostly still syntax.
    if token.isdigit():
        return rng.choice(("0", "1", "3", "7", "4096"))
    words = [t for t in tokens if re.fullmatch(r"[A-Za-z_]\w*", t)]
    return rng.choice(words) if words else token


def mutants() -> list[tuple[str, str, str]]:
    """(id, path, mutant text): the same list on every run."""
    programs = sources()
    per_program = max(20, TOTAL_MUTANTS // len(programs))
    cases = []
    for index, (path, text) in enumerate(programs):
        rng = random.Random(1000 + index)
        cases += [(f"{Path(path).stem}-{n}", path, mutate(text, rng)) for n in range(per_program)]
    return cases


def assert_located(error: DhelixError, path: str, text: str) -> None:
    """The rendering starts ``file:line:col:`` with the position inside that file's text.

    The file is the mutant itself, or one it imports (named as the user sees it, e.g.
    ``stdlib/layers.dhx``); the span's source carries the text either way.
    """
    rendered = error.render()
    first = error.errors[0] if isinstance(error, ErrorGroup) else error
    assert first.span is not None, f"error without a position:\n{rendered}"
    source = first.span.source
    if source.path == path:
        assert source.text == text, "the error was located in some other text"
    match = re.match(rf"{re.escape(source.path)}:(\d+):(\d+): ", rendered)
    assert match, f"no file:line:col: at the start of:\n{rendered}"
    line, column = int(match[1]), int(match[2])
    lines = source.text.split("\n")
    assert 1 <= line <= len(lines), rendered
    assert 1 <= column <= len(lines[line - 1]) + 1, rendered


def zeroed() -> list[tuple[str, str, str]]:
    """(id, path, text): each number of each sample in turn replaced by 0 — zero sizes are
    the classic way to crash a checker (a division or modulo by a setting)."""
    cases = []
    for path, text in sources()[:3]:
        tokens = TOKEN.findall(text)
        for i in (i for i, token in enumerate(tokens) if token.isdigit() and token != "0"):
            mutant = "".join(tokens[:i] + ["0"] + tokens[i + 1:])
            cases.append((f"{Path(path).stem}-zero-{i}", path, mutant))
    return cases


MUTANTS = mutants() + zeroed()


@pytest.mark.parametrize("path,text", [(p, t) for _, p, t in MUTANTS],
                         ids=[name for name, _, _ in MUTANTS])
def test_mutant_is_accepted_or_rejected_with_a_located_error(path, text):
    try:
        process(text, path)
    except DhelixError as error:
        assert_located(error, path, text)


def test_accepted_mutants_format_losslessly():
    # Mutations move comments to odd places: a stress test for where fmt attaches them.
    accepted = 0
    for _, path, text in MUTANTS:
        try:
            tree = parse(text, path)
        except DhelixError:
            continue
        accepted += 1
        formatted = format_source(text, path)
        assert parse(formatted, path) == tree
        assert format_source(formatted, path) == formatted
        assert Counter(c.text for c in find_comments(formatted)) == \
            Counter(c.text for c in find_comments(text))
    assert accepted > 0


def test_samples_parse():
    # The unmutated programs are valid syntax, so every mutant is a small step from valid.
    for path, text in sources():
        parse(text, path)
