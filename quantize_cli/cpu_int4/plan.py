"""Deciding, by name and shape alone, what gets quantized, what is kept and what is dropped.

No model class is instantiated: the rules below read tensor names and shapes, so any
architecture whose linear layers are stored as `<module>.weight` [N, K] works, and the plan can
be printed (`--dry-run`) before anything heavy happens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cpu_int4_vllm.format import (
    DEFAULT_GROUP_SIZE,
    GROUP_SIZES,
    ROW_MULTIPLE,
    TensorSpec,
    bits_per_weight,
    expert_layer,
    is_router,
    quantized_tensors,
    shape_problem,
)

from .checkpoint import FLOAT_DTYPES, Checkpoint, TensorInfo
from .errors import QuantizeError

EMBEDDING_MODULES = {"embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings"}
HEAD_MODULES = {"lm_head", "embed_out"}
# 2-D weights that are not linear layers: never quantized (nor are MoE routers: format.ROUTER).
NOT_LINEAR = re.compile(r"(norm|^ln_|\.ln_|wpe|position|token_type|rotary)")
# vLLM fuses these siblings into one layer; a fused layer is quantized all or nothing.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"))
# Tensor-parallel sizes a checkpoint is checked for (powers of two, as vLLM deployments use).
TP_SIZES = (1, 2, 4, 8, 16)
# vLLM splits these along K across tensor-parallel ranks (row-parallel); other linears split N.
ROW_PARALLEL = re.compile(r"\.(o_proj|down_proj|out_proj|c_proj|fc2|w2|wo|dense_4h_to_h)$|\.output\.dense$")
VOCAB_PADDING = 64  # vLLM pads a vocab table to a multiple of this before splitting it
# Architectures that end in a vocabulary head (tied or not). Encoder models (BertModel, ...)
# have none, and vLLM builds their tables without a quantization config: those stay as they are.
GENERATIVE = re.compile(r"(ForCausalLM|LMHeadModel|ForConditionalGeneration)$")
# Architectures whose vLLM model (0.32, read in its sources) builds the token table without a
# quantization config: an int4 table cannot load there (measured with Mixtral: "no module or
# parameter named 'embed_tokens.weight_packed'"), so it stays as it is. Their heads are int4.
PLAIN_TABLE_ARCHITECTURES = {
    "AfmoeForCausalLM", "BailingMoeV25ForCausalLM", "BloomForCausalLM", "FalconForCausalLM",
    "FalconH1ForCausalLM", "Glm4MoeForCausalLM", "GptOssForCausalLM", "GraniteMoeForCausalLM",
    "GraniteMoeHybridForCausalLM", "HYV3ForCausalLM", "JambaForCausalLM", "Lfm2ForCausalLM",
    "Lfm2MoeForCausalLM", "LongcatFlashForCausalLM", "MambaForCausalLM", "Mamba2ForCausalLM",
    "MixtralForCausalLM", "NemotronForCausalLM", "OlmoHybridForCausalLM", "OPTForCausalLM",
    "Plamo3ForCausalLM", "Qwen3NextForCausalLM",
}  # fmt: skip


@dataclass(frozen=True)
class LayerChoice:
    """What happens to one source tensor."""

    info: TensorInfo
    action: str  # "quantize", "keep" or "drop"
    reason: str = ""  # why a candidate layer is kept in full precision, or why a tensor is dropped

    @property
    def module(self) -> str:
        return self.info.name.removesuffix(".weight")


@dataclass(frozen=True)
class ExpertCount:
    """What a plan does to mixture-of-experts layers (all zeros for a dense model)."""

    layers: int
    experts: int
    params: int
    source_bytes: int
    output_bytes: int


@dataclass
class Plan:
    """Every source tensor's fate, plus the config fields the runtime needs."""

    group_size: int
    quantize_embedding: bool
    tied: bool
    has_head: bool
    choices: list[LayerChoice]
    ignore: list[str] = field(default_factory=list)  # modules kept in full precision

    @property
    def quantized(self) -> list[LayerChoice]:
        return [c for c in self.choices if c.action == "quantize"]

    @property
    def kept_layers(self) -> list[LayerChoice]:
        """Candidate layers kept in full precision (the rest of "keep" are norms, biases...)."""
        return [c for c in self.choices if c.action == "keep" and c.reason]

    def kept_rows(self) -> list[tuple[str, str]]:
        """(tensor, why) for each kept candidate, an expert layer's tensors as one row."""
        rows: dict[str, str] = {}
        for c in self.kept_layers:
            layer = expert_layer(c.module)
            rows.setdefault(f"{layer}.*" if layer else c.info.name, c.reason)
        return list(rows.items())

    def experts(self) -> ExpertCount:
        """The quantized experts: how many, in how many MoE layers, their weights and bytes."""
        chosen = [c for c in self.quantized if expert_layer(c.module)]
        return ExpertCount(
            layers=len({expert_layer(c.module) for c in chosen}),
            experts=len({c.module.rpartition(".")[0] for c in chosen}),
            params=sum(c.info.shape[0] * c.info.shape[1] for c in chosen),
            source_bytes=sum(c.info.nbytes for c in chosen),
            output_bytes=sum(spec.nbytes for c in chosen for spec in self.outputs(c)),
        )

    @property
    def quantized_params(self) -> int:
        return sum(c.info.shape[0] * c.info.shape[1] for c in self.quantized)

    def outputs(self, choice: LayerChoice) -> tuple[TensorSpec, ...]:
        """The tensors the output holds for one source tensor."""
        if choice.action == "quantize":
            n, k = choice.info.shape
            return quantized_tensors(choice.module, n, k, self.group_size)
        return (choice.info,) if choice.action == "keep" else ()

    def output_tensors(self) -> list[TensorSpec]:
        """Every tensor the output will hold, in source order."""
        return [spec for c in self.choices for spec in self.outputs(c)]

    def output_bytes(self) -> int:
        """Bytes of tensor data the output will hold."""
        return sum(spec.nbytes for spec in self.output_tensors())

    @property
    def bits_per_weight(self) -> float:
        return bits_per_weight(self.group_size)

    @property
    def tp_sizes(self) -> list[int]:
        """The tensor-parallel sizes at which every quantized layer's share can be int4."""
        layers = [(c.module, *c.info.shape) for c in self.quantized]
        return [
            tp for tp in TP_SIZES if not any(tp_problem(m, n, k, self.group_size, tp) for m, n, k in layers)
        ]


def compile_patterns(patterns: list[str]) -> list[re.Pattern | str]:
    """Validate --ignore patterns: exact module names, dotted suffixes, or `re:<regex>`."""
    compiled: list[re.Pattern | str] = []
    for p in patterns:
        if p.startswith("re:"):
            try:
                compiled.append(re.compile(p[3:]))
            except re.error as err:
                raise QuantizeError(f"invalid --ignore regex {p!r}: {err}") from err
        else:
            compiled.append(p.removesuffix(".weight"))
    return compiled


def matches(module: str, patterns: list[re.Pattern | str]) -> bool:
    """True if the module is named by a pattern (exact, dotted suffix, or regex search)."""
    for p in patterns:
        if isinstance(p, re.Pattern):
            if p.search(module):
                return True
        elif module == p or module.endswith("." + p):
            return True
    return False


def tp_problem(module: str, n: int, k: int, group_size: int, tp: int) -> str | None:
    """Why a quantized [N, K] layer's share on each of `tp` ranks cannot be int4, or None."""
    if tp == 1:
        return None
    if _role(module) != "linear":
        n = -(-n // VOCAB_PADDING) * VOCAB_PADDING  # the table's rows are padded, then split
    elif ROW_PARALLEL.search(module):
        if k % (tp * group_size):
            return f"K={k} over tp={tp} is {k / tp:g} per rank, not a multiple of group size {group_size}"
        return None
    if n % (tp * ROW_MULTIPLE):
        return f"N={n} over tp={tp} is {n / tp:g} per rank, not a multiple of {ROW_MULTIPLE}"
    return None


def make_plan(
    ckpt: Checkpoint,
    group_size: int = DEFAULT_GROUP_SIZE,
    ignore: list[str] | None = None,
    quantize_embedding: bool = True,
    tp: int = 1,
) -> Plan:
    """Decide every tensor's fate; layers that break a shape rule (at tensor-parallel size `tp`)
    are kept and named in `ignore`."""
    if group_size not in GROUP_SIZES:
        raise QuantizeError(f"group size {group_size} is not supported; use one of {list(GROUP_SIZES)}")
    if tp not in TP_SIZES:
        raise QuantizeError(f"--tp {tp} is not supported; use one of {list(TP_SIZES)}")
    patterns = compile_patterns(ignore or [])
    _refuse_fused_experts(ckpt)
    has_head = _has_head(ckpt)
    tied = has_head and _is_tied(ckpt)
    plain_table = next(
        (a for a in ckpt.config.get("architectures") or [] if a in PLAIN_TABLE_ARCHITECTURES), None
    )
    choices = [
        _choose(t, group_size, patterns, quantize_embedding, tied, has_head, plain_table, tp)
        for t in ckpt.tensors
    ]
    choices = _keep_fused_siblings_together(_keep_experts_together(choices))
    plan = Plan(group_size, quantize_embedding, tied, has_head, choices)
    # vLLM asks once for all experts of a layer (`<layer>.experts`): that name stands for them.
    plan.ignore = sorted({expert_layer(c.module) or c.module for c in plan.kept_layers})
    if tied and any(_role(c.module) == "embedding" for c in plan.kept_layers):
        plan.ignore.append("lm_head")  # the tied head is the table: it follows the table's fate
    return plan


def _refuse_fused_experts(ckpt: Checkpoint) -> None:
    """Stop on experts stored as one 3-D tensor per layer: the format is per-expert 2-D."""
    for t in ckpt.tensors:
        if len(t.shape) == 3 and "experts" in t.name and t.dtype in FLOAT_DTYPES:
            raise QuantizeError(
                f"{t.name} holds all experts in one 3-D tensor {list(t.shape)}; cpu-int4 quantizes"
                " experts stored one 2-D tensor each (experts.<E>.gate_proj.weight, ...), as"
                " transformers' save_pretrained writes them"
            )


def _has_head(ckpt: Checkpoint) -> bool:
    """Whether the model ends in a vocabulary head; without `architectures`, assume it does."""
    if any(_role(t.name.removesuffix(".weight")) == "head" for t in ckpt.tensors):
        return True
    architectures = ckpt.config.get("architectures") or []
    return not architectures or any(GENERATIVE.search(a) for a in architectures)


def _is_tied(ckpt: Checkpoint) -> bool:
    config = ckpt.config.get("text_config", ckpt.config)
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    # transformers' default is True, but a checkpoint that stores its own head is not tied.
    return not any(_role(t.name.removesuffix(".weight")) == "head" for t in ckpt.tensors)


def _role(module: str) -> str:
    last = module.rsplit(".", 1)[-1]
    if last in EMBEDDING_MODULES:
        return "embedding"
    if last in HEAD_MODULES:
        return "head"
    return "linear"


def _choose(
    info: TensorInfo,
    group_size: int,
    patterns: list,
    quantize_embedding: bool,
    tied: bool,
    has_head: bool,
    plain_table: str | None,
    tp: int,
) -> LayerChoice:
    if not info.name.endswith(".weight") or len(info.shape) != 2 or info.dtype not in FLOAT_DTYPES:
        return LayerChoice(info, "keep")
    module = info.name.removesuffix(".weight")
    role = _role(module)
    if role == "linear" and (NOT_LINEAR.search(module) or is_router(module)):
        return LayerChoice(info, "keep")
    if role == "head" and tied:
        return LayerChoice(info, "drop", "tied to the embedding table")
    if role == "embedding" and not quantize_embedding:
        return LayerChoice(info, "keep", "--no-quantize-embedding")
    if role == "embedding" and not has_head:
        return LayerChoice(info, "keep", "no output head: vLLM runs this table unquantized")
    if role == "embedding" and plain_table:
        return LayerChoice(info, "keep", f"vLLM builds {plain_table}'s table unquantized")
    if matches(module, patterns):
        return LayerChoice(info, "keep", "--ignore")
    problem = shape_problem(info.shape[0], info.shape[1], group_size) or tp_problem(
        module, info.shape[0], info.shape[1], group_size, tp
    )
    if problem:
        return LayerChoice(info, "keep", problem)
    return LayerChoice(info, "quantize")


def _keep_fused_siblings_together(choices: list[LayerChoice]) -> list[LayerChoice]:
    by_module = {c.module: c for c in choices}
    result = []
    for c in choices:
        parent, _, last = c.module.rpartition(".")
        if c.action == "quantize":
            for group in FUSED_SIBLINGS:
                if last not in group:
                    continue
                kept = [s for s in group if (sib := by_module.get(f"{parent}.{s}")) and sib.reason]
                if kept:
                    c = LayerChoice(c.info, "keep", f"fused in vLLM with {parent}.{kept[0]}, which is kept")
        result.append(c)
    return result


def _keep_experts_together(choices: list[LayerChoice]) -> list[LayerChoice]:
    """All experts of a layer are int4 or none: vLLM runs them as one layer with one method."""
    kept = {}
    for c in choices:
        layer = expert_layer(c.module)
        if layer and c.reason and layer not in kept:
            kept[layer] = f"{c.module}: {c.reason}"
    result = []
    for c in choices:
        layer = expert_layer(c.module)
        if layer in kept and c.action == "quantize":
            c = LayerChoice(c.info, "keep", f"experts of {layer} stay bf16 together ({kept[layer]})")
        result.append(c)
    return result


# The RMSNorm whose output each layer reads (Llama-family names). Its weight tells, with no
# calibration data, how much each input channel is amplified: a data-free importance for search.
_INPUT_NORMS = (
    (re.compile(r"^(.*)\.self_attn\.[qkv]_proj$"), r"\1.input_layernorm.weight"),
    (re.compile(r"^(.*)\.mlp\.(gate|up)_proj$"), r"\1.post_attention_layernorm.weight"),
)
# Norms computed as x * (1 + weight) rather than x * weight.
_OFFSET_NORM_MODELS = {"gemma", "gemma2", "gemma3", "gemma3_text"}


def input_norm(module: str, tied: bool, names: set[str]) -> str | None:
    """Name of the norm weight that scales this layer's input, if the checkpoint has one."""
    if module == "lm_head" or (tied and _role(module) == "embedding"):
        candidate = "model.norm.weight"  # the head reads the final norm's output
    else:
        candidate = next((rx.sub(rep, module) for rx, rep in _INPUT_NORMS if rx.match(module)), None)
    return candidate if candidate in names else None


def norm_offset(config: dict) -> float:
    """1.0 for models whose norms scale by (1 + weight), else 0.0."""
    return 1.0 if config.get("model_type") in _OFFSET_NORM_MODELS else 0.0
