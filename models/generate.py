"""Autoregressive generation with a KV cache: one prefill call, then a lax.while_loop of one-token steps, jitted once
per (model, settings, shape bucket). Works on sharded parameters (the jit follows their shardings).

Beam search (`num_beams` > 1) keeps K hypotheses a row as K cache rows: each step scores every beam's continuations
by summed log-probability, takes the best 2K candidates, moves those ending in EOS among the first K to the row's
pool of finished hypotheses (score: sum / generated_tokens ** length_penalty, EOS counted) and continues the best K
others, reordering the cache rows to their source beams. When a row is done follows Hugging Face's `early_stopping`:
True, once its pool holds K hypotheses; False (their default), once it is full and the best running beam, scored at
its current length, cannot beat the pool's worst; 'never', the same bound taken at `max_new_tokens` when
length_penalty > 0 (the longest a beam can get: the exact bound). A done row adds nothing more to its pool; at
`max_new_tokens` the running beams of rows not done join it, and the best hypothesis is returned."""
import functools

import jax
import jax.numpy as jnp

import kernels
from models.layers.options import compute_dtype


def _bucket(n):
    """Prompt lengths are padded up to a bucket so varied prompts share compilations: powers of two to 1024, then
    multiples of 1024."""
    return max(8, 1 << (n - 1).bit_length()) if n <= 1024 else -(-n // 1024) * 1024


KV_CACHE_DTYPES = ("int8", "bfloat16", "float16", "float32")  # what `generate(kv_cache_dtype=)` stores a cache in
# XLA options of every generation program (here and models/paged_generate.py), over the process's flags. No while-loop
# double buffering: engine.compiler turns it on for the training step's pipelined collectives, and it unrolls loops by
# two, here the layer scans (two copies of a layer and its attention kernel in every program); generation pipelines
# no collective, so the copies cost compile time only (models/README.md, "what generation compiles on a GPU").
COMPILER_OPTIONS = {"xla_gpu_enable_while_loop_double_buffering": False}


def generate(model, params, input_ids, *, max_new_tokens, attention_mask=None, temperature=0.0, top_k=None,
             top_p=None, eos_token_id=None, pad_token_id=None, rng=None, kv_cache_dtype=None, num_beams=1,
             length_penalty=1.0, early_stopping=False):
    """Generates up to `max_new_tokens` tokens per row.

    input_ids, attention_mask: int [B, T]; decoder-only prompts are left-padded (mask 0 on the padding).
    temperature 0 is greedy; otherwise sampling from softmax(logits / temperature), optionally restricted to the
    top_k tokens and/or the smallest set with probability >= top_p. rng: a PRNG key for sampling.
    A row that emits eos_token_id is then filled with pad_token_id (default: eos_token_id); the loop stops once
    every row is done. kv_cache_dtype: the KV cache's storage (default the model's compute dtype); 'int8' keeps
    keys and values as int8 with a scale per token and head (`layers.empty_cache`), half of bf16's bytes.
    num_beams > 1: beam search (see the module docstring; greedy, no sampling), the best hypothesis per row, scored
    by summed log-probability / generated_tokens ** length_penalty (0: plain sum; > 0 favours longer ones);
    early_stopping: True, False or 'never', when a row's search ends (Hugging Face's meanings, see the module
    docstring; their default False).
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
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams={num_beams!r}; expected an integer >= 1")
    if num_beams > 1 and (temperature > 0 or top_k is not None or top_p is not None):
        raise ValueError(f"num_beams={num_beams} with temperature={temperature}, top_k={top_k}, top_p={top_p}; "
                         "beam search is deterministic: expected temperature 0 and no top_k / top_p")
    if early_stopping not in (True, False, "never") or not isinstance(early_stopping, (bool, str)):
        raise ValueError(f"early_stopping={early_stopping!r}; expected True, False or 'never'")
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
    if num_beams > 1:
        run = _compiled_beam(model, max_new_tokens, num_beams, float(length_penalty), early_stopping, eos_token_id,
                             pad_token_id, cache_dtype)
    else:
        run = _compiled(model, max_new_tokens, float(temperature), top_k, top_p, eos_token_id, pad_token_id,
                        cache_dtype)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((params, ids, mask, rng))):
        run = run.__wrapped__  # inside a caller's jit (a predictor's pred_fn): inlined there, compiled as the caller's
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


def _prefill(model, variables, ids, mask, max_new, cache_dtype):
    """(last position's float32 logits [B, V], cache, step(tokens [B], cache) -> (logits, cache)). The cache is in
    `cache_dtype`, else the model's compute dtype (that of its parameters unless its config names one)."""
    B = ids.shape[0]
    cache_dtype = cache_dtype or compute_dtype(model.config, variables["params"])
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
    return logits[:, -1].astype(jnp.float32), cache, step


def _reorder_cache(cache, rows):
    """The cache with its batch rows taken from `rows` [B]: the layers' leaves are [layers, batch, ...], the
    segment ids [batch, len], the index a scalar."""
    return {**cache, "layers": jax.tree.map(lambda x: jnp.take(x, rows, axis=1), cache["layers"]),
            "segment_ids": jnp.take(cache["segment_ids"], rows, axis=0)}


@functools.lru_cache(maxsize=64)
def _compiled_beam(model, max_new, K, length_penalty, early_stopping, eos, pad, cache_dtype):
    neg = jnp.float32(-1e30)  # a dead beam's score; finite, so sums and top_k never see inf - inf

    def run(params, ids, mask, rng):
        del rng
        B = ids.shape[0]
        ids, mask = jnp.repeat(ids, K, axis=0), jnp.repeat(mask, K, axis=0)  # row b·K + k is beam k of row b
        logits, cache, step = _prefill(model, {"params": params}, ids, mask, max_new, cache_dtype)
        V = logits.shape[-1]
        # Only beam 0 starts alive, so the first step's K beams are K distinct tokens.
        scores = jnp.where(jnp.arange(K)[None, :] == 0, 0.0, neg) * jnp.ones((B, 1), jnp.float32)
        seqs = jnp.full((B, K, max_new), pad, jnp.int32)
        pool_scores = jnp.full((B, K), neg)
        pool_seqs = jnp.full((B, K, max_new), pad, jnp.int32)
        pool_count = jnp.zeros((B,), jnp.int32)
        norm = lambda total, n: total / jnp.asarray(n, jnp.float32) ** length_penalty  # noqa: E731

        def add_to_pool(pool, cand_scores, cand_seqs, take):
            """The best K of the pool and the candidates with `take` (others score neg)."""
            p_scores, p_seqs, count = pool
            cand_scores = jnp.where(take, cand_scores, neg)
            all_scores = jnp.concatenate([p_scores, cand_scores], axis=1)
            all_seqs = jnp.concatenate([p_seqs, cand_seqs], axis=1)
            best, index = jax.lax.top_k(all_scores, K)
            return best, jnp.take_along_axis(all_seqs, index[:, :, None], axis=1), count + take.sum(axis=1)

        def advance(i, logits, scores, seqs, cache, pool, done):
            """One beam step at generated position i (0-based) from the beams' next-token logits [B·K, V]."""
            logp = jax.nn.log_softmax(logits, axis=-1).reshape(B, K, V)
            total, flat = jax.lax.top_k((scores[:, :, None] + logp).reshape(B, K * V), 2 * K)
            source, token = flat // V, (flat % V).astype(jnp.int32)
            history = jnp.take_along_axis(seqs, source[:, :, None], axis=1)  # [B, 2K, max_new]
            history = jax.lax.dynamic_update_slice(history, token[:, :, None], (0, 0, i))
            if eos is not None:
                ends = token == eos
                # Hugging Face's rule: an EOS candidate counts only among the first K; alive ones only (a dead
                # beam's candidates score about neg).
                finish = ends & (jnp.arange(2 * K)[None, :] < K) & (total > neg / 2) & ~done[:, None]
                pool = add_to_pool(pool, norm(total, i + 1), history, finish)
            else:
                ends = jnp.zeros_like(token, bool)
            keep = jnp.argsort(ends, axis=1, stable=True)[:, :K]  # the best K candidates not ending in EOS
            scores = jnp.take_along_axis(total, keep, axis=1)
            seqs = jnp.take_along_axis(history, keep[:, :, None], axis=1)
            rows = (jnp.arange(B)[:, None] * K + jnp.take_along_axis(source, keep, axis=1)).reshape(-1)
            cache = _reorder_cache(cache, rows)
            full = pool[2] >= K
            if early_stopping is not True:  # can the best running beam still beat the worst of a full pool?
                longest = max_new if early_stopping == "never" and length_penalty > 0 else i + 1
                full = full & (norm(scores[:, 0], longest) <= pool[0][:, -1])
            done = done | full
            return scores, seqs, cache, pool, done, jnp.take_along_axis(token, keep, axis=1).reshape(-1), keep

        pool = (pool_scores, pool_seqs, pool_count)
        done = jnp.zeros((B,), bool)
        state = advance(0, logits, scores, seqs, cache, pool, done)

        def cond(state):
            i, done = state[0], state[5]
            return (i < max_new) & ~jnp.all(done)

        def body(state):
            i, scores, seqs, cache, pool, done, tokens, _ = state
            logits, cache = step(tokens, cache)
            return (i + 1, *advance(i, logits[:, -1].astype(jnp.float32), scores, seqs, cache, pool, done))

        i, scores, seqs, _, pool, done, _, rank = jax.lax.while_loop(cond, body, (jnp.int32(1), *state))
        # Rows still running at the length limit: their beams that ranked among the last step's first K candidates
        # join the pool (i tokens long), as Hugging Face finalises them.
        pool = add_to_pool(pool, norm(scores, i), seqs, ~done[:, None] & (scores > neg / 2) & (rank < K))
        return pool[1][:, 0]

    return jax.jit(run, compiler_options=COMPILER_OPTIONS)


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
        logits, cache, step = _prefill(model, {"params": params}, ids, mask, max_new, cache_dtype)
        rng, sub = jax.random.split(rng)
        token = select(logits, sub)
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

    return jax.jit(run, compiler_options=COMPILER_OPTIONS)
