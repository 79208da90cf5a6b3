"""RMSNorm and LayerNorm."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.layers.options import Dtype, layer_dtype


class Norm(nn.Module):
    """RMSNorm (kind='rms': LLaMA, T5) or LayerNorm (kind='layer': GPT-J, OPT), statistics in float32.

    offset: the scale applied is offset + w (Gemma stores w and computes x * (1 + w); a fresh w is then zeros). With
    an offset the product is taken in float32 before the cast to dtype, as transformers' Gemma norms do (LLaMA's
    casts first). dtype None: the output takes the scale's dtype (the input's without a scale)."""
    kind: str = "rms"
    eps: float = 1e-6
    use_scale: bool = True
    use_bias: bool = True  # LayerNorm only
    offset: float = 0.0
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        if not self.use_scale:
            return _normalize(x, None, None, self.kind, self.eps, 0.0, layer_dtype(self.dtype, x))
        scale = self.param("scale", nn.initializers.zeros if self.offset else nn.initializers.ones, (d,),
                           self.param_dtype)
        bias = (self.param("bias", nn.initializers.zeros, (d,), self.param_dtype)
                if self.kind == "layer" and self.use_bias else None)
        return _normalize(x, scale, bias, self.kind, self.eps, self.offset, layer_dtype(self.dtype, scale))


@functools.partial(jax.checkpoint, static_argnums=(3, 4, 5, 6))
def _normalize(x, scale, bias, kind, eps, offset, dtype):
    """Norm's arithmetic. Checkpointed, so that a gradient keeps only x (and the parameters) and recomputes the
    float32 statistics in the backward, where it reads x anyway: differentiated as written it would keep x in float32
    (twice a 16-bit input's bytes) and the normalised rows beside the output."""
    h = x.astype(jnp.float32)
    if kind == "layer":
        h = h - h.mean(-1, keepdims=True)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps)
    if scale is None:
        return h.astype(dtype)
    if offset:
        return (h * (offset + scale.astype(jnp.float32))).astype(dtype)
    h = h.astype(dtype) * scale.astype(dtype)
    if bias is not None:
        h = h + bias.astype(dtype)
    return h
