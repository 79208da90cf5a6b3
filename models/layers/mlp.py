"""The feed-forward block: gated (SwiGLU, gated GELU) or not, plain jnp or through the fused kernels."""
import flax.linen as nn
import jax.numpy as jnp

import kernels
from models.layers.linear import Linear, activate, kernel_activation, projection_options
from models.layers.options import Dtype
from models.layers.parallel import gather_tokens, split_tokens


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
    fp8: bool = False  # the projections' matmuls in FP8 (`Linear`; not with `implementation`)
    fp8_history: int = 0  # their amax histories' length (0: current scaling)
    sequence_parallel: bool = False  # x and the output with tokens split over `model` (`split_tokens`)
    dtype: Dtype | None = None  # None: the projections' kernels' dtype
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = gather_tokens(x, self.sequence_parallel)
        d = x.shape[-1]
        kw = dict(use_bias=self.use_bias, std=self.std, dtype=self.dtype, param_dtype=self.param_dtype)
        fused = dict(implementation=self.implementation, interpret=self.interpret)
        up = Linear(d, self.hidden, name="up", **kw, **projection_options(self, "up"))
        if not self.gated:
            h = up(x, act=self.act, **fused) if self.implementation is not None else activate(up(x), None, self.act)
        else:
            gate = Linear(d, self.hidden, name="gate", **kw, **projection_options(self, "gate"))
            if (self.implementation is not None and not self.use_bias and not gate.lora_rank and not up.lora_rank
                    and not self.fp8):  # (with fp8 the Linears refuse `implementation` in one line)
                (w_gate, gate_scale), (w_up, up_scale) = gate.weight(), up.weight()
                h = kernels.gated_mlp(x.astype(gate.compute_dtype()), w_gate, w_up, w_gate_scale=gate_scale,
                                      w_up_scale=up_scale, activation=kernel_activation(self.act),
                                      **fused)
            elif self.implementation is not None:
                h = gate(x, act=self.act, **fused) * up(x, **fused)
            else:
                h = activate(gate(x), up(x), self.act)
        out = Linear(self.hidden, d, name="down", **{**kw, "std": self.out_std or self.std},
                     **projection_options(self, "down"))(h)
        return split_tokens(out, self.sequence_parallel)
