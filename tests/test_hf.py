"""Hugging Face Llama models in and out: `dhelix new --hf`, `dhelix run --init`, `dhelix export
--hf`, checked against `transformers` itself on a tiny random model (fp32, no network)."""

from __future__ import annotations

import json

import pytest
from commands import dhelix_here

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dhelix import api  # noqa: E402
from dhelix.cli.main import main  # noqa: E402
from dhelix.interpreter.training.data import DataSource  # noqa: E402
from dhelix.interpreter.ops.weights import WeightPlan  # noqa: E402

TOL = 1e-5
SEQ = 16


def tiny_config(**changes):
    fields = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_theta=10000.0)
    fields.update(changes)
    return transformers.LlamaConfig(**fields)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random tiny LlamaForCausalLM saved in shards (so --init reads through the index)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config()).float().eval()
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def new_program(hf_dir, out, *args) -> str:
    assert main(["new", "--hf", str(hf_dir / "config.json"), "--seq", str(SEQ), "-o", str(out), *args]) == 0
    return str(out)


def hf_model(folder):
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_new_writes_a_checked_canonical_program(hf_dir, tmp_path, capsys):
    path = new_program(hf_dir, tmp_path / "tiny.dhx", "--gpus", "4", "--pp", "2")
    assert main(["fmt", path, "--check"]) == 0
    assert main(["check", path]) == 0
    program = api.load_program(path)
    get = program.model.get
    assert (get("layers"), get("hidden"), get("ffn"), get("heads"), get("kv_heads"), get("vocab")) == (2, 64, 128, 4, 2, 256)
    assert (get("rope_theta"), get("norm_inv_eps"), program.model.layer) == (10000, 1000000, "llama_rope")
    assert (program.mesh.size("tp"), program.mesh.size("pp"), program.mesh.size("dp")) == (2, 2, 1)
    # Never over a file that exists, nor over the configuration it reads.
    assert main(["new", "--hf", str(hf_dir / "config.json"), "-o", path]) == 2
    assert main(["new", "--hf", str(hf_dir / "config.json"), "-o", str(hf_dir / "config.json")]) == 2
    assert "the file exists" in capsys.readouterr().err


def test_new_names_each_field_the_layers_cannot_compute(tmp_path, capsys):
    config = tiny_config(mlp_bias=True, rms_norm_eps=3e-6, attention_bias=True)
    config.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert main(["new", "--hf", str(tmp_path / "config.json"), "-o", str(tmp_path / "m.dhx")]) == 1
    err = capsys.readouterr().err
    for field in ("mlp_bias", "rms_norm_eps", "attention_bias"):
        line = next(i for i, row in enumerate(text.splitlines(), 1) if f'"{field}"' in row)
        assert f"config.json:{line}:3: {field}" in err
    assert "3 errors" in err and not (tmp_path / "m.dhx").exists()


def test_each_rank_reads_exactly_its_shard(hf_dir, tmp_path):
    path = new_program(hf_dir, tmp_path / "tp2.dhx", "--gpus", "2")
    program = api.load_program(path)
    plan = WeightPlan(program, hf=str(hf_dir))
    for name in plan.names():
        spec = plan.spec(name)
        full = plan.full(name)
        for rank in range(2):
            assert torch.equal(plan.shard(name, {"tp": rank}), spec.take(full, rank, 2 if spec.axis else 1)), name


def test_a_mismatched_checkpoint_names_the_tensor_and_both_shapes(tmp_path):
    small, large = tmp_path / "small", tmp_path / "large"
    transformers.LlamaForCausalLM(tiny_config()).save_pretrained(small)
    path = new_program(small, tmp_path / "m.dhx")
    transformers.LlamaForCausalLM(tiny_config(intermediate_size=96)).save_pretrained(large)
    with pytest.raises(Exception, match=r"model.layers.0.mlp.gate_proj.weight: the checkpoint has \[96, 64\], "
                                        r"the program's layers.0.fc1 needs \[128, 64\]"):
        WeightPlan(api.load_program(path), hf=str(large))


def test_a_missing_shard_is_named(hf_dir, tmp_path):
    import shutil

    from dhelix.interpreter.ops.hf_weights import HFWeightsError

    folder = tmp_path / "copy"
    shutil.copytree(hf_dir, folder)
    shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    (folder / shard).unlink()
    path = new_program(folder, tmp_path / "m.dhx")
    with pytest.raises(HFWeightsError, match=f"cannot read .* from '.*{shard}'"):
        WeightPlan(api.load_program(path), hf=str(folder))


def test_reference_logits_equal_transformers(hf_dir, tmp_path):
    program = api.load_program(new_program(hf_dir, tmp_path / "m.dhx"))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    ours = api.logits(api.reference_model(program, hf=str(hf_dir)), ids)
    with torch.no_grad():
        theirs = hf_model(hf_dir)(ids).logits
    assert (ours - theirs).abs().max() < TOL


def test_llama3_rope_scaling_in_and_out(tmp_path):
    """Llama 3.1's RoPE scaling: the configuration becomes layer llama3_rope, whose logits are
    transformers'; the exported configuration and weights give them back."""
    from dhelix.interpreter.ops.hf_weights import check_llama, hf_state, write_hf
    from dhelix.dsl.frontend.hfconfig import hf_config_of

    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    torch.manual_seed(1)
    theirs = transformers.LlamaForCausalLM(tiny_config(rope_parameters=scaling, rms_norm_eps=1e-5)).eval()
    theirs.save_pretrained(tmp_path / "in")
    program = api.load_program(new_program(tmp_path / "in", tmp_path / "m.dhx"))
    assert program.model.layer == "llama3_rope" and program.model.get("rope_original") == 16
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(2))
    ours = api.reference_model(program, hf=str(tmp_path / "in"))
    with torch.no_grad():
        expected = theirs(ids).logits
    assert (api.logits(ours, ids) - expected).abs().max() < TOL
    numerics = check_llama(ours.plan)
    config = hf_config_of(program.model, numerics["norm_inv_eps"], numerics["rope_theta"], numerics["scaling"])
    full = {name: p.detach() for name, p in ours.params.items()}
    write_hf(tmp_path / "out", config, hf_state(ours.plan, full, torch.float32), 10**9)
    with torch.no_grad():
        assert (hf_model(tmp_path / "out")(ids).logits - expected).abs().max() < TOL


def test_new_refuses_other_rope_scaling(tmp_path, capsys):
    tiny_config(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}).save_pretrained(tmp_path)
    assert main(["new", "--hf", str(tmp_path / "config.json"), "-o", str(tmp_path / "m.dhx")]) == 1
    assert 'RoPE scaling of type "linear" is not computed' in capsys.readouterr().err


def run(*args):
    done = dhelix_here("run", *args, cwd=None, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.parametrize("layout", [("--gpus", "4", "--pp", "2"), ("--gpus", "4", "--tp", "2")],
                         ids=["tp2_pp2", "tp2_dp2"])
def test_init_first_step_loss_equals_transformers_and_export_loads_back(hf_dir, tmp_path, layout):
    path = new_program(hf_dir, tmp_path / "m.dhx", *layout, "--microbatches", "2")
    log, ckpt, out = tmp_path / "log.jsonl", tmp_path / "ck", tmp_path / "hf_out"
    run(path, "--init", str(hf_dir), "--steps", "2", "--lr", "1e-2", "--seed", "0", "--log", str(log),
        "--save", str(ckpt))
    first = next(json.loads(line)["loss"] for line in log.read_text().splitlines() if '"loss"' in line)
    program = api.load_program(path)
    batch = DataSource(program, program.mesh.size("dp"), 0).batch(0)
    with torch.no_grad():
        scores = hf_model(hf_dir)(batch.inputs.reshape(-1, SEQ)).logits
    expected = torch.nn.functional.cross_entropy(scores.reshape(-1, 256), batch.targets.reshape(-1))
    assert abs(first - expected.item()) < TOL
    # The trained weights out, loaded by transformers: the same logits as the checkpoint's own model.
    assert main(["export", path, "--checkpoint", str(ckpt), "--hf", str(out), "--max-shard-size", "0.1"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    ids = batch.inputs[0]
    trained = hf_model(out)
    with torch.no_grad():
        theirs = trained(ids).logits
        moved = (trained.model.embed_tokens.weight - hf_model(hf_dir).model.embed_tokens.weight).abs().max()
    assert moved > 1e-3  # two steps of training are in what was exported
    ours = api.logits(api.reference_model(program, checkpoint=str(ckpt)), ids)
    assert (ours - theirs).abs().max() < TOL
    # The save keeps its program: the checkpoint alone generates (byte-level text, 3 new tokens).
    assert main(["generate", str(ckpt), "--prompt", "ab", "--max-new", "3"]) == 0


def test_tied_embeddings_train_as_transformers_does_and_go_back_out_tied(tmp_path):
    """tie_word_embeddings: the program ties its LM head to the embedding (tp 2 x pp 2, fold u:
    both on pipeline rank 0); the first step's loss is transformers', and so is the second's
    after one AdamW step of transformers' own tied model (the two copies' gradients summed);
    the export is tied again (no lm_head tensor) and gives the checkpoint's logits."""
    torch.manual_seed(3)
    theirs = transformers.LlamaForCausalLM(tiny_config(tie_word_embeddings=True, num_hidden_layers=4)).float()
    theirs.save_pretrained(tmp_path / "in")
    path = new_program(tmp_path / "in", tmp_path / "m.dhx", "--gpus", "4", "--pp", "2", "--microbatches", "4")
    program = api.load_program(path)
    assert program.model.get("tie_embeddings") == 1 and program.fold.kind == "u"
    log, ckpt, out = tmp_path / "log.jsonl", tmp_path / "ck", tmp_path / "out"
    run(path, "--init", str(tmp_path / "in"), "--steps", "2", "--lr", "1e-3", "--lr-decay", "constant", "--seed", "0",
        "--log", str(log), "--save", str(ckpt))
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines() if '"loss"' in line]
    source = DataSource(program, program.mesh.size("dp"), 0)
    assert losses == pytest.approx(_adamw_losses(theirs, source, steps=2), abs=TOL)
    assert main(["export", path, "--checkpoint", str(ckpt), "--hf", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", framework="pt") as handle:
        assert "lm_head.weight" not in handle.keys()
    ids = source.batch(0).inputs[0]
    with torch.no_grad():
        back = hf_model(out)(ids).logits
    assert (api.logits(api.reference_model(program, checkpoint=str(ckpt)), ids) - back).abs().max() < TOL


def test_tied_embeddings_on_pipeline_ranks_apart_are_refused_at_the_setting(tmp_path, capsys):
    tiny_config(tie_word_embeddings=True).save_pretrained(tmp_path)
    new_program(tmp_path, tmp_path / "m.dhx")
    text = (tmp_path / "m.dhx").read_text().replace("mesh {\n  tp = 1\n}", "mesh {\n  pp = 2\n}")
    text = text.replace("gpus_per_node = 1", "gpus_per_node = 2").replace("fold u", "fold none")
    (tmp_path / "pp2.dhx").write_text(text)
    assert main(["check", str(tmp_path / "pp2.dhx")]) == 1
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith("fold none"))
    err = capsys.readouterr().err
    assert f"pp2.dhx:{line}:1: tie_embeddings = 1 with fold none on 2 pipeline ranks: the embedding" in err
    (tmp_path / "two.dhx").write_text(text.replace("tie_embeddings = 1", "tie_embeddings = 2"))
    assert main(["check", str(tmp_path / "two.dhx")]) == 1
    assert "tie_embeddings = 2: write tie_embeddings = 1 for an LM head tied to the embedding" in \
        capsys.readouterr().err
    # `dhelix new` does not write such a program: its --pp is the mistake.
    assert main(["new", "--hf", str(tmp_path / "config.json"), "--gpus", "2", "--pp", "2", "-o",
                 str(tmp_path / "n.dhx")]) == 2
    assert "--pp 2: the configuration ties its embeddings" in capsys.readouterr().err


def test_tied_embeddings_match_the_reference_under_zero1_and_clipping(tmp_path):
    """tp 2 x dp 2 with ZeRO-1 and clipping: every step's gradients (the two copies' summed)
    and update equal the reference's, whose norm counts the tied weight once."""
    torch.manual_seed(4)
    transformers.LlamaForCausalLM(tiny_config(tie_word_embeddings=True)).save_pretrained(tmp_path)
    path = new_program(tmp_path, tmp_path / "m.dhx", "--gpus", "4", "--tp", "2", "--microbatches", "2")
    done = run(path, "--zero1", "--clip", "0.05", "--steps", "2", "--check")
    assert done.stdout.count("max update diff") == 2


def test_qwen2_q_k_v_biases_train_as_transformers_does_and_go_back_out(tmp_path):
    """Qwen2's q/k/v biases (layer qwen2_rope: the qkv weight's last row, split over tp with
    its columns): under tp 2 x pp 2 the first two steps' losses are those of transformers'
    Qwen2ForCausalLM trained by torch.optim.AdamW (so the bias gradients are), and the export
    loads back as Qwen2ForCausalLM with the checkpoint's logits."""
    torch.manual_seed(5)
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=256,
                                      max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)
    theirs = transformers.Qwen2ForCausalLM(config).float()
    with torch.no_grad():  # biases away from their zero initialisation
        for name, param in theirs.named_parameters():
            if name.endswith(".bias"):
                param.normal_()
    theirs.save_pretrained(tmp_path / "in")
    path = new_program(tmp_path / "in", tmp_path / "m.dhx", "--gpus", "4", "--pp", "2", "--microbatches", "2")
    program = api.load_program(path)
    assert program.model.layer == "qwen2_rope"
    log, ckpt, out = tmp_path / "log.jsonl", tmp_path / "ck", tmp_path / "out"
    run(path, "--init", str(tmp_path / "in"), "--steps", "2", "--lr", "1e-3", "--lr-decay", "constant", "--seed", "0",
        "--log", str(log), "--save", str(ckpt))
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines() if '"loss"' in line]
    source = DataSource(program, program.mesh.size("dp"), 0)
    assert losses == pytest.approx(_adamw_losses(theirs, source, steps=2), abs=TOL)
    assert main(["export", path, "--checkpoint", str(ckpt), "--hf", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    ids = source.batch(0).inputs[0]
    with torch.no_grad():
        back = transformers.Qwen2ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
        trained = theirs.eval()(ids).logits
    ours = api.logits(api.reference_model(program, checkpoint=str(ckpt)), ids)
    assert (ours - back).abs().max() < TOL
    assert (ours - trained).abs().max() < 1e-4  # two AdamW steps apart from transformers' own


def test_new_refuses_qwen2_with_llama3_scaling_and_a_tie_that_is_not_a_boolean(tmp_path, capsys):
    scaling = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    text = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, num_hidden_layers=2, vocab_size=256,
                                    rope_parameters=scaling).to_json_string()
    (tmp_path / "config.json").write_text(text.replace('"tie_word_embeddings": false', '"tie_word_embeddings": 1'))
    assert main(["new", "--hf", str(tmp_path / "config.json"), "-o", str(tmp_path / "m.dhx")]) == 1
    err = capsys.readouterr().err
    assert "Qwen2 with Llama 3's RoPE scaling is not computed" in err
    assert "tie_word_embeddings = 1: true or false was expected" in err


def test_a_gemm_bias_is_one_or_absent_and_never_on_a_row_parallel_gemm(tmp_path):
    from dhelix.dsl.core.errors import DhelixError
    from dhelix.dsl.passes.pipeline import check_text
    from dhelix.interpreter.ops.weights import ShardingError

    from conftest import tiny_example_text

    text = tiny_example_text().replace("layer = llama\n", "layer = biased\n") + """
layer biased {
  in x [tokens / tp, hidden]
  ag = all_gather(x, tp)
  up = gemm(ag, hidden, ffn / tp, bias = BIAS_UP)
  down = gemm(up, ffn / tp, hidden, bias = BIAS_DOWN)
  rs = reduce_scatter(down, tp)
  out rs
}
"""
    with pytest.raises(DhelixError, match="bias = 2: write bias = 1 for a bias"):
        check_text(text.replace("BIAS_UP", "2").replace("BIAS_DOWN", "0"), str(tmp_path / "a.dhx"))
    program = check_text(text.replace("BIAS_UP", "1").replace("BIAS_DOWN", "1"), str(tmp_path / "b.dhx"))
    with pytest.raises(ShardingError, match="gemm down is row-parallel .* and has a bias"):
        WeightPlan(program)
    assert WeightPlan(check_text(text.replace("BIAS_UP", "1").replace("BIAS_DOWN", "0"),
                                 str(tmp_path / "c.dhx"))).spec("layers.0.up").full == (65, 128)


def _adamw_losses(theirs, source, steps: int) -> list[float]:
    """The first ``steps`` losses of transformers' model ``theirs`` trained on ``source``'s
    batches by torch's AdamW with the run's settings (lr 1e-3, constant, no weight decay)."""
    optimizer = torch.optim.AdamW(theirs.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses = []
    for step in range(steps):
        batch = source.batch(step)
        scores = theirs(batch.inputs.reshape(-1, SEQ)).logits
        loss = torch.nn.functional.cross_entropy(scores.reshape(-1, 256), batch.targets.reshape(-1))
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses


# --- Hugging Face in: what must not load silently (issue 53, items 8 and 9) -------------------

def _saved(folder, **config_changes):
    """A tiny random Llama (seed 0) saved in ``folder`` in one model.safetensors, its config.json
    changed by ``config_changes``."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_config()).save_pretrained(folder)
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        config.update(config_changes)
        rope = config.get("rope_parameters") or {}  # transformers 5 keeps rope_theta there
        rope.update({key: value for key, value in config_changes.items() if key in rope})
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory):
    """A tiny Llama in one model.safetensors, and the program made from it."""
    folder = _saved(tmp_path_factory.mktemp("single"))
    return folder, new_program(folder, folder.parent / "single.dhx")


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_a_broken_single_safetensors_is_a_located_error_not_a_traceback(single_dir, tmp_path, capsys, damage):
    import shutil

    from dhelix.interpreter.ops.hf_weights import HFWeightsError

    folder, path = single_dir
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"empty": b"", "truncated": data[: len(data) // 2], "garbage": b"\x07" * 64}[damage])
    with pytest.raises(HFWeightsError, match=f"cannot read '{weights}'"):
        api.reference_model(api.load_program(path), hf=str(broken))
    assert main(["generate", path, "--init", str(broken), "--max-new", "1"]) == 1
    err = capsys.readouterr().err
    assert f"error: cannot read '{weights}'" in err and "Traceback" not in err
    if damage == "truncated":  # `run --init` says so before any rank starts
        assert main(["run", path, "--init", str(broken), "--steps", "1"]) == 1
        assert f"error: cannot read '{weights}'" in capsys.readouterr().err


def test_quantized_weights_are_refused_naming_the_tensor_and_its_dtype(single_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from dhelix.interpreter.ops.hf_weights import HFWeightsError

    folder, path = single_dir
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"].to(torch.float8_e4m3fn)
    state["lm_head.weight"] = (state["lm_head.weight"] * 100).to(torch.int8)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFWeightsError) as info:
        WeightPlan(api.load_program(path), hf=str(tmp_path))
    text = info.value.render()
    assert "model.layers.0.mlp.down_proj.weight: the checkpoint stores it as F8_E4M3" in text
    assert "lm_head.weight: the checkpoint stores it as I8" in text


def test_new_refuses_a_quantization_config_at_the_field(tmp_path, capsys):
    config = tiny_config().to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2))
    assert main(["new", "--hf", str(tmp_path / "config.json"), "-o", str(tmp_path / "m.dhx")]) == 1
    line = next(i for i, row in enumerate((tmp_path / "config.json").read_text().splitlines(), 1)
                if '"quantization_config"' in row)
    assert f"config.json:{line}:3: quantization_config (fp8): quantized weights" in capsys.readouterr().err


@pytest.mark.parametrize(("field", "value", "shown"), [
    ("rope_theta", 500000.0, "rope_theta: the checkpoint's configuration has 500000, the program 10000 (rope_theta)"),
    ("num_hidden_layers", 4, "num_hidden_layers: the checkpoint's configuration has 4, the program 2 (layers)"),
    ("rms_norm_eps", 1e-5, "rms_norm_eps: the checkpoint's configuration has 1e-05, the program 1e-06 (norm_inv_eps)"),
])
def test_the_checkpoints_config_is_compared_with_the_program(single_dir, tmp_path, field, value, shown):
    from dhelix.dsl.core.errors import DhelixError

    folder, path = single_dir
    other = _saved(tmp_path / "other", **{field: value})
    with pytest.raises(DhelixError) as info:
        WeightPlan(api.load_program(path), hf=str(other))
    text = (other / "config.json").read_text()
    line, column = next((i, row.index(f'"{field}"') + 1) for i, row in enumerate(text.splitlines(), 1)
                        if f'"{field}"' in row)
    assert f"config.json:{line}:{column}: {shown}" in info.value.render()


def test_a_tied_program_refuses_a_checkpoint_with_its_own_lm_head(single_dir, tmp_path):
    from dhelix.dsl.core.errors import DhelixError

    folder, _ = single_dir
    tied = _saved(tmp_path / "tied", tie_word_embeddings=True)
    path = new_program(tied, tmp_path / "tied.dhx")
    untied = _saved(tmp_path / "untied")
    with pytest.raises(DhelixError, match=r"tie_word_embeddings: the checkpoint's configuration has an LM head of "
                                          r"its own \(lm_head.weight\), the program a tied LM head"):
        WeightPlan(api.load_program(path), hf=str(untied))
    (untied / "config.json").unlink()  # no configuration to compare: the tensor itself says so
    with pytest.raises(DhelixError, match=r"have an LM head of their own \(lm_head.weight\), which the program's "
                                          r"tied LM head \(tie_embeddings = 1\) would ignore"):
        WeightPlan(api.load_program(path), hf=str(untied))


def test_mistral_past_its_sliding_window_is_refused_or_warned(single_dir, tmp_path, capsys):
    from dhelix.dsl.core.errors import DhelixError

    folder, path = single_dir
    narrow = _saved(tmp_path / "narrow", model_type="mistral", sliding_window=SEQ // 2)
    with pytest.raises(DhelixError, match=f"sliding_window = {SEQ // 2} is shorter than the sequence"):
        WeightPlan(api.load_program(path), hf=str(narrow))
    window = _saved(tmp_path / "window", model_type="mistral", sliding_window=SEQ)
    assert main(["generate", path, "--init", str(window), "--prompt", "abc", "--max-new", str(SEQ)]) == 0
    assert f"warning: sliding_window = {SEQ} in '{window / 'config.json'}'" in capsys.readouterr().err


# --- Hugging Face out (issue 53, items 8 and 10) ----------------------------------------------

@pytest.fixture(scope="module")
def qwen2_save(tmp_path_factory):
    """A one-step `dhelix run --save` of a tiny Qwen2 (bos 5, eos 7, 256 positions) made by
    `dhelix new --hf` from a folder with a tokenizer."""
    folder = tmp_path_factory.mktemp("qwen2")
    transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=2, vocab_size=256, max_position_embeddings=256, bos_token_id=5,
                             eos_token_id=7).save_pretrained(folder)
    (folder / "tokenizer.json").write_text('{"model": {}}')
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<7>"}')
    path = new_program(folder, folder / "m.dhx")
    run(path, "--steps", "1", "--save", str(folder / "ck"))
    return folder, path


def test_export_keeps_the_sources_tokens_and_positions_and_its_tokenizer(qwen2_save, tmp_path, capsys):
    folder, path = qwen2_save
    out = tmp_path / "out"
    assert main(["export", path, "--checkpoint", str(folder / "ck"), "--hf", str(out),
                 "--tokenizer", str(folder / "tokenizer.json")]) == 0
    assert "Qwen2ForCausalLM; load with from_pretrained" in capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (5, 7, 256)
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 5, "eos_token_id": 7}
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == 7
    assert (out / "tokenizer_config.json").read_text() == '{"eos_token": "<7>"}'
    assert (out / "tokenizer.json").is_file()


def test_a_program_not_from_hugging_face_exports_its_sequence_at_least(qwen2_save, tmp_path):
    from dhelix.dsl.frontend.hfconfig import hf_config_of

    program = api.load_program(qwen2_save[1])
    get = program.model.get
    assert hf_config_of(program.model, None, None)["max_position_embeddings"] == 256
    settings = tuple((k, v) for k, v in program.model.settings if k not in ("max_positions", "bos_token", "eos_token"))
    plain = hf_config_of(type(program.model)(program.model.name, settings, program.model.dtype, program.model.layer),
                         None, None)
    assert plain["max_position_embeddings"] == get("seq") and "eos_token_id" not in plain


def test_an_export_whose_write_fails_is_an_error_and_leaves_nothing(qwen2_save, tmp_path, capsys, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    folder, path = qwen2_save

    def full(tensors, filename, metadata=None):  # what safetensors raises on a full disk
        raise SafetensorError(f'Error while serializing: I/O error: No space left on device (os error 28) at path '
                              f'"{filename}"')

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "out"
    assert main(["export", path, "--checkpoint", str(folder / "ck"), "--hf", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"error: cannot write '{out / 'model.safetensors'}': No space left on device" in err
    assert "Traceback" not in err and not out.exists()
