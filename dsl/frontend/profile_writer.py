"""Write a :class:`~dhelix.dsl.frontend.profiles.Profile` as a profile YAML file.

The inverse of :func:`~dhelix.dsl.frontend.profiles.parse_profile`:
``parse_profile(render_profile(p), path) == p`` for every valid profile (a tested property),
so the schema keeps one owner, the reader. The text follows the layout of the shipped
profiles: one section per top-level key, flow mappings for links, collectives and OEF rows,
and a comment after each number saying where it comes from (``notes``, keyed by the dotted
path of the value, ``achieved.gemm`` or ``links.local``).

Numbers are written so that PyYAML reads back the same float (``repr``; an exponent gets a
mantissa with a dot, which YAML 1.1 needs to see a float); strings are written plain when
YAML reads them back as that string, else double-quoted.
"""

from __future__ import annotations

import json
import re
from typing import Mapping, Sequence

import yaml

from dhelix.dsl.core.mesh import COMM_LANES
from dhelix.dsl.frontend.kernel_terms import NONE as NO_KERNEL_TERMS, Kernels
from dhelix.dsl.frontend.profiles import (COLLECTIVES, COMPUTE_BOUND, DTYPES, MEMORY_BOUND, OEF_CLASSES, OPTIONAL_ACHIEVED,
                                          STAMP_KEYS, Measured, Profile)

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.@-]*")


def render_profile(profile: Profile, notes: Mapping[str, str] | None = None, header: Sequence[str] = ()) -> str:
    """The YAML text of ``profile``: ``header`` lines as leading comments, ``notes[path]``
    as the comment after the value at ``path``. Assumes a valid profile (as parsed or built
    by the calibration); the text parses back to an equal Profile."""
    out = _Lines(notes or {})
    for line in header:
        out.comment(line)
    out.value("name", _str(profile.name), "name")
    if profile.description:
        out.value("description", _str(profile.description), "description")
    out.blank()
    out.section("peak_tflops", "peak_tflops")
    for dtype in (d for d in DTYPES if d in profile.peak_tflops):
        out.value(dtype, _num(profile.peak_tflops[dtype]), f"peak_tflops.{dtype}", 1)
    out.value("hbm_gbps", _num(profile.hbm_gbps), "hbm_gbps")
    if profile.memory_gb is not None:
        out.value("memory_gb", _num(profile.memory_gb), "memory_gb")
    if profile.optimizer_gbps is not None:
        out.value("optimizer_gbps", _num(profile.optimizer_gbps), "optimizer_gbps")
    out.blank()
    out.section("achieved", "achieved")
    for cls in (c for c in COMPUTE_BOUND + MEMORY_BOUND + OPTIONAL_ACHIEVED if c in profile.achieved):
        out.value(cls, _num(profile.achieved[cls]), f"achieved.{cls}", 1)
    out.blank()
    out.section("links", "links")
    for lane in [*COMM_LANES, *(name for name in profile.links if name not in COMM_LANES)]:  # levels' after
        link = profile.links[lane]
        out.value(lane, _flow({"bw_gbps": _num(link.bw_gbps), "latency_us": _num(link.latency_us)}),
                  f"links.{lane}", 1)
    out.blank()
    out.section("collectives", "collectives")
    for name in COLLECTIVES:
        model = profile.collectives[name]
        efficiency = (_flow({lane: _num(model.efficiency_on(lane)) for lane in COMM_LANES}) if model.lanes
                      else _num(model.efficiency))
        out.value(name, _flow({"model": model.model, "efficiency": efficiency}), f"collectives.{name}", 1)
    out.blank()
    _oef(out, profile)
    out.blank()
    out.section("slowdown", "slowdown")
    out.value("compute_with_comm", _num(profile.slowdown), "slowdown.compute_with_comm", 1)
    out.blank()
    out.section("launch_gap", "launch_gap")
    out.value("fixed_us", _num(profile.launch_gap.fixed_us), "launch_gap.fixed_us", 1)
    out.value("comm_fraction", _num(profile.launch_gap.comm_fraction), "launch_gap.comm_fraction", 1)
    if profile.host is not None:
        out.blank()
        out.section("host", "host")
        out.value("link_gbps", _num(profile.host.link_gbps), "host.link_gbps", 1)
        out.value("optimizer_gbps", _num(profile.host.optimizer_gbps), "host.optimizer_gbps", 1)
        if profile.host.memory_gb is not None:
            out.value("memory_gb", _num(profile.host.memory_gb), "host.memory_gb", 1)
    if profile.kernels != NO_KERNEL_TERMS:
        out.blank()
        _kernels(out, profile.kernels)
    if profile.cores is not None:
        out.blank()
        out.section("cores", "cores")
        out.value("usable", str(profile.cores.usable), "cores.usable", 1)
        out.value("ranks", str(profile.cores.ranks), "cores.ranks", 1)
        out.value("comm_busy", _num(profile.cores.comm_busy), "cores.comm_busy", 1)
    if profile.measured is not None:
        out.blank()
        _measured(out, profile.measured)
    return out.text()


def _kernels(out: "_Lines", kernels: Kernels) -> None:
    out.section("kernels", "kernels")
    out.value("overhead_us", _num(kernels.overhead_us), "kernels.overhead_us", 1)
    if kernels.sms is not None:
        out.value("sms", str(kernels.sms), "kernels.sms", 1)
    out.value("gemm_tile", f"[{kernels.gemm_tile[0]}, {kernels.gemm_tile[1]}]", "kernels.gemm_tile", 1)
    out.value("attention", kernels.attention, "kernels.attention", 1)
    out.value("loss", kernels.loss, "kernels.loss", 1)


def _oef(out: "_Lines", profile: Profile) -> None:
    out.section("oef", "oef")
    out.section("classes", "oef.classes", 1)
    for cls in OEF_CLASSES:
        out.value(cls, _num(profile.oef_classes[cls]), f"oef.classes.{cls}", 2)
    if not profile.oef_pairs:
        return
    out.section("pairs", "oef.pairs", 1)
    rows: dict[str, dict[str, str]] = {}
    for (fkey, bkey), value in profile.oef_pairs.items():
        rows.setdefault(fkey, {})[_str(bkey)] = _num(value)
    for fkey, row in rows.items():
        out.value(_str(fkey), _flow(row), f"oef.pairs.{fkey}", 2)


def _measured(out: "_Lines", measured: Measured) -> None:
    out.section("measured", "measured")
    out.value("dtype", measured.dtype, "measured.dtype", 1)
    if measured.source:
        out.value("source", _str(measured.source), "measured.source", 1)
    for key in (k for k in STAMP_KEYS if k in measured.stamp):
        out.value(key, _str(measured.stamp[key]), f"measured.{key}", 1)
    if measured.repeats is not None:
        out.value("repeats", str(measured.repeats), "measured.repeats", 1)
    if measured.mesh:
        out.value("mesh", _flow({axis: str(size) for axis, size in measured.mesh.items()}), "measured.mesh", 1)
    for key, entries, fmt in (("shapes", measured.shapes, _str), ("ops", measured.ops, _num)):
        if not entries and key == "shapes":
            continue
        if not entries:
            out.value(key, "{}", f"measured.{key}", 1)
            continue
        out.section(key, f"measured.{key}", 1)
        for name, value in entries.items():
            out.value(_str(name), fmt(value), f"measured.{key}.{name}", 2)
    if measured.pairs:
        out.section("pairs", "measured.pairs", 1)
        for pair in measured.pairs:
            sides = {side: "[" + ", ".join(_str(n) for n in names) + "]"
                     for side, names in (("fwd", pair.fwd), ("bwd", pair.bwd))}
            out.line(f"    - {_flow(sides | {'us': _num(pair.us)})}")


class _Lines:
    """The output lines, with the notes as trailing comments."""

    def __init__(self, notes: Mapping[str, str]):
        self.notes = notes
        self.lines: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append(text)

    def comment(self, text: str) -> None:
        self.lines.append(f"# {text}".rstrip())

    def blank(self) -> None:
        self.lines.append("")

    def section(self, key: str, path: str, depth: int = 0) -> None:
        self.lines.append(self._noted(f"{'  ' * depth}{key}:", path))

    def value(self, key: str, text: str, path: str, depth: int = 0) -> None:
        self.lines.append(self._noted(f"{'  ' * depth}{key}: {text}", path))

    def _noted(self, text: str, path: str) -> str:
        note = self.notes.get(path)
        return f"{text}   # {note}" if note else text

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _flow(entries: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"{key}: {value}" for key, value in entries.items()) + "}"


def _str(text: str) -> str:
    """``text`` as a YAML scalar that reads back as this string."""
    if _PLAIN.fullmatch(text) and yaml.safe_load(text) == text:
        return text
    return json.dumps(text, ensure_ascii=False)  # a JSON string is a YAML double-quoted scalar


def _num(value: float) -> str:
    """``value`` as a YAML number that reads back as the same float."""
    value = float(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    text = repr(value)
    mantissa, _, exponent = text.partition("e")
    if exponent and "." not in mantissa:  # YAML 1.1 sees a float only with a dot in it
        text = f"{mantissa}.0e{exponent}"
    return text
