"""What a training step keeps from the forward for the backward (without remat): every activation in the compute
dtype, and no more of them than the matmuls and the attention need; a scanned stack keeps only its layers' inputs
and their matmul and attention outputs (`models.layers.stack`), and recomputes the elementwise work between them.

Read off `jax.vjp`'s backward function, whose leaves are exactly the residuals the forward hands the backward (a
scanned stack's as [layers, ...] arrays, one per kind). Each kept activation costs its bytes of memory and, in a
scanned stack, a zero fill and a copy into and out of the stacked buffer, so a needless one is time on a GPU as
well as memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from engine.tasks import lm

B, T = 2, 32


def _residuals(family, config="tiny", scan_layers=True, **overrides):
    """(model config, the backward's residual leaves) of a bf16 model's loss on one batch of whole rows (a vocabulary
    of 96, no layer's width)."""
    model = models.create_model(family, config, scan_layers=scan_layers, remat="none", vocab_size=96, **overrides)
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
def test_a_bf16_step_keeps_no_float32_activation_and_only_the_mlps_projections(family, gated):
    """The norms keep their 16-bit input (their float32 statistics are recomputed in the backward, which reads the
    input anyway); of the MLP's width a scanned stack keeps the first projections' outputs (gated: gate and up; else
    up), not the activation (act(gate) * up, recomputed from them) nor its intermediates."""
    config, leaves = _residuals(family)
    d, ff = config.hidden_size, config.intermediate_size or 4 * config.hidden_size
    wide32 = _wide32(leaves, d, ff)
    assert not wide32, wide32
    assert len(_activations(leaves, ff)) == (2 if gated else 1), _activations(leaves, ff)


def test_dropout_keeps_no_random_draws():
    """With dropout a scanned stack draws its masks again in the backward (from the same key) instead of keeping the
    float32 draws or more activations: no float32 activation, as many of the model's width as without dropout."""
    config, leaves = _residuals("llama", dropout_rate=0.1)
    _, without = _residuals("llama")
    assert not _wide32(leaves, config.hidden_size, config.intermediate_size)
    assert len(_activations(leaves, config.hidden_size)) == len(_activations(without, config.hidden_size))


def test_a_scanned_llama_keeps_its_layer_inputs_and_matmul_and_attention_outputs():
    """With the GPU's attention kernel (Triton, interpreted), of the model's width a scanned LLaMA layer keeps its
    input and the q and o projections' outputs (no norm's output, no residual sum), of the heads' only the kernel's
    output (q and k are roped again from the projections'), so it keeps fewer bytes than the same layers unrolled,
    which keep what the backward reads."""
    kernel = dict(attention_implementation="triton", kernel_interpret=True)
    config, leaves = _residuals("llama", **kernel)
    d, heads = config.hidden_size, (config.num_heads, config.hidden_size // config.num_heads)
    assert len(_activations(leaves, d)) == 3 + 2, _activations(leaves, d)  # + the final norm's input and output
    assert len([x for x in leaves if x.ndim >= 4 and tuple(x.shape[-2:]) == heads]) == 1
    _, unrolled = _residuals("llama", scan_layers=False, **kernel)
    kept = lambda xs: sum(x.size * x.dtype.itemsize for x in xs)  # noqa: E731
    assert kept(leaves) < kept(unrolled), (kept(leaves), kept(unrolled))


def test_gemmas_offset_norms_keep_their_input_only():
    """Gemma 2's norms (x * (1 + w), the product in float32, four a layer) keep no float32 activation either."""
    config, leaves = _residuals("gemma2")
    wide32 = _wide32(leaves, config.hidden_size, config.intermediate_size)
    assert not wide32, wide32


def test_a_mixtures_experts_keep_two_tensors_of_their_width():
    """Mixtral's experts (rows sorted by expert, [B T k, ff]) keep gate and up, as the dense MLP."""
    _, leaves = _residuals("mixtral", intermediate_size=48)
    kept = [x.shape for x in leaves if x.shape[-1:] == (48,)]
    assert len(kept) == 2, kept
