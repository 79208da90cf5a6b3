"""Reward-model training and scoring (RLHF step 2) on `models.RewardModel`: a sequence's reward is the score at its
last token (the response's EOS in the rows of `engine.tasks.rlhf.preference`); the scores at every position are what
PPO's critic uses as values. Trained on preference triples with the Bradley-Terry loss
-log sigmoid(r_chosen - r_rejected).
"""
import jax
import jax.numpy as jnp
import numpy as np

import kernels
from models import RewardModel


def _complete_rows(ids, segment_ids, labels):
    """Rows [N, T] of `engine.tasks.rlhf.preference` (inputs = tokens[:-1], the next tokens as labels) -> the whole sequences
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
    """Rewards float32 [B, 2] of the chosen and rejected rows of `engine.tasks.rlhf.preference` examples (or [B] for a batch of
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
        raise ValueError(f"reward_model={type(reward_model).__name__}; expected a models.RewardModel")

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
