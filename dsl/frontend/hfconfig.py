"""A Hugging Face ``config.json`` of the Llama family as a dhelix model, and back.

:func:`read_hf_config` reads a Llama, Mistral or Qwen2 configuration into :class:`HFModel`,
the model settings of the stdlib layer ``llama_rope`` (RMSNorm with epsilon ``1 /
norm_inv_eps``, grouped-query attention with rotary embeddings of base ``rope_theta``, a
SwiGLU MLP, an LM head of its own or, with ``tie_word_embeddings``, the embedding's transpose:
``tie_embeddings = 1``), or of ``llama3_rope`` (the same with Llama 3's RoPE scaling)
for a ``rope_type`` "llama3" configuration, or of ``qwen2_rope`` (``llama_rope`` with Qwen2's
biases on q, k and v) for a Qwen2 one. Whatever the layers cannot compute is an error located
at the configuration's field (``config.json:12:3``) naming it: biases on every attention
projection or on the MLP, other RoPE scaling, a sliding window shorter than the sequence,
another activation, a ``head_dim`` other than ``hidden / heads``. Every problem is collected
and raised at once.

:func:`hf_config_of` is the inverse for ``dhelix export --hf``: the ``LlamaConfig`` fields of
a program's model. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import json
import math
import re

import attrs

from dhelix.dsl.core.errors import CheckError, ErrorCollector
from dhelix.dsl.core.span import Source, Span
from dhelix.dsl.frontend.modelcheck import TIE_SETTING

#: The ``model_type`` values read, computed by ``llama_rope`` (Qwen2: ``qwen2_rope``) with the same weights.
MODEL_TYPES = ("llama", "mistral", "qwen2")
#: The layer a configuration becomes (stdlib/layers.dhx).
LAYER = "llama_rope"
#: The layer of a Qwen2 configuration: ``llama_rope`` with a bias on q, k and v.
QWEN2_LAYER = "qwen2_rope"
#: The layer of a configuration with Llama 3's RoPE scaling, and its four extra settings with
#: the configuration's names for them.
LLAMA3_LAYER = "llama3_rope"
LLAMA3_SCALING = (("rope_factor", "factor"), ("rope_low_freq", "low_freq_factor"),
                  ("rope_high_freq", "high_freq_factor"), ("rope_original", "original_max_position_embeddings"))
#: The model settings of the special token ids a configuration gives, with its names for them.
SPECIAL_TOKENS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"))
#: The model settings a Hugging Face checkpoint's configuration must agree on with the program
#: it is loaded into, with the configuration's fields (:func:`compare_hf_config`).
COMPARED = (("layers", "num_hidden_layers"), ("hidden", "hidden_size"), ("ffn", "intermediate_size"),
            ("heads", "num_attention_heads"), ("kv_heads", "num_key_value_heads"), ("vocab", "vocab_size"),
            ("rope_theta", "rope_theta"), ("norm_inv_eps", "rms_norm_eps"), (TIE_SETTING, "tie_word_embeddings"),
            *((ours, "rope_scaling") for ours, _ in LLAMA3_SCALING))
#: Hugging Face's ``torch_dtype`` / ``dtype`` names → dhelix dtypes.
HF_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
#: Defaults of the fields a configuration may leave out (LlamaConfig's).
DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "rope_scaling": None, "max_position_embeddings": 2048}


@attrs.frozen
class HFModel:
    """A configuration's model: ``settings`` in the order a model block lists them (integers,
    and ``dtype``), ``model_type``, ``max_seq`` (``max_position_embeddings``) and the stdlib
    ``layer`` that computes it."""

    settings: tuple[tuple[str, object], ...]
    model_type: str
    max_seq: int
    layer: str = LAYER

    def get(self, key: str):
        """The setting ``key`` (None when absent)."""
        return dict(self.settings).get(key)


def key_span(source: Source, key: str) -> Span:
    """Where ``"key":`` is written in the JSON ``source`` (the first occurrence), else the
    first character of the file."""
    match = re.search(r'"%s"\s*:' % re.escape(key), source.text)
    if match is None:
        return Span(source, 1, 1, 1, 1)
    line = source.text.count("\n", 0, match.start()) + 1
    column = match.start() - (source.text.rfind("\n", 0, match.start()) + 1) + 1
    return Span(source, line, column, line, column + len(key) + 1)


def read_hf_config(text: str, path: str, seq: int | None = None) -> HFModel:
    """The model of the configuration ``text`` (the file ``path``) for sequences of ``seq``
    tokens (default: ``max_position_embeddings``, at most 4096). Raises CheckError (an
    ErrorGroup for several) located at the fields this layer cannot compute."""
    source = Source(path, text)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckError(f"not a JSON file: {exc.msg}", Span(source, exc.lineno, exc.colno, exc.lineno, exc.colno),
                         ["give the config.json of a Hugging Face model"]) from None
    if not isinstance(config, dict):
        raise CheckError("a config.json holds one JSON object", Span(source, 1, 1, 1, 1))
    errors = ErrorCollector()
    reader = _Reader(config, source, errors)
    model_type = reader.model_type()
    settings: list[tuple[str, object]] = [*reader.shape_settings()]
    max_seq = reader.integer("max_position_embeddings")
    seq = seq or min(max_seq or 4096, 4096)
    reader.refuse_unsupported(model_type, seq, settings)
    scaling = reader.rope_scaling()
    settings += [("seq", seq), ("rope_theta", reader.rope_theta()), *scaling, ("norm_inv_eps", reader.inv_eps())]
    settings += [(TIE_SETTING, 1)] if reader.value("tie_word_embeddings") is True else []
    settings += [(ours, value) for ours, value in (("max_positions", max_seq), *reader.special_tokens()) if value]
    settings += [("dtype", reader.dtype())]
    if model_type == "qwen2" and scaling:
        reader.fail("rope_scaling" if config.get("rope_scaling") else "rope_parameters",
                    "Qwen2 with Llama 3's RoPE scaling is not computed (no stdlib layer has both)")
    errors.raise_if_any()
    layer = QWEN2_LAYER if model_type == "qwen2" else LLAMA3_LAYER if scaling else LAYER
    return HFModel(tuple(settings), model_type, max_seq or seq, layer)


def compare_hf_config(text: str, path: str, program: dict[str, int | None], seq: int) -> None:
    """Check that the configuration ``text`` (the file ``path``, a Hugging Face checkpoint's)
    is the model of ``program``, a program's settings of :data:`COMPARED` (``tie_embeddings``
    0 or 1; ``rope_factor`` … None without Llama 3's scaling) training sequences of ``seq``
    tokens. Raises CheckError (an ErrorGroup for several) located at each field the layers
    cannot compute (:func:`read_hf_config`: a sliding window shorter than ``seq``, quantized
    weights) or whose value differs from the program's."""
    theirs = dict(read_hf_config(text, path, seq).settings)
    source, errors = Source(path, text), ErrorCollector()
    for ours, field in COMPARED:
        mine, found = program.get(ours), theirs.get(ours, 0 if ours == TIE_SETTING else None)
        if mine != found:
            errors.add(CheckError(f"{field}: the checkpoint's configuration has {_shown(ours, found)}, the program "
                                  f"{_shown(ours, mine)} ({ours})", key_span(source, field),
                                  ["the weights would load into another model; give the program made from this "
                                   "configuration"]))
    errors.raise_if_any()


def _shown(setting: str, value) -> str:
    if value is None:
        return "none"
    if setting == "norm_inv_eps":
        return f"{1 / value:g}"
    if setting == TIE_SETTING:
        return "a tied LM head" if value else "an LM head of its own (lm_head.weight)"
    return str(value)


@attrs.define
class _Reader:
    """The fields of one configuration, each problem recorded in ``errors`` at its field."""

    config: dict
    source: Source
    errors: ErrorCollector

    def fail(self, key: str, message: str, *notes: str) -> None:
        self.errors.add(CheckError(message, key_span(self.source, key), list(notes)))

    def value(self, key: str):
        return self.config.get(key, DEFAULTS.get(key))

    def integer(self, key: str, required: bool = False) -> int | None:
        value = self.config.get(key)
        if value is None:
            if required:
                self.fail(key, f"the configuration has no '{key}'", "Llama and Mistral configurations are read "
                          "(hidden_size, intermediate_size, num_attention_heads, …)")
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.fail(key, f"{key} = {json.dumps(value)}: a positive whole number was expected")
            return None
        return value

    def model_type(self) -> str:
        kind = self.config.get("model_type")
        if kind not in MODEL_TYPES:
            self.fail("model_type", f"model_type {json.dumps(kind)} is not of the Llama family",
                      f"the configurations read are {', '.join(MODEL_TYPES)}'s (layer {LAYER})")
        return str(kind)

    def shape_settings(self) -> list[tuple[str, int | None]]:
        names = (("layers", "num_hidden_layers"), ("hidden", "hidden_size"), ("ffn", "intermediate_size"),
                 ("heads", "num_attention_heads"))
        settings = [(ours, self.integer(theirs, required=True)) for ours, theirs in names]
        heads = dict(settings)["heads"]
        kv_heads = self.integer("num_key_value_heads") or heads
        settings += [("kv_heads", kv_heads), ("vocab", self.integer("vocab_size", required=True))]
        hidden = dict(settings)["hidden"]
        if heads and kv_heads and heads % kv_heads:
            self.fail("num_key_value_heads", f"num_attention_heads = {heads} is not a multiple of "
                      f"num_key_value_heads = {kv_heads}")
        if hidden and heads and hidden % heads:
            self.fail("num_attention_heads", f"hidden_size = {hidden} is not divisible by num_attention_heads = "
                      f"{heads}", "the layer's head_dim is hidden / heads")
        head_dim = self.config.get("head_dim")
        if head_dim is not None and hidden and heads and head_dim != hidden // heads:
            self.fail("head_dim", f"head_dim = {head_dim} differs from hidden_size / num_attention_heads = "
                      f"{hidden // heads}", f"layer {LAYER} computes head_dim as hidden / heads")
        return settings

    def refuse_unsupported(self, model_type: str, seq: int, settings) -> None:
        """Record an error for each field whose value the layer does not compute."""
        for key in ("attention_bias", "mlp_bias"):
            if self.value(key):
                self.fail(key, f"{key} = true: biases on every attention projection (o_proj too) or on the MLP "
                          "are not in a stdlib layer", f"layer {LAYER} reads unbiased projections, as Llama's, and "
                          f"{QWEN2_LAYER} Qwen2's biases on q, k and v only")
        if not isinstance(self.value("tie_word_embeddings"), bool):
            self.fail("tie_word_embeddings", f"tie_word_embeddings = {json.dumps(self.value('tie_word_embeddings'))}: "
                      "true or false was expected")
        if self.value("hidden_act") != "silu":
            self.fail("hidden_act", f"hidden_act {json.dumps(self.value('hidden_act'))}: the layer's MLP is "
                      "SwiGLU (silu)")
        window = self.config.get("sliding_window")
        if window is not None and self.config.get("use_sliding_window", True) and window < seq:
            self.fail("sliding_window", f"sliding_window = {window} is shorter than the sequence ({seq} tokens): "
                      "the layer's attention is causal over the whole sequence",
                      f"give sequences of {window} tokens or less")
        if self.config.get("attention_dropout", 0.0):
            self.fail("attention_dropout", "attention_dropout is not computed; set it to 0.0")
        if self.config.get("quantization_config") is not None:
            method = self.config["quantization_config"]
            method = method.get("quant_method", "") if isinstance(method, dict) else ""
            self.fail("quantization_config", f"quantization_config{f' ({method})' if method else ''}: quantized "
                      "weights (fp8, int8, int4) are not read; the layers compute with unquantized ones",
                      "give the configuration of the model's unquantized (bf16, fp16 or fp32) release")

    def special_tokens(self) -> list[tuple[str, int | None]]:
        """``bos_token`` and ``eos_token``: the configuration's ids (the first of a list), None
        where it gives none; kept in the program so that ``export --hf`` writes them back."""
        tokens = []
        for ours, theirs in SPECIAL_TOKENS:
            value = self.config.get(theirs)
            value = value[0] if isinstance(value, list) and value else value
            tokens.append((ours, value if isinstance(value, int) and not isinstance(value, bool) and value >= 0
                           else None))
        return tokens

    def rope_scaling(self) -> list[tuple[str, int]]:
        """The settings of Llama 3's RoPE scaling (none without scaling); other kinds are errors."""
        key = "rope_scaling" if self.config.get("rope_scaling") else "rope_parameters"
        scaling = self.config.get(key) or {}
        kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else scaling
        if kind == "default":
            return []
        if kind != "llama3":
            self.fail(key, f"{key}: RoPE scaling of type {json.dumps(kind)} is not computed",
                      "the rotary embeddings have a base (rope_theta) and Llama 3's scaling (rope_type llama3)")
            return []
        settings = []
        for ours, theirs in LLAMA3_SCALING:
            value = scaling.get(theirs)
            if not isinstance(value, (int, float)) or value <= 0 or value != int(value):
                self.fail(key, f"{key}: {theirs} = {json.dumps(value)}: a positive whole number was expected",
                          "the language's numbers are integers")
                return []
            settings.append((ours, int(value)))
        return settings

    def rope_theta(self) -> int | None:
        theta = _rope_parameters(self.config).get("rope_theta", self.value("rope_theta"))
        key = "rope_theta" if "rope_theta" in self.config else "rope_parameters"
        if not isinstance(theta, (int, float)) or theta <= 0 or theta != int(theta):
            self.fail(key, f"rope_theta = {json.dumps(theta)}: a positive whole base was expected",
                      "the language's numbers are integers")
            return None
        return int(theta)

    def inv_eps(self) -> int | None:
        eps = self.value("rms_norm_eps")
        if not isinstance(eps, (int, float)) or not 0 < eps < 1:
            self.fail("rms_norm_eps", f"rms_norm_eps = {json.dumps(eps)}: a number between 0 and 1 was expected")
            return None
        inverse = round(1 / eps)
        if not math.isclose(1 / inverse, eps, rel_tol=1e-9):
            self.fail("rms_norm_eps", f"rms_norm_eps = {eps} is not 1 / N for a whole N",
                      "the language writes it as norm_inv_eps = N (1e-6 is 1000000)")
            return None
        return inverse

    def dtype(self) -> str:
        name = self.config.get("torch_dtype", self.config.get("dtype")) or "bfloat16"
        if name not in HF_DTYPES:
            self.fail("torch_dtype" if "torch_dtype" in self.config else "dtype",
                      f"dtype {json.dumps(name)} is not run", f"dtypes: {', '.join(HF_DTYPES)}")
            return "bf16"
        return HF_DTYPES[name]


def _rope_parameters(config: dict) -> dict:
    # transformers 5 keeps the base and the scaling together in `rope_parameters`.
    value = config.get("rope_parameters")
    return value if isinstance(value, dict) else {}


def hf_config_of(model, norm_inv_eps: int | None, rope_theta: int | None, scaling: tuple | None = None, *,
                 qkv_bias: bool = False) -> dict:
    """The ``LlamaConfig`` fields (``config.json``) of the dhelix ``model`` (a
    :class:`~dhelix.dsl.core.program.Model`) whose layer has norm epsilon ``1 / norm_inv_eps``
    (None: the default 1e-5), rotary base ``rope_theta`` and Llama 3's RoPE ``scaling``
    (factor, low, high, original; None: none); with ``qkv_bias`` (q, k and v biased) a
    ``Qwen2Config``'s instead."""
    get = model.get
    rope_scaling = None if scaling is None else {
        "rope_type": "llama3", **{theirs: value for (_, theirs), value in zip(LLAMA3_SCALING, scaling, strict=True)}}
    dtypes = {ours: theirs for theirs, ours in HF_DTYPES.items()}
    kind = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
            "max_window_layers": get("layers")} if qkv_bias else {"architectures": ["LlamaForCausalLM"],
                                                                  "model_type": "llama"}
    return {
        **kind,
        "hidden_size": get("hidden"), "intermediate_size": get("ffn"), "num_attention_heads": get("heads"),
        "num_key_value_heads": get("kv_heads"), "num_hidden_layers": get("layers"), "vocab_size": get("vocab"),
        "head_dim": get("hidden") // get("heads"),
        # The source's context (dhelix new --hf keeps it), never less than the sequences trained on.
        "max_position_embeddings": max(get("seq"), get("max_positions") or 0),
        **{theirs: get(ours) for ours, theirs in SPECIAL_TOKENS if get(ours) is not None},
        "rms_norm_eps": 1 / (norm_inv_eps or 100000), "rope_theta": float(rope_theta or 10000),
        "rope_scaling": rope_scaling, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": get(TIE_SETTING) == 1, "torch_dtype": dtypes.get(model.dtype, "float32"),
    }


def generation_config_of(model) -> dict:
    """The ``generation_config.json`` of the dhelix ``model``: its special token ids (none
    known: an empty configuration, greedy by transformers' defaults)."""
    return {theirs: model.get(ours) for ours, theirs in SPECIAL_TOKENS if model.get(ours) is not None}


@attrs.frozen
class Layout:
    """Where a new program runs: ``gpus`` in nodes of ``gpus_per_node``, split as ``tp`` ×
    ``pp`` × dp (the rest), ``microbatches`` of ``micro_batch`` sequences, priced with the
    hardware ``profile``."""

    gpus: int = 1
    gpus_per_node: int = 8
    tp: int | None = None
    pp: int = 1
    micro_batch: int = 1
    microbatches: int | None = None
    profile: str = "h100"


def choose_tp(model: HFModel, layout: Layout) -> int:
    """``layout.tp``, or the largest tensor-parallel size inside a node that divides the GPUs
    left after the pipeline and every size tp splits (heads, kv heads, ffn, vocab, seq)."""
    if layout.tp is not None:
        return layout.tp
    per_pipeline = layout.gpus // layout.pp
    splits = [model.get(key) for key in ("heads", "kv_heads", "ffn", "vocab", "seq")]
    fits = [t for t in range(1, min(per_pipeline, layout.gpus_per_node) + 1)
            if per_pipeline % t == 0 and all(value % t == 0 for value in splits)]
    return max(fits)


def program_text(model: HFModel, name: str, layout: Layout, origin: str) -> str:
    """The text of a program training ``model`` (named ``name``, read from ``origin``) on
    ``layout``: the stdlib ``llama_rope`` layer, fold u with the W schedule, strand
    interleaving over tp (fold none with 1F1B when the layers do not split into 2 · pp stages).
    Not yet checked or formatted (the caller does both)."""
    tp = choose_tp(model, layout)
    dp = layout.gpus // (tp * layout.pp)
    nodes = max(1, layout.gpus // layout.gpus_per_node)
    per_node = min(layout.gpus, layout.gpus_per_node)
    microbatches = layout.microbatches or 4 * layout.pp
    settings = "\n".join(f"  {key} = {value}" for key, value in model.settings)
    mesh = "\n".join(f"  {axis} = {size}" for axis, size in (("tp", tp), ("pp", layout.pp), ("dp", dp)) if size > 1)
    folds = model.get("layers") % (2 * layout.pp) == 0
    schedule = "fold u\npipeline w_helix\n" if folds else "fold none\npipeline one_f_one_b\n"
    strands = "strands {\n  overlap tp\n  comm_with_comm on\n  movable wgrad\n}\n" if tp > 1 else ""
    return (f"# {model.model_type} from the Hugging Face configuration {origin}: layer {model.layer}, whose\n"
            f"# weights map one to one onto Hugging Face's.\n"
            f'import "stdlib/layers.dhx"\nimport "stdlib/pipelines.dhx"\n\n'
            f"model {name} {{\n{settings}\n  layer = {model.layer}\n}}\n\n"
            f'cluster {{\n  nodes = {nodes}\n  gpus_per_node = {per_node}\n  profile = "{layout.profile}"\n}}\n\n'
            f"mesh {{\n{mesh or '  tp = 1'}\n}}\n\n"
            f"train {{\n  micro_batch = {layout.micro_batch}\n  microbatches = {microbatches}\n}}\n\n"
            f"{schedule}\n{strands}")
