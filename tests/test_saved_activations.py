"""What a training step keeps from the forward for the backward (without remat): every activation in the compute
dtype, and no more of them than the matmuls and the attention need.

Read off `jax.vjp`'s backward function, whose leaves are exactly the residuals the forward hands the backward (a
scanned stack's as [layers, ...] arrays, one per kind). Each kept activation costs its bytes of memory and, in a
scanned stack, a copy into and out of the stacked buffer, so a needless one is time on a GPU as well as memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from engine.tasks import lm

B, T = 2, 32


def _residuals(family, config="tiny", **overrides):
    """(model config, the backward's residual leaves) of a bf16 model's loss on one batch of whole rows (a vocabulary
    of 96, no layer's width)."""
    model = models.create_model(family, config, scan_layers=True, remat="none", vocab_size=96, **overrides)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), models.init_params(model, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, model.config.vocab_size, (B, T + 1)).astype(np.int32)
    batch = {"input_ids": jnp.asarray(tokens[:, :-1]), "labels": jnp.asarray(tokens[:, 1:])}
    loss_fn = lm.lm_loss_fn(model)
    _, backward = jax.vjp(lambda p: loss_fn(p, batch, jax.random.PRNGKey(0), True)[0], params)
    weights = {id(x) for x in jax.tree.leaves(params)}
    return model.config, [x for x in jax.tree.leaves(backward) if id(x) not in weights and hasattr(x, "shape")]


def _activations(leaves, width):
    """The activations [..., B, T, width] among `leaves` (a scanned stack's [layers, B, T, width] counts once: one
    a layer)."""
    return [x.shape for x in leaves if x.ndim >= 3 and x.shape[-1] == width and x.shape[-3:-1] == (B, T)]


def _wide32(leaves, *widths):
    """Shapes of the float32 activations [..., B, T, width] among `leaves` (the layers' widths: the loss's own
    float32 rows over the vocabulary are the loss's business)."""
    return [shape for w in set(widths) for shape in _activations(
        [x for x in leaves if x.dtype == jnp.float32], w)]


@pytest.mark.parametrize("family, gated", [("llama", True), ("gptj", False)])
def test_a_bf16_step_keeps_no_float32_activation_and_three_mlp_tensors_at_most(family, gated):
    """The norms keep their 16-bit input (their float32 statistics are recomputed in the backward, which reads the
    input anyway); the MLP keeps the projections' outputs and the down projection's input (gated: gate, up and
    act(gate) * up; else up's output and its activation), not the activation's intermediates."""
    config, leaves = _residuals(family)
    d, ff = config.hidden_size, config.intermediate_size or 4 * config.hidden_size
    wide32 = _wide32(leaves, d, ff)
    assert not wide32, wide32
    assert len(_activations(leaves, ff)) == (3 if gated else 2), _activations(leaves, ff)


def test_gemmas_offset_norms_keep_their_input_only():
    """Gemma 2's norms (x * (1 + w), the product in float32, four a layer) keep no float32 activation either."""
    config, leaves = _residuals("gemma2")
    wide32 = _wide32(leaves, config.hidden_size, config.intermediate_size)
    assert not wide32, wide32


def test_a_mixtures_experts_keep_three_tensors_of_their_width():
    """Mixtral's experts (rows sorted by expert, [B T k, ff]) keep gate, up and act(gate) * up, as the dense MLP."""
    _, leaves = _residuals("mixtral", intermediate_size=48)
    kept = [x.shape for x in leaves if x.shape[-1:] == (48,)]
    assert len(kept) == 3, kept
