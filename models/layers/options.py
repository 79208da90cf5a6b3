"""The runtime options every family's config carries (`ModelOptions`), and what of them the attention and MLP blocks
take (`sublayer_options`)."""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from models import pipeline

Dtype = Any

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the projections of Attention and MLP
QUANTIZE_FORMATS = (None, "int8", "nf4")  # frozen projections' storage (kernels.matmul.formats)


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Runtime options every family's config carries (not part of a checkpoint).

    dtype: computation dtype; None (the default): the dtype of the parameters the model is handed, so a Trainer's
    `Precision(compute_dtype=)` (which casts them) governs every matmul; a name forces that dtype whatever the
    parameters hold. param_dtype: the dtype fresh parameters are created in. scan_layers: one nn.scan over stacked
    layer weights (a leading [layers] axis), so a deep model compiles one layer. remat: 'none' (no matmul or kernel
    recomputed; a scanned stack recomputes the elementwise work between them, `layers.stack`), 'full' (recompute the
    whole layer in the backward pass) or 'dots' (save the outputs of weight matmuls, recompute the rest).
    attention_implementation: passed to kernels.flash_attention (None = best for the backend). mlp_implementation:
    None = plain jnp MLP; a name ('xla', 'triton', ...) routes the MLP through the fused kernels. kernel_interpret:
    run those Pallas kernels in Pallas's interpreter (to test a model's GPU kernels on CPU). dropout_rate: dropout
    in training calls (`train=True`, with a 'dropout' rng) on each attention and MLP output before its residual add
    and where the family's Hugging Face model has it (OPT and GPT-J after the embeddings; T5 also after each stack's
    embeddings and final norm). attention_dropout_rate: dropout on the attention probabilities in training calls
    (inside the flash kernels: `kernels.flash_attention`'s dropout_rate), read from the family's Hugging Face config
    (LLaMA and OPT `attention_dropout`, GPT-J `attn_pdrop`, T5 `dropout_rate`). lora_rank > 0: LoRA (Hu et al.,
    2021) on the projections named in lora_targets (of q, k, v, o, gate, up, down): y = x W + (x A) B alpha / rank
    with A [in, rank] random and B [rank, out] zeros, both float32 (`models.lora`: the trainable set, merging);
    lora_dropout drops the adapters' input in training calls (PEFT's lora_dropout; a runtime option).
    quantize='int8': the same projections store their kernels as int8 with a float32 scale per output column
    (`kernel_scale`; `models.quantize`), a frozen base for LoRA in a quarter of float32's memory: y = (x q) s.
    quantize='nf4': QLoRA's 4-bit NormalFloat, two per byte, a float32 absmax per 64 rows of a column
    (`kernels.matmul.formats`), dequantised before each matmul; an eighth of float32's memory (plus 1/16 in scales).
    Unlike the other options these fields change the parameters, so training scripts record them.
    fp8: the attention and MLP projections' matmuls (q, k, v, o, gate, up, down; not the embedding, the LM head, a
    mixture's router and experts, or attention's own products) in FP8 (`kernels.matmul.fp8.fp8_dot`; torchtitan's
    float8 training with its default per-tensor current scaling): both operands rounded to e4m3 and the output
    gradient to e5m2, each under a scale from its own amax in the step, float32 accumulation; the parameters, their
    dtype and the optimizer are unchanged, so checkpoints are too. A cuBLASLt FP8 GEMM on Hopper GPUs, emulated
    (FP8's rounding, float32 products) elsewhere (models/README.md#fp8). LoRA adapters stay in the compute dtype on
    an FP8 base product; not with quantize (int8 / nf4 bases) or mlp_implementation (the fused kernels).
    fp8_history > 0: delayed scaling instead (Transformer Engine's and MaxText's recipe): each projection holds a
    float32 `fp8_history` parameter [3, fp8_history] of the last amaxes of its input, kernel and output gradient,
    scales from their maxima, updated by the train step (its "gradient" is its next value) and saved with the
    checkpoints; a field that changes the parameters, like quantize (the histories are there whatever fp8 says).
    pipeline_microbatches: micro-batches per step of the pipeline when the ambient mesh has a `stage` axis
    (`models.pipeline`; 0: as many as stages); more shrink the bubble, (S - 1) / (V M + S - 1) of each stage's time.
    pipeline_virtual_stages: V, the times a micro-batch passes every stage (1: GPipe; V > 1: the interleaved
    schedule, stage s running layer chunks s, S + s, 2S + s, ... of L / (V S) layers each; needs M >= S). With V > 1
    a scanned stack is stored [V, L / V, ...] (`layers.stack.stored_rounds`), so, like quantize, it changes the
    parameters' layout: training scripts record it, and `models.stack_layers` converts.
    pipeline_schedule: 'gpipe' (every forward, then the backward as autodiff of the tick loop: all M micro-batches'
    activations alive at the turn; the interleaved one with V > 1) or '1f1b' (each micro-batch's backward as soon
    as it leaves the last stage, the loss inside the pipeline: at most 2S - 1 micro-batches' stage inputs alive per
    stage; V = 1, and the model call must be given its loss, `DecoderLM(loss_tail=)` as `engine.tasks.lm.lm_loss_fn`
    does: models/README.md#the-pipeline).
    pipeline_fsdp_gather: with `fsdp` inside a stage (ZeRO-3), 'tick' (each tick gathers its layers' weight shards
    and reduce-scatters their gradients: a device holds 1/fsdp of its stage) or 'step' (the stage's weights gathered
    once before the tick loop and their gradients reduced once after it: every device holds the stage's whole
    weights and gradients; far fewer bytes sent, models/README.md#the-pipeline).
    sequence_parallel: under a mesh whose automatic `model` axis divides the tokens, the residual stream between
    the tensor-parallel attention and MLP blocks (and the norms and dropouts on it) holds T / model tokens per
    device (Megatron-LM's sequence parallelism, Korthikanti et al., 2022): each block all-gathers its input's tokens
    and its row-parallel output is reduce-scattered over them instead of all-reduced (`split_tokens`,
    `gather_tokens`). Same values; less activation memory at the same bytes sent.
    """
    dtype: str | None = None
    param_dtype: str = "float32"
    scan_layers: bool = False
    remat: str = "none"
    attention_implementation: str | None = None
    mlp_implementation: str | None = None
    kernel_interpret: bool = False
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple = LORA_TARGETS
    lora_dropout: float = 0.0
    quantize: str | None = None
    fp8: bool = False
    fp8_history: int = 0
    pipeline_microbatches: int = 0
    pipeline_virtual_stages: int = 1
    pipeline_schedule: str = "gpipe"
    pipeline_fsdp_gather: str = "tick"
    sequence_parallel: bool = False

    def __post_init__(self):
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value is None and name == "dtype":
                continue
            try:
                floating = value is not None and jnp.issubdtype(jnp.dtype(value), jnp.floating)
            except TypeError:
                floating = False
            if not floating:
                raise ValueError(f"{name}={value!r}; expected a floating dtype name such as 'bfloat16'"
                                 + (" or None (the parameters' dtype)" if name == "dtype" else ""))
        if self.quantize not in QUANTIZE_FORMATS:
            raise ValueError(f"quantize={self.quantize!r}; expected one of {QUANTIZE_FORMATS}")
        if not isinstance(self.fp8, bool):
            raise ValueError(f"fp8={self.fp8!r}; expected a bool")
        if isinstance(self.fp8_history, bool) or not isinstance(self.fp8_history, int) or self.fp8_history < 0:
            raise ValueError(f"fp8_history={self.fp8_history!r}; expected an integer >= 0 (0: current scaling)")
        if self.fp8 and (self.quantize is not None or self.mlp_implementation is not None):
            raise ValueError(f"fp8=True with quantize={self.quantize!r}, mlp_implementation="
                             f"{self.mlp_implementation!r}; expected both None (FP8 matmuls take float kernels in "
                             "plain XLA, not int8 / nf4 bases or the fused matmul kernels)")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank!r}; expected an integer >= 0 (0: no LoRA)")
        if (isinstance(self.pipeline_microbatches, bool) or not isinstance(self.pipeline_microbatches, int)
                or self.pipeline_microbatches < 0):
            raise ValueError(f"pipeline_microbatches={self.pipeline_microbatches!r}; expected an integer >= 0 "
                             "(0: one per stage)")
        if (isinstance(self.pipeline_virtual_stages, bool) or not isinstance(self.pipeline_virtual_stages, int)
                or self.pipeline_virtual_stages < 1):
            raise ValueError(f"pipeline_virtual_stages={self.pipeline_virtual_stages!r}; expected an integer >= 1 "
                             "(1: GPipe)")
        if self.pipeline_schedule not in pipeline.SCHEDULES:
            raise ValueError(f"pipeline_schedule={self.pipeline_schedule!r}; expected one of {pipeline.SCHEDULES}")
        if self.pipeline_fsdp_gather not in pipeline.FSDP_GATHERS:
            raise ValueError(f"pipeline_fsdp_gather={self.pipeline_fsdp_gather!r}; expected one of "
                             f"{pipeline.FSDP_GATHERS}")
        if self.pipeline_schedule == "1f1b" and self.pipeline_virtual_stages > 1:
            raise ValueError(f"pipeline_schedule='1f1b' with pipeline_virtual_stages={self.pipeline_virtual_stages}; "
                             "expected pipeline_virtual_stages=1 (1F1B runs one chunk per stage)")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout={self.lora_dropout!r}; expected a rate in [0, 1)")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha={self.lora_alpha!r}; expected a number > 0")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if isinstance(self.lora_targets, str) or unknown or not self.lora_targets:
            raise ValueError(f"lora_targets={self.lora_targets!r}; expected a non-empty tuple of {LORA_TARGETS}")

    # Attention geometry of the decoder families (fields num_heads, hidden_size, optional num_kv_heads / head_dim).
    @property
    def kv_heads(self):
        return getattr(self, "num_kv_heads", None) or self.num_heads

    @property
    def dim_per_head(self):
        return getattr(self, "head_dim", None) or self.hidden_size // self.num_heads


def sublayer_options(config):
    """Attention / MLP keyword arguments of a config's LoRA, quantisation, FP8 and sequence-parallel fields
    (`ModelOptions`)."""
    return dict(lora_rank=config.lora_rank, lora_alpha=config.lora_alpha, lora_targets=tuple(config.lora_targets),
                lora_dropout=config.lora_dropout, quantize=config.quantize, fp8=config.fp8,
                fp8_history=config.fp8_history,
                sequence_parallel=config.sequence_parallel)


def layer_dtype(dtype, *like):
    """The dtype a layer computes in: `dtype` when set, else that of the first floating array of `like` (the
    parameter it reads, or its input): the parameters' dtype governs unless a config names another."""
    if dtype is not None:
        return jnp.dtype(dtype)
    for x in like:
        if x is not None and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.dtype(x.dtype)
    raise ValueError("no floating array to take the compute dtype from; expected a dtype")


def config_dtype(config):
    """A config's `dtype` as the layers take it: None (follow the parameters) or a jnp.dtype."""
    return None if config.dtype is None else jnp.dtype(config.dtype)


def compute_dtype(config, params=None):
    """The dtype a model of `config` computes in: config.dtype when set, else that of `params` (its first floating
    leaf; e.g. bfloat16 parameters cast by a Trainer's Precision), else config.param_dtype (the dtype of the
    parameters it creates). KV caches default to it."""
    if config.dtype is not None:
        return jnp.dtype(config.dtype)
    return jnp.dtype(next((x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)),
                          config.param_dtype))
