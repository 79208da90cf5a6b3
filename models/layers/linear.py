"""Projections: `Linear` (float, int8 or NF4 kernels, FP8 matmuls, LoRA adapters, the fused-matmul path) and the
activations."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import kernels
from kernels.matmul.formats import NF4_BLOCK, NF4_LEVELS, dequantize_nf4
from kernels.matmul.fp8 import HISTORY_ROWS, OVERWRITE, fp8_dot
from models.layers.options import Dtype, layer_dtype

_NF4_STD = float(np.std(NF4_LEVELS))  # of a uniformly random NF4 code: a fresh kernel's scale divides by it

# Hugging Face activation names -> the fused kernels' names.
_KERNEL_ACTIVATION = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "swish": "silu"}


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


@functools.partial(jax.checkpoint, static_argnums=(2,))
def activate(y, up, act):
    """act(y) (* up unless None): an MLP's elementwise part after its first projection(s), checkpointed so that a
    gradient keeps only its inputs (and the down projection its output) and recomputes the rest in the backward's
    fusion, which reads them anyway; differentiated as written it would also keep the activation's intermediates
    (SiLU: its sigmoid and output, each as large as y)."""
    h = activation(act)(y)
    return h if up is None else h * up


def kernel_activation(name):
    """The fused kernels' name of a Hugging Face activation name."""
    return _KERNEL_ACTIVATION.get(name, name)


def lora_a_init(key, shape, dtype=jnp.float32):
    """LoRA's A [..., in, rank]: uniform in +-1/sqrt(in) (PEFT's kaiming_uniform(a=sqrt(5))); B starts at zero, so
    a fresh adapter changes nothing."""
    bound = shape[-2] ** -0.5
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def quantized_params(module, name, fmt, shape, std):
    """Declares a fresh quantised weight of float shape [..., K, N] in `module`: `name` ('int8': int8 [..., K, N];
    'nf4': two codes a byte, uint8 [..., K / 2, N]) and `name`_scale (float32 [..., N]; nf4: [..., K / 64, N]),
    uniformly random codes scaled to the float init's standard deviation `std` (a real base comes quantised from a
    float checkpoint: `models.quantize`, `load_pretrained(quantize=...)`). Returns (codes, scale)."""
    *lead, k, n = shape
    if fmt == "int8":
        return (module.param(name, lambda key, s: jax.random.randint(key, s, -127, 128, jnp.int8), tuple(shape)),
                module.param(f"{name}_scale", lambda key, s: jnp.full(s, std * 3 ** 0.5 / 127), (*lead, n)))
    if k % NF4_BLOCK:
        raise ValueError(f"quantize='nf4' on a projection of {k} inputs ({module.name}); expected a multiple of "
                         f"{NF4_BLOCK}")
    return (module.param(name, lambda key, s: jax.random.randint(key, s, 0, 256).astype(jnp.uint8), (*lead, k // 2, n)),
            module.param(f"{name}_scale", lambda key, s: jnp.full(s, std / _NF4_STD), (*lead, k // NF4_BLOCK, n)))


class Linear(nn.Module):
    """y = act(x @ kernel + bias), kernel [in, out]. With `implementation` the matmul, bias and activation run fused in
    kernels.fused_matmul. `weight()` gives the kernel as the fused gated MLP reads it; `.bias` the bias.
    lora_rank > 0 adds LoRA's float32 `lora_a` [in, rank] and `lora_b` [rank, out]: (x A) B * lora_scale joins the
    product before the activation. quantize='int8' stores the kernel as int8 with a float32 `kernel_scale` [out]:
    y = (x q) * scale, the scale applied to the product (a per-column scale commutes with it), so the dequantised
    weight never exists; the kernel path reads q as int8 and scales in its epilogue. With LoRA the kernel path
    computes (x q) s alone and the rest follows in plain jnp. dtype None: the product is taken in the dtype of the
    kernel it is handed (a quantised kernel's: its scale's), the input cast to it. fp8: x @ kernel runs as
    `kernels.matmul.fp8.fp8_dot` (e4m3 operands, e5m2 output gradient, per-tensor scales, float32 accumulation)
    and returns the compute dtype; bias, LoRA's low-rank product and the activation stay in the compute dtype. Not
    with quantize or `implementation` (ModelOptions refuses them together). fp8_history > 0: delayed scaling, the
    scales from a float32 `fp8_history` [3, fp8_history] of the last amaxes of x, the kernel and the output gradient
    (zeros when fresh; a parameter whose next value is its gradient, engine/step/update.py); it is declared whenever
    fp8_history > 0, so a checkpoint of an FP8 run loads without fp8 too (and then goes unused)."""
    in_features: int
    features: int
    use_bias: bool = False
    std: float = 0.02
    lora_rank: int = 0
    lora_scale: float = 1.0
    lora_dropout: float = 0.0
    deterministic: bool = True
    quantize: str | None = None
    fp8: bool = False
    fp8_history: int = 0
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32

    def setup(self):
        shape = (self.in_features, self.features)
        # Fresh quantised kernels: uniformly random codes scaled to the float init's standard deviation. A real base
        # comes quantised from a float checkpoint (`models.quantize`, `load_pretrained(quantize=...)`).
        if self.quantize:
            self.kernel, self.kernel_scale = quantized_params(self, "kernel", self.quantize, shape, self.std)
        else:
            self.kernel = self.param("kernel", nn.initializers.normal(self.std), shape, self.param_dtype)
        self.bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype) \
            if self.use_bias else None
        if self.lora_rank:
            self.lora_a = self.param("lora_a", lora_a_init, (self.in_features, self.lora_rank), jnp.float32)
            self.lora_b = self.param("lora_b", nn.initializers.zeros, (self.lora_rank, self.features), jnp.float32)
        if self.fp8_history:
            self.amax_history = self.param(OVERWRITE, nn.initializers.zeros, (HISTORY_ROWS, self.fp8_history),
                                           jnp.float32)

    def compute_dtype(self):
        """`dtype`, else the dtype of the kernel (a quantised kernel's scale) this module is handed."""
        return layer_dtype(self.dtype, self.kernel_scale if self.quantize else self.kernel)

    def weight(self):
        """(kernel, scale): the int8 kernel and its column scale, or the (nf4: dequantised) float kernel in the
        compute dtype and None."""
        if self.quantize == "int8":
            return self.kernel, self.kernel_scale
        if self.quantize == "nf4":
            return dequantize_nf4(self.kernel, self.kernel_scale, self.compute_dtype()), None
        return self.kernel.astype(self.compute_dtype()), None

    def __call__(self, x, act=None, implementation=None, interpret=False):
        dtype = self.compute_dtype()
        x = x.astype(dtype)
        w, scale = self.weight()
        b = None if self.bias is None else self.bias.astype(dtype)
        if self.fp8 and (self.quantize or implementation is not None):
            raise ValueError(f"Linear {self.name} with fp8=True and quantize={self.quantize!r}, implementation="
                             f"{implementation!r}; expected neither (FP8 takes the float kernel in plain XLA)")
        if implementation is not None and not self.lora_rank:
            return kernels.fused_matmul(x, w, b, w_scale=scale, activation=kernel_activation(act),
                                        implementation=implementation, interpret=interpret)
        if implementation is not None:
            y = kernels.fused_matmul(x, w, w_scale=scale, implementation=implementation, interpret=interpret)
        elif self.fp8:
            y = fp8_dot(x, w, self.amax_history if self.fp8_history else None)
        else:
            y = jnp.dot(x, w.astype(dtype))
            if scale is not None:
                y = y * scale.astype(dtype)
        if b is not None:
            y = y + b
        if self.lora_rank:
            if self.lora_dropout and not self.deterministic:  # the adapters' input only (PEFT's lora_dropout)
                keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - self.lora_dropout, x.shape)
                x = jnp.where(keep, x / (1.0 - self.lora_dropout), 0).astype(dtype)
            low = jnp.dot(x, self.lora_a.astype(dtype))
            y = y + jnp.dot(low, self.lora_b.astype(dtype)) * jnp.asarray(self.lora_scale, dtype)
        return y if act is None else activation(act)(y)


def projection_options(module, name):
    """Linear's LoRA, quantisation and FP8 arguments for projection `name` of an Attention or MLP `module`."""
    out = {} if module.quantize is None else {"quantize": module.quantize}
    if module.fp8:
        out["fp8"] = True
    if module.fp8_history:
        out["fp8_history"] = module.fp8_history
    if not module.lora_rank or name not in module.lora_targets:
        return out
    return dict(out, lora_rank=module.lora_rank, lora_scale=module.lora_alpha / module.lora_rank,
                lora_dropout=module.lora_dropout, deterministic=module.deterministic)
