"""Hardware profiles: what the planner's cost model knows about a GPU platform.

A profile is a YAML file (read with PyYAML's safe loader only). Every mistake in it is a
located :class:`ProfileError` (``file:line:col``, the line, a caret, notes). Units are SI
with the scale in the key's name: ``_tflops`` (10^12 FLOP/s), ``_gbps`` (10^9 bytes/s),
``_us`` (microseconds). The schema (keys marked * are required)::

    name*: a40                        # the name `cluster { profile = "a40" }` uses
    description: free text
    peak_tflops*:                     # dense peak per dtype (fp32, bf16, fp16, fp8), > 0;
      bf16: 149.7                     #   a dtype left out cannot be costed on this platform
    hbm_gbps*: 696                    # memory bandwidth, > 0
    memory_gb: 48                     # device memory per GPU (rank), > 0; the simulator
                                      #   warns when a rank's predicted peak exceeds it
    optimizer_gbps: 7.5               # bytes/s (10^9) an AdamW step streams, > 0; measured by
                                      #   `dhelix profile`; absent: hbm_gbps × achieved.activation
    achieved*:                        # fraction (0, 1] of the peak an op class reaches:
      gemm, attention, router         #   of peak_tflops (compute-bound classes)
      norm, add, activation, permute  #   of hbm_gbps (memory-bound classes)
      gemm_fp8                        #   optional: of the fp8 peak, an fp8 GEMM (absent: gemm's)
    links*:
      local*: {bw_gbps*, latency_us*} # node-local collectives: NCCL bus bandwidth
      cross*: {bw_gbps*, latency_us*} # cross-node: bandwidth per GPU
      island: {bw_gbps*, latency_us*} # a level of a cluster's levels block: its stages'
                                      #   link (absent: local inside a node, else cross)
    collectives:                      # optional; each {model, efficiency (0, 1]}
      all_gather, reduce_scatter, all_reduce, all_to_all, p2p, reduce, broadcast
                                      # model: ring | ring_allreduce | pairwise | p2p | rooted
                                      #   (rooted: a pipelined chain to or from one root,
                                      #   alpha (g - 1) + S / B; reduce and broadcast by default)
                                      # efficiency: one number for both lanes, or per lane:
                                      #   {local: 0.45, cross: 0.8} (a lane left out: 1.0)
    oef*:
      classes*: {comp_comp, comp_intra, comp_inter, intra_intra, inter_inter, intra_inter}
      pairs:                          # overrides: forward-strand op -> backward-strand op -> OEF
        qkv: {reduce_scatter@local: 0.73}
    slowdown*:
      compute_with_comm*: 0.25        # σ in [0, 1]: own comm overlapping own compute
    launch_gap*: {fixed_us*, comm_fraction*}   # per paired segment, both >= 0
    host:                             # optional: the host beside each GPU, for `train { offload }`
      link_gbps*: 64                  #   host <-> device bandwidth per GPU and direction (PCIe, C2C), > 0
      optimizer_gbps*: 12             #   bytes/s (10^9) a host AdamW step streams, per GPU's share of the
                                      #   host's cores and memory, > 0 (absent section: offload refused)
      memory_gb: 1024                 #   host memory of one node (GB), > 0: what the offloaded optimizer
                                      #   states of the node's GPUs may take (absent: not checked)
    kernels:                          # optional per-kernel terms (frontend.kernel_terms):
      overhead_us: 4                  #   fixed time per kernel launched, >= 0
      sms: 108                        #   streaming multiprocessors (GEMM tile waves)
      gemm_tile: [128, 256]           #   a GEMM's output tile
      attention: flash                #   flash | materialized (the scores in HBM)
      loss: vocab_parallel            #   vocab_parallel | upcast | fused (the logits' copies a loss holds)
    cores: {usable*, ranks*, comm_busy*}   # optional: a CPU host's cores and the ranks sharing
                                      #   them when measured (frontend.host_cores)
    measured:                         # filled by `dhelix profile`; optional
      dtype*: bf16
      source: what was profiled       # the program file
      machine, torch, backend, date, command: strings stamping the measurement
      repeats: 5                      # timed repetitions per median
      mesh: {tp: 2, pp: 2}            # the mesh measured on (axes larger than 1)
      shapes: {op name: signature}    # `[64, 64] -> [64, 128]`, see frontend.profilecheck
      ops: {op name: µs}              # solo op times
      pairs: [{fwd*: [names], bwd*: [names], us*}]   # segment-pair make-spans

OEF values (``(T_i + T_j - P) / min(T_i, T_j)``, the paper's Eq. 1) must lie in [-1, 2].
A pair key is an op name (``qkv``, ``fc1.wgrad``), an op kind (``gemm_wgrad``,
``attention_bwd``) or a communication kind with its lane (``all_gather@local``,
``p2p@cross``; ring-attention steps and send/recv are ``p2p``). Shipped profiles live in the
package ``dhelix.stdlib_schedules`` next to ``layers.dhx``.
"""

from __future__ import annotations

import functools

import re
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import attrs
import yaml

from dhelix.dsl.core.dtypes import DTYPES
from dhelix.dsl.core.mesh import COMM_LANES, DIMENSIONS
from dhelix.dsl.core.span import Source, Span
from dhelix.dsl.core.textfile import FileProblem, name_problem, read_text_file
from dhelix.dsl.core.wording import did_you_mean
from dhelix.dsl.frontend.host_cores import HostCores, read_cores
from dhelix.dsl.frontend.kernel_terms import NONE as NO_KERNEL_TERMS, Kernels, read_kernels
from dhelix.dsl.frontend.profile_reader import ProfileError, ProfileReader

COMPUTE_BOUND = ("gemm", "attention", "router")
MEMORY_BOUND = ("norm", "add", "activation", "permute")
#: Fractions a profile may add: ``gemm_fp8``, of the fp8 peak an fp8 GEMM reaches (absent:
#: ``gemm``'s; an fp8 GEMM's casts and scaling keep it further from its doubled peak).
OPTIONAL_ACHIEVED = ("gemm_fp8",)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p", "reduce", "broadcast")
COLLECTIVE_MODELS = ("ring", "ring_allreduce", "pairwise", "p2p", "rooted")
DEFAULT_MODELS = {"all_gather": "ring", "reduce_scatter": "ring", "all_reduce": "ring_allreduce",
                  "all_to_all": "pairwise", "p2p": "p2p", "reduce": "rooted", "broadcast": "rooted"}
OEF_CLASSES = ("comp_comp", "comp_intra", "comp_inter", "intra_intra", "inter_inter", "intra_inter")
TOP_KEYS = ("name", "description", "peak_tflops", "hbm_gbps", "memory_gb", "optimizer_gbps", "achieved", "links",
            "collectives", "oef", "slowdown", "launch_gap", "host", "kernels", "cores",
            "measured")
#: The keys of the ``host`` section (:data:`HOST_REQUIRED` required there).
HOST_KEYS = ("link_gbps", "optimizer_gbps", "memory_gb")
HOST_REQUIRED = ("link_gbps", "optimizer_gbps")
TOP_REQUIRED = ("name", "peak_tflops", "hbm_gbps", "achieved", "links", "oef", "slowdown", "launch_gap")
STAMP_KEYS = ("machine", "torch", "backend", "date", "command")
MEASURED_KEYS = ("dtype", "source", *STAMP_KEYS, "repeats", "mesh", "shapes", "ops", "pairs")
#: The keys a measured mesh may have (the dimensions, then ep), as its error lists them.
MEASURED_AXES = DIMENSIONS + ("ep",)
_LEVEL = re.compile(r"[a-z_][a-z0-9_]*")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*(@[A-Za-z_]+)?")


@attrs.frozen
class Link:
    """One communication lane's link: bandwidth (GB/s) and per-step latency (µs)."""

    bw_gbps: float
    latency_us: float


@attrs.frozen
class Collective:
    """How one collective is timed: a NOTES §3.6 model and the fraction of the link's
    bandwidth it reaches, on both lanes unless ``lanes`` gives a lane its own fraction."""

    model: str
    efficiency: float = 1.0
    lanes: dict = attrs.field(factory=dict, hash=False)  # lane -> efficiency on that lane

    def efficiency_on(self, lane: str) -> float:
        """The bandwidth fraction this collective reaches on ``lane`` (local or cross)."""
        return self.lanes.get(lane, self.efficiency)


@attrs.frozen
class LaunchGap:
    """The cost of pairing two segments: the larger of a fixed gap and a share of the comm time."""

    fixed_us: float
    comm_fraction: float

    def seconds(self, comm_seconds: float) -> float:
        """The gap for a pair whose communication takes ``comm_seconds`` when run alone."""
        return max(self.fixed_us * 1e-6, self.comm_fraction * comm_seconds)


@attrs.frozen
class Host:
    """The host beside each GPU, what optimizer offload (``train { offload = optimizer }``)
    costs: the host link's bandwidth per GPU and direction (GB/s: PCIe, NVLink-C2C) and the
    rate (GB/s) at which a host AdamW step streams its bytes (the GPU's share of the host);
    the host memory of one node (GB; None: not known, not checked), which the offloaded
    optimizer states of all its GPUs share."""

    link_gbps: float
    optimizer_gbps: float
    memory_gb: float | None = None


@attrs.frozen
class MeasuredPair:
    fwd: tuple[str, ...]
    bwd: tuple[str, ...]
    us: float


@attrs.frozen
class Measured:
    """Timings taken by `dhelix profile` for one program and dtype (op names are that program's),
    with the stamp of the measurement and what it was measured at (``mesh``: axis -> size,
    ``shapes``: op name -> signature), so that a profile of another program is recognised."""

    dtype: str
    source: str = ""
    ops: dict = attrs.field(factory=dict, hash=False)  # op name -> µs
    pairs: tuple[MeasuredPair, ...] = ()
    stamp: dict = attrs.field(factory=dict, hash=False)  # machine, torch, backend, date, command -> str
    repeats: int | None = None
    mesh: dict = attrs.field(factory=dict, hash=False)  # axis -> size (axes larger than 1)
    shapes: dict = attrs.field(factory=dict, hash=False)  # op name -> signature

    def pair_us(self, fwd: Sequence[str], bwd: Sequence[str]) -> float | None:
        """The measured make-span (µs) of exactly this segment pair, if there is one."""
        key = (tuple(fwd), tuple(bwd))
        return next((p.us for p in self.pairs if (p.fwd, p.bwd) == key), None)


@attrs.frozen
class Profile:
    """A validated hardware profile (see the module docstring for the meaning of each field)."""

    name: str
    peak_tflops: dict = attrs.field(hash=False)
    hbm_gbps: float
    achieved: dict = attrs.field(hash=False)
    links: dict = attrs.field(hash=False)  # lane -> Link
    collectives: dict = attrs.field(hash=False)  # collective -> Collective
    oef_classes: dict = attrs.field(hash=False)
    oef_pairs: dict = attrs.field(hash=False)  # (fwd key, bwd key) -> OEF
    slowdown: float
    launch_gap: LaunchGap
    measured: Measured | None = None
    description: str = ""
    memory_gb: float | None = None  # device memory per rank; None: not known
    optimizer_gbps: float | None = None  # an AdamW step's streaming rate; None: from hbm_gbps
    kernels: Kernels = NO_KERNEL_TERMS  # per-kernel terms; the default changes no op's time
    host: Host | None = None  # the host link and CPU optimizer; None: not known (no offload)
    cores: HostCores | None = None  # a CPU host's cores its ranks share; None: not a CPU host
    path: str = attrs.field(default="", eq=False)

    def host_or_error(self, span: Span | None = None) -> Host:
        """The profile's :class:`Host`; a ProfileError located at ``span`` (where offload is
        asked for) naming the missing field when the profile has none."""
        if self.host is None:
            raise ProfileError(f"offload = optimizer needs the host link's bandwidth, and profile '{self.name}' "
                               "has no host.link_gbps", span,
                               ["optimizer offload moves each step's gradients to the host and the updated "
                                "weights back over the host link, and runs AdamW on the host's CPU: add a "
                                "host section to the profile (host: {link_gbps: ..., optimizer_gbps: ...}), "
                                "or remove offload", f"profile file: {self.path}"])
        return self.host

    def peak_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for ``dtype``; a ProfileError when the profile has none."""
        if dtype not in self.peak_tflops:
            raise ProfileError(f"profile '{self.name}' has no peak_tflops for {dtype}",
                               notes=[f"it lists {', '.join(self.peak_tflops)}", f"profile file: {self.path}"])
        return self.peak_tflops[dtype] * 1e12

    def oef(self, fwd_keys: Sequence[str], bwd_keys: Sequence[str], default: str) -> float:
        """The OEF of a forward-strand op and a backward-strand op, each given by its keys
        from the most to the least specific; the class ``default`` when no override matches."""
        for fkey in fwd_keys:
            for bkey in bwd_keys:
                value = self.oef_pairs.get((fkey, bkey))
                if value is not None:
                    return value
        return self.oef_classes[default]


def profile_names() -> list[str]:
    """The names of the shipped profiles, sorted."""
    root = resources.files("dhelix.stdlib_schedules")
    return sorted(entry.name[:-5] for entry in root.iterdir() if entry.name.endswith(".yaml"))


def load_profile(name_or_path: str, search_dir: str | Path | None = None, span: Span | None = None) -> Profile:
    """Load a profile by shipped name (``"a40"``) or by path (``"lab/h100.yaml"``).

    A bare name is always a shipped profile: a file ``<name>.yaml`` beside the program does
    not replace it (the program names such a file by its path, ``"a40.yaml"``). A path (it
    ends in ``.yaml``/``.yml`` or has a ``/``) is taken relative to ``search_dir`` (or the
    working directory). ``span`` locates the reference in the caller's file. Raises
    ProfileError for a missing profile and for every schema mistake.
    """
    base = Path(search_dir) if search_dir is not None else Path.cwd()
    problem = name_problem(name_or_path)
    if problem:
        raise ProfileError(f"cannot use this profile name: {problem}", span)
    is_path = name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path or "\\" in name_or_path
    if is_path:
        path = base / name_or_path
        if not _is_file(path):
            raise ProfileError(f"cannot find profile file '{name_or_path}'", span, [f"looked in {base}"])
        try:
            text = read_text_file(path)
        except FileProblem as exc:
            raise ProfileError(f"cannot read profile file '{name_or_path}': {exc.reason}", span,
                               ["save it as UTF-8 text"] if exc.not_utf8 else []) from None
        return parse_profile(text, str(path))
    shipped = _shipped_text(name_or_path)
    if shipped is None:
        names = profile_names()
        notes = did_you_mean(name_or_path, names) + [f"shipped profiles: {', '.join(names)}"]
        if search_dir is not None and _is_file(base / f"{name_or_path}.yaml"):
            notes.append(f'a profile file is named by its path: profile = "{name_or_path}.yaml"')
        raise ProfileError(f"unknown profile '{name_or_path}'", span, notes)
    return parse_profile(shipped, f"stdlib/{name_or_path}.yaml")


@functools.lru_cache(maxsize=32)
def _shipped_text(name: str) -> str | None:
    """The text of the shipped profile ``name`` (None when there is none). Cached: the
    package's files do not change while it runs, and `dhelix tune` checks thousands of
    variants that name one."""
    shipped = resources.files("dhelix.stdlib_schedules") / f"{name}.yaml"
    return shipped.read_text() if shipped.is_file() else None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a path too long for the system names no file
        return False


@functools.lru_cache(maxsize=16)
def parse_profile(text: str, path: str) -> Profile:
    """Validate the YAML ``text`` of the file ``path`` and build its Profile.

    Collects every schema mistake and raises them at once (a ProfileError or an ErrorGroup).
    The result is cached by (text, path): a Profile is frozen, and `dhelix tune` checks
    thousands of variants of one program, each naming the same profile (errors are not
    cached: each call raises them afresh).
    """
    reader = ProfileReader(Source(path, text))
    root = reader.compose()
    top = reader.mapping(root, "", TOP_KEYS, TOP_REQUIRED)
    profile = None if top is None else _build(reader, top, path)
    reader.errors.raise_if_any()
    assert profile is not None, "no profile, yet no error recorded"  # compose refuses an empty text
    return profile


def _build(reader: ProfileReader, top: dict, path: str) -> Profile | None:
    fields: dict[str, Any] = dict(  # each None where an error was recorded
        name=reader.string(top.get("name"), "name"),
        description=reader.string(top["description"], "description") if "description" in top else "",
        peak_tflops=_peak(reader, top.get("peak_tflops")),
        hbm_gbps=reader.number(top.get("hbm_gbps"), "hbm_gbps", positive=True),
        achieved=reader.number_map(top.get("achieved"), "achieved", COMPUTE_BOUND + MEMORY_BOUND + OPTIONAL_ACHIEVED,
                                   COMPUTE_BOUND + MEMORY_BOUND, positive=True, high=1.0),
        links=_links(reader, top.get("links")),
        collectives=_collectives(reader, top.get("collectives")),
        oef_classes=None, oef_pairs=None,
        slowdown=_slowdown(reader, top.get("slowdown")),
        launch_gap=_launch_gap(reader, top.get("launch_gap")),
        measured=_measured(reader, top["measured"]) if "measured" in top else None,
        memory_gb=reader.number(top["memory_gb"], "memory_gb", positive=True) if "memory_gb" in top else None,
        optimizer_gbps=(reader.number(top["optimizer_gbps"], "optimizer_gbps", positive=True)
                        if "optimizer_gbps" in top else None),
        kernels=read_kernels(reader, top["kernels"]) if "kernels" in top else NO_KERNEL_TERMS,
        host=_host(reader, top["host"]) if "host" in top else None,
        cores=read_cores(reader, top["cores"]) if "cores" in top else None,
    )
    fields["oef_classes"], fields["oef_pairs"] = _oef(reader, top.get("oef"))
    optional = ("measured", "memory_gb", "optimizer_gbps", "host", "cores")
    if reader.errors.errors or any(v is None for k, v in fields.items() if k not in optional):
        return None
    return Profile(**fields, path=path)


def _host(reader: ProfileReader, node) -> Host | None:
    keys = reader.mapping(node, "host", HOST_KEYS, HOST_REQUIRED)
    if keys is None:
        return None
    link = reader.number(keys.get("link_gbps"), "host.link_gbps", positive=True)
    rate = reader.number(keys.get("optimizer_gbps"), "host.optimizer_gbps", positive=True)
    memory = reader.number(keys["memory_gb"], "host.memory_gb", positive=True) if "memory_gb" in keys else None
    if link is None or rate is None or ("memory_gb" in keys and memory is None):
        return None
    return Host(link, rate, memory)


def _links(reader: ProfileReader, node) -> dict | None:
    # Besides the two lanes, a link per level of a declared topology (``island``, ``rack``).
    lanes = reader.mapping(node, "links", None, COMM_LANES)
    if lanes is None:
        return None
    out = {}
    for lane in lanes:
        where = f"links.{lane}"
        if lane not in COMM_LANES and not _LEVEL.fullmatch(lane):
            reader.error(reader.key_nodes[id(lanes[lane])], f"'{lane}' cannot name a level's link",
                         ["links: local, cross, and one per level of a cluster's levels block (a plain name)"])
            continue
        keys = reader.mapping(lanes.get(lane), where, ("bw_gbps", "latency_us"), ("bw_gbps", "latency_us"))
        if keys is None:
            continue
        bw = reader.number(keys.get("bw_gbps"), f"{where}.bw_gbps", positive=True)
        latency = reader.number(keys.get("latency_us"), f"{where}.latency_us", nonneg=True)
        if bw is not None and latency is not None:
            out[lane] = Link(bw, latency)
    return out if all(lane in out for lane in COMM_LANES) else None


def _peak(reader: ProfileReader, node) -> dict | None:
    values = reader.number_map(node, "peak_tflops", DTYPES, (), positive=True)
    if values == {}:
        reader.error(node, "peak_tflops lists no dtype", [f"dtypes: {', '.join(DTYPES)}"])
        return None
    return values


def _collectives(reader: ProfileReader, node) -> dict | None:
    out = {name: Collective(model) for name, model in DEFAULT_MODELS.items()}
    if node is None:
        return out
    entries = reader.mapping(node, "collectives", COLLECTIVES, ())
    if entries is None:
        return None
    for name, value in entries.items():
        where = f"collectives.{name}"
        keys = reader.mapping(value, where, ("model", "efficiency"), ("model",))
        if keys is None:
            continue
        model = reader.choice(keys.get("model"), f"{where}.model", COLLECTIVE_MODELS)
        eff, lanes = _efficiency(reader, keys.get("efficiency"), f"{where}.efficiency")
        if model is not None and eff is not None:
            out[name] = Collective(model, eff, lanes)
    return out


def _efficiency(reader: ProfileReader, node, where: str) -> tuple[float | None, dict]:
    """(efficiency on both lanes, per-lane efficiencies) of a collective: a number, or a
    mapping of lanes to numbers (a lane left out runs at 1.0); (None, {}) after an error."""
    if node is None:
        return 1.0, {}
    if isinstance(node, yaml.MappingNode):
        lanes = reader.number_map(node, where, COMM_LANES, (), positive=True, high=1.0)
        return (None, {}) if lanes is None else (1.0, lanes)
    return reader.number(node, where, positive=True, high=1.0), {}


def _oef(reader: ProfileReader, node) -> tuple[dict | None, dict | None]:
    parts = reader.mapping(node, "oef", ("classes", "pairs"), ("classes",))
    if parts is None:
        return None, None
    classes = reader.number_map(parts.get("classes"), "oef.classes", OEF_CLASSES, OEF_CLASSES, oef=True)
    pairs: dict = {}
    rows = reader.mapping(parts["pairs"], "oef.pairs", None, ()) if "pairs" in parts else {}
    for fkey, row in (rows or {}).items():
        if not _pair_key(reader, fkey, row, "oef.pairs"):
            continue
        for bkey, value in (reader.mapping(row, f"oef.pairs.{fkey}", None, ()) or {}).items():
            where = f"oef.pairs.{fkey}"
            if _pair_key(reader, bkey, value, where):
                oef = reader.number(value, f"{where}.{bkey}", oef=True)
                if oef is not None:
                    pairs[(fkey, bkey)] = oef
    return classes, pairs


def _slowdown(reader: ProfileReader, node) -> float | None:
    values = reader.number_map(node, "slowdown", ("compute_with_comm",), ("compute_with_comm",),
                               nonneg=True, high=1.0)
    return None if values is None else values["compute_with_comm"]


def _launch_gap(reader: ProfileReader, node) -> LaunchGap | None:
    keys = ("fixed_us", "comm_fraction")
    values = reader.number_map(node, "launch_gap", keys, keys, nonneg=True)
    return None if values is None else LaunchGap(values["fixed_us"], values["comm_fraction"])


def _measured(reader: ProfileReader, node) -> Measured | None:
    keys = reader.mapping(node, "measured", MEASURED_KEYS, ("dtype",))
    if keys is None:
        return None
    fields: dict[str, Any] = dict(  # each None where an error was recorded
        dtype=reader.choice(keys.get("dtype"), "measured.dtype", DTYPES),
        source=reader.string(keys["source"], "measured.source") if "source" in keys else "",
        ops=reader.number_map(keys["ops"], "measured.ops", None, (), nonneg=True) if "ops" in keys else {},
        stamp=_stamp(reader, keys),
        repeats=reader.integer(keys["repeats"], "measured.repeats") if "repeats" in keys else 0,
        mesh=_measured_mesh(reader, keys["mesh"]) if "mesh" in keys else {},
        shapes=_measured_shapes(reader, keys["shapes"]) if "shapes" in keys else {},
        pairs=_measured_pairs(reader, keys["pairs"]) if "pairs" in keys else (),
    )
    if any(value is None for value in fields.values()):
        return None
    return Measured(**fields | {"repeats": fields["repeats"] or None})


def _stamp(reader: ProfileReader, keys: dict) -> dict | None:
    stamp = {key: reader.string(keys[key], f"measured.{key}") for key in STAMP_KEYS if key in keys}
    return None if None in stamp.values() else stamp


def _measured_mesh(reader: ProfileReader, node) -> dict | None:
    entries = reader.mapping(node, "measured.mesh", MEASURED_AXES, ())
    if entries is None:
        return None
    sizes = {axis: reader.integer(value, f"measured.mesh.{axis}") for axis, value in entries.items()}
    return None if None in sizes.values() else sizes


def _measured_shapes(reader: ProfileReader, node) -> dict | None:
    entries = reader.mapping(node, "measured.shapes", None, ())
    if entries is None:
        return None
    shapes = {name: reader.string(value, f"measured.shapes.{name}") for name, value in entries.items()}
    return None if None in shapes.values() else shapes


def _measured_pairs(reader: ProfileReader, node) -> tuple[MeasuredPair, ...]:
    pairs = []
    for index, item in enumerate(reader.sequence(node, "measured.pairs")):
        where = f"measured.pairs[{index}]"
        entry = reader.mapping(item, where, ("fwd", "bwd", "us"), ("fwd", "bwd", "us"))
        if entry is None:
            continue
        fwd = reader.string_list(entry.get("fwd"), f"{where}.fwd")
        bwd = reader.string_list(entry.get("bwd"), f"{where}.bwd")
        us = reader.number(entry.get("us"), f"{where}.us", nonneg=True)
        if fwd == () and bwd == ():
            reader.error(item, f"{where} pairs two empty segments", ["name the ops of at least one side"])
        elif fwd is not None and bwd is not None and us is not None:
            pairs.append(MeasuredPair(fwd, bwd, us))
    return tuple(pairs)


def _pair_key(reader: ProfileReader, key: str, value_node, where: str) -> bool:
    """Check an oef.pairs key (an op name or kind, or ``<collective>@<lane>``); errors
    point at the key."""
    problem, notes = _pair_key_problem(key)
    if problem:
        reader.error(reader.key_nodes.get(id(value_node), value_node), f"{problem} in {where}", notes)
        return False
    return True


def _pair_key_problem(key: str) -> tuple[str, list[str]]:
    """Why ``key`` is not a valid oef.pairs key ('' when it is), with notes."""
    if not _KEY.fullmatch(key):
        return f"'{key}' is not an op name, op kind or <collective>@<lane>", []
    kind, _, lane = key.partition("@")
    if lane:
        if kind not in COLLECTIVES:
            return f"unknown collective '{kind}' in '{key}'", did_you_mean(kind, COLLECTIVES) + \
                [f"collectives: {', '.join(COLLECTIVES)}"]
        if lane not in COMM_LANES:
            return (f"unknown lane '{lane}' in '{key}'",
                    did_you_mean(lane, COMM_LANES) + [f"lanes: {', '.join(COMM_LANES)}"])
    elif kind in COLLECTIVES:
        return f"'{key}' needs its lane", [f"write {key}@local or {key}@cross"]
    return "", []
