"""RMSNorm and LayerNorm."""
import flax.linen as nn
import jax
import jax.numpy as jnp

from models.layers.options import Dtype


class Norm(nn.Module):
    """RMSNorm (kind='rms': LLaMA, T5) or LayerNorm (kind='layer': GPT-J, OPT), statistics in float32.

    offset: the scale applied is offset + w (Gemma stores w and computes x * (1 + w); a fresh w is then zeros). With
    an offset the product is taken in float32 before the cast to dtype, as transformers' Gemma norms do (LLaMA's
    casts first)."""
    kind: str = "rms"
    eps: float = 1e-6
    use_scale: bool = True
    use_bias: bool = True  # LayerNorm only
    offset: float = 0.0
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = x.astype(jnp.float32)
        if self.kind == "layer":
            h = h - h.mean(-1, keepdims=True)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + self.eps)
        if self.use_scale and self.offset:
            scale = self.param("scale", nn.initializers.zeros, (d,), self.param_dtype)
            return (h * (self.offset + scale.astype(jnp.float32))).astype(self.dtype)
        h = h.astype(self.dtype)
        if self.use_scale:
            h = h * self.param("scale", nn.initializers.ones, (d,), self.param_dtype).astype(self.dtype)
        if self.kind == "layer" and self.use_scale and self.use_bias:
            h = h + self.param("bias", nn.initializers.zeros, (d,), self.param_dtype).astype(self.dtype)
        return h
