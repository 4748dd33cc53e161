"""Hardware profiles: the shipped ones load and cite their sources; schema mistakes are located."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.frontend.profile_writer import render_profile
from dhelix.dsl.frontend.profile_reader import ProfileError
from dhelix.dsl.frontend.profiles import load_profile, parse_profile, profile_names

MINIMAL = """\
name: lab
peak_tflops: {bf16: 100}
hbm_gbps: 1000
achieved: {gemm: 0.7, attention: 0.5, router: 0.3, norm: 0.8, add: 0.8, activation: 0.8, permute: 0.6}
links:
  local: {bw_gbps: 100, latency_us: 2}
  cross: {bw_gbps: 10, latency_us: 8}
oef:
  classes: {comp_comp: 0, comp_intra: 0.8, comp_inter: 0.9, intra_intra: 0.1, inter_inter: 0.1, intra_inter: 0.95}
slowdown: {compute_with_comm: 0.2}
launch_gap: {fixed_us: 20, comm_fraction: 0.1}
"""


def error_of(text: str, path: str = "lab.yaml") -> str:
    with pytest.raises(DhelixError) as info:
        parse_profile(text, path)
    return str(info.value)


def test_profile_names_are_the_shipped_ones():
    assert profile_names() == ["a100", "a40", "a800", "h100", "h200"]


@pytest.mark.parametrize("name", ["a100", "a40", "a800", "h100", "h200"])
def test_each_shipped_profile_loads(name):
    profile = load_profile(name)
    assert profile.name == name
    assert profile.path == f"stdlib/{name}.yaml"
    assert set(profile.links) == {"local", "cross"}
    assert profile.peak_flops("bf16") > 1e14
    assert all(-1 <= v <= 2 for v in profile.oef_pairs.values())


def test_shipped_profiles_follow_the_papers_platform_data():
    a40, a800, h100 = (load_profile(n) for n in ("a40", "a800", "h100"))
    assert a40.oef_classes["intra_inter"] == 0.37  # Fig. 4: PCIe shares the links with the NIC
    assert a800.oef_classes["intra_inter"] == 0.99
    assert h100.links["local"].bw_gbps == 450 and h100.links["cross"].bw_gbps == 50
    a100 = load_profile("a100")  # Centauri's Cluster A: 600 GB/s NVSwitch, 25 Gb/s of IB per GPU
    assert a100.links["local"].bw_gbps == 300 and a100.links["cross"].bw_gbps == 25 / 8
    assert h100.oef(("qkv", "gemm"), ("ag1.bwd", "reduce_scatter@local"), "comp_intra") == 0.73
    assert h100.oef(("ln1", "rmsnorm"), ("ag1.bwd", "reduce_scatter@local"), "comp_intra") == 0.8


def _numbers(node, ancestors=()):
    """(number node, ancestor key nodes) for every number in a composed YAML tree."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield from _numbers(value, ancestors + (key,))
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            yield from _numbers(item, ancestors)
    elif node.tag.endswith((":int", ":float")):
        yield node, ancestors


@pytest.mark.parametrize("name", ["a100", "a40", "a800", "h100", "h200"])
def test_every_shipped_number_names_its_source(name):
    from importlib import resources

    text = (resources.files("dhelix.stdlib_schedules") / f"{name}.yaml").read_text()
    lines = text.splitlines()
    for node, ancestors in _numbers(yaml.compose(text, Loader=yaml.SafeLoader)):
        # The number's own line, else the nearest enclosing key line with a comment, cites it.
        candidates = [node.start_mark.line] + [k.start_mark.line for k in reversed(ancestors)]
        comment = next((lines[i].split("#", 1)[1] for i in candidates if "#" in lines[i]), "")
        assert "[" in comment, f"{name}.yaml:{node.start_mark.line + 1}: number without a source"


def test_no_shipped_file_cites_an_absolute_path_of_one_machine():
    # The profiles cite the reference notes; a path of the machine that wrote them is nowhere else.
    from conftest import ROOT

    folders = ("stdlib_schedules", "tests/errors", "examples", "docs", "benchmarks")
    files = [p for folder in folders for p in (ROOT / folder).rglob("*")
             if p.is_file() and "results" not in p.relative_to(ROOT).parts]
    files += [ROOT / "README.md", ROOT / "Makefile"]
    absolute = sorted(str(p.relative_to(ROOT)) for p in files if b"/work/" in p.read_bytes())
    assert absolute == []


def test_minimal_profile_parses_with_default_collectives():
    profile = parse_profile(MINIMAL, "lab.yaml")
    assert profile.collectives["all_to_all"].model == "pairwise"
    assert profile.measured is None and profile.oef_pairs == {}


def test_unknown_key_suggests_the_right_one():
    assert error_of(MINIMAL.replace("hbm_gbps", "hbm_gbs")) == """\
lab.yaml:1:1: the profile is missing 'hbm_gbps'
  1 | name: lab
    | ^^^^^^^^^
lab.yaml:3:1: unknown key 'hbm_gbs' in the profile
  3 | hbm_gbs: 1000
    | ^^^^^^^
  note: did you mean 'hbm_gbps'?
  note: keys here: name, description, peak_tflops, hbm_gbps, memory_gb, optimizer_gbps, achieved, links, collectives, oef, slowdown, launch_gap, host, kernels, cores, measured
2 errors"""


def test_wrong_type_is_located_at_the_value():
    assert error_of(MINIMAL.replace("hbm_gbps: 1000", "hbm_gbps: fast")) == """\
lab.yaml:3:11: 'hbm_gbps' must be a number, got a string 'fast'
  3 | hbm_gbps: fast
    |           ^^^^"""


def test_negative_latency_is_located_in_a_flow_mapping():
    assert error_of(MINIMAL.replace("latency_us: 8", "latency_us: -8")) == """\
lab.yaml:7:36: 'links.cross.latency_us' must be zero or positive, got -8
  7 |   cross: {bw_gbps: 10, latency_us: -8}
    |                                    ^^"""


def test_oef_outside_its_range():
    assert error_of(MINIMAL.replace("comp_intra: 0.8", "comp_intra: 2.5")) == """\
lab.yaml:9:39: OEF 2.5 of 'oef.classes.comp_intra' is outside [-1, 2]
  9 |   classes: {comp_comp: 0, comp_intra: 2.5, comp_inter: 0.9, intra_intra: 0.1, inter_inter: 0.1, intra_inter: 0.95}
    |                                       ^^^
  note: OEF = (T_i + T_j - P) / min(T_i, T_j): 0 is no overlap, 1 hides the shorter op
  note: measured values beyond the range are noise: clamp them and say so in a comment"""


def test_bad_pair_keys_name_collectives_and_lanes():
    text = MINIMAL.replace("oef:\n", "oef:\n  pairs:\n    all_gathr@local: {gemm_dgrad: 0.9}\n"
                           "    qkv: {reduce_scatter@locl: 0.7, all_to_all: 0.5}\n")
    assert error_of(text) == """\
lab.yaml:10:5: unknown collective 'all_gathr' in 'all_gathr@local' in oef.pairs
  10 |     all_gathr@local: {gemm_dgrad: 0.9}
     |     ^^^^^^^^^^^^^^^
  note: did you mean 'all_gather'?
  note: collectives: all_gather, reduce_scatter, all_reduce, all_to_all, p2p, reduce, broadcast
lab.yaml:11:11: unknown lane 'locl' in 'reduce_scatter@locl' in oef.pairs.qkv
  11 |     qkv: {reduce_scatter@locl: 0.7, all_to_all: 0.5}
     |           ^^^^^^^^^^^^^^^^^^^
  note: did you mean 'local'?
  note: lanes: local, cross
lab.yaml:11:37: 'all_to_all' needs its lane in oef.pairs.qkv
  11 |     qkv: {reduce_scatter@locl: 0.7, all_to_all: 0.5}
     |                                     ^^^^^^^^^^
  note: write all_to_all@local or all_to_all@cross
3 errors"""


def test_collective_model_choice_and_efficiency():
    text = MINIMAL + "collectives:\n  all_gather: {model: rign, efficiency: 1.5}\n"
    assert error_of(text) == """\
lab.yaml:13:23: 'collectives.all_gather.model' must be one of ring, ring_allreduce, pairwise, p2p, rooted, got 'rign'
  13 |   all_gather: {model: rign, efficiency: 1.5}
     |                       ^^^^
  note: did you mean 'ring'?
lab.yaml:13:41: 'collectives.all_gather.efficiency' must be at most 1, got 1.5
  13 |   all_gather: {model: rign, efficiency: 1.5}
     |                                         ^^^
2 errors"""


def test_collective_efficiency_may_differ_per_lane():
    text = MINIMAL + "collectives:\n  p2p: {model: p2p, efficiency: {local: 0.25}}\n  all_gather: {model: ring, efficiency: 0.5}\n"
    profile = parse_profile(text, "lab.yaml")
    p2p, gather = profile.collectives["p2p"], profile.collectives["all_gather"]
    assert (p2p.efficiency_on("local"), p2p.efficiency_on("cross")) == (0.25, 1.0)  # a lane left out: 1.0
    assert (gather.efficiency_on("local"), gather.efficiency_on("cross")) == (0.5, 0.5)


def test_per_lane_efficiency_names_a_lane():
    text = MINIMAL + "collectives:\n  p2p: {model: p2p, efficiency: {locl: 0.25, cross: 0}}\n"
    assert error_of(text) == """\
lab.yaml:13:34: unknown key 'locl' in collectives.p2p.efficiency
  13 |   p2p: {model: p2p, efficiency: {locl: 0.25, cross: 0}}
     |                                  ^^^^
  note: did you mean 'local'?
  note: keys here: local, cross
lab.yaml:13:53: 'collectives.p2p.efficiency.cross' must be positive, got 0
  13 |   p2p: {model: p2p, efficiency: {locl: 0.25, cross: 0}}
     |                                                     ^
2 errors"""


def test_yaml_syntax_error_is_located():
    assert error_of("name: lab\npeak_tflops: {bf16: 100\nhbm_gbps: 3\n") == """\
lab.yaml:3:9: YAML syntax error: expected ',' or '}', but got ':'
  3 | hbm_gbps: 3
    |         ^
  note: while parsing a flow mapping (line 2)"""


def test_duplicate_key_and_empty_file():
    assert error_of(MINIMAL + "name: again\n").startswith("lab.yaml:12:1: 'name' is set twice in the profile")
    assert error_of("# nothing\n") == """\
lab.yaml:1:1: the profile is empty
  1 | # nothing
    | ^
  note: a profile is a YAML mapping; see the shipped stdlib/h100.yaml"""


MEASURED = """\
measured:
  dtype: bf16
  source: dhelix profile examples/llama8b_a40.dhx
  ops: {qkv: 812.5, ag1: 410}
  pairs:
    - {fwd: [ln1, ag1], bwd: [h2.bwd], us: 612}
    - {fwd: [], bwd: [h2.bwd], us: 95}
"""


def test_measured_section_parses():
    measured = parse_profile(MINIMAL + MEASURED, "lab.yaml").measured
    assert measured.dtype == "bf16" and measured.ops == {"qkv": 812.5, "ag1": 410.0}
    assert measured.pair_us(["ln1", "ag1"], ["h2.bwd"]) == 612
    assert measured.pair_us([], ["h2.bwd"]) == 95
    assert measured.pair_us(["ln1"], ["h2.bwd"]) is None


def test_measured_section_is_validated():
    text = MINIMAL + MEASURED.replace("dtype: bf16", "dtype: bf61").replace("us: 95", "us: -95") \
        + "    - {fwd: [], bwd: []}\n"
    assert error_of(text) == """\
lab.yaml:13:10: 'measured.dtype' must be one of fp32, bf16, fp16, fp8, got 'bf61'
  13 |   dtype: bf61
     |          ^^^^
  note: did you mean 'bf16'?
lab.yaml:18:36: 'measured.pairs[1].us' must be zero or positive, got -95
  18 |     - {fwd: [], bwd: [h2.bwd], us: -95}
     |                                    ^^^
lab.yaml:19:7: measured.pairs[2] is missing 'us'
  19 |     - {fwd: [], bwd: []}
     |       ^^^^^^^^^^^^^^^^^^
lab.yaml:19:7: measured.pairs[2] pairs two empty segments
  19 |     - {fwd: [], bwd: []}
     |       ^^^^^^^^^^^^^^^^^^
  note: name the ops of at least one side
4 errors"""


def test_unknown_profile_name_lists_the_shipped_ones():
    with pytest.raises(ProfileError) as info:
        load_profile("a4O")
    assert str(info.value) == """\
error: unknown profile 'a4O'
  note: did you mean 'a40'?
  note: shipped profiles: a100, a40, a800, h100, h200"""


def test_profiles_load_by_path_relative_to_the_search_dir(tmp_path):
    (tmp_path / "lab.yaml").write_text(MINIMAL)
    assert load_profile("lab.yaml", search_dir=tmp_path).hbm_gbps == 1000
    with pytest.raises(ProfileError, match="cannot find profile file 'missing.yaml'"):
        load_profile("missing.yaml", search_dir=tmp_path)


def test_a_bare_name_is_always_the_shipped_profile(tmp_path):
    # A file beside the program named like a shipped profile does not replace it …
    (tmp_path / "h100.yaml").write_text(MINIMAL.replace("name: lab", "name: h100"))
    profile = load_profile("h100", search_dir=tmp_path)
    assert profile.path == "stdlib/h100.yaml" and profile == load_profile("h100")
    assert load_profile("h100.yaml", search_dir=tmp_path).hbm_gbps == 1000  # … its path names it
    # … and a name that is only a file beside the program is unknown, with the way to name it.
    (tmp_path / "lab.yaml").write_text(MINIMAL)
    with pytest.raises(ProfileError) as info:
        load_profile("lab", search_dir=tmp_path)
    assert str(info.value) == """\
error: unknown profile 'lab'
  note: shipped profiles: a100, a40, a800, h100, h200
  note: a profile file is named by its path: profile = \"lab.yaml\""""


def test_a_program_naming_a40_gets_the_shipped_a40_despite_a_local_file(tmp_path):
    from dhelix.dsl.passes.pipeline import check_text

    example = Path(__file__).resolve().parent.parent / "examples" / "tiny_llama_cpu.dhx"
    program_file = tmp_path / "tiny.dhx"
    program_file.write_text(example.read_text())
    (tmp_path / "a40.yaml").write_text(MINIMAL.replace("name: lab", "name: a40"))
    program = check_text(program_file.read_text(), str(program_file))
    assert program.profile == load_profile("a40") and program.profile.path == "stdlib/a40.yaml"


def test_a_dtype_without_a_peak_cannot_be_costed():
    with pytest.raises(ProfileError) as info:
        load_profile("a40").peak_flops("fp8")
    assert str(info.value) == """\
error: profile 'a40' has no peak_tflops for fp8
  note: it lists bf16, fp16, fp32
  note: profile file: stdlib/a40.yaml"""


STAMPED = MEASURED.replace("  ops:", """\
  machine: "lab1: NVIDIA H100 80GB HBM3"
  torch: 2.5.1
  backend: nccl
  date: "2025-03-01T12:00:00+00:00"
  command: dhelix profile lab.dhx -o lab.yaml --backend nccl --repeats 5
  repeats: 5
  mesh: {tp: 8, pp: 2}
  shapes: {qkv: "[8192, 4096] -> [8192, 768] weight [4096, 768]"}
  ops:""")


def test_stamp_mesh_and_shapes_of_the_measured_section_parse():
    measured = parse_profile(MINIMAL + STAMPED, "lab.yaml").measured
    assert measured.stamp["machine"] == "lab1: NVIDIA H100 80GB HBM3" and measured.stamp["torch"] == "2.5.1"
    assert measured.stamp["backend"] == "nccl" and measured.repeats == 5
    assert measured.mesh == {"tp": 8, "pp": 2}
    assert measured.shapes == {"qkv": "[8192, 4096] -> [8192, 768] weight [4096, 768]"}


def test_stamp_mesh_and_shapes_are_validated():
    text = MINIMAL + STAMPED.replace("repeats: 5", "repeats: five").replace("{tp: 8, pp: 2}", "{tp: 0, pq: 2}") \
        .replace('{qkv: "[8192', '{qkv: ["8192').replace('768]"}', '768]"]}').replace("torch: 2.5.1", "torch: [2]")
    assert error_of(text) == """\
lab.yaml:16:10: 'measured.torch' must be a string, got a list
  16 |   torch: [2]
     |          ^^^
lab.yaml:20:12: 'measured.repeats' must be a whole number, got a string 'five'
  20 |   repeats: five
     |            ^^^^
lab.yaml:21:14: 'measured.mesh.tp' must be at least 1, got 0
  21 |   mesh: {tp: 0, pq: 2}
     |              ^
lab.yaml:21:17: unknown key 'pq' in measured.mesh
  21 |   mesh: {tp: 0, pq: 2}
     |                 ^^
  note: did you mean 'pp'?
  note: keys here: tp, cp, dp, pp, ep
lab.yaml:22:17: 'measured.shapes.qkv' must be a string, got a list
  22 |   shapes: {qkv: ["8192, 4096] -> [8192, 768] weight [4096, 768]"]}
     |                 ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
5 errors"""


@pytest.mark.parametrize("name", ["a100", "a40", "a800", "h100", "h200"])
def test_written_profiles_read_back_equal(name):
    profile = load_profile(name)
    text = render_profile(profile, {"hbm_gbps": "[spec] a note"}, ["a header"])
    assert text.startswith("# a header\nname: ") and "hbm_gbps: " in text and "   # [spec] a note\n" in text
    assert parse_profile(text, "copy.yaml") == profile


def test_a_written_measured_section_reads_back_equal():
    profile = parse_profile(MINIMAL + STAMPED, "lab.yaml")
    assert parse_profile(render_profile(profile), "copy.yaml") == profile


def test_a_profile_reads_and_writes_its_host_cores():
    import attrs

    from dhelix.dsl.frontend.host_cores import HostCores

    # Measured on GPUs, the shipped profiles have no cores: the simulator's bound is off there.
    assert all(load_profile(name).cores is None for name in profile_names())
    profile = attrs.evolve(load_profile("a100"), cores=HostCores(usable=2, ranks=4, comm_busy=0.375))
    text = render_profile(profile)
    assert "cores:\n  usable: 2\n  ranks: 4\n  comm_busy: 0.375\n" in text
    assert parse_profile(text, "copy.yaml") == profile
    assert parse_profile(text, "copy.yaml").cores.ranks_on_host(2) == 2  # at most the world


def test_wrong_host_cores_are_located_errors():
    text = render_profile(load_profile("a100")) + "\ncores:\n  usable: 0\n  ranks: 2.5\n  comm_busy: 1.5\n  speed: 3\n"
    with pytest.raises(DhelixError) as info:
        parse_profile(text, "bad.yaml")
    message = str(info.value)
    assert "bad.yaml:" in message
    assert "'cores.usable' must be at least 1" in message
    assert "'cores.ranks' must be a whole number" in message
    assert "'cores.comm_busy' must be at most 1" in message
    assert "unknown key 'speed' in cores" in message
