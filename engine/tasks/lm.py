"""Causal language modelling on packed rows: collation, the next-token loss (plain logits or the fused head + loss
kernel), and generation of token ids and texts.

Losses: with `implementation=None` the model computes the logits [B, T, vocab] and the loss is taken from them.
With a kernel implementation ('xla', 'triton', 'mosaic_tpu', or 'auto' for the backend's best) the model returns its
hidden states and `kernels.linear_cross_entropy` applies the output head blockwise over the vocabulary, so the
[tokens, vocab] logits never exist (for a 128k vocabulary they are the largest activation of a step); token accuracy
is then not reported, as it would need them.
"""
import jax
import jax.numpy as jnp
import numpy as np

import kernels
import models


def collate_lm(examples):
    """Rows of `pack` -> {'input_ids', 'labels', 'segment_ids'} [B, seq_len]; labels are -100 where the next token
    is padding or starts another document. Rows without 'segment_ids' (each {'tokens'} alone: one whole sequence,
    as PyTorch trainers feed fixed-length windows) -> {'input_ids', 'labels'}: the model attends without segment
    ids, which lets a GPU take cuDNN's attention (`kernels.default_implementation`)."""
    tokens = np.stack([e["tokens"] for e in examples])
    with_ids = ["segment_ids" in e for e in examples]
    if not any(with_ids):
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].astype(np.int32)}
    if not all(with_ids):
        raise ValueError(f"examples: row {with_ids.index(False)} has no 'segment_ids' and row {with_ids.index(True)} "
                         "has; expected every row of a batch with them (packed documents) or none (whole rows)")
    seg = np.stack([e["segment_ids"] for e in examples])
    labels = np.where((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0), tokens[:, 1:], -100).astype(np.int32)
    return {"input_ids": tokens[:, :-1], "labels": labels, "segment_ids": seg[:, :-1]}


# None: plain logits; 'chunked': kernels.linear_cross_entropy_sum (a mean loss only); else linear_cross_entropy's.
LOSS_IMPLEMENTATIONS = (None, "auto", "chunked") + kernels.IMPLEMENTATIONS


def head_weight(model, params):
    """The output head of `model` as `(w [d_model, vocab], bias [vocab] | None)`: the embedding table transposed
    when the head is tied to it (LLaMA/OPT/T5 `tie_word_embeddings`), else the untied `lm_head` (with GPT-J's bias)."""
    if model.config.tie_word_embeddings:
        table = params["shared" if getattr(model, "is_encoder_decoder", False) else "embed"]["embedding"]
        return table.T, None
    return params["lm_head"]["kernel"], params["lm_head"].get("bias")


def check_implementation(implementation):
    if implementation not in LOSS_IMPLEMENTATIONS:
        raise ValueError(f"loss implementation={implementation!r}; expected one of {LOSS_IMPLEMENTATIONS} (None: "
                         "plain logits; otherwise kernels.linear_cross_entropy)")


def default_loss_implementation(model=None, *, dtype, platform, device_kind, per_token=False):
    """The loss implementation a training script takes by default on a device of `platform` and `device_kind` (a
    run's, or a compile-only target's): None (plain logits) on a CPU and for a `model` whose final logits are
    soft-capped (the fused kernel does not cap them); else what `kernels.default_implementation` measured fastest
    for `linear_cross_entropy` at `dtype` on that kind (None where plain logits won; with `per_token`, DPO's and
    PPO's per-token log-probabilities, a measured 'chunked', a summed loss, is None too)."""
    if platform == "cpu" or getattr(getattr(model, "config", None), "final_logit_softcap", None):
        return None
    choice = kernels.default_implementation("linear_cross_entropy", device_kind=device_kind, dtype=dtype)
    return None if choice == "plain" or (per_token and choice == "chunked") else choice


def token_losses(model, params, out, labels, implementation=None, interpret=False):
    """Per-token cross-entropy [B, T] (float32, 0 where labels < 0) from the model's output `out`: logits [B, T, V]
    (implementation None) or hidden states [B, T, D] fed to kernels.linear_cross_entropy with the model's head, so
    the logits never exist. A token's log-probability is minus its loss."""
    valid = labels >= 0
    if implementation == "chunked":
        raise ValueError("loss implementation='chunked' gives a summed loss (kernels.linear_cross_entropy_sum), not "
                         "per-token losses; expected None (plain logits) or a kernel implementation here")
    if implementation is None:
        losses = cross_entropy(out, jnp.maximum(labels, 0))
    else:
        x, w = _head_operands(model, params, out)
        losses = kernels.linear_cross_entropy(x, w, jnp.where(valid, labels, -100), ignore_index=-100,
                                              implementation=None if implementation == "auto" else implementation,
                                              interpret=interpret)
    return jnp.where(valid, losses, 0.0)


@jax.custom_vjp
def cross_entropy(logits, labels):
    """Per-token softmax cross-entropy (float32 [...]) of logits [..., V] (any float dtype, taken in float32) at
    integer labels [...] in [0, V): log-sum-exp minus the label's logit. Its own backward, (softmax - onehot) * g in
    one elementwise pass over the logits, written in their dtype: differentiated as written, the label's logit (a
    gather) would transpose to a scatter into a float32 [..., V] of zeros, and the log-softmax to more full float32
    passes besides (at 16384 tokens of a 128256 vocabulary each is 8.4 GB)."""
    return _cross_entropy_forward(logits, labels)[0]


def _cross_entropy_forward(logits, labels):
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    return lse - jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0], (logits, labels, lse)


def _cross_entropy_backward(residuals, g):
    logits, labels, lse = residuals
    x = logits.astype(jnp.float32)
    onehot = jax.lax.broadcasted_iota(labels.dtype, x.shape, x.ndim - 1) == labels[..., None]
    return ((jnp.exp(x - lse[..., None]) - onehot) * g[..., None]).astype(logits.dtype), None


cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)


def _head_operands(model, params, out):
    """(x, w) with x @ w the logits of hidden states `out`: the head in `out`'s dtype, a bias folded in as a column
    of ones (x @ w + b == [x, 1] @ [w; b], padded with zeros to a multiple of 128 so a kernel's tiles stay whole)."""
    w, bias = head_weight(model, params)
    x, w = out, w.astype(out.dtype)
    if bias is not None:
        extra = 128 - x.shape[-1] % 128
        ones = jnp.ones(x.shape[:-1] + (1,), x.dtype)
        x = jnp.concatenate([x, ones, jnp.zeros(x.shape[:-1] + (extra - 1,), x.dtype)], axis=-1)
        w = jnp.concatenate([w, bias.astype(w.dtype)[None], jnp.zeros((extra - 1, w.shape[1]), w.dtype)], axis=0)
    return x, w


def loss_and_metrics(model, params, out, labels, implementation, interpret, count=None):
    """Mean cross-entropy over labels >= 0 (`token_losses`; 'chunked': `kernels.linear_cross_entropy_sum` with
    weights 1 / count), the token count and, with plain logits, accuracy. count: what the mean divides by (the
    whole batch's labelled tokens when `labels` are some of its rows, so that the rows' results add up to the
    batch's); None: these labels' count."""
    valid = labels >= 0
    n = jnp.maximum(valid.sum(), 1) if count is None else count
    metrics = {"tokens": valid.sum().astype(jnp.float32)}
    if implementation is None:
        metrics["accuracy"] = jnp.where(valid, out.argmax(-1) == labels, False).sum() / n
    if implementation == "chunked":
        x, w = _head_operands(model, params, out)
        weights = jnp.where(valid, 1.0, 0.0) / n
        return kernels.linear_cross_entropy_sum(x, w, jnp.where(valid, labels, -100), weights), metrics
    return token_losses(model, params, out, labels, implementation, interpret).sum() / n, metrics


def dropout_rngs(rng):
    """Flax `rngs` for a model call: the step's key as the 'dropout' stream (none without a key)."""
    return {} if rng is None else {"dropout": rng}


def lm_loss_fn(model, implementation=None, *, interpret=False):
    """`loss_fn(params, batch, rng, is_training)` for a decoder-only model on `collate_lm` batches: mean
    next-token cross-entropy over the labelled positions, plus the number of tokens and (with plain logits) token
    accuracy. implementation: None (plain logits) or a kernel implementation for the fused head + loss ('xla',
    'triton', 'mosaic_tpu', 'auto'; see the module docstring). interpret: run a Pallas kernel in its interpreter.
    Training calls run the model with dropout (its config.dropout_rate) drawn from `rng`. A mixture-of-experts model
    (config.num_experts) adds its router losses with the config's weights and reports both (`add_router_losses`).
    A model on the 1F1B pipeline (config.pipeline_schedule='1f1b') is given the loss as its tail (`DecoderLM`'s
    loss_tail: the head and loss per micro-batch inside the pipeline, the fused one too; a mixture's router losses
    of the whole batch's statistics, which the pipeline returns beside it)."""
    check_implementation(implementation)
    config = getattr(model, "config", None)
    cap = getattr(config, "final_logit_softcap", None)
    if implementation is not None and cap is not None:  # the fused kernel computes plain logits: a wrong loss
        raise ValueError(f"loss_implementation={implementation!r} with a final logit soft-cap ({cap}, Gemma 2); "
                         "expected plain logits (--loss_implementation=plain): the fused head + loss does not cap")
    one_f_one_b = getattr(config, "pipeline_schedule", "gpipe") == "1f1b"

    def loss_fn(params, batch, rng, is_training):
        if one_f_one_b:
            labels = batch["labels"]
            # The batch's count travels with each row: the pipeline's custom_vjp rules run the tail, and a rule
            # closing over a traced value fails where the shard_map step re-traces the loss (engine.step.gathering).
            count = jnp.full(labels.shape[:1], jnp.maximum((labels >= 0).sum(), 1))
            tail = lambda out, rows, tail_params: loss_and_metrics(  # noqa: E731
                model, tail_params, out, rows[0], implementation, interpret, count=rows[1][0])
            (loss, metrics), sown = apply_sowing(model, params, batch["input_ids"], batch.get("segment_ids"),
                                                 train=is_training, rngs=dropout_rngs(rng),
                                                 loss_tail=(tail, (labels, count)),
                                                 return_hidden=implementation is not None)
            return add_router_losses(config, loss, metrics, sown)
        out, sown = apply_sowing(model, params, batch["input_ids"], batch.get("segment_ids"),
                                 return_hidden=implementation is not None, train=is_training, rngs=dropout_rngs(rng))
        loss, metrics = loss_and_metrics(model, params, out, batch["labels"], implementation, interpret)
        return add_router_losses(model.config, loss, metrics, sown)
    loss_fn.weight_metric = "tokens"  # a mean over tokens: Trainer(step='shard_map') weights shards by it
    # per-token terms of a decoder whose positions and attention see whole rows: the shard_map step may split the
    # rows' tokens over `context` (each device its slice; engine.step.check_token_parallel)
    loss_fn.token_parallel = isinstance(model, models.layers.DecoderLM) and not one_f_one_b
    return loss_fn


def apply_sowing(model, params, *args, **kwargs):
    """(model.apply({'params': params}, *args, **kwargs), what its layers sowed into 'intermediates'): a mixture of
    experts' router statistics ({} for any other model, which runs as plain apply)."""
    if not getattr(getattr(model, "config", None), "num_experts", 0):
        return model.apply({"params": params}, *args, **kwargs), {}
    out, state = model.apply({"params": params}, *args, mutable=["intermediates"], **kwargs)
    return out, state.get("intermediates", {})


def add_router_losses(config, loss, metrics, intermediates):
    """(loss + router_aux_loss_coef · load balancing + router_z_loss_coef · z-loss, metrics with both terms) for a
    mixture-of-experts model (`models.layers.router_losses` of the statistics its layers sowed, or its pipeline's
    sums of them; unchanged when there are none)."""
    terms = models.layers.router_losses(intermediates) if intermediates else None
    if terms is None:
        return loss, metrics
    balance, z = terms
    metrics = {**metrics, "load_balancing_loss": balance, "router_z_loss": z}
    return loss + config.router_aux_loss_coef * balance + config.router_z_loss_coef * z, metrics


def until_eos(ids, eos_id):
    """Token ids up to and including the first EOS (all of them when there is none); -100 labels dropped."""
    out = []
    for i in np.asarray(ids).tolist():
        if i < 0:
            break
        out.append(i)
        if i == eos_id:
            break
    return out


def generate_tokens(model, params, tokenizer, prompts, *, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                    seed=0, kv_cache_dtype=None, num_beams=1, length_penalty=1.0, early_stopping=False):
    """`models.generate` on token-id prompts (lists; decoder prompts left-padded, T5 inputs right-padded): each
    row's new token ids up to and including its first EOS (all `max_new_tokens` when there is none); num_beams > 1:
    beam search (`early_stopping`: True, False or 'never', as in `models.generate`). Every process must call it
    with the same prompts (the parameters may span hosts); every process gets every row."""
    from jax.experimental import multihost_utils  # noqa: PLC0415

    if not prompts:
        raise ValueError("prompts: none given; expected at least one prompt")
    encoder_decoder = getattr(model, "is_encoder_decoder", False)
    positions = model.config.max_position_embeddings if getattr(model, "position_offset", None) is not None else None
    for n, prompt in enumerate(prompts):  # learned positions (OPT's) end: a position past them reads no embedding
        if positions is not None and len(prompt) + max_new_tokens - 1 > positions:
            raise ValueError(f"prompt {n} ({len(prompt)} tokens) and max_new_tokens={max_new_tokens} reach position "
                             f"{len(prompt) + max_new_tokens - 1}, past the model's {positions} learned positions (its "
                             "max_position_embeddings); expected a shorter prompt or fewer new tokens")
    ids, mask = left_pad(prompts, tokenizer, right=encoder_decoder)
    out = models.generate(model, params, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_k=top_k, top_p=top_p, rng=jax.random.PRNGKey(seed),
                          eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id, kv_cache_dtype=kv_cache_dtype,
                          num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping)
    out = np.asarray(multihost_utils.process_allgather(out, tiled=True))
    new = out[:, 1:] if encoder_decoder else out[:, ids.shape[1]:]
    return [until_eos(row, tokenizer.eos_id) for row in new]


def generate_texts(model, params, tokenizer, prompts, *, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                   seed=0, after_prompt=(), kv_cache_dtype=None, num_beams=1, length_penalty=1.0,
                   early_stopping=False):
    """Continuations of `prompts` (strings) with `generate_tokens`, decoded up to EOS. T5 inputs get EOS appended, as
    in training; decoder prompts `after_prompt`, token ids appended to every prompt (the prompt/response separator
    of a model tuned on `engine.tasks.rlhf.preference` rows)."""
    encoder_decoder = getattr(model, "is_encoder_decoder", False)
    suffix = [tokenizer.eos_id] if encoder_decoder and tokenizer.eos_id is not None else list(after_prompt)
    if not prompts:
        raise ValueError("prompts: none given; expected at least one prompt")
    encoded = [tokenizer.encode(p) + suffix for p in prompts]
    for n, (prompt, tokens) in enumerate(zip(prompts, encoded)):
        if not tokens:
            raise ValueError(f"prompt {n} ({prompt!r}) has no tokens; expected a non-empty prompt")
    new = generate_tokens(model, params, tokenizer, encoded, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_k=top_k, top_p=top_p, seed=seed, kv_cache_dtype=kv_cache_dtype, num_beams=num_beams,
                          length_penalty=length_penalty, early_stopping=early_stopping)
    return [tokenizer.decode([i for i in row if i != tokenizer.eos_id]) for row in new]


def left_pad(prompts, tokenizer, *, right=False):
    """Token lists -> (ids [B, T], mask [B, T]) left-padded for a decoder's generation (right-padded with
    right=True, for an encoder)."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        cols = slice(0, len(p)) if right else slice(width - len(p), width)
        ids[i, cols], mask[i, cols] = p, 1
    return jnp.asarray(ids), jnp.asarray(mask)
