"""Autoregressive generation with a KV cache: one prefill call, then a lax.while_loop of one-token steps, jitted once
per (model, settings, shape bucket). Works on sharded parameters (the jit follows their shardings)."""
import functools

import jax
import jax.numpy as jnp

import kernels


def _bucket(n):
    """Prompt lengths are padded up to a bucket so varied prompts share compilations: powers of two to 1024, then
    multiples of 1024."""
    return max(8, 1 << (n - 1).bit_length()) if n <= 1024 else -(-n // 1024) * 1024


KV_CACHE_DTYPES = ("int8", "bfloat16", "float16", "float32")  # what `generate(kv_cache_dtype=)` stores a cache in


def generate(model, params, input_ids, *, max_new_tokens, attention_mask=None, temperature=0.0, top_k=None,
             top_p=None, eos_token_id=None, pad_token_id=None, rng=None, kv_cache_dtype=None):
    """Generates up to `max_new_tokens` tokens per row.

    input_ids, attention_mask: int [B, T]; decoder-only prompts are left-padded (mask 0 on the padding).
    temperature 0 is greedy; otherwise sampling from softmax(logits / temperature), optionally restricted to the
    top_k tokens and/or the smallest set with probability >= top_p. rng: a PRNG key for sampling.
    A row that emits eos_token_id is then filled with pad_token_id (default: eos_token_id); the loop stops once
    every row is done. kv_cache_dtype: the KV cache's storage (default the model's compute dtype); 'int8' keeps
    keys and values as int8 with a scale per token and head (`layers.empty_cache`), half of bf16's bytes.
    Returns int32 [B, T + max_new_tokens] (prompt then new tokens) for decoder-only models, and the decoder ids
    [B, 1 + max_new_tokens] (start token then new tokens) for T5.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, len]; got shape {input_ids.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}; expected >= 1")
    if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
        raise ValueError(f"temperature={temperature}, top_k={top_k}, top_p={top_p}; expected temperature >= 0, "
                         "top_k >= 1, 0 < top_p <= 1")
    B, T = input_ids.shape
    mask = jnp.ones((B, T), jnp.int32) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    ids = jnp.asarray(input_ids, jnp.int32)
    pad = _bucket(T) - T
    encoder_decoder = getattr(model, "is_encoder_decoder", False)
    # Decoder prompts grow on the left (the last column must be the newest token); encoder inputs on the right.
    widths = ((0, 0), (0, pad) if encoder_decoder else (pad, 0))
    ids, mask = jnp.pad(ids, widths), jnp.pad(mask, widths)
    if pad_token_id is None:
        pad_token_id = 0 if eos_token_id is None else eos_token_id
    cache_dtype = None
    if kv_cache_dtype is not None:
        try:
            cache_dtype = jnp.dtype(kv_cache_dtype).name
        except TypeError:
            cache_dtype = repr(kv_cache_dtype)
        if cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; expected None, 'int8', 'bfloat16', 'float16' or "
                             "'float32'")
    run = _compiled(model, max_new_tokens, float(temperature), top_k, top_p, eos_token_id, pad_token_id,
                    cache_dtype)
    mesh = _mesh_of(params)
    # Traced under the parameters' mesh, Pallas kernels run on each device's own block (kernels/_partition.py).
    with kernels.under_mesh(mesh):
        new = run(params, ids, mask, jax.random.PRNGKey(0) if rng is None else rng)
    if encoder_decoder:
        return jnp.concatenate([jnp.full((B, 1), model.config.decoder_start_token_id, jnp.int32), new], axis=1)
    return jnp.concatenate([jnp.asarray(input_ids, jnp.int32), new], axis=1)


def _mesh_of(params):
    """The mesh of the first parameter placed with a NamedSharding (None for tracers and single-device arrays)."""
    for x in jax.tree.leaves(params):
        try:
            sharding = x.sharding
        except Exception:  # noqa: BLE001 - a tracer inside someone else's jit has no concrete sharding
            return None
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    return None


@functools.lru_cache(maxsize=64)
def _compiled(model, max_new, temperature, top_k, top_p, eos, pad, cache_dtype):
    def select(logits, rng):
        if temperature == 0.0:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits = logits / temperature
        if top_k is not None:
            kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        if top_p is not None and top_p < 1:
            ordered = jnp.sort(logits, axis=-1)[:, ::-1]
            probs = jax.nn.softmax(ordered, axis=-1)
            keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p  # the top token is always kept
            threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
            logits = jnp.where(logits < threshold, -jnp.inf, logits)
        return jax.random.categorical(rng, logits).astype(jnp.int32)

    def run(params, ids, mask, rng):
        B = ids.shape[0]
        variables = {"params": params}
        if getattr(model, "is_encoder_decoder", False):
            encoder_out = model.apply(variables, ids, mask, method="encode")

            def step(tokens, cache):
                return model.apply(variables, tokens[:, None], encoder_out, mask, cache=cache, method="decode")

            start = jnp.full((B,), model.config.decoder_start_token_id, jnp.int32)
            logits, cache = step(start, model.init_cache(B, max_new, cache_dtype))
        else:
            def step(tokens, cache):
                return model.apply(variables, tokens[:, None], jnp.ones((B, 1), jnp.int32), cache=cache)

            logits, cache = model.apply(variables, ids, mask,
                                        cache=model.init_cache(B, ids.shape[1] + max_new, cache_dtype))
        rng, sub = jax.random.split(rng)
        token = select(logits[:, -1], sub)
        done = jnp.zeros((B,), bool) if eos is None else token == eos
        out = jnp.full((B, max_new), pad, jnp.int32).at[:, 0].set(token)

        def cond(state):
            i, _, _, done, _, _ = state
            return (i < max_new) & ~jnp.all(done)

        def body(state):
            i, out, token, done, cache, rng = state
            logits, cache = step(token, cache)
            rng, sub = jax.random.split(rng)
            token = jnp.where(done, pad, select(logits[:, -1], sub))
            if eos is not None:
                done = done | (token == eos)
            out = jax.lax.dynamic_update_slice(out, token[:, None], (0, i))
            return i + 1, out, token, done, cache, rng

        return jax.lax.while_loop(cond, body, (jnp.int32(1), out, token, done, cache, rng))[1]

    return jax.jit(run)
