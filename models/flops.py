"""Model FLOPs of a training example: the numerator of model FLOPs utilisation (MFU).

Counted as in the PaLM paper (appendix B) and MaxText: a token passing through a weight matrix of N entries costs
2N FLOPs forward and 4N backward (6N), and attention costs two matmuls of 2 x heads x head_dim FLOPs per visible key,
again x3 for training. Rematerialisation is not counted (MFU measures the model's work, not the recomputation), and
causal attention counts half the keys, (T + 1) / 2 on average, because the flash kernels skip the masked blocks; a
layer with a sliding window of W < T counts the keys inside it (the kernels skip the blocks outside too).
Weights are read off the parameter tree: every Linear 'kernel', plus the embedding table when it doubles as the
output head (tied); a lookup costs nothing. A mixture of experts' stacked experts count the share a token passes
through: k of E (its top-k), the router being a Linear of its own.
"""
import jax

from models.layers import sliding_layers
from models.registry import init_params


def _kernel_sizes(params, active_experts=1.0):
    """{path tuple: entries} of every Linear kernel (stacked layers included), and of every stacked expert weight
    times `active_experts` (the share of the experts a token passes through)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    sizes = {}
    for path, leaf in leaves:
        keys = tuple(k.key for k in path)
        if keys[-1] == "kernel":
            sizes[keys] = leaf.size
        elif "experts" in keys[:-1]:
            sizes[keys] = leaf.size * active_experts
    return sizes


def train_flops_per_example(model, seq_len, decoder_len=None):
    """Forward + backward FLOPs of one example: `seq_len` tokens for a decoder-only model; for T5, `seq_len`
    encoder and `decoder_len` decoder tokens (the decoder's cross-attention keys and values are projections of the
    encoder tokens, so they count per encoder token)."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r}; expected a positive int")
    c = model.config
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    kernels = _kernel_sizes(params, getattr(c, "num_experts_per_tok", 1) / getattr(c, "num_experts", 1))
    if hasattr(c, "d_kv"):  # T5
        if not isinstance(decoder_len, int) or decoder_len < 1:
            raise ValueError(f"decoder_len={decoder_len!r}; expected a positive int for an encoder-decoder model")
        S, T, per_key = seq_len, decoder_len, 12 * c.num_heads * c.d_kv
        encoder_side = sum(n for p, n in kernels.items()
                           if p[0] == "encoder" or ("cross_attn" in p and p[-2] in ("k", "v")))
        decoder_side = sum(kernels.values()) - encoder_side + (params["shared"]["embedding"].size
                                                               if c.tie_word_embeddings else 0)
        attention = per_key * (c.num_layers * S * S + c.decoder_layers * (T * (T + 1) / 2 + T * S))
        return 6 * (S * encoder_side + T * decoder_side) + attention
    if decoder_len is not None:
        raise ValueError(f"decoder_len={decoder_len!r}; expected None for a decoder-only model")
    T = seq_len
    weights = sum(kernels.values()) + (params["embed"]["embedding"].size if c.tie_word_embeddings else 0)
    pairs = sum(_causal_pairs(T, c.sliding_window if sliding else None) for sliding in sliding_layers(c))
    return 6 * T * weights + 12 * c.num_heads * c.dim_per_head * pairs


def _causal_pairs(T, window):
    """(query, key) pairs a causal layer of T tokens attends, each query to at most `window` keys (None: all)."""
    if window is None or window >= T:
        return T * (T + 1) / 2
    return window * (window + 1) / 2 + (T - window) * window
