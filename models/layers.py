"""Building blocks shared by every family: norms, rotary embeddings, attention (with its KV cache), MLPs, and the
layer stack (scan over layers, remat). Written once; each family file composes them.

Layouts: activations [batch, len, d_model]; attention heads [batch, len, heads, head_dim]. Dense kernels are stored
[in, out] (the transpose of PyTorch's Linear.weight). Parameters are a plain nested dict of arrays.

The KV cache of a decoder is a dict {'layers': {'k', 'v': [layers, batch, max_len, kv_heads, head_dim]},
'index': int32 scalar (slots written so far), 'segment_ids': int32 [batch, max_len] (0 = empty or padding)}. A call
with a cache writes its tokens at `index`; a call with more than one token is a prefill and must start at index 0.
"""
import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import kernels
from kernels.matmul.formats import NF4_BLOCK, NF4_LEVELS, dequantize_nf4
from models import pipeline

Dtype = Any


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the projections of Attention and MLP
QUANTIZE_FORMATS = (None, "int8", "nf4")  # frozen projections' storage (kernels.matmul.formats)
_NF4_STD = float(np.std(NF4_LEVELS))  # of a uniformly random NF4 code: a fresh kernel's scale divides by it


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Runtime options every family's config carries (not part of a checkpoint).

    dtype: computation dtype; param_dtype: storage dtype of the parameters. scan_layers: one nn.scan over stacked
    layer weights (a leading [layers] axis), so a deep model compiles one layer. remat: 'none', 'full' (recompute the
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
    pipeline_microbatches: micro-batches per step of the pipeline when the ambient mesh has a `stage` axis
    (`models.pipeline`; 0: as many as stages); more shrink the bubble, (S - 1) / (M + S - 1) of each stage's time.
    sequence_parallel: under a mesh whose automatic `model` axis divides the tokens, the residual stream between
    the tensor-parallel attention and MLP blocks (and the norms and dropouts on it) holds T / model tokens per
    device (Megatron-LM's sequence parallelism, Korthikanti et al., 2022): each block all-gathers its input's tokens
    and its row-parallel output is reduce-scattered over them instead of all-reduced (`split_tokens`,
    `gather_tokens`). Same values; less activation memory at the same bytes sent.
    """
    dtype: str = "float32"
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
    pipeline_microbatches: int = 0
    sequence_parallel: bool = False

    def __post_init__(self):
        if self.quantize not in QUANTIZE_FORMATS:
            raise ValueError(f"quantize={self.quantize!r}; expected one of {QUANTIZE_FORMATS}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank!r}; expected an integer >= 0 (0: no LoRA)")
        if (isinstance(self.pipeline_microbatches, bool) or not isinstance(self.pipeline_microbatches, int)
                or self.pipeline_microbatches < 0):
            raise ValueError(f"pipeline_microbatches={self.pipeline_microbatches!r}; expected an integer >= 0 "
                             "(0: one per stage)")
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


_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight-matmul outputs
}


def activation(name):
    """Hugging Face activation names -> functions. 'gelu_new' is GPT-2's tanh approximation."""
    table = {
        "relu": jax.nn.relu,
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    }
    if name not in table:
        raise ValueError(f"activation {name!r} is not supported; expected one of {sorted(table)}")
    return table[name]


class Norm(nn.Module):
    """RMSNorm (kind='rms': LLaMA, T5) or LayerNorm (kind='layer': GPT-J, OPT), statistics in float32."""
    kind: str = "rms"
    eps: float = 1e-6
    use_scale: bool = True
    use_bias: bool = True  # LayerNorm only
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = x.astype(jnp.float32)
        if self.kind == "layer":
            h = h - h.mean(-1, keepdims=True)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + self.eps)
        h = h.astype(self.dtype)
        if self.use_scale:
            h = h * self.param("scale", nn.initializers.ones, (d,), self.param_dtype).astype(self.dtype)
        if self.kind == "layer" and self.use_scale and self.use_bias:
            h = h + self.param("bias", nn.initializers.zeros, (d,), self.param_dtype).astype(self.dtype)
        return h


def lora_a_init(key, shape, dtype=jnp.float32):
    """LoRA's A [..., in, rank]: uniform in +-1/sqrt(in) (PEFT's kaiming_uniform(a=sqrt(5))); B starts at zero, so
    a fresh adapter changes nothing."""
    bound = shape[-2] ** -0.5
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class Linear(nn.Module):
    """y = act(x @ kernel + bias), kernel [in, out]. With `implementation` the matmul, bias and activation run fused in
    kernels.fused_matmul. `weight()` gives the kernel as the fused gated MLP reads it; `.bias` the bias.
    lora_rank > 0 adds LoRA's float32 `lora_a` [in, rank] and `lora_b` [rank, out]: (x A) B * lora_scale joins the
    product before the activation. quantize='int8' stores the kernel as int8 with a float32 `kernel_scale` [out]:
    y = (x q) * scale, the scale applied to the product (a per-column scale commutes with it), so the dequantised
    weight never exists; the kernel path reads q as int8 and scales in its epilogue. With LoRA the kernel path
    computes (x q) s alone and the rest follows in plain jnp."""
    in_features: int
    features: int
    use_bias: bool = False
    std: float = 0.02
    lora_rank: int = 0
    lora_scale: float = 1.0
    lora_dropout: float = 0.0
    deterministic: bool = True
    quantize: str | None = None
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def setup(self):
        shape = (self.in_features, self.features)
        # Fresh quantised kernels: uniformly random codes scaled to the float init's standard deviation. A real base
        # comes quantised from a float checkpoint (`models.quantize`, `load_pretrained(quantize=...)`).
        if self.quantize == "int8":
            self.kernel = self.param("kernel", lambda k, s: jax.random.randint(k, s, -127, 128, jnp.int8), shape)
            self.kernel_scale = self.param("kernel_scale", lambda k, s: jnp.full(s, self.std * 3 ** 0.5 / 127),
                                           (self.features,))
        elif self.quantize == "nf4":
            if self.in_features % NF4_BLOCK:
                raise ValueError(f"quantize='nf4' on a projection of {self.in_features} inputs ({self.name}); "
                                 f"expected a multiple of {NF4_BLOCK}")
            self.kernel = self.param("kernel", lambda k, s: jax.random.randint(k, s, 0, 256).astype(jnp.uint8),
                                     (self.in_features // 2, self.features))
            self.kernel_scale = self.param("kernel_scale", lambda k, s: jnp.full(s, self.std / _NF4_STD),
                                           (self.in_features // NF4_BLOCK, self.features))
        else:
            self.kernel = self.param("kernel", nn.initializers.normal(self.std), shape, self.param_dtype)
        self.bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype) \
            if self.use_bias else None
        if self.lora_rank:
            self.lora_a = self.param("lora_a", lora_a_init, (self.in_features, self.lora_rank), jnp.float32)
            self.lora_b = self.param("lora_b", nn.initializers.zeros, (self.lora_rank, self.features), jnp.float32)

    def weight(self):
        """(kernel, scale): the int8 kernel and its column scale, or the (nf4: dequantised) float kernel in the
        compute dtype and None."""
        if self.quantize == "int8":
            return self.kernel, self.kernel_scale
        if self.quantize == "nf4":
            return dequantize_nf4(self.kernel, self.kernel_scale, self.dtype), None
        return self.kernel.astype(self.dtype), None

    def __call__(self, x, act=None, implementation=None, interpret=False):
        x = x.astype(self.dtype)
        w, scale = self.weight()
        b = None if self.bias is None else self.bias.astype(self.dtype)
        if implementation is not None and not self.lora_rank:
            return kernels.fused_matmul(x, w, b, w_scale=scale, activation=_KERNEL_ACTIVATION.get(act, act),
                                        implementation=implementation, interpret=interpret)
        if implementation is not None:
            y = kernels.fused_matmul(x, w, w_scale=scale, implementation=implementation, interpret=interpret)
        else:
            y = jnp.dot(x, w.astype(self.dtype))
            if scale is not None:
                y = y * scale.astype(self.dtype)
        if b is not None:
            y = y + b
        if self.lora_rank:
            if self.lora_dropout and not self.deterministic:  # the adapters' input only (PEFT's lora_dropout)
                keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - self.lora_dropout, x.shape)
                x = jnp.where(keep, x / (1.0 - self.lora_dropout), 0).astype(self.dtype)
            low = jnp.dot(x, self.lora_a.astype(self.dtype))
            y = y + jnp.dot(low, self.lora_b.astype(self.dtype)) * jnp.asarray(self.lora_scale, self.dtype)
        return y if act is None else activation(act)(y)


def sublayer_options(config):
    """Attention / MLP keyword arguments of a config's LoRA, quantisation and sequence-parallel fields
    (`ModelOptions`)."""
    return dict(lora_rank=config.lora_rank, lora_alpha=config.lora_alpha, lora_targets=tuple(config.lora_targets),
                lora_dropout=config.lora_dropout, quantize=config.quantize,
                sequence_parallel=config.sequence_parallel)


def _lora(module, name):
    """Linear's LoRA and quantisation arguments for projection `name` of an Attention or MLP `module`."""
    out = {} if module.quantize is None else {"quantize": module.quantize}
    if not module.lora_rank or name not in module.lora_targets:
        return out
    return dict(out, lora_rank=module.lora_rank, lora_scale=module.lora_alpha / module.lora_rank,
                lora_dropout=module.lora_dropout, deterministic=module.deterministic)


# Hugging Face activation names -> the fused kernels' names.
_KERNEL_ACTIVATION = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "swish": "silu"}


# ----------------------------------------------------------------------------------------------------- positions

def segment_positions(segment_ids):
    """Position of each token within its run of equal segment ids, 0 on padding (id 0): [0,0,1,1,2] -> [0,0,0,1,0].
    Left padding therefore does not shift the positions of the real tokens (as in transformers' generate), and
    packed sequences restart at 0."""
    T = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], dtype=bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return jnp.where(segment_ids > 0, idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1), 0)


@dataclasses.dataclass(frozen=True)
class Rotary:
    """Rotary position embedding of the first `dim` features of each head.

    interleaved=False rotates the two halves (LLaMA, rotate_half); True rotates adjacent pairs (GPT-J,
    rotate_every_two). scaling: sorted (key, value) pairs of a Hugging Face `rope_parameters` / `rope_scaling` dict;
    rope_type 'default', 'linear', 'dynamic' (NTK, recomputed from the current length), 'llama3' and 'yarn'.
    """
    dim: int
    theta: float = 10000.0
    interleaved: bool = False
    scaling: tuple = ()
    max_position_embeddings: int = 2048

    def _static_inv_freq(self):
        """(inverse frequencies [dim/2] float32, cos/sin multiplier), following the published formulas."""
        s = dict(self.scaling)
        kind = s.get("rope_type", s.get("type", "default"))
        d = self.dim
        inv = 1.0 / (np.float32(self.theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))
        if kind in ("default", "dynamic"):  # dynamic is applied at call time
            return inv, 1.0
        if kind == "linear":
            return inv / np.float32(s["factor"]), 1.0
        if kind == "llama3":
            factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
            old_len = s.get("original_max_position_embeddings", self.max_position_embeddings)
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > old_len / low, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
            return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
        if kind == "yarn":
            old_len = s.get("original_max_position_embeddings", self.max_position_embeddings)
            factor = s.get("factor") or self.max_position_embeddings / old_len

            def mscale(scale, m=1.0):
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            att = s.get("attention_factor")
            if att is None:
                m, m_all = s.get("mscale"), s.get("mscale_all_dim")
                att = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
            beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

            def correction_dim(rotations):
                return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

            lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
            if s.get("truncate", True):
                lo, hi = math.floor(lo), math.ceil(hi)
            lo, hi = max(lo, 0), min(hi, d - 1)
            hi = hi + 0.001 if lo == hi else hi
            ramp = np.clip((np.arange(d // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1)
            extrapolate = 1 - ramp
            return (inv / factor * (1 - extrapolate) + inv * extrapolate).astype(np.float32), float(att)
        raise ValueError(f"rope scaling type {kind!r} is not supported; expected default, linear, dynamic, llama3 "
                         "or yarn")

    def __call__(self, x, positions):
        """x [batch, len, heads, head_dim], positions int [batch, len] -> x with its first `dim` features rotated."""
        inv, att = self._static_inv_freq()
        inv = jnp.asarray(inv)
        s = dict(self.scaling)
        if s.get("rope_type", s.get("type")) == "dynamic":
            # NTK-aware base, grown from the longest position in this call (as transformers does per forward).
            seq_len = jnp.maximum(jnp.max(positions) + 1, self.max_position_embeddings).astype(jnp.float32)
            factor, d = s["factor"], self.dim
            base = self.theta * ((factor * seq_len / self.max_position_embeddings) - (factor - 1)) ** (d / (d - 2))
            inv = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
        angles = positions[..., None].astype(jnp.float32) * inv  # [B, T, dim/2]
        cos = (jnp.cos(angles) * att)[:, :, None, :]
        sin = (jnp.sin(angles) * att)[:, :, None, :]
        rot, rest = x[..., :self.dim].astype(jnp.float32), x[..., self.dim:]
        if self.interleaved:
            x1, x2 = rot[..., ::2], rot[..., 1::2]
            out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(rot.shape)
        else:
            x1, x2 = jnp.split(rot, 2, axis=-1)
            out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return jnp.concatenate([out.astype(x.dtype), rest], axis=-1)


# ----------------------------------------------------------------------------------------------------- attention

def attend(q, k, v, *, causal, q_segment_ids=None, kv_segment_ids=None, bias=None, sm_scale=None,
           implementation=None, interpret=False, dropout_rate=0.0, dropout_rng=None):
    """The one attention helper. q [B, T, H, D]; k, v [B, S, KVH, D] (H a multiple of KVH); segment ids int32
    [B, T] / [B, S]: a query sees only keys with its id. dropout_rate > 0 (with a `dropout_rng` key) drops attention
    probabilities. Returns [B, T, H, D].

    Without `bias` everything goes through kernels.flash_attention. T5's relative position bias is an additive
    [1 or B, H, T, S] term the kernel does not take, so that case runs here in plain jnp (float32 softmax), with the
    kernels' dropout mask.
    """
    if bias is None:
        seg = None if q_segment_ids is None else (
            q_segment_ids if kv_segment_ids is None else (q_segment_ids, kv_segment_ids))
        return kernels.flash_attention(q, k, v, causal=causal, segment_ids=seg, sm_scale=sm_scale,
                                       implementation=implementation, interpret=interpret,
                                       dropout_rate=dropout_rate, dropout_rng=dropout_rng)
    B, T, H, D = q.shape
    S, KVH = k.shape[1], k.shape[2]
    scale = D ** -0.5 if sm_scale is None else sm_scale
    qg = q.reshape(B, T, KVH, H // KVH, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = scores + bias.reshape(bias.shape[0], KVH, H // KVH, T, S).astype(jnp.float32)
    mask = jnp.ones((1, T, S), bool)
    if causal:
        mask = jnp.tril(jnp.ones((T, S), bool))[None]  # top-left aligned, as kernels.flash_attention
    if q_segment_ids is not None:
        kv_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (q_segment_ids[:, :, None] == kv_ids[:, None, :])
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1)
    if dropout_rate:
        keys = kernels.dropout_keys(dropout_rng, B, H).reshape(B, KVH, H // KVH, 1, 1)
        probs = probs * kernels.dropout_multiplier(keys, jnp.arange(T)[:, None], jnp.arange(S)[None, :], dropout_rate)
    return jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v).reshape(B, T, H, D)


class Attention(nn.Module):
    """Multi-head / grouped-query attention with projections q, k, v, o and an optional KV cache.

    Call: (x [B, T, d_model], ctx, cache=None, kv_input=None, bias=None) -> (out [B, T, d_model], cache).
    ctx (from `decoder_context`) holds 'positions' and 'segment_ids' [B, T], and with a cache 'cache_index' and
    'kv_segment_ids' [B, max_len]. kv_input [B, S, d] makes it cross-attention (keys from the encoder, whose
    padding is ctx['encoder_segment_ids']); its keys are computed once and kept in the cache as cross_k / cross_v.
    bias: additive [1 or B, heads, T, keys] (T5), which takes the plain-jnp path of `attend`. dropout_rate drops
    attention probabilities in training calls (deterministic=False, with a 'dropout' rng).
    """
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool = True
    use_bias: bool = False
    out_bias: bool | None = None  # None: same as use_bias
    rotary: Rotary | None = None
    sm_scale: float | None = None  # None: head_dim ** -0.5
    std: float = 0.02  # initial weights' standard deviation; q_std and out_std (None: std) for q and o (T5)
    q_std: float | None = None
    out_std: float | None = None
    implementation: str | None = None
    interpret: bool = False
    dropout_rate: float = 0.0
    deterministic: bool = True
    lora_rank: int = 0  # LoRA on the projections in lora_targets, int8 kernels (see `sublayer_options`)
    lora_alpha: float = 16.0
    lora_targets: tuple = ()
    lora_dropout: float = 0.0
    quantize: str | None = None
    sequence_parallel: bool = False  # x and the output with tokens split over `model` (`split_tokens`)
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, ctx, cache=None, kv_input=None, bias=None):
        x = gather_tokens(x, self.sequence_parallel)
        if kv_input is not None:
            kv_input = gather_tokens(kv_input, self.sequence_parallel)
        B, T, d_model = x.shape
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        kw = dict(std=self.std, dtype=self.dtype, param_dtype=self.param_dtype)
        q = Linear(d_model, H * D, self.use_bias, name="q", **{**kw, "std": self.q_std or self.std},
                   **_lora(self, "q"))(x)
        q = q.reshape(B, T, H, D)
        if self.rotary is not None:
            q = self.rotary(q, ctx["positions"])

        def project_kv(src):
            k = Linear(src.shape[-1], KVH * D, self.use_bias, name="k", **kw, **_lora(self, "k"))(src)
            v = Linear(src.shape[-1], KVH * D, self.use_bias, name="v", **kw, **_lora(self, "v"))(src)
            k, v = k.reshape(*src.shape[:2], KVH, D), v.reshape(*src.shape[:2], KVH, D)
            if self.rotary is not None:
                k = self.rotary(k, ctx["positions"])
            return k, v

        opts = dict(sm_scale=self.sm_scale, implementation=self.implementation, interpret=self.interpret, bias=bias)
        if self.dropout_rate and not self.deterministic:
            opts.update(dropout_rate=self.dropout_rate, dropout_rng=self.make_rng("dropout"))
        if kv_input is not None:
            # Cross-attention: a query of sequence s sees the encoder tokens of sequence s (ids > 0; 0 is padding)
            # so packed pairs stay apart; with 0/1 masks every query, padding included as in transformers, sees
            # every encoder token.
            if cache is not None and "cross_k" in cache:
                k, v = cache["cross_k"], cache["cross_v"]
            else:
                k, v = project_kv(kv_input)
            if cache is not None:
                cache = {**cache, "cross_k": k, "cross_v": v}
            out = attend(q, k, v, causal=False, q_segment_ids=jnp.maximum(ctx["segment_ids"], 1),
                         kv_segment_ids=ctx["encoder_segment_ids"].astype(jnp.int32), **opts)
        else:
            k, v = project_kv(x)
            quantized = cache is not None and "k_scale" in cache  # an int8 cache (`empty_cache`)
            if cache is not None:
                idx = ctx["cache_index"]
                write = lambda buf, x: jax.lax.dynamic_update_slice(  # noqa: E731
                    buf, x.astype(buf.dtype), (0, idx) + (0,) * (buf.ndim - 2))
                if quantized:
                    (k8, k_scale), (v8, v_scale) = kernels.quantize_kv(k), kernels.quantize_kv(v)
                    cache = {**cache, "k": write(cache["k"], k8), "v": write(cache["v"], v8),
                             "k_scale": write(cache["k_scale"], k_scale), "v_scale": write(cache["v_scale"], v_scale)}
                else:
                    cache = {**cache, "k": write(cache["k"], k), "v": write(cache["v"], v)}
            if cache is not None and T == 1 and bias is None:  # decode step: every filled slot of the cache, the
                # cache split across programs and a kv head's query heads read together (kernels.decode_attention)
                scales = dict(k_scale=cache["k_scale"], v_scale=cache["v_scale"]) if quantized else {}
                out = kernels.decode_attention(
                    q, *((cache["k"], cache["v"]) if quantized else (cache["k"].astype(self.dtype),
                                                                    cache["v"].astype(self.dtype))),
                    segment_ids=(ctx["segment_ids"], ctx["kv_segment_ids"]), sm_scale=self.sm_scale,
                    implementation=self.implementation, interpret=self.interpret, **scales)
            elif cache is not None and T == 1:  # T5's decoder: its relative position bias goes through `attend`
                read = (lambda n: (cache[n].astype(jnp.float32) * cache[f"{n}_scale"][..., None]).astype(self.dtype)
                        ) if quantized else (lambda n: cache[n].astype(self.dtype))
                out = attend(q, read("k"), read("v"), causal=False, q_segment_ids=ctx["segment_ids"],
                             kv_segment_ids=ctx["kv_segment_ids"], **opts)
            else:  # training / prefill (a prefill starts at cache index 0, so the fresh keys are all there is)
                out = attend(q, k, v, causal=self.causal, q_segment_ids=ctx["segment_ids"], **opts)
        out = out.reshape(B, T, H * D)
        out_bias = self.use_bias if self.out_bias is None else self.out_bias
        out = Linear(H * D, d_model, out_bias, name="o", **{**kw, "std": self.out_std or self.std},
                     **_lora(self, "o"))(out)
        return split_tokens(out, self.sequence_parallel), cache


class MLP(nn.Module):
    """Feed-forward block: gated, down(act(gate(x)) * up(x)) (LLaMA SwiGLU, T5 v1.1), or down(act(up(x))).

    `implementation` (None = plain jnp, the default and the reference) routes the first matmul(s) and the
    activation through the fused kernels: kernels.gated_mlp for the gated form (kernels.fused_matmul for each of
    gate and up when they have a bias or LoRA adapters), kernels.fused_matmul otherwise."""
    hidden: int
    act: str = "silu"
    gated: bool = True
    use_bias: bool = False
    std: float = 0.02
    out_std: float | None = None  # the down projection's initial standard deviation (None: std)
    implementation: str | None = None
    interpret: bool = False
    lora_rank: int = 0  # LoRA on the projections in lora_targets, int8 kernels (see `sublayer_options`)
    lora_alpha: float = 16.0
    lora_targets: tuple = ()
    lora_dropout: float = 0.0
    deterministic: bool = True  # False: training call (LoRA dropout, with a 'dropout' rng)
    quantize: str | None = None
    sequence_parallel: bool = False  # x and the output with tokens split over `model` (`split_tokens`)
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = gather_tokens(x, self.sequence_parallel)
        d = x.shape[-1]
        kw = dict(use_bias=self.use_bias, std=self.std, dtype=self.dtype, param_dtype=self.param_dtype)
        fused = dict(implementation=self.implementation, interpret=self.interpret)
        up = Linear(d, self.hidden, name="up", **kw, **_lora(self, "up"))
        if not self.gated:
            h = up(x, act=self.act, **fused)
        else:
            gate = Linear(d, self.hidden, name="gate", **kw, **_lora(self, "gate"))
            if self.implementation is not None and not self.use_bias and not gate.lora_rank and not up.lora_rank:
                (w_gate, gate_scale), (w_up, up_scale) = gate.weight(), up.weight()
                h = kernels.gated_mlp(x.astype(self.dtype), w_gate, w_up, w_gate_scale=gate_scale,
                                      w_up_scale=up_scale, activation=_KERNEL_ACTIVATION.get(self.act, self.act),
                                      **fused)
            else:
                h = gate(x, act=self.act, **fused) * up(x, **fused)
        out = Linear(self.hidden, d, name="down", **{**kw, "std": self.out_std or self.std}, **_lora(self, "down"))(h)
        return split_tokens(out, self.sequence_parallel)


def _token_axes(x, sequence_parallel):
    """(the mesh axes x [B, T, ...]'s tokens are split over between blocks, whether `model` is among them):
    `context` when the ambient mesh's automatic context axis is larger than 1 and divides T (context parallelism),
    then with `sequence_parallel` `model` when that axis is automatic, larger than 1 and divides what is left."""
    context = kernels.context_size(x.shape[1])
    axes = (kernels.CONTEXT_AXIS,) if context > 1 else ()
    model = kernels.auto_axis_size(kernels.MODEL_AXIS) if sequence_parallel else 1
    split = model > 1 and x.shape[1] % (context * model) == 0
    return axes + ((kernels.MODEL_AXIS,) if split else ()), split


def split_tokens(x, sequence_parallel=False):
    """x [B, T, ...] with its token dim over `_token_axes` (nothing to do when there are none). Called on a
    stack's input: every op until attention is per token, so the split then holds through the layers (attention
    exchanges the context split for heads inside `kernels.flash_attention`); with sequence_parallel also on the
    row-parallel output of each attention and MLP block, which the partitioner then reduce-scatters over `model`
    instead of all-reducing (its gradient is all-gathered back: `_reshard`)."""
    axes, split = _token_axes(x, sequence_parallel)
    if not axes:
        return x
    if not split:
        unconstrained = jax.sharding.PartitionSpec.UNCONSTRAINED
        return jax.lax.with_sharding_constraint(
            x, jax.sharding.PartitionSpec(unconstrained, axes, *[unconstrained] * (x.ndim - 2)))
    return _reshard(x, _token_spec(x, axes[:-1]), _token_spec(x, axes))


def gather_tokens(x, sequence_parallel):
    """x [B, T, ...] with whole tokens over `model` again (the context split kept) where `split_tokens` split
    them over it: the input of a tensor-parallel attention or MLP block, and of the head, under sequence
    parallelism (an all-gather; its gradient is reduce-scattered)."""
    axes, split = _token_axes(x, sequence_parallel)
    return _reshard(x, _token_spec(x, axes), _token_spec(x, axes[:-1])) if split else x


def _token_spec(x, axes):
    """x's layout with its tokens over `axes` (whole when there are none), its rows as they are and every other dim
    whole."""
    return jax.sharding.PartitionSpec(jax.sharding.PartitionSpec.UNCONSTRAINED, axes or None, *[None] * (x.ndim - 2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _reshard(x, source, target):
    """x laid out as `source`, then as `target` (a sequence-parallel gather or split of its tokens); the gradient
    takes the same two layouts in reverse. Stated for the backward pass too: left to itself, the partitioner met a
    token-split cotangent at a row-parallel weight's transposed matmul with all-to-alls and weight gathers (tiny
    LLaMA, data 4 x model 2: 12 MB of all-to-all, +11% temporaries)."""
    return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(x, source), target)


def _reshard_fwd(x, source, target):
    return _reshard(x, source, target), None


def _reshard_bwd(source, target, _, g):
    return (jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(g, target), source),)


_reshard.defvjp(_reshard_fwd, _reshard_bwd)


# ----------------------------------------------------------------------------------------------------- stacks

def apply_layers(block_cls, x, ctx, cache, config, *, num_layers=None, name="layers", owner=None, **block_kwargs):
    """Runs the blocks of a stack (config.num_layers unless given); call from inside a parent's compact method.

    A block is a Module whose __call__(x, ctx, layer_cache) returns (x, layer_cache); it is built with
    config=config and block_kwargs. config.scan_layers: one nn.scan with parameters stacked along a leading
    [num_layers] axis under `name`; else separate `{name}_{i}` sub-trees. cache: the model's cache dict or None; its
    'layers' are stacked [num_layers, ...] either way, so generation does not care which. config.remat wraps each
    block in nn.remat. Under a mesh with a `stage` axis (and no cache) the scanned stack runs as a pipeline
    (`models.pipeline`); `owner`, the calling module, lends it the stacked weights, and a stack without an owner
    refuses such a mesh. Returns (x, new cache['layers'] or None)."""
    num_layers = config.num_layers if num_layers is None else num_layers
    scan, remat = config.scan_layers, config.remat
    cache = None if cache is None else cache["layers"]
    block_kwargs = {"config": config, **block_kwargs}
    if remat != "none" and remat not in _REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}; expected 'none', 'full' or 'dots'")
    stages = pipeline.num_stages()
    if stages > 1 and cache is None:
        if owner is None:
            raise ValueError(f"a mesh with stage={stages}: this model's layer stack '{name}' cannot run as a "
                             "pipeline (decoder-only families can); expected a mesh with stage=1")
        if not scan:
            raise ValueError(f"a mesh with stage={stages} needs scan_layers=True (the pipeline splits the stacked "
                             "layer weights); got scan_layers=False")
        if not owner.is_initializing():
            return _pipelined(owner, block_cls, x, ctx, config, name, block_kwargs, stages), None
    if remat != "none":
        block_cls = nn.remat(block_cls, policy=_REMAT_POLICIES[remat], prevent_cse=not scan)
    if scan:
        stack = nn.scan(block_cls, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                        in_axes=(nn.broadcast, 0), length=num_layers)
        return stack(name=name, **block_kwargs)(x, ctx, cache)
    caches = []
    for i in range(num_layers):
        layer_cache = None if cache is None else jax.tree_util.tree_map(lambda a: a[i], cache)
        x, layer_cache = block_cls(name=f"{name}_{i}", **block_kwargs)(x, ctx, layer_cache)
        caches.append(layer_cache)
    if cache is None:
        return x, None
    return x, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *caches)


def stack_layers(model, params):
    """(model with scan_layers=True, params with its `layers_{i}` sub-trees stacked into one [num_layers, ...] tree
    under `layers`): the layout a pipeline splits over stages. Unchanged when already scanned. Decoder-only
    families (a `DecoderLM`); ValueError otherwise."""
    if not isinstance(model, DecoderLM):
        raise ValueError(f"a pipeline needs a decoder-only model (LLaMA, GPT-J, OPT); got {type(model).__name__}")
    if model.config.scan_layers:
        return model, params
    n = model.config.num_layers
    params = dict(params)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[params.pop(f"layers_{i}") for i in range(n)])
    # The stack sits where the unscanned model creates its first layer (creation order decides auto_shard's names
    # fallback and the tables it logs).
    params = {**{k: v for k, v in params.items() if k in ("embed", "embed_positions", "project_in")},
              "layers": stacked, **{k: v for k, v in params.items() if k not in ("embed", "embed_positions",
                                                                                  "project_in")}}
    return model.clone(config=dataclasses.replace(model.config, scan_layers=True)), params


def _pipelined(owner, block_cls, x, ctx, config, name, block_kwargs, stages):
    """The scanned stack `owner`'s `name` as a pipeline of `stages` stages: each layer is the block applied to its
    slice of the stacked weights (dropout keys folded per layer and micro-batch)."""
    block = block_cls(parent=None, **block_kwargs)
    key = None if block_kwargs.get("deterministic", True) else owner.make_rng("dropout")

    def layer_fn(w, h, c, layer, micro):
        rngs = {} if key is None else {"dropout": jax.random.fold_in(jax.random.fold_in(key, layer), micro)}
        return block.apply({"params": w}, h, c, None, rngs=rngs)[0]

    if config.remat != "none":
        layer_fn = jax.checkpoint(layer_fn, policy=_REMAT_POLICIES[config.remat], prevent_cse=False)
    return pipeline.pipeline(layer_fn, owner.variables["params"][name], x, ctx, stages=stages,
                             microbatches=config.pipeline_microbatches or stages)


def decoder_context(input_ids, attention_mask, positions, cache):
    """Builds the per-call context for a (cached) decoder.

    attention_mask int [B, T]: 0 = padding, 1 = token; larger ids mark packed sequences (a token sees only its own
    sequence). Positions default to the position within the sequence, counting the tokens already in the cache.
    Returns (ctx, cache without 'layers' but with index / segment ids advanced, or None)."""
    B, T = input_ids.shape
    seg = jnp.ones((B, T), jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)
    ctx = {"segment_ids": seg}
    if cache is None:
        ctx["positions"] = segment_positions(seg) if positions is None else positions
        return ctx, None
    idx = cache["index"]
    if positions is None:
        seen = jnp.sum(cache["segment_ids"] > 0, axis=1, dtype=jnp.int32)
        positions = seen[:, None] + segment_positions(seg)
    kv_seg = jax.lax.dynamic_update_slice(cache["segment_ids"], seg, (0, idx))
    ctx.update(positions=positions, cache_index=idx, kv_segment_ids=kv_seg)
    return ctx, {"index": idx + T, "segment_ids": kv_seg}


def empty_cache(num_layers, batch, max_len, kv_heads, head_dim, dtype):
    """Zeroed decoder cache (see the module docstring for the layout). dtype int8: keys and values stored as int8
    with a float32 scale per token and head (`k_scale`, `v_scale` [layers, batch, max_len, kv_heads];
    `kernels.quantize_kv`), half of bf16's bytes, read as int8 by `kernels.decode_attention`."""
    shape = (num_layers, batch, max_len, kv_heads, head_dim)
    layer = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    if jnp.dtype(dtype) == jnp.int8:
        layer.update(k_scale=jnp.ones(shape[:-1], jnp.float32), v_scale=jnp.ones(shape[:-1], jnp.float32))
    return {"layers": layer, "index": jnp.zeros((), jnp.int32),
            "segment_ids": jnp.zeros((batch, max_len), jnp.int32)}


# ----------------------------------------------------------------------------------------------------- ends

def token_embedding(vocab_size, features, *, std=0.02, name=None, dtype=jnp.float32, param_dtype=jnp.float32):
    """Token embedding table 'embedding' [vocab, features]."""
    return nn.Embed(vocab_size, features, embedding_init=nn.initializers.normal(std), dtype=dtype,
                    param_dtype=param_dtype, name=name)


def lm_output(x, embed, tied, new_cache, layer_cache, return_hidden, *, head_bias=False, std=0.02,
              dtype=jnp.float32, param_dtype=jnp.float32):
    """Final projection of a decoder (call from its compact method). Tied heads reuse the embedding table; an untied
    head is 'lm_head' [d_model, vocab]. Returns float32 logits [B, T, vocab] (or the hidden states [B, T, d_model]
    when return_hidden, for a fused linear + cross-entropy), plus the updated cache when there is one."""
    if tied:
        head = embed.attend
    else:
        linear = Linear(x.shape[-1], embed.num_embeddings, head_bias, std=std, dtype=dtype, param_dtype=param_dtype,
                        name="lm_head")
        _ = linear.kernel  # create the head's parameters even when only hidden states are returned
        head = linear
    out = x if return_hidden else head(x).astype(jnp.float32)
    if new_cache is None:
        return out
    return out, {**new_cache, "layers": layer_cache}


def rope_from_hf(hf):
    """(rope_theta, scaling pairs) from a transformers config dict: v5 `rope_parameters` or v4 `rope_theta` +
    `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    if params.get("rope_type", "default") == "default":
        params.pop("rope_type", None)
    if params.get("rope_type") in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return float(theta), tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))


def rope_to_hf(theta, scaling):
    return {"rope_type": "default", "rope_theta": theta, **{k: list(v) if isinstance(v, tuple) else v
                                                           for k, v in scaling}}


class DecoderLM(nn.Module):
    """The shell every decoder-only family shares: token (+ learned position) embeddings -> blocks -> final norm ->
    head. A family subclasses it and sets `block` (its layer), `norm_kind`, `head_bias` and, for OPT,
    `position_offset`; its config provides num_layers, hidden_size, vocab_size, norm_eps, initializer_range,
    tie_word_embeddings, kv_heads and dim_per_head (and optionally embed_dim, final_layer_norm,
    layer_norm_elementwise_affine, max_position_embeddings).

    __call__(input_ids [B, T], attention_mask [B, T] | None, *, positions, cache, return_hidden, train) -> logits
    [B, T, vocab] float32, or (logits, cache) when a cache (from init_cache) is passed; see decoder_context for the
    mask and the positions. train=True applies dropout (config.dropout_rate) and needs a 'dropout' rng. Blocks take
    a `deterministic` attribute (False in training calls)."""
    config: Any
    block = None
    norm_kind = "rms"
    head_bias = False
    position_offset = None  # learned absolute positions, read at position + offset (OPT)
    embed_dropout = False  # dropout after the embeddings in training calls (OPT, GPT-J)

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, *, positions=None, cache=None, return_hidden=False,
                 train=False):
        c = self.config
        kw = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype))
        lin = dict(std=c.initializer_range, **kw)
        embed_dim = getattr(c, "embed_dim", c.hidden_size)
        affine = getattr(c, "layer_norm_elementwise_affine", True)
        ctx, new_cache = decoder_context(input_ids, attention_mask, positions, cache)
        embed = token_embedding(c.vocab_size, embed_dim, name="embed", **lin)
        x = embed(input_ids)
        if embed_dim != c.hidden_size:
            x = Linear(embed_dim, c.hidden_size, name="project_in", **lin)(x)
        if self.position_offset is not None:
            table = token_embedding(c.max_position_embeddings + self.position_offset, c.hidden_size,
                                    name="embed_positions", **lin)
            x = x + table(ctx["positions"] + self.position_offset)
        if self.embed_dropout:
            x = nn.Dropout(c.dropout_rate, deterministic=not train)(x)
        x, layer_cache = apply_layers(self.block, split_tokens(x, c.sequence_parallel), ctx, cache, c, owner=self,
                                      deterministic=not train)
        if getattr(c, "final_layer_norm", True):
            x = Norm(self.norm_kind, c.norm_eps, use_scale=affine, name="final_norm", **kw)(x)
        x = gather_tokens(x, c.sequence_parallel)
        if embed_dim != c.hidden_size:
            x = Linear(c.hidden_size, embed_dim, name="project_out", **lin)(x)
        return lm_output(x, embed, c.tie_word_embeddings, new_cache, layer_cache, return_hidden,
                         head_bias=self.head_bias, **lin)

    def init_cache(self, batch, max_len, dtype=None):
        """An empty KV cache for `batch` rows of up to `max_len` tokens (prompt + generated)."""
        c = self.config
        return empty_cache(c.num_layers, batch, max_len, c.kv_heads, c.dim_per_head, dtype or c.dtype)
