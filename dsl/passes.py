"""The named pipeline of passes that the CLI runs and can stop after (``--dump STAGE``).

Each pass is a pure function from the previous stage's result to the next; ``STAGES``
lists them in order with the dumper that prints their result.
"""

from __future__ import annotations

from typing import Callable

import attrs

from . import dump
from .autodiff import derive_backward
from .check import check_program
from .imports import load_modules
from .parser import parse
from .program import Program


@attrs.frozen
class Stage:
    name: str
    doc: str
    dumper: Callable[[object], str]


STAGES = (
    Stage("parse", "the syntax tree of the main file", dump.dump_syntax),
    Stage("resolve", "the files loaded through imports and what they define", dump.dump_modules),
    Stage("check", "the checked configuration: model, mesh groups and lanes, fold, pipeline, strands",
          dump.dump_config),
    Stage("shapes", "the forward layer DAG with per-GPU shapes, kinds and lanes", dump.dump_forward),
    Stage("autodiff", "the forward and the derived backward layer DAGs", dump.dump_dags),
)
STAGE_NAMES = tuple(stage.name for stage in STAGES)


def run_until(text: str, path: str, stop: str = STAGE_NAMES[-1]):
    """Run the passes on ``text`` (the file ``path``) up to and including ``stop``.

    Returns that stage's result: a Module (parse), a list of Modules (resolve) or a
    Program. Raises DhelixError subclasses for every user mistake.
    """
    if stop == "parse":
        return parse(text, path)
    modules = load_modules(text, path)
    if stop == "resolve":
        return modules
    program = check_program(modules)
    if stop in ("check", "shapes"):
        return program
    return autodiff(program)


def autodiff(program: Program) -> Program:
    """The program with its backward layer DAG derived (unchanged for a library file)."""
    if program.forward is None:
        return program
    return attrs.evolve(program, backward=derive_backward(program.forward))


def check_text(text: str, path: str) -> Program:
    """Run every pass on ``text``; the entry point of `dhelix check` and the fuzz test."""
    return run_until(text, path)


def dump_stage(stop: str, result) -> str:
    """The text dump of ``result``, the output of stage ``stop``."""
    return next(stage for stage in STAGES if stage.name == stop).dumper(result)
