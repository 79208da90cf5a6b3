"""Reward models for RLHF (Ouyang et al., 2022, "Training language models to follow instructions with human
feedback", step 2): a decoder-only language model whose output head is replaced by one scalar per position.

`RewardModel(backbone)` runs the backbone to its final hidden states and projects each position to a score
(`score` [d_model, 1], no bias: transformers' `*ForSequenceClassification` layout, which `load_reward_model` and
`save_reward_model` read and write). The losses and rewards built on it live with the RLHF tasks
(`engine.tasks.rlhf.reward`).
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.hf import load_sequence_classifier, save_pretrained
from models.layers import Linear, config_dtype

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


def init_reward_params(reward_model, backbone_params, rng):
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
    return Linear(width, 1, use_bias=False, std=config.initializer_range, dtype=config_dtype(config),
                  param_dtype=jnp.dtype(config.param_dtype), name="score")


def load_reward_model(path, *, layout=None, dtype=jnp.float32, **options):
    """(RewardModel, params) from a transformers `*ForSequenceClassification` directory with one label (LLaMA,
    GPT-J or OPT; `models.load_sequence_classifier`), placed by `layout` when given (`models.load_pretrained`'s).
    Its reward is the score at the sequence's last token, as transformers reads it at the last token that is not
    padding."""
    backbone, params, score = load_sequence_classifier(path, dtype=dtype, layout=layout, **options)
    if score.shape[1] != 1:
        raise ValueError(f"{path} is a classifier of {score.shape[1]} labels; expected a reward model (1 label)")
    return RewardModel(backbone), {"backbone": params, "score": {"kernel": score}}


def save_reward_model(reward_model, params, path, *, pad_token_id=None):
    """Writes a transformers `*ForSequenceClassification` directory (one label) that `load_reward_model` and
    transformers' `AutoModelForSequenceClassification` read back; `pad_token_id` as `models.save_pretrained`'s."""
    save_pretrained(reward_model.backbone, params["backbone"], path, score=params["score"]["kernel"],
                    pad_token_id=pad_token_id)
