"""Hostile-input fuzzing: every shipped file, mutated, gives an exit code and never a crash.

Each shipped ``.dhx`` (examples and standard library) and ``.yaml`` (hardware profiles) is
mutated with a seeded generator in the ways a hostile or careless user would: deep nesting,
huge numbers, control and invisible bytes, long names and (for YAML) anchors and aliases. The
commands check, plan, simulate, render and export then run on each mutant in a separate
process (``fuzz_worker.py``) with a time limit per command and a memory limit, and must
return 0, 1 (a program error, located ``file:line:col:``) or 2 (a usage error) — never a
traceback, a timeout or running out of memory. A mutant that checks runs all five commands;
one that does not, check and one other command chosen by the seed (they stop at the same
error). Valid mutants of the paper-sized examples are only drawn and exported: planning them
takes seconds even unmutated.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = sorted([*ROOT.glob("examples/*.dhx"), *ROOT.glob("stdlib_schedules/*.dhx")])
PROFILES = sorted(ROOT.glob("stdlib_schedules/*.yaml"))
TINY = (ROOT / "examples" / "tiny_llama_cpu.dhx").read_text()
DHX_KINDS = ("nesting", "huge_number", "control_byte", "long_name")
YAML_KINDS = ("nesting", "huge_number", "control_byte", "long_name", "alias")
MUTANTS_PER_FILE = 1
LOCATED = re.compile(r"[^\n:]+:\d+:\d+: ")
CONTROL = ("\x00", "\x07", "\x1b[2J", "\x7f", "\x85", "\u2028", "\u202e", "\ufeff", "\udcff")  # \udcff: byte 0xff


def _numbers(text: str) -> list[re.Match]:
    return list(re.finditer(r"(?<![\w.])\d+(?![\w.])", text))


def _replace(text: str, match: re.Match, new: str) -> str:
    return text[:match.start()] + new + text[match.end():]


def mutate_dhx(text: str, kind: str, rng: random.Random) -> str:
    """``text`` with one mutation of ``kind``."""
    numbers = _numbers(text)
    if kind == "nesting" and numbers:
        depth, at = rng.choice((60, 101, 500, 3000)), rng.choice(numbers)
        wrap = rng.choice((("-" * depth, ""), ("min(1, " * depth, ")" * depth), ("1 + (" * depth, ")" * depth)))
        return _replace(text, at, wrap[0] + at.group() + wrap[1])
    if kind == "huge_number" and numbers:
        digits = rng.choice((19, 20, 31, 309, 400, 5000))
        return _replace(text, rng.choice(numbers), "9" * digits)
    if kind == "long_name":
        words = list(re.finditer(r"(?<![\w\"])[A-Za-z_]\w*", text))
        at = rng.choice(words)
        return _replace(text, at, at.group() * (rng.choice((300, 20_000)) // len(at.group()) + 1))
    at = rng.randrange(len(text) + 1)
    return text[:at] + rng.choice(CONTROL) + text[at:]


def mutate_yaml(text: str, kind: str, rng: random.Random) -> str:
    """``text`` (a profile) with one mutation of ``kind``."""
    if kind == "nesting":
        depth = rng.choice((20, 1000))
        return text + f"extra: {'[' * depth}{']' * depth}\n"
    if kind == "alias":
        laughs = ["a0: &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9]"]
        laughs += [f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 9)}]" for n in range(1, 9)]
        return text + "\n".join(laughs) + "\n" if rng.random() < 0.5 else text.replace("achieved:", "achieved: &x", 1)
    numbers = list(re.finditer(r"(?<=: )-?[\d.]+(e-?\d+)?", text))
    if kind == "huge_number" and numbers:
        return _replace(text, rng.choice(numbers), rng.choice(("9" * 400, "1.0e-320", "1e400", "-0.0", "0")))
    if kind == "long_name":
        keys = list(re.finditer(r"^\s*([a-z_]+):", text, re.M))
        at = rng.choice(keys)
        return text[:at.start(1)] + "k" * rng.choice((300, 20_000)) + text[at.end(1):]
    at = rng.randrange(len(text) + 1)
    return text[:at] + rng.choice(CONTROL) + text[at:]


def cases() -> list[dict]:
    """The mutants with the commands to run on each: the same list on every run."""
    rng = random.Random(12)
    found = []
    for path in PROGRAMS:
        files = {p.name: p.read_text() for p in PROGRAMS if p.parent == path.parent}
        for n in range(MUTANTS_PER_FILE):
            kind = DHX_KINDS[(PROGRAMS.index(path) + n) % len(DHX_KINDS)]  # every kind, file by file
            mutant = mutate_dhx(path.read_text(), kind, rng)
            found.append({"id": f"{path.stem}-{kind}-{n}", "files": files | {path.name: mutant}, "main": path.name})
    for path in PROFILES:
        for n in range(MUTANTS_PER_FILE + 2):
            kind = YAML_KINDS[(n + PROFILES.index(path)) % len(YAML_KINDS)]
            program = TINY.replace('profile = "a40"', 'profile = "lab.yaml"')
            found.append({"id": f"{path.name}-{kind}", "main": "main.dhx",
                          "files": {"main.dhx": program, "lab.yaml": mutate_yaml(path.read_text(), kind, rng)}})
    for case in found:
        main = case["main"]
        case["commands"] = [["check", main]]
        case["others"] = [["plan", main], ["simulate", main], ["render", main, "-o", "out.dot"],
                          ["export", main, "--torch-csv", "out.csv"]]
        case["pick"] = rng.randrange(4)
    return found


def _run(batch: list[dict], tmp_path: Path, name: str) -> list[list[dict]]:
    cases_file, results_file = tmp_path / f"{name}.json", tmp_path / f"{name}-results.json"
    cases_file.write_text(json.dumps(batch))
    subprocess.run([sys.executable, str(Path(__file__).with_name("fuzz_worker.py")), str(cases_file),
                    str(results_file)], check=True, timeout=600, cwd=ROOT)
    return json.loads(results_file.read_text())


def _problems(case: dict, results: list[dict]) -> list[str]:
    found = []
    for argv, result in zip(case["commands"], results, strict=True):
        where = f"{case['id']}: dhelix {' '.join(argv)}"
        if "crash" in result:
            found.append(f"{where} crashed:\n{result['crash']}")
        elif result["code"] not in (0, 1, 2):
            found.append(f"{where} exited {result['code']}")
        elif result["code"] == 1 and not LOCATED.match(result["stderr"]):
            found.append(f"{where} gave an unlocated error:\n{result['stderr'][:600]}")
    return found


def test_mutated_shipped_files_give_an_exit_code_never_a_crash(tmp_path):
    all_cases = cases()
    first = _run(all_cases, tmp_path, "check")
    # The other commands: all four on mutants that check, one on those that do not.
    for case, (checked,) in zip(all_cases, first, strict=True):
        # The paper-sized examples take seconds to plan and simulate: their valid mutants
        # are drawn and exported only (the tiny example and the profiles get every command).
        small = case["main"] == "main.dhx" or case["id"].startswith("tiny")
        others = case["others"] if small else case["others"][2:]
        case["commands"] = others if checked.get("code") == 0 else [case["others"][case["pick"]]]
    second = _run(all_cases, tmp_path, "others")
    problems, accepted = [], 0
    for case, checked, rest in zip(all_cases, first, second, strict=True):
        accepted += checked[0].get("code") == 0
        problems += _problems({**case, "commands": [["check", case["main"]]]}, checked)
        problems += _problems(case, rest)
    assert not problems, "\n\n".join(problems)
    assert 0 < accepted < len(all_cases)  # some mutants stay valid and reach every command
