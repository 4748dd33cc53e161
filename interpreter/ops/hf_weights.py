"""Hugging Face Llama weights in and out: the names, layouts and files of ``safetensors``.

A program whose layer is ``llama_rope`` (``dhelix new --hf``; any layer with the same op
names, norms, rotary attention and SwiGLU MLP) has the weights of ``LlamaForCausalLM``, one
to one. dhelix's matrices are ``[in, out]`` (``x @ W``), Hugging Face's ``[out, in]``
(``nn.Linear``), so each is the other's transpose; two of them are fused:

- ``layers.i.qkv`` = ``[q_proj.T | k_proj.T | v_proj.T]``: the attention reads q heads,
  then k heads, then v heads, each head-major, which is the order of the rows of Hugging
  Face's projections (and query head j reads kv head ``j // (heads / kv_heads)`` in both);
- ``layers.i.fc1`` = ``[gate_proj.T | up_proj.T]``: swiglu is ``silu(first half) * second``;
- Qwen2's ``layers.i.qkv`` (layer ``qwen2_rope``, a gemm with ``bias = 1``) has one more row,
  ``[q_proj.bias | k_proj.bias | v_proj.bias]`` (:func:`bias_parts`).

The rest map alone: ``ln1``/``ln2`` the input and post-attention norms, ``prj`` = ``o_proj.T``,
``fc2`` = ``down_proj.T``, ``embedding`` = ``embed_tokens``, ``final_norm`` = ``model.norm``,
``lm_head`` = ``lm_head.weight.T`` (with tied embeddings ``embed_tokens.T``, and not written
out: ``tie_word_embeddings`` says so).

:class:`HFWeights` reads a (sharded) checkpoint folder for ``dhelix run --init``: each rank
reads only the rows or columns of its own shard (``safe_open(...).get_slice``), whichever
blocks a tensor-parallel shard is made of (:class:`~.weights.ShardSpec`). :func:`write_hf`
writes full weights as ``config.json`` + ``model.safetensors`` (sharded above a size, with
``model.safetensors.index.json``) for ``dhelix export --hf``.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import torch

from dhelix.dsl.core.errors import DhelixError, OutputError
from dhelix.dsl.core.outputfile import write_atomically, write_text_atomically
from dhelix.dsl.core.textfile import FileProblem, read_text_file
from dhelix.dsl.frontend.hfconfig import COMPARED, LLAMA3_SCALING, compare_hf_config
from dhelix.dsl.frontend.modelcheck import TIE_SETTING

from .kernels import EPS
from .rope import rope_of
from .weights import EMBEDDING, FINAL_NORM, LM_HEAD

#: The ops of a layer whose weights are Hugging Face's, with their op kind and the tensors
#: (under ``model.layers.<i>.``) each is the concatenation of.
LAYER_PARTS = {
    "ln1": ("rmsnorm", ("input_layernorm.weight",)),
    "qkv": ("gemm", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    "prj": ("gemm", ("self_attn.o_proj.weight",)),
    "ln2": ("rmsnorm", ("post_attention_layernorm.weight",)),
    "fc1": ("gemm", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "fc2": ("gemm", ("mlp.down_proj.weight",)),
}
MODEL_PARTS = {EMBEDDING: "model.embed_tokens.weight", FINAL_NORM: "model.norm.weight", LM_HEAD: "lm_head.weight"}
SINGLE_FILE, INDEX, CONFIG = "model.safetensors", "model.safetensors.index.json", "config.json"
#: The safetensors element types read (converted to fp32); anything else (fp8, int8, uint8: a
#: quantized checkpoint's) would load as raw integers.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
#: A tokenizer's files beside its ``tokenizer.json``, copied with it by ``export --hf``.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
#: The fix a layer that is not Hugging Face's Llama is told.
LLAMA_ROPE_NOTE = "use the stdlib layer llama_rope, which a Hugging Face configuration becomes"


class HFWeightsError(DhelixError):
    """A program or a checkpoint whose weights do not map onto Hugging Face's Llama."""


def check_llama(plan) -> dict:
    """The rotary base, its Llama 3 scaling and the norm epsilon (``rope_theta``, ``scaling``,
    ``norm_inv_eps``) of ``plan``'s program, after checking that its layer has Llama's weights
    and numerics; HFWeightsError naming what differs."""
    fwd = plan.full_forward
    kinds = {op.name: op.op for op in fwd.ops if op.weight is not None}
    wanted = {name: kind for name, (kind, _) in LAYER_PARTS.items()}
    if kinds != wanted:
        raise HFWeightsError(f"layer {plan.program.model.layer} has the weights {_listing(kinds)}; Hugging Face's "
                             f"Llama maps onto {_listing(wanted)}", notes=[LLAMA_ROPE_NOTE])
    attention = [dict(op.params) for op in fwd.ops if op.op == "attention"]
    swiglu = any(op.op == "swiglu" for op in fwd.ops)
    if len(attention) != 1 or attention[0].get("rope") is None or not swiglu:
        raise HFWeightsError(f"layer {plan.program.model.layer} has no rotary attention with a SwiGLU MLP, which "
                             "Hugging Face's Llama computes", notes=[LLAMA_ROPE_NOTE])
    _, scaling = rope_of(attention[0])
    biased = sorted(op.name for op in fwd.ops if op.op == "gemm" and dict(op.params).get("bias"))
    if biased not in ([], ["qkv"]):
        raise HFWeightsError(f"layer {plan.program.model.layer} has a bias on {', '.join(biased)}; Hugging Face's "
                             "Llama has none and Qwen2 one on q, k and v only (qkv)",
                             notes=["use the stdlib layer llama_rope or qwen2_rope"])
    return {"rope_theta": attention[0]["rope"], "scaling": scaling, "norm_inv_eps": plan.norm_params.get("inv_eps"),
            "qkv_bias": bool(biased)}


def _listing(kinds: dict) -> str:
    return ", ".join(f"{name} ({kind})" for name, kind in sorted(kinds.items()))


def hf_parts(plan, name: str) -> list[tuple[str, tuple[int, ...], bool]]:
    """The Hugging Face tensors parameter ``name`` is made of, in order along dhelix's
    columns: (tensor name, its shape, whether it is dhelix's transpose). A gemm with a bias
    (Qwen2's qkv) has its bias row below: :func:`bias_parts`."""
    get = plan.program.model.get
    hidden, ffn, vocab = get("hidden"), get("ffn"), get("vocab")
    d = hidden // get("heads")
    if name in MODEL_PARTS:
        shape = (hidden,) if name == FINAL_NORM else (vocab, hidden)
        # A tied LM head is the embedding's transpose: the checkpoint holds embed_tokens only.
        tensor = MODEL_PARTS[EMBEDDING if name == LM_HEAD and plan.tied else name]
        return [(tensor, shape, name == LM_HEAD)]
    _, layer, op = name.split(".", 2)
    prefix = f"model.layers.{layer}."
    rows = {"self_attn.q_proj.weight": get("heads") * d, "self_attn.k_proj.weight": get("kv_heads") * d,
            "self_attn.v_proj.weight": get("kv_heads") * d, "self_attn.o_proj.weight": hidden,
            "mlp.gate_proj.weight": ffn, "mlp.up_proj.weight": ffn, "mlp.down_proj.weight": hidden}
    ins = {"self_attn.o_proj.weight": get("heads") * d, "mlp.down_proj.weight": ffn}
    parts = []
    for tensor in LAYER_PARTS[op][1]:
        shape = (hidden,) if tensor.endswith("layernorm.weight") else (rows[tensor], ins.get(tensor, hidden))
        parts.append((prefix + tensor, shape, len(shape) == 2))
    return parts


def bias_parts(plan, name: str) -> list[tuple[str, int]]:
    """The Hugging Face bias tensors (name, length) of parameter ``name``'s last row, in
    order along its columns, when it is a gemm with a bias (Qwen2's q, k and v); else none."""
    if not name.startswith("layers.") or not plan.spec(name).full[0] == _in_features(plan, name) + 1:
        return []
    return [(tensor.replace(".weight", ".bias"), shape[0]) for tensor, shape, _ in hf_parts(plan, name)]


def _in_features(plan, name: str) -> int:
    tensor, shape, transposed = hf_parts(plan, name)[0]
    return shape[-1] if transposed else shape[0]


class HFWeights:
    """A Hugging Face checkpoint folder (``model.safetensors`` or the shards its index names)
    read into ``plan``'s parameters. Construction checks every tensor's presence, shape and
    element type (floating point: quantized weights are refused), then the folder's
    ``config.json`` against the program (:func:`_compare_config`) and a tied program against
    an LM head of the checkpoint's own."""

    def __init__(self, folder: str, plan):
        from safetensors import safe_open

        self.folder, self.plan, self._open = Path(folder), plan, safe_open
        self.files = _weight_map(self.folder)
        numerics = check_llama(plan)
        problems = []
        for name in plan.names():
            wanted = [(tensor, shape) for tensor, shape, _ in hf_parts(plan, name)]
            for tensor, shape in wanted + [(bias, (length,)) for bias, length in bias_parts(plan, name)]:
                found, dtype = self._header(tensor)
                if found != shape:
                    problems.append(f"{tensor}: the checkpoint has {list(found) if found else 'no such tensor'}, "
                                    f"the program's {name} needs {list(shape)}")
                elif dtype not in FLOAT_DTYPES:
                    problems.append(f"{tensor}: the checkpoint stores it as {dtype}, which would load as raw "
                                    "integers (a quantized checkpoint: its scales are not applied)")
        if problems:
            raise HFWeightsError(f"the Hugging Face weights in '{folder}' do not fit this program: {problems[0]}"
                                 + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                                 notes=problems[1:4] + ["give the checkpoint of the configuration the program "
                                                        "was made from"])
        #: The configuration's ``sliding_window`` (None: none, or no configuration).
        self.sliding_window = _compare_config(self.folder, plan, numerics)
        if plan.tied and MODEL_PARTS[LM_HEAD] in self.files and not (self.folder / CONFIG).is_file():
            raise HFWeightsError(f"the Hugging Face weights in '{folder}' have an LM head of their own "
                                 f"({MODEL_PARTS[LM_HEAD]}), which the program's tied LM head (tie_embeddings = 1) "
                                 "would ignore", notes=["give a program with an LM head of its own (no tie_embeddings)"])

    def _header(self, tensor: str) -> tuple[tuple[int, ...] | None, str | None]:
        """The shape and safetensors element type of ``tensor`` (None, None: absent)."""
        file = self.files.get(tensor)
        if file is None:
            return None, None
        with _reading(file, tensor):
            with self._open(file, framework="pt") as handle:
                piece = handle.get_slice(tensor)
                return tuple(piece.get_shape()), piece.get_dtype()

    def _rows(self, tensor: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (``dim`` 0) or columns (1) ``start … stop-1`` of ``tensor``, as fp32."""
        with _reading(self.files[tensor], tensor):
            with self._open(self.files[tensor], framework="pt") as handle:
                piece = handle.get_slice(tensor)
                piece = piece[start:stop] if dim == 0 else piece[:, start:stop]
        return piece.float()

    def _range(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Parameter ``name`` in dhelix's layout, restricted to ``start … stop-1`` along ``dim``."""
        parts, pieces, offset = hf_parts(self.plan, name), [], 0
        biases = [bias for bias, _ in bias_parts(self.plan, name)] or [None] * len(parts)
        for (tensor, shape, transposed), bias in zip(parts, biases, strict=True):
            ours = shape[::-1] if transposed else shape
            if len(parts) > 1 and dim != len(ours) - 1:  # replicated fused parts: read whole
                pieces.append(self._with_bias(self._whole(tensor, shape, transposed), bias, 0, shape[0]))
                continue
            width = ours[dim]
            low, high = max(start, offset), min(stop, offset + width)
            offset += width
            if low < high:
                hf_dim = len(ours) - 1 - dim if transposed else dim
                piece = self._rows(tensor, hf_dim, low - (offset - width), high - (offset - width))
                pieces.append(self._with_bias(piece.t() if transposed else piece, bias,
                                              low - (offset - width), high - (offset - width)))
        joined = 1 if len(parts) > 1 else dim  # fused parts sit side by side along dhelix's columns
        return torch.cat(pieces, dim=joined) if len(pieces) > 1 else pieces[0].contiguous()

    def _with_bias(self, piece: torch.Tensor, bias: str | None, start: int, stop: int) -> torch.Tensor:
        """``piece`` (columns ``start … stop-1`` of a part) with its bias's as a last row."""
        if bias is None:
            return piece
        return torch.cat((piece, self._rows(bias, 0, start, stop)[None]))

    def _whole(self, tensor, shape, transposed) -> torch.Tensor:
        piece = self._rows(tensor, 0, 0, shape[0])
        return piece.t() if transposed else piece

    def full(self, name: str) -> torch.Tensor:
        """The full fp32 parameter ``name`` in dhelix's layout."""
        spec = self.plan.spec(name)
        return self._range(name, 0, 0, spec.full[0])

    def shard(self, name: str, index: int, parts: int) -> torch.Tensor:
        """This rank's piece of parameter ``name`` (the rank is ``index`` of ``parts`` along its
        spec's axis), reading only the slices it is made of."""
        spec = self.plan.spec(name)
        if spec.dim is None or parts == 1:
            return self.full(name)
        pieces, start = [], 0
        for block in spec.blocks:
            piece = block // parts
            pieces.append(self._range(name, spec.dim, start + index * piece, start + (index + 1) * piece))
            start += block
        return torch.cat(pieces, dim=spec.dim).contiguous()


@contextlib.contextmanager
def _reading(file: Path, tensor: str | None = None):
    """Reads of the safetensors ``file`` (of ``tensor``), their failures (a missing shard, a
    truncated, empty or garbage file: safetensors' own error types) as HFWeightsError."""
    try:
        yield
    except Exception as exc:
        what = f"{tensor} from '{file}'" if tensor else f"'{file}'"
        raise HFWeightsError(f"cannot read {what}: {(str(exc).splitlines() or [type(exc).__name__])[0][:200]}",
                             notes=["the folder's files are incomplete or corrupt"]) from None


def _weight_map(folder: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it, from the index or the single file."""
    from safetensors import safe_open

    index, single = folder / INDEX, folder / SINGLE_FILE
    try:
        if index.is_file():
            names = json.loads(index.read_text())["weight_map"]
            return {tensor: folder / file for tensor, file in names.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HFWeightsError(f"cannot read the Hugging Face weights in '{folder}': {exc}") from None
    if single.is_file():
        with _reading(single), safe_open(single, framework="pt") as handle:
            return {tensor: single for tensor in handle.keys()}
    raise HFWeightsError(f"'{folder}' has neither {SINGLE_FILE} nor {INDEX}",
                         notes=["give the folder a Hugging Face model was saved in (save_pretrained)"])


def _compare_config(folder: Path, plan, numerics: dict) -> int | None:
    """Check the folder's ``config.json`` (when it has one) against ``plan``'s program
    (:func:`~dhelix.dsl.frontend.hfconfig.compare_hf_config`: errors located at its fields);
    returns its ``sliding_window`` (None: none)."""
    path = folder / CONFIG
    if not path.is_file():
        return None
    try:
        text = read_text_file(str(path))
    except FileProblem as exc:
        raise HFWeightsError(f"cannot read '{path}': {exc.reason}") from None
    get = plan.program.model.get
    ours = {key: get(key) for key, _ in COMPARED[:6]}
    scaling = numerics["scaling"] or (None,) * len(LLAMA3_SCALING)
    ours.update({"rope_theta": numerics["rope_theta"], "norm_inv_eps": numerics["norm_inv_eps"] or round(1 / EPS),
                 TIE_SETTING: int(plan.tied)}, **{key: value for (key, _), value in zip(LLAMA3_SCALING, scaling,
                                                                                       strict=True)})
    compare_hf_config(text, str(path), ours, get("seq"))
    config = json.loads(text)
    window = config.get("sliding_window")
    return window if isinstance(window, int) and config.get("use_sliding_window", True) else None


def hf_state(plan, full: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hugging Face's state dict (in ``dtype``) of dhelix's full parameters ``full``."""
    state = {}
    for name in plan.names():
        if plan.tied and name == LM_HEAD:  # the copy of the embedding: written once, as embed_tokens
            continue
        offset, parts = 0, hf_parts(plan, name)
        biases = [bias for bias, _ in bias_parts(plan, name)] or [None] * len(parts)
        for (tensor, shape, transposed), bias in zip(parts, biases, strict=True):
            if len(parts) == 1:
                piece = full[name]
            else:
                piece = full[name].narrow(1, offset, shape[0])
                offset += shape[0]
            if bias is not None:  # the last row
                state[bias] = piece[-1].to(dtype).contiguous()
                piece = piece[:-1]
            state[tensor] = (piece.t() if transposed else piece).to(dtype).contiguous()
    return state


def write_hf(folder: Path, config: dict, state: dict[str, torch.Tensor], shard_bytes: int,
             extra: dict[str, str | Path] | None = None) -> list[Path]:
    """Write ``config.json`` and ``state`` into ``folder`` (created): one ``model.safetensors``,
    or above ``shard_bytes`` shards named like Hugging Face's with their index; and each of
    ``extra``, a file name → its text or the file to copy (``generation_config.json``, a
    tokenizer's files). Every file is written beside and renamed into place. Returns the
    files written; OutputError when one cannot be written, after removing those written (and
    the folder, when this made it)."""
    groups, size = [[]], 0
    for tensor, value in state.items():
        nbytes = value.numel() * value.element_size()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += nbytes
    names = [SINGLE_FILE] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    made, written = not folder.exists(), []
    try:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot make the folder '{folder}': {exc.strerror or exc}") from None
        for file, group in zip(names, groups, strict=True):
            write_atomically(folder / file, lambda path, g=group: _save_safetensors({t: state[t] for t in g}, path))
            written.append(folder / file)
        texts = {CONFIG: config}
        if len(groups) > 1:
            texts[INDEX] = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
                            "weight_map": {t: file for file, group in zip(names, groups, strict=True) for t in group}}
        for file, value in [*((f, json.dumps(v, indent=2) + "\n") for f, v in texts.items()), *(extra or {}).items()]:
            if isinstance(value, Path):
                write_atomically(folder / file, lambda path, source=value: shutil.copyfile(source, path))
            else:
                write_text_atomically(folder / file, value)
            written.append(folder / file)
    except OutputError as exc:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            if made:
                folder.rmdir()
        exc.add_note("the files written before were removed" if written else "nothing was written")
        raise
    return written


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``safetensors.torch.save_file`` with the format Hugging Face's loaders expect, raising
    OSError when the system refuses the write (safetensors raises its own error)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as exc:
        found = re.search(r"I/O error: (.*?) \(os error (\d+)\)", str(exc))
        if found is None:
            raise
        raise OSError(int(found[2]), found[1]) from None
