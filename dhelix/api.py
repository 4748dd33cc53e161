"""The Python API: a program, its single-process model, checkpoints, logits and generation.

For scripts and notebooks; the command line is built on the same functions::

    from dhelix import api

    program = api.load_program("model.dhx")
    model = api.reference_model(program, checkpoint="out/checkpoint")   # or hf="hf_dir", or seeded
    logits = api.logits(model, torch.tensor([[1, 2, 3]]))                # [batch, seq, vocab]
    ids = api.generate(model, [72, 105], max_new=20)                      # greedy by default
    api.export_hf(program, "out/checkpoint", "hf_out")                   # config.json + safetensors

The model is :class:`~dhelix.interpreter.verify.reference.ReferenceModel`: plain torch on one
process, the layer DAG without model parallelism, the weights full. Generation runs the whole
prefix again for every new token (no key-value cache): meant to see what a model learned,
not to serve it. Everything raises :class:`~dhelix.dsl.core.errors.DhelixError` subclasses
for bad input; nothing prints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from dhelix.dsl.core.program import Program
from dhelix.dsl.frontend.hfconfig import generation_config_of, hf_config_of
from dhelix.dsl.frontend.imports import read_source
from dhelix.dsl.passes.overrides import require_model
from dhelix.dsl.passes.pipeline import check_text
from dhelix.interpreter.training.checkpoint import read_weights
from dhelix.interpreter.ops.hf_weights import TOKENIZER_FILES, check_llama, hf_state, write_hf
from dhelix.interpreter.verify.reference import ReferenceModel
from dhelix.interpreter.ops.weights import WeightPlan, torch_dtype

#: ``export_hf``'s largest safetensors file before it shards (Hugging Face's default, 5 GB).
SHARD_BYTES = 5 * 10**9

__all__ = ["load_program", "reference_model", "load_checkpoint", "logits", "generate", "export_hf",
           "SHARD_BYTES"]


def load_program(path: str, text: str | None = None) -> Program:
    """The checked program of the file ``path`` (or of ``text``, shown as ``path``); it must
    have a model block."""
    program = check_text(read_source(path) if text is None else text, path)
    require_model(program, path)
    return program


def reference_model(program: Program, *, seed: int = 0, hf: str | None = None,
                    checkpoint: str | None = None) -> ReferenceModel:
    """The single-process fp32 model of ``program`` in eval mode: seeded weights (``seed``, as
    ``dhelix run --seed``), a Hugging Face checkpoint folder's (``hf``) or the last save of a
    ``dhelix run --save`` folder (``checkpoint``)."""
    model = ReferenceModel(program, seed, hf=hf)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model.eval()


def load_checkpoint(model: ReferenceModel, checkpoint: str) -> dict:
    """Copy the weights of the last save under ``checkpoint`` into ``model``; returns the
    save's metadata (``step``, ``seed``, …)."""
    weights, meta = read_weights(checkpoint, model.plan)
    with torch.no_grad():
        for name, param in model.params.items():
            param.copy_(weights[name])
    return meta


def logits(model: ReferenceModel, ids: torch.Tensor) -> torch.Tensor:
    """The next-token logits ``[batch, seq, vocab]`` of ``ids`` ``[batch, seq]`` (no gradient)."""
    with torch.no_grad():
        return model.logits(ids)


def generate(model: ReferenceModel, prompt: Sequence[int], max_new: int = 50, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, stop: int | None = None) -> list[int]:
    """``prompt`` followed by up to ``max_new`` generated token ids: the most likely next
    token (``temperature`` 0, the default), else one drawn from the softmax at
    ``temperature`` among the smallest set of tokens whose probability reaches ``top_p``
    (seeded by ``seed``); it stops early after the token ``stop``."""
    if not prompt:
        raise ValueError("generation needs a prompt of at least one token")
    ids, gen = list(prompt), torch.Generator().manual_seed(seed)
    for _ in range(max_new):
        last = logits(model, torch.tensor([ids]))[0, -1].double()
        ids.append(_pick(last, temperature, top_p, gen))
        if ids[-1] == stop:
            break
    return ids


def _pick(scores: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """The next token from one position's logits ``scores`` (greedy, or nucleus sampling)."""
    if temperature <= 0:
        return int(scores.argmax())
    probs = torch.softmax(scores / temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    keep = ordered.cumsum(0) - ordered < top_p  # the tokens before the mass reaches top_p, and the one that does
    ordered = ordered * keep
    return int(order[torch.multinomial(ordered / ordered.sum(), 1, generator=gen)])


def export_hf(program: Program, checkpoint: str, folder: str, shard_bytes: int = SHARD_BYTES, *,
              tokenizer: str | None = None) -> list[Path]:
    """Write the last save under ``checkpoint`` as a Hugging Face folder (``config.json`` of a
    ``LlamaForCausalLM``, or a ``Qwen2ForCausalLM`` for layer ``qwen2_rope``;
    ``generation_config.json``; ``model.safetensors`` or its shards above ``shard_bytes``
    with their index) in the program's dtype, with the ``tokenizer`` (a ``tokenizer.json``)
    and the tokenizer files beside it; returns the files written (``config.json`` among
    them). HFWeightsError when the program's layer is not Llama's."""
    plan = WeightPlan(program)
    numerics = check_llama(plan)
    weights, _ = read_weights(checkpoint, plan)
    config = hf_config_of(program.model, numerics["norm_inv_eps"], numerics["rope_theta"], numerics["scaling"],
                          qkv_bias=numerics["qkv_bias"])
    extra: dict[str, str | Path] = {"generation_config.json": json.dumps(generation_config_of(program.model),
                                                                          indent=2) + "\n"}
    if tokenizer is not None:
        beside = Path(tokenizer).parent
        extra.update({name: beside / name for name in TOKENIZER_FILES if (beside / name).is_file()})
        extra["tokenizer.json"] = Path(tokenizer)
    return write_hf(Path(folder), config, hf_state(plan, weights, torch_dtype(program)), shard_bytes, extra)
