"""Text in and out: `--tokenizer tokenizer.json` for text data (documents separated by the
end-of-text id), byte-level text, and generation through `dhelix.api`."""

from __future__ import annotations

import pytest
from commands import dhelix_here

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

from dhelix import api  # noqa: E402
from dhelix.cli.main import main  # noqa: E402
from dhelix.interpreter.training.data import DataError, DataSpec, load_corpus  # noqa: E402
from dhelix.interpreter.training.tokenizer import ByteCodec, TokenizerError, codec  # noqa: E402

LINES = ["the pipeline folds into a u", "strands interleave the forward and the backward",
         "communication hides behind computation", "a tiny tokenizer trained in the test"]
PROGRAM = """
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m { layers = 2  hidden = 32  ffn = 64  heads = 4  kv_heads = 2  seq = 8  vocab = 256  dtype = fp32
          layer = llama_rope  rope_theta = 10000  norm_inv_eps = 100000 }
cluster { nodes = 1  gpus_per_node = 1 }
mesh { tp = 1 }
train { micro_batch = 1  microbatches = 2 }
fold none
pipeline one_f_one_b
"""


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A byte-level BPE tokenizer trained on LINES, with an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(LINES, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_a_trained_tokenizer_round_trips_text(tokenizer_file):
    text = codec(tokenizer_file, 1024)
    for line in LINES + ["unseen words: zebra quartz!"]:
        ids = text.encode(line)
        assert text.decode(ids) == line
    assert len(text.encode(LINES[0])) < len(LINES[0])  # merges learnt: fewer tokens than bytes
    assert text.end_of_text == 0
    with pytest.raises(TokenizerError, match="has 300 tokens, but the model's vocab is 256"):
        codec(tokenizer_file, 256)


def test_documents_are_separated_by_the_end_of_text_id(tokenizer_file, tmp_path):
    for i, line in enumerate(LINES):
        (tmp_path / f"doc{i}.txt").write_text(line * 3)
    corpus = load_corpus(DataSpec(str(tmp_path), tokenizer=tokenizer_file), 512, 8)
    stream = torch.cat([corpus.train.reshape(-1), corpus.held_out.reshape(-1)])
    text = codec(tokenizer_file, 512)
    first = text.encode(LINES[0] * 3)
    assert stream[:len(first)].tolist() == first and stream[len(first)] == text.end_of_text
    with pytest.raises(DataError, match="the model's vocab is 256"):
        load_corpus(DataSpec(str(tmp_path), tokenizer=tokenizer_file), 256, 8)


def test_byte_level_text_round_trips_and_marks_ids_past_a_byte():
    text = ByteCodec()
    assert text.decode(text.encode("héllo")) == "héllo"
    assert text.decode([104, 300, 105]) == "h\ufffdi"


def test_greedy_generation_follows_the_logits_and_sampling_is_seeded(tmp_path):
    path = tmp_path / "m.dhx"
    path.write_text(PROGRAM)
    model = api.reference_model(api.load_program(str(path)), seed=3)
    ids = api.generate(model, [10, 20], max_new=5)
    for n in range(2, 7):
        assert ids[n] == int(api.logits(model, torch.tensor([ids[:n]]))[0, -1].argmax())
    first = api.generate(model, [10, 20], max_new=6, temperature=1.0, top_p=0.9, seed=5)
    assert first == api.generate(model, [10, 20], max_new=6, temperature=1.0, top_p=0.9, seed=5)
    stop_at = ids.index(ids[3], 2)  # the first generated token equal to it ends the text
    assert api.generate(model, [10, 20], max_new=6, stop=ids[3]) == ids[:stop_at + 1]


def test_generate_command_prints_the_prompt_and_its_continuation(tmp_path, capsys):
    path = tmp_path / "m.dhx"
    path.write_text(PROGRAM)
    assert main(["generate", str(path), "--prompt", "Hi", "--max-new", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Hi") and len(out.encode()) >= 3
    assert main(["generate", str(path), "--prompt", "", "--max-new", "4"]) == 2
    assert main(["generate", str(tmp_path), "--max-new", "4"]) == 1  # a folder that is no checkpoint


def test_generate_command_decodes_with_the_tokenizer(tokenizer_file, tmp_path, capsys):
    path = tmp_path / "m.dhx"
    path.write_text(PROGRAM.replace("vocab = 256", "vocab = 512"))
    assert main(["generate", str(path), "--tokenizer", tokenizer_file, "--prompt", LINES[0], "--max-new", "3"]) == 0
    out = capsys.readouterr().out
    model = api.reference_model(api.load_program(str(path)))
    text = codec(tokenizer_file, 512)
    assert out == text.decode(api.generate(model, text.encode(LINES[0]), 3, stop=text.end_of_text)) + "\n"
    assert out.startswith(LINES[0])


def test_eval_data_is_held_out_whole_and_the_training_data_trained_on_whole(tmp_path):
    (tmp_path / "train.txt").write_text("abcdefghij" * 5)
    (tmp_path / "eval.txt").write_text("zyxwvutsrq" * 2)
    corpus = load_corpus(DataSpec(str(tmp_path / "train.txt")), 256, 8, DataSpec(str(tmp_path / "eval.txt")))
    assert corpus.train.shape == (50 // 9, 9) and corpus.held_out.shape == (20 // 9, 9)
    assert bytes(corpus.held_out[0].tolist()) == b"zyxwvutsr"


def test_run_trains_on_tokenized_text_and_evaluates_on_eval_data(tokenizer_file, tmp_path, capsys):
    import json

    path = tmp_path / "m.dhx"
    path.write_text(PROGRAM.replace("vocab = 256", "vocab = 512"))
    (tmp_path / "train").mkdir()
    for i, line in enumerate(LINES):
        (tmp_path / "train" / f"{i}.txt").write_text(line * 4)
    (tmp_path / "eval.txt").write_text(" ".join(LINES))
    log = tmp_path / "log.jsonl"
    done = dhelix_here("run", str(path), "--data", str(tmp_path / "train"), "--eval-data", str(tmp_path / "eval.txt"),
                       "--tokenizer", tokenizer_file, "--steps", "2", "--eval-every", "1", "--log", str(log),
                       cwd=None, timeout=300)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum("eval_loss" in r for r in records) == 2 and sum("loss" in r for r in records) == 2
    # Refused before any rank starts: the command says so (in this process).
    assert main(["run", str(path), "--tokenizer", tokenizer_file]) == 2
    assert "--tokenizer goes with training data" in capsys.readouterr().err
