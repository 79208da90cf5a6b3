"""Reward models for RLHF (Ouyang et al., 2022, "Training language models to follow instructions with human
feedback", step 2): a decoder-only language model whose output head is replaced by one scalar per position.

`RewardModel(backbone)` runs the backbone to its final hidden states and projects each position to a score
(`score` [d_model, 1], no bias: transformers' `*ForSequenceClassification` layout, which `load_pretrained` and
`save_pretrained` read and write). A sequence's reward is the score at its last token (the response's EOS in the rows of
`engine.preference`); the scores at every position are what PPO's critic uses as values. Trained on the preference
triples of `engine.preference` with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected).
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import kernels
import models
from models.layers import Linear

# `Trainer(trainable=...)`'s regex of a RewardModel's score head, at the top of its parameters or under a key (PPO's
# 'critic'): with LoRA the head is trained beside the adapters. The paths are '/'-joined down to the leaf
# ('score/kernel'), so a pattern ending at 'score$' matches none of them.
SCORE_TRAINABLE = r"(^|/)score/"


class RewardModel(nn.Module):
    """`apply({'params': p}, input_ids [B, T], attention_mask [B, T] | None, train=False) -> scores [B, T]` float32.

    Parameters: {'backbone': the decoder's (its unused output head included, so a language model's checkpoint loads
    as is), 'score': {'kernel' [d_model, 1]}} (no bias, as transformers' sequence classifiers: the Bradley-Terry loss
    cannot see a constant shift of every reward anyway). attention_mask as the backbone takes it (0 on padding,
    segment ids for packed rows)."""
    backbone: Any

    @property
    def config(self):
        return self.backbone.config

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, *, train=False):
        hidden = self.backbone(input_ids, attention_mask, return_hidden=True, train=train)
        return _score_head(hidden.shape[-1], self.backbone.config)(hidden)[..., 0].astype(jnp.float32)


def init_params(reward_model, backbone_params, rng):
    """Parameters of `reward_model` whose backbone is `backbone_params` (e.g. an SFT checkpoint's) and whose score
    head is fresh (host arrays, which a Trainer or a Predictor places on any mesh). The backbone's arrays are used
    as they are (same placement, no copy). Abstract backbone parameters (jax.ShapeDtypeStructs: --mesh=auto's
    description) get an abstract head."""
    abstract = jax.eval_shape(reward_model.init, rng, jnp.zeros((1, 8), jnp.int32))["params"]
    want = jax.tree.structure(abstract["backbone"])
    if jax.tree.structure(backbone_params) != want:
        raise ValueError("backbone_params do not fit the reward model's backbone; expected the parameters of "
                         f"{type(reward_model.backbone).__name__} with this config")
    # The head alone (initialising the whole model for it would hold a second backbone on one device).
    c = reward_model.backbone.config
    width = abstract["score"]["kernel"].shape[0]
    head = _score_head(width, c)
    if all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(backbone_params)):
        return {"backbone": backbone_params, "score": jax.eval_shape(head.init, rng, jnp.zeros((1, width)))["params"]}
    return {"backbone": backbone_params, "score": jax.device_get(head.init(rng, jnp.zeros((1, width)))["params"])}


def _score_head(width, config):
    return Linear(width, 1, use_bias=False, std=config.initializer_range, dtype=jnp.dtype(config.dtype),
                  param_dtype=jnp.dtype(config.param_dtype), name="score")


def load_pretrained(path, *, mesh=None, dtype=jnp.float32, **options):
    """(RewardModel, params) from a transformers `*ForSequenceClassification` directory with one label (LLaMA,
    GPT-J or OPT; `models.load_sequence_classifier`), placed on `mesh` when given. Its reward is the score at the
    sequence's last token, as transformers reads it at the last token that is not padding."""
    backbone, params, score = models.load_sequence_classifier(path, dtype=dtype, mesh=mesh, **options)
    if score.shape[1] != 1:
        raise ValueError(f"{path} is a classifier of {score.shape[1]} labels; expected a reward model (1 label)")
    return RewardModel(backbone), {"backbone": params, "score": {"kernel": score}}


def save_pretrained(reward_model, params, path, *, pad_token_id=None):
    """Writes a transformers `*ForSequenceClassification` directory (one label) that `load_pretrained` and
    transformers' `AutoModelForSequenceClassification` read back; `pad_token_id` as `models.save_pretrained`'s."""
    models.save_pretrained(reward_model.backbone, params["backbone"], path, score=params["score"]["kernel"],
                           pad_token_id=pad_token_id)


def _complete_rows(ids, segment_ids, labels):
    """Rows [N, T] of `engine.preference` (inputs = tokens[:-1], the next tokens as labels) -> the whole sequences
    [N, T + 1], each row's last label (a response's EOS) appended after its inputs, and that token's index. On a
    context mesh the rows are padded on to a multiple of its size, so that they split over it like the policy's
    [N, T] (the backbone is causal: padding after a token changes nothing before it); one program mixing split and
    unsplit lengths of the same tokens (PPO's scores) failed XLA:CPU's verifier."""
    n = (segment_ids > 0).sum(-1)
    before = jnp.maximum(n - 1, 0)[:, None]
    last_label = jnp.take_along_axis(labels, before, axis=-1)[:, 0]
    last_segment = jnp.take_along_axis(segment_ids, before, axis=-1)[:, 0]
    context = kernels.auto_axis_size(kernels.CONTEXT_AXIS)
    width = -(-(ids.shape[-1] + 1) // context) * context
    at = (jnp.arange(width)[None] == n[:, None]) & (last_label >= 0)[:, None]
    widen = lambda x: jnp.pad(x, ((0, 0), (0, width - x.shape[-1])))  # noqa: E731
    ids = jnp.where(at, last_label[:, None], widen(ids))
    segment_ids = jnp.where(at, last_segment[:, None], widen(segment_ids))
    return ids, segment_ids, jnp.where(last_label >= 0, n, before[:, 0])


def sequence_rewards(reward_model, params, batch, *, train=False, rng=None):
    """Rewards float32 [B, 2] of the chosen and rejected rows of `engine.preference` examples (or [B] for a batch of
    single rows [B, T]): the score at each sequence's final token, its last label (the response's EOS), which the
    rows hold as a label only and which is appended to the inputs here."""
    T = batch["input_ids"].shape[-1]
    lead = batch["input_ids"].shape[:-1]
    ids, seg, last = _complete_rows(*(batch[k].reshape(-1, T) for k in ("input_ids", "segment_ids", "labels")))
    scores = reward_model.apply({"params": params}, ids, seg, train=train, rngs={} if rng is None else {"dropout": rng})
    return jnp.take_along_axis(scores, last[:, None], axis=-1)[:, 0].reshape(lead)


def reward_loss_fn(reward_model):
    """`loss_fn(params, batch, rng, is_training)` for `Trainer` on `preference.collate_preferences` batches: the mean
    Bradley-Terry loss -log sigmoid(r_chosen - r_rejected), plus metrics reward_accuracy (r_chosen > r_rejected),
    reward_margin,
    chosen_reward and rejected_reward."""
    if not isinstance(reward_model, RewardModel):
        raise ValueError(f"reward_model={type(reward_model).__name__}; expected an engine.reward.RewardModel")

    def loss_fn(params, batch, rng, is_training):
        rewards = sequence_rewards(reward_model, params, batch, train=is_training, rng=rng)
        margin = rewards[:, 0] - rewards[:, 1]
        metrics = {"reward_accuracy": jnp.mean(margin > 0), "reward_margin": jnp.mean(margin),
                   "chosen_reward": jnp.mean(rewards[:, 0]), "rejected_reward": jnp.mean(rewards[:, 1])}
        return -jnp.mean(jax.nn.log_sigmoid(margin)), metrics
    return loss_fn


def reward_pred_fn(reward_model):
    """`pred_fn` for an `engine.Predictor`: `sequence_rewards` of each example ([2] per preference example)."""
    return lambda params, batch, rng: sequence_rewards(reward_model, params, batch)


def reward_accuracy(examples, rewards):
    """{'reward_accuracy': the fraction of preference examples whose chosen response gets the higher reward}
    (`eval_metric_fn` for `Trainer.fit`)."""
    wins = [float(r[0] > r[1]) for r in rewards]
    del examples
    return {"reward_accuracy": float(np.mean(wins)) if wins else float("nan")}
