"""Plain-JAX side of the fused-matmul family: the epilogue math every backend shares, the `'xla'` backend, and the
materialising references the tests compare against.

A backend is a module with two functions (see `triton.py`, `mosaic_tpu.py`):
- `matmul(lhs, rhs, extras, *, terms, epilogue, extra_kinds, out_dtypes, trans_lhs, trans_rhs, blocks, interpret,
  aliases)`: accumulators `acc_t = sum_{(i, j) in terms[t]} op(lhs[i]) @ op(rhs[j])` in float32 (`op` transposes
  when `trans_lhs` / `trans_rhs`), then `epilogue(accs, cols, *extras) -> outputs`, applied per output tile before
  its only store. `extras` are per-row `[M, 1]`, per-column `[1, N]` or per-tile `[M, N]` arrays (`extra_kinds`);
  `cols [1, N]` are the output's column indices. `aliases`: (extra index, output index) pairs, a per-tile extra whose
  buffer the output is written into in place (each tile read before its own store).
- `lce_forward(x [N, D], w [D, V], labels [N], *, blocks, interpret) -> (lse [N], label_logit [N])`, float32, with
  the vocabulary swept blockwise by an online log-sum-exp (`lse_update`).
"""
import jax
import jax.numpy as jnp
from jax import lax



def _erf(z):
    """erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7): Pallas's Triton lowering has no erf or erfc, which
    jax.nn.gelu(approximate=False) needs."""
    t = 1.0 / (1.0 + 0.3275911 * jnp.abs(z))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf_abs = 1.0 - poly * jnp.exp(-z * z)
    return jnp.where(z < 0, -erf_abs, erf_abs)  # Not jnp.sign: Mosaic lowers it per TPU generation, so not on CPU.


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda z: 0.5 * z * (1.0 + _erf(z * 0.7071067811865476)),
    "gelu_tanh": lambda z: jax.nn.gelu(z, approximate=True),
    "silu": jax.nn.silu,
}
# What the references use: jax.nn's own definitions, independent of the kernels' ones above.
_REFERENCE_ACTIVATIONS = {**ACTIVATIONS, "gelu": lambda z: jax.nn.gelu(z, approximate=False)}
# A finite "minus infinity": masked logits must not turn exp(m_old - m_new) into exp(-inf - -inf) = nan.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def activate(z, activation):
    return z if activation is None else ACTIVATIONS[activation](z)


def activate_with_grad(z, activation):
    """(act(z), act'(z)) elementwise, by forward-mode AD so each activation is written once."""
    return jax.jvp(ACTIVATIONS[activation], (z,), (jnp.ones_like(z),))


# ---- Epilogues: (accs, cols, *extras) -> outputs, all float32 tiles; the kernels cast on store. ----

def _scaled(acc, scale):
    return acc if scale is None else acc * scale


def epilogue_bias_act(activation, has_bias, has_scale=False):
    """act(acc * scale + bias); extras: (scale [1, N] if has_scale, bias [1, N] if has_bias)."""
    def epilogue(accs, cols, *extras):
        scale, extras = (extras[0], extras[1:]) if has_scale else (None, extras)
        z = _scaled(accs[0], scale)
        return (activate(z + extras[0] if has_bias else z, activation),)
    return epilogue


def epilogue_bias_act_grad(activation, has_bias, has_scale=False, with_dz=False, with_acc_dz=False):
    """d acc = dy * act'(z) * scale for z = acc * scale + bias, the forward matmul recomputed and never stored;
    extras: (scale?, bias?, dy). with_dz adds dz = dy * act'(z) (what the bias's gradient sums when a scale
    differs it from d acc), with_acc_dz adds acc * dz (what the scale's gradient sums)."""
    def epilogue(accs, cols, *extras):
        scale, extras = (extras[0], extras[1:]) if has_scale else (None, extras)
        z = _scaled(accs[0], scale)
        z = z + extras[0] if has_bias else z
        dy = extras[-1].astype(jnp.float32)
        dz = dy if activation is None else dy * activate_with_grad(z, activation)[1]
        return (_scaled(dz, scale),) + ((dz,) if with_dz else ()) + ((accs[0] * dz,) if with_acc_dz else ())
    return epilogue


def epilogue_identity(accs, cols, *extras):
    return accs


def epilogue_add(accs, cols, total):
    """acc + total: a product added to the float32 sum it accumulates into (extras: that sum's tile)."""
    return (accs[0] + total,)


def epilogue_gate(activation, has_scales=False):
    """act(gate) * up with gate = acc_gate (* gate_scale), up = acc_up (* up_scale); extras: the two scales [1, N]
    when has_scales."""
    def epilogue(accs, cols, *scales):
        gate, up = (_scaled(acc, s) for acc, s in zip(accs, scales if has_scales else (None, None)))
        return (activate(gate, activation) * up,)
    return epilogue


def epilogue_gate_grad(activation, has_scales=False, with_acc_d=False):
    """(d acc_gate, d acc_up) of h = act(gate) * up from the recomputed products and the dh tile; extras: (gate_scale,
    up_scale)? then dh. with_acc_d adds (acc_gate * d gate, acc_up * d up), what the scales' gradients sum."""
    def epilogue(accs, cols, *extras):
        scales, dh = (extras[:2] if has_scales else (None, None)), extras[-1].astype(jnp.float32)
        gate, up = (_scaled(acc, s) for acc, s in zip(accs, scales))
        a, da = activate_with_grad(gate, activation)
        d_gate, d_up = dh * up * da, dh * a
        outs = (_scaled(d_gate, scales[0]), _scaled(d_up, scales[1]))
        return outs + ((accs[0] * d_gate, accs[1] * d_up) if with_acc_d else ())
    return epilogue


def epilogue_dlogits(accs, cols, lse, labels, g):
    """d loss / d logits = g * (softmax - onehot(label)) for one vocabulary chunk; `labels` are chunk-relative."""
    p = jnp.exp(accs[0] - lse)
    return (g * (p - (cols == labels).astype(jnp.float32)),)


def lse_update(carry, logits, cols, labels, vocab):
    """One step of the online log-sum-exp over a vocabulary block: carry (m, l, label_logit), each [rows, 1]."""
    m, l, label_logit = carry
    logits = jnp.where(cols < vocab, logits, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1, keepdims=True))
    l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new), axis=-1, keepdims=True)
    label_logit = label_logit + jnp.sum(jnp.where(cols == labels, logits, 0.0), axis=-1, keepdims=True)
    return m_new, l, label_logit


def lse_init(rows):
    return (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))


# ---- The 'xla' backend. ----

def dot(a, b, trans_a=False, trans_b=False):
    """a @ b (a.T / b.T when trans_*) with float32 accumulation, b in a's dtype; also used inside the kernels."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    if b.dtype != a.dtype:  # an int8 weight tile, converted where it is read (weight-only quantisation)
        b = b.astype(a.dtype)
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def matmul(lhs, rhs, extras=(), *, terms, epilogue, extra_kinds=(), out_dtypes, trans_lhs=False, trans_rhs=False,
           blocks=None, interpret=False, aliases=()):
    del extra_kinds, blocks, interpret, aliases  # Whole arrays: XLA tiles, fuses the epilogue and reuses buffers.
    accs = tuple(sum(dot(lhs[i], rhs[j], trans_lhs, trans_rhs) for i, j in term) for term in terms)
    cols = lax.broadcasted_iota(jnp.int32, (1, accs[0].shape[1]), 1)
    outs = epilogue(accs, cols, *extras)
    return tuple(o.astype(d) for o, d in zip(outs, out_dtypes))


def sweep_vocab(step, carry, w, chunk):
    """Folds `step(carry, w_c, start) -> carry` over w's columns `chunk` at a time: a scan over the whole chunks,
    then one static step for the remainder, so w is never padded (padding would copy the whole of w)."""
    num_full, tail = divmod(w.shape[1], chunk)
    if num_full:
        def body(carry, c):
            start = c * chunk
            return step(carry, lax.dynamic_slice_in_dim(w, start, chunk, axis=1), start), None
        carry, _ = lax.scan(body, carry, jnp.arange(num_full))
    if tail:
        carry = step(carry, w[:, num_full * chunk:], num_full * chunk)
    return carry


def lce_forward(x, w, labels, *, blocks, interpret=False):
    """Sweeps vocabulary chunks of `blocks.vocab_chunk` columns: one [N, chunk] float32 logits block is live."""
    del interpret
    n, vocab = x.shape[0], w.shape[1]
    labels = labels.reshape(n, 1)

    def step(carry, w_c, start):
        cols = start + lax.broadcasted_iota(jnp.int32, (1, w_c.shape[1]), 1)
        return lse_update(carry, dot(x, w_c), cols, labels, vocab)

    m, l, label_logit = sweep_vocab(step, lse_init(n), w, blocks.vocab_chunk)
    return (m + jnp.log(l))[:, 0], label_logit[:, 0]


# ---- Materialising references for tests (autodiff'd by JAX, nothing shared with the fused paths but the ops). ----

def _weight(w, scale, x):
    """The weight a reference multiplies by: w itself, or a quantised one dequantised (w * scale per column)."""
    return w if scale is None else (w.astype(jnp.float32) * scale.astype(jnp.float32)).astype(x.dtype)


def fused_matmul_reference(x, w, bias=None, *, w_scale=None, activation=None):
    z = jnp.matmul(x, _weight(w, w_scale, x), preferred_element_type=jnp.float32)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    return (z if activation is None else _REFERENCE_ACTIVATIONS[activation](z)).astype(x.dtype)


def gated_mlp_reference(x, w_gate, w_up, *, w_gate_scale=None, w_up_scale=None, activation="silu"):
    gate = jnp.matmul(x, _weight(w_gate, w_gate_scale, x), preferred_element_type=jnp.float32)
    up = jnp.matmul(x, _weight(w_up, w_up_scale, x), preferred_element_type=jnp.float32)
    return (_REFERENCE_ACTIVATIONS[activation](gate) * up).astype(x.dtype)


def linear_cross_entropy_reference(x, w, labels, *, ignore_index=-100):
    """Materialises the [..., V] float32 logits; the baseline for parity and for the memory comparison."""
    logits = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    valid = labels != ignore_index
    safe = jnp.where(valid, labels, 0)
    label_logit = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    return jnp.where(valid, jax.nn.logsumexp(logits, axis=-1) - label_logit, 0.0)
