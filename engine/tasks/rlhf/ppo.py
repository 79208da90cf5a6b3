"""PPO for RLHF (Ouyang et al., 2022, step 3; the clipped objective of Schulman et al., 2017): the policy (actor)
learns to write responses that a frozen reward model scores highly, held near a frozen reference policy by a
per-token KL penalty, with a critic (value model) for the advantages.

One iteration (`fit_ppo`):
1. Rollout: the actor samples a response to each of `rollout_batch_size` prompts (`lm.generate_tokens`, with its
   KV cache; or, with `PPOConfig(rollout_engine='paged')`, `models.PagedEngine`: continuous batching over a paged
   KV cache, a group's samples sharing their prompt's pages). Each prompt + response becomes an
   `engine.tasks.rlhf.preference` row (only the response labelled).
2. Scoring, one compiled pass of an `engine.Predictor`: the actor's and the reference's log-probabilities of the
   response tokens, the critic's values at every position and the reward model's score of the whole sequence (or,
   instead of a reward model, `reward_fn(prompt, response)` on the host: a rule or a verifier).
3. On the host: per-token rewards r_t = -kl_coef * (log pi(a_t) - log pi_ref(a_t)), plus the score at the last
   response token; advantages by GAE (gamma, lam), whitened over the batch's response tokens; returns = advantages
   + values.
4. `ppo_epochs` epochs of the `Trainer` over these rows: the clipped policy loss plus value_coef x the clipped value
   loss (`PPO.loss_fn`), on the joint parameters {'actor', 'critic'}, both trained by the Trainer's optimizer.

Memory: four models, two trained (actor and critic, with optimizer state) and two frozen (reference and reward model,
parameters only, used in the scoring pass; `ref_params` may be the very arrays the actor starts from: the Trainer
places copies of its initial parameters before it donates them). With LoRA (adapters trained, every other weight
frozen: `Trainer(trainable=...)`) the frozen models need no weights of their own: `ref_params=None` makes the
reference the actor with its adapters off, and `reward_params={'score': ...}` (no 'backbone') the reward model the
critic's backbone with its adapters off under that score head, both reading the Trainer's frozen arrays (DeepSpeed-
Chat and Colossal-AI's LoRA PPO keep one base model for actor and reference likewise). Two copies of the base
weights instead of four; `fit_ppo` checks that those weights are frozen. The models run deterministically (no
dropout), so the ratio of the first update is exactly 1. A run resumes exactly: each iteration's experience is
written to the workdir before the updates.

GRPO (Shao et al., 2024, DeepSeekMath; `PPOConfig(advantage_estimator='grpo', samples_per_prompt=G)`, the
`adv_estimator` switch of OpenRLHF and verl): no critic. Each prompt is answered G times and a response's advantage,
at every one of its tokens, is its score's standing in its group, (score - group mean) / (group std + 1e-4); the KL
to the reference moves from the reward into the loss (the k3 estimator pi_ref/pi - log(pi_ref/pi) - 1 per token,
weighted by kl_coef). The Trainer's parameters are then {'actor'} alone: one trained model with its optimizer state
instead of two, the memory the paper drops the value model for.
"""
import dataclasses
import os
import re
import signal
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

import models
from engine.tasks import lm
from engine.tasks.rlhf import preference, reward
from engine import fit_loop
from engine.predictor import Predictor
from engine.step import cast_floating
from engine.trainer import global_batch_size
from models.generate import KV_CACHE_DTYPES

EXPERIENCE_FILE = "ppo_experience-{}.npz"  # an iteration's rollouts, kept while a checkpoint inside it may restore
ADVANTAGE_ESTIMATORS = ("gae", "grpo")
ROLLOUT_ENGINES = ("static", "paged")
_PAGE_SIZE = 16  # tokens per page of the paged rollouts (the engine's default)
_STATS = ("score", "kl", "response_tokens", "ended")
_AGREE_EVERY = 16  # a paged rollout's engine steps between the processes' agreements on a signal


class RolloutStopped(Exception):
    """A rollout's `should_stop` said to stop: the rollout is dropped, nothing of it kept."""


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """max_new_tokens: response length at most; temperature: of the rollouts' sampling (0: greedy); kl_coef: the
    per-token KL penalty towards the reference; clip_ratio: PPO's epsilon for the probability ratio; value_clip: for
    the value change; value_coef: weight of the value loss; gamma, lam: GAE's discount and lambda; unfinished_reward:
    when set, the reward of a response cut off at max_new_tokens before its EOS (TRL's non-EOS penalty): a learnt
    reward model has only seen finished responses and may score unfinished ones highly, which PPO then exploits.
    kv_cache_dtype: the rollouts' KV cache storage (None: the actor's compute dtype; 'int8': half of bf16's bytes,
    `models.generate`); the rows are scored by full forward passes, so only the sampling sees its rounding.
    rollout_engine: 'static' (`models.generate`: one left-padded batch, a contiguous cache of prompt +
    max_new_tokens per row, every row decoded until the longest ends) or 'paged' (`models.PagedEngine`: continuous
    batching over a paged KV cache, a row retiring at its own EOS, the samples of one prompt sharing its pages;
    kv_cache_dtype None or 'int8' only). Greedy rollouts are the same tokens either way; sampled ones are not (the
    static path draws from one key for the batch, the engine from a seed per row). Static is the default: on short
    responses the engine's per-step host scheduling costs more than it saves (models/README.md). The engine runs on
    the actor's parameters as placed (its jitted steps follow their shardings); its pool is made at the first paged
    rollout and kept, through the updates too, so that its steps compile once. rollout_kv_memory_gb: 'paged' only,
    the pool's size (None: pages for every row of the rollout at once, unshared).
    advantage_estimator: 'gae' (a critic's values, the KL penalty in the rewards) or 'grpo' (no critic: each
    response's score against its prompt's group, the KL in the loss; see the module's docstring);
    samples_per_prompt: responses sampled per prompt in a rollout (GRPO's group size, at least 2 for it);
    scale_rewards: GRPO divides each group's centred scores by their standard deviation (False: Dr. GRPO, Liu et al.
    2025: the division weights groups of nearly equal scores, too easy or too hard prompts, most)."""
    max_new_tokens: int = 16
    temperature: float = 1.0
    kl_coef: float = 0.05
    clip_ratio: float = 0.2
    value_clip: float = 0.2
    value_coef: float = 0.5
    gamma: float = 1.0
    lam: float = 0.95
    unfinished_reward: Optional[float] = None
    kv_cache_dtype: Optional[str] = None
    advantage_estimator: str = "gae"
    samples_per_prompt: int = 1
    scale_rewards: bool = True
    rollout_engine: str = "static"
    rollout_kv_memory_gb: Optional[float] = None

    def __post_init__(self):
        checks = {"max_new_tokens": isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
                  "temperature": self.temperature >= 0, "kl_coef": self.kl_coef >= 0,
                  "clip_ratio": 0 < self.clip_ratio < 1, "value_clip": self.value_clip > 0,
                  "value_coef": self.value_coef >= 0, "gamma": 0 < self.gamma <= 1, "lam": 0 <= self.lam <= 1,
                  "unfinished_reward": self.unfinished_reward is None or isinstance(self.unfinished_reward,
                                                                                    (int, float)),
                  "kv_cache_dtype": self.kv_cache_dtype is None or self.kv_cache_dtype in KV_CACHE_DTYPES,
                  "advantage_estimator": self.advantage_estimator in ADVANTAGE_ESTIMATORS,
                  "samples_per_prompt": isinstance(self.samples_per_prompt, int) and self.samples_per_prompt >= (
                      2 if self.advantage_estimator == "grpo" else 1),
                  "scale_rewards": isinstance(self.scale_rewards, bool),
                  "rollout_engine": self.rollout_engine in ROLLOUT_ENGINES,
                  "rollout_kv_memory_gb": self.rollout_kv_memory_gb is None or (
                      isinstance(self.rollout_kv_memory_gb, (int, float)) and self.rollout_kv_memory_gb > 0)}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"PPOConfig.{name}={getattr(self, name)!r} is out of range; expected max_new_tokens "
                                 ">= 1, temperature >= 0, kl_coef >= 0, 0 < clip_ratio < 1, value_clip > 0, value_coef "
                                 ">= 0, 0 < gamma <= 1, 0 <= lam <= 1, unfinished_reward None or a number, "
                                 "kv_cache_dtype None, 'int8', 'bfloat16', 'float16' or 'float32', "
                                 f"advantage_estimator one of {ADVANTAGE_ESTIMATORS}, samples_per_prompt >= 1 (>= 2 "
                                 "with 'grpo': a group to compare with), scale_rewards a bool, rollout_engine one "
                                 f"of {ROLLOUT_ENGINES}, rollout_kv_memory_gb None or > 0")
        paged = self.rollout_engine == "paged"
        if paged and self.kv_cache_dtype not in (None, "int8"):
            raise ValueError(f"PPOConfig.kv_cache_dtype={self.kv_cache_dtype!r} with rollout_engine='paged'; "
                             "expected None (the actor's compute dtype) or 'int8': the paged cache's storages")
        if not paged and self.rollout_kv_memory_gb is not None:
            raise ValueError(f"PPOConfig.rollout_kv_memory_gb={self.rollout_kv_memory_gb!r} with rollout_engine="
                             f"{self.rollout_engine!r}; expected it with rollout_engine='paged' only (the static "
                             "cache is one batch of prompt + max_new_tokens rows)")


def advantages_and_returns(rewards, values, mask, *, gamma, lam):
    """GAE over each row's labelled (response) positions, which are contiguous: float32 [B, T] advantages and
    returns (= advantages + values), 0 elsewhere. rewards, values: [B, T]; mask: bool [B, T]."""
    rewards, values, mask = (np.asarray(x) for x in (rewards, values, mask))
    B, T = mask.shape
    adv = np.zeros((B, T), np.float32)
    running = np.zeros(B, np.float32)
    for t in range(T - 1, -1, -1):
        next_value = values[:, t + 1] * mask[:, t + 1] if t + 1 < T else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = np.where(mask[:, t], delta + gamma * lam * running, 0.0)
        adv[:, t] = running
    return adv, np.where(mask, adv + values, 0.0).astype(np.float32)


def group_advantages(scores, group_size, scale=True):
    """GRPO's advantages of float [N] `scores`, N / group_size consecutive groups of one prompt's responses: each
    score minus its group's mean, over its group's standard deviation (Bessel-corrected, + 1e-4, as TRL's) when
    `scale`, float32 [N]. A group of equal scores gives zeros (nothing to learn from it)."""
    groups = np.asarray(scores, np.float32).reshape(-1, group_size)
    centred = groups - groups.mean(1, keepdims=True)
    if scale:
        centred = centred / (groups.std(1, ddof=1, keepdims=True) + 1e-4)
    return centred.reshape(-1).astype(np.float32)


def _log_probs(actor, params, batch, implementation, interpret):
    """(log pi(label) [B, T] (0 where unlabelled) of `actor` with `params`, a mixture of experts' router
    statistics: `lm.apply_sowing`)."""
    out, sown = lm.apply_sowing(actor, params, batch["input_ids"], batch["segment_ids"],
                                return_hidden=implementation is not None)
    return -lm.token_losses(actor, params, out, batch["labels"], implementation, interpret), sown


def ppo_loss_fn(actor, critic, config=PPOConfig(), *, implementation=None, interpret=False):
    """`loss_fn(params, batch, rng, is_training)` for a `Trainer` on params {'actor', 'critic'} and `PPO.rollout`'s
    experience rows: mean over response tokens of the clipped policy loss + value_coef x the clipped value loss;
    metrics policy_loss, value_loss, clip_fraction (tokens whose ratio was clipped), approx_kl (to the rollout's
    policy) and tokens. critic None (GRPO): params {'actor'}, and instead of the value loss kl_coef x the k3
    estimate of the KL to the reference (the rows' ref_log_probs), metric kl. implementation: as `PPO`'s. A mixture
    of experts actor adds its router losses (`lm.add_router_losses`)."""
    c = config

    def loss_fn(params, batch, rng, is_training):
        del rng, is_training  # deterministic models: the first update's ratio is exactly 1
        mask = batch["labels"] >= 0
        n = jnp.maximum(mask.sum(), 1)
        mean = lambda x: jnp.where(mask, x, 0.0).sum() / n  # noqa: E731
        log_probs, sown = _log_probs(actor, params["actor"], batch, implementation, interpret)
        log_ratio = jnp.where(mask, log_probs - batch["old_log_probs"], 0.0)
        ratio = jnp.exp(log_ratio)
        adv = batch["advantages"]
        policy = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - c.clip_ratio, 1 + c.clip_ratio))
        policy_loss = mean(policy)
        metrics = {"policy_loss": policy_loss,
                   "clip_fraction": mean((jnp.abs(ratio - 1) > c.clip_ratio).astype(jnp.float32)),
                   "approx_kl": mean(ratio - 1 - log_ratio), "tokens": mask.sum().astype(jnp.float32)}
        if critic is None:  # GRPO: the KL to the reference in the loss (k3: unbiased, never negative)
            ref_ratio = jnp.where(mask, batch["ref_log_probs"] - log_probs, 0.0)
            metrics["kl"] = mean(jnp.exp(ref_ratio) - ref_ratio - 1)
            loss = policy_loss + c.kl_coef * metrics["kl"]
        else:
            values = critic.apply({"params": params["critic"]}, batch["input_ids"], batch["segment_ids"])
            old, ret = batch["old_values"], batch["returns"]
            clipped = old + jnp.clip(values - old, -c.value_clip, c.value_clip)
            metrics["value_loss"] = mean(0.5 * jnp.maximum((values - ret) ** 2, (clipped - ret) ** 2))
            loss = policy_loss + c.value_coef * metrics["value_loss"]
        return lm.add_router_losses(getattr(actor, "config", None), loss, metrics, sown)
    loss_fn.weight_metric = "tokens"
    return loss_fn


class PPO:
    """The models and settings of a PPO run.

    Args:
      actor: the policy, a decoder-only model; its parameters are `params['actor']` of the Trainer.
      critic: an `models.RewardModel` of any backbone; `params['critic']` (usually a copy of the reward
        model's parameters, or of the actor's backbone with a fresh score head). None with GRPO
        (config.advantage_estimator='grpo'), which has none: the Trainer's params are then {'actor'}.
      ref_params: the frozen reference policy's parameters (the actor's starting point), for the KL penalty; None:
        the actor with its LoRA adapters off (the actor needs adapters, and only they may train).
      tokenizer: of the actor (and of the reward model: they read the same token rows).
      mesh: the scoring pass's mesh (the Trainer's).
      seq_len: row width; rows longer than seq_len + 1 tokens lose their end.
      reward_model, reward_params: a frozen learnt reward model (`models.RewardModel`; reward_params without
        'backbone', i.e. {'score': [d, 1]}: the critic's backbone with its LoRA adapters off under that score head,
        the critic's backbone then frozen but for its adapters; GRPO: with a backbone of its own), or
      reward_fn: `reward_fn(prompt, response) -> float` on strings (the response decoded up to EOS): a rule or
        verifier instead of a learnt model. Exactly one of reward_model and reward_fn.
      config: a `PPOConfig`.
      implementation: None (plain logits) or a kernel implementation for the fused head of the log-probabilities
        (`lm.token_losses`).
    """

    def __init__(self, *, actor, critic, ref_params, tokenizer, mesh, seq_len, reward_model=None, reward_params=None,
                 reward_fn=None, config=PPOConfig(), implementation=None, interpret=False):
        if not isinstance(config, PPOConfig):
            raise ValueError(f"config={config!r}; expected an engine.tasks.rlhf.ppo.PPOConfig")
        grpo = config.advantage_estimator == "grpo"
        if not isinstance(critic, models.RewardModel) and not (grpo and critic is None):
            raise ValueError(f"critic={type(critic).__name__} with advantage_estimator="
                             f"{config.advantage_estimator!r}; expected an models.RewardModel ('gae'), or "
                             "None ('grpo': no critic)")
        if grpo and critic is not None:
            raise ValueError("critic given with advantage_estimator='grpo'; expected None (GRPO's advantages come "
                             "from each prompt's group of responses, not from a value model)")
        if (reward_model is None) == (reward_fn is None):
            raise ValueError("reward_model and reward_fn: got both or neither; expected exactly one")
        if reward_model is not None and (not isinstance(reward_model, models.RewardModel) or reward_params is None):
            raise ValueError(f"reward_model={type(reward_model).__name__} with reward_params "
                             f"{'None' if reward_params is None else 'given'}; expected an models.RewardModel "
                             "and its parameters")
        if reward_fn is not None and not callable(reward_fn):
            raise ValueError(f"reward_fn={reward_fn!r}; expected a callable (prompt, response) -> float")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len={seq_len!r}; expected an int >= 2")
        lm.check_implementation(implementation)
        if ref_params is None and not actor.config.lora_rank:
            raise ValueError("ref_params=None (the reference is the actor with its LoRA adapters off); expected an "
                             "actor with lora_rank > 0, or the reference's parameters")
        self.ref_from_actor = ref_params is None
        self.reward_from_critic = reward_model is not None and "backbone" not in reward_params
        if self.reward_from_critic and (critic is None or not critic.backbone.config.lora_rank
                                        or reward_model.backbone.config != critic.backbone.config
                                        or set(reward_params) != {"score"}):
            raise ValueError(f"reward_params with keys {sorted(reward_params)} (no 'backbone': the critic's backbone "
                             "with its adapters off); expected {'score'} with a critic of LoRA adapters (lora_rank "
                             "> 0) whose backbone is the reward model's")
        self.actor, self.critic, self.ref_params, self.tokenizer = actor, critic, ref_params, tokenizer
        self.reward_model, self.reward_params, self.reward_fn = reward_model, reward_params, reward_fn
        self.mesh, self.seq_len, self.config = mesh, seq_len, config
        self.implementation, self.interpret = implementation, interpret
        self._scorer = Predictor(mesh=mesh, collate_fn=preference.collate_preferences, pred_fn=self._score)
        if config.rollout_engine == "paged":
            if not isinstance(actor, models.layers.DecoderLM):
                raise ValueError(f"actor={type(actor).__name__} with rollout_engine='paged'; expected a decoder-only "
                                 "model (a models.layers.DecoderLM), or rollout_engine='static'")
            if jax.process_count() > 1:
                raise ValueError(f"rollout_engine='paged' on {jax.process_count()} processes; expected one process "
                                 "(the engine's scheduler reads each step's tokens on its host), or "
                                 "rollout_engine='static'")
            if config.rollout_kv_memory_gb is not None:
                one_row = -(-seq_len // _PAGE_SIZE) * models.page_bytes(actor, _PAGE_SIZE, config.kv_cache_dtype)
                if config.rollout_kv_memory_gb * 2 ** 30 < one_row:
                    raise ValueError(f"PPOConfig.rollout_kv_memory_gb={config.rollout_kv_memory_gb} holds less than "
                                     f"one row of {seq_len} tokens ({one_row / 2 ** 30:.3g} GB); expected at least "
                                     "that")
        self.paged_engine = None  # the rollouts' models.PagedEngine, made at the first paged rollout and kept

    # -------------------------------------------------------------------------------------------- scoring, loss
    def _score(self, params, batch, rng):
        del rng
        log_probs = lambda p: _log_probs(self.actor, p, batch, self.implementation, self.interpret)[0]  # noqa: E731
        ref = models.adapters_off(params["actor"]) if self.ref_from_actor else params["ref"]
        out = {"log_probs": log_probs(params["actor"]), "ref_log_probs": log_probs(ref)}
        if self.critic is not None:
            out["values"] = self.critic.apply({"params": params["critic"]}, batch["input_ids"], batch["segment_ids"])
        if self.reward_model is not None:
            scorer = params["reward"]
            if self.reward_from_critic:
                scorer = {"backbone": models.adapters_off(params["critic"]["backbone"]), "score": scorer["score"]}
            out["score"] = reward.sequence_rewards(self.reward_model, scorer, batch)
        return out

    def frozen_paths(self):
        """Regexes of the parameters {'actor', 'critic'} that the shared frozen models read, so must not train."""
        out = []
        if self.ref_from_actor:
            out.append(r"^actor/")
        if self.reward_from_critic:
            out.append(r"^critic/backbone/")
        return out

    def loss_fn(self):
        """This run's `ppo_loss_fn`."""
        return ppo_loss_fn(self.actor, self.critic, self.config, implementation=self.implementation,
                           interpret=self.interpret)

    # ------------------------------------------------------------------------------------------------ rollouts
    def generate_and_score(self, params, prompts, *, seed, temperature=None, per_device_batch_size=8,
                           compute_dtype=None, should_stop=None):
        """The actor's (`params['actor']`) responses to the string `prompts`, sampled at `temperature` (default the
        config's; 0: greedy), and their scoring: (responses: token lists up to EOS, rows: `preference.token_row`
        examples, scored: one dict per row of log_probs, ref_log_probs, values (with a critic) [seq_len] and score []
        (the reward, or config.unfinished_reward for a response cut off before its EOS)). compute_dtype (the
        Trainer's `Precision.compute_dtype`; None: as they are): every model's floating parameters are cast to it
        for sampling and scoring, as the train step casts them, so the old log-probabilities are the step's own
        (the first update's ratio is 1) and the models compute in it. should_stop: a callable polled between the
        paged engine's steps and before the scoring; once it returns True, `RolloutStopped` (nothing is returned)."""
        params = cast_floating(params, compute_dtype)
        temperature = self.config.temperature if temperature is None else temperature
        tokens = [preference.prompt_tokens(self.tokenizer, p, self.seq_len, f"prompt {n}")
                  for n, p in enumerate(prompts)]
        if self.config.rollout_engine == "paged":
            responses, capped = self._paged_generate(params["actor"], tokens, temperature, seed, should_stop)
        else:
            responses = lm.generate_tokens(self.actor, params["actor"], self.tokenizer, tokens,
                                           max_new_tokens=self.config.max_new_tokens, temperature=temperature,
                                           seed=seed, kv_cache_dtype=self.config.kv_cache_dtype)
            capped = [False] * len(responses)
        if should_stop is not None and should_stop():
            raise RolloutStopped()
        rows = []
        for n, (prompt, response) in enumerate(zip(tokens, responses)):
            ids, labels, segments, cut = preference.token_row(prompt, response, self.seq_len)
            if cut or capped[n]:
                more = "+" if capped[n] else ""  # the paged engine stopped it at the row's end
                raise ValueError(f"seq_len={self.seq_len}: prompt {n} ({len(prompt)} tokens with the separator) and "
                                 f"its response ({len(response)}{more}) do not fit; expected seq_len >= the longest "
                                 "prompt + max_new_tokens - 1")
            rows.append({"input_ids": ids, "labels": labels, "segment_ids": segments})
        frozen = {} if self.ref_from_actor else {"ref": self.ref_params}
        if self.reward_model is not None:
            frozen["reward"] = self.reward_params
        frozen = cast_floating(frozen, compute_dtype)
        scored = self._scorer.predict(rows, per_device_batch_size=per_device_batch_size, params={**params, **frozen})
        eos = self.tokenizer.eos_id
        for prompt, response, s in zip(prompts, responses, scored):
            ended = bool(response) and response[-1] == eos
            if self.reward_fn is not None:
                s["score"] = float(self.reward_fn(prompt, self.tokenizer.decode(
                    [i for i in response if i != eos])))
            if not ended and self.config.unfinished_reward is not None:
                s["score"] = self.config.unfinished_reward
            s["score"] = np.float32(s["score"])
        return responses, rows, scored

    def _paged_generate(self, actor_params, prompts, temperature, seed, should_stop=None):
        """(responses, capped) of token-id `prompts` through `self.paged_engine`: each row a request of its own seed
        (distinct in a rollout, drawn from `seed`), the rows of one prompt (GRPO's group) sharing its pages. A row's
        request is capped at the seq_len + 1 tokens a row holds (so the decode step's page table has one width for
        every rollout); capped[n]: row n met that cap before its EOS and max_new_tokens, where the static path's row
        would have been cut. Runs on the actor's parameters as they are placed (the engine's jitted steps follow
        their shardings, as `models.generate` does), its KV pool in the compute dtype or int8."""
        c, max_len = self.config, self.seq_len + 1
        if self.paged_engine is None or self.paged_engine.max_batch < len(prompts):
            self.paged_engine = None  # its pool goes before the larger one is made
            # A row's tokens but its last (never fed back) fill at most seq_len positions.
            pool = (dict(num_pages=len(prompts) * -(-self.seq_len // _PAGE_SIZE)) if c.rollout_kv_memory_gb is None
                    else dict(memory_bytes=int(c.rollout_kv_memory_gb * 2 ** 30)))
            self.paged_engine = models.PagedEngine(self.actor, actor_params, max_batch=len(prompts),
                                                   page_size=_PAGE_SIZE, cache_dtype=c.kv_cache_dtype,
                                                   max_len=max_len, **pool)
        engine = self.paged_engine
        engine.params = actor_params  # this rollout's policy; the compiled steps take the parameters as arguments
        base = int(np.random.SeedSequence(seed % 2 ** 64).generate_state(1)[0])
        limits = [min(c.max_new_tokens, max_len - len(p)) for p in prompts]
        ids = [engine.add_request(p, limit, eos_id=self.tokenizer.eos_id, temperature=temperature,
                                  seed=(base + n) % 2 ** 32) for n, (p, limit) in enumerate(zip(prompts, limits))]
        out = {}
        while engine.busy:
            if should_stop is not None and should_stop():
                self.paged_engine = None  # its pages hold the dropped requests: the next rollout makes another
                raise RolloutStopped()
            out.update(engine.step())
        responses = [out[i] for i in ids]
        eos = self.tokenizer.eos_id
        capped = [len(r) == limit < c.max_new_tokens and r[-1] != eos for r, limit in zip(responses, limits)]
        return responses, capped

    def rollout(self, params, prompts, *, seed, per_device_batch_size=8, compute_dtype=None, should_stop=None):
        """Experience for one iteration from string `prompts`, each answered config.samples_per_prompt times (in
        consecutive rows): (examples, stats). Each example holds the row's input_ids, labels, segment_ids,
        old_log_probs and advantages [seq_len], and old_values and returns (GAE) or ref_log_probs (GRPO); stats: the
        mean score, the mean KL to the reference per response (sum over its tokens), the mean response length and
        the fraction of responses that ended with EOS. compute_dtype, should_stop: as in `generate_and_score`."""
        c = self.config
        prompts = [p for p in prompts for _ in range(c.samples_per_prompt)]
        responses, rows, scored = self.generate_and_score(params, prompts, seed=seed, compute_dtype=compute_dtype,
                                                          per_device_batch_size=per_device_batch_size,
                                                          should_stop=should_stop)
        stack = lambda key: np.stack([s[key] for s in scored]).astype(np.float32)  # noqa: E731
        log_probs, ref_log_probs, score = (stack(k) for k in ("log_probs", "ref_log_probs", "score"))
        mask = np.stack([r["labels"] for r in rows]) >= 0
        kl = np.where(mask, log_probs - ref_log_probs, 0.0)
        if c.advantage_estimator == "grpo":
            adv = group_advantages(score, c.samples_per_prompt, c.scale_rewards)
            adv = np.where(mask, adv[:, None], 0.0).astype(np.float32)
            extra = [{"ref_log_probs": np.where(m, r, 0.0)} for m, r in zip(mask, ref_log_probs)]
        else:
            values = stack("values")
            rewards = -c.kl_coef * kl
            last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
            rewards[np.arange(len(rows)), last] += score
            adv, returns = advantages_and_returns(rewards, np.where(mask, values, 0.0), mask, gamma=c.gamma,
                                                  lam=c.lam)
            mean, std = adv[mask].mean(), adv[mask].std()
            adv = np.where(mask, (adv - mean) / (std + 1e-8), 0.0).astype(np.float32)
            extra = [{"old_values": np.where(m, v, 0.0), "returns": r} for m, v, r in zip(mask, values, returns)]
        examples = [{**row, "old_log_probs": log_probs[i], "advantages": adv[i], **extra[i]}
                    for i, row in enumerate(rows)]
        eos = self.tokenizer.eos_id
        stats = {"score": float(score.mean()), "kl": float(kl.sum(1).mean()),
                 "response_tokens": float(np.mean([len(r) for r in responses])),
                 "ended": float(np.mean([bool(r) and r[-1] == eos for r in responses]))}
        return examples, stats


def iteration_prompts(prompts, iteration, n, seed):
    """The `n` prompts of an iteration: consecutive slices of per-pass permutations of `prompts` (deterministic in
    seed, so a resumed run takes the same ones)."""
    out, orders = [], {}
    for k in range(iteration * n, (iteration + 1) * n):
        pass_, i = divmod(k, len(prompts))
        if pass_ not in orders:
            orders[pass_] = np.random.default_rng([seed, pass_]).permutation(len(prompts))
        out.append(prompts[orders[pass_][i]])
    return out


def _save_experience(workdir, iteration, examples, stats, keep):
    """Writes `iteration`'s experience beside the checkpoints, then `_prune_experience(workdir, keep)`."""
    if jax.process_index() == 0:
        path = os.path.join(workdir, EXPERIENCE_FILE.format(iteration))
        arrays = {k: np.stack([e[k] for e in examples]) for k in examples[0]}
        with open(path + ".tmp", "wb") as f:
            np.savez(f, iteration=iteration, stats=np.array([stats[k] for k in sorted(stats)]), **arrays)
        os.replace(path + ".tmp", path)
    _prune_experience(workdir, keep)


def _prune_experience(workdir, keep):
    """Removes the experience of the iterations not in `keep` (those no checkpoint a restart may restore lies in)."""
    if jax.process_index() != 0 or not os.path.isdir(workdir):
        return
    for name in os.listdir(workdir):
        match = re.fullmatch(re.escape(EXPERIENCE_FILE).replace(r"\{\}", r"(\d+)"), name)
        if match and int(match.group(1)) not in keep:
            os.remove(os.path.join(workdir, name))


def _load_experience(workdir, iteration, stat_names):
    """The examples and stats `_save_experience` wrote for `iteration`, else None."""
    path = os.path.join(workdir, EXPERIENCE_FILE.format(iteration))
    if not os.path.exists(path):
        return None
    with np.load(path) as z:
        if int(z["iteration"]) != iteration:
            return None
        arrays = {k: z[k] for k in z.files if k not in ("iteration", "stats")}
        stats = dict(zip(sorted(stat_names), z["stats"].tolist()))
    return [{k: v[i] for k, v in arrays.items()} for i in range(len(arrays["input_ids"]))], stats


def _iteration_done(trainer, it, stats, history, on_iteration):
    history.append(stats)
    trainer.write_scalars("rollout", stats)
    if on_iteration is not None:
        on_iteration(it, stats)


def _stop_between_fits(trainer, stop, where="between PPO's fits"):
    """Between fits (before and after a rollout) and during a rollout (`RolloutStopped`): a SIGTERM / SIGINT that
    arrived outside `fit` (agreed across processes) saves the Trainer's step, waits for the write and ends the run as
    `fit` would (`engine.StoppedBySignal`)."""
    stop.agree()
    if not stop():
        return
    saved = trainer.workdir is not None and trainer.step > 0
    logging.warning("signal received %s: stopping at step %d", where, trainer.step)
    if saved and trainer.step not in trainer.checkpoint_steps():  # a resumed step is saved (and maybe not placed)
        trainer.save_checkpoint()
    trainer.close()
    raise fit_loop.StoppedBySignal(stop.signum or signal.SIGTERM, trainer.step, saved=saved)


def _rollout_poll(stop):
    """`should_stop` of fit_ppo's rollouts: the signal, agreed across processes every `_AGREE_EVERY`-th poll (every
    process polls alike: the engine's steps are the same on each)."""
    polls = [0]

    def should_stop():
        polls[0] += 1
        if stop.processes > 1 and (polls[0] - 1) % _AGREE_EVERY:  # the first poll agrees (the static path's only)
            return False
        stop.agree()
        return stop()
    return should_stop


def fit_ppo(trainer, ppo, prompts, *, max_steps, rollout_batch_size, per_device_batch_size, ppo_epochs=1, seed=0,
            log_every=10, save_every=None, on_iteration=None, hang_timeout=None):
    """Runs PPO iterations until `max_steps` updates in total (resumes included: a Trainer restored from its
    workdir continues where it stopped, exactly, even mid-iteration). `trainer`: an `engine.Trainer` with
    `loss_fn=ppo.loss_fn()`, params {'actor', 'critic'} ({'actor'} for GRPO) and
    `collate_fn=preference.collate_preferences`. prompts:
    strings; each iteration answers rollout_batch_size / samples_per_prompt of them (`iteration_prompts`), in
    `rollout_batch_size` rows (responses), a multiple of the Trainer's global batch and of the config's
    samples_per_prompt, and makes `ppo_epochs` epochs of updates on their experience. save_every: iterations between
    checkpoints (and one at the end). After each whole iteration its rollout's stats go to TensorBoard
    (`rollout/score`, `rollout/kl`, ...) and to on_iteration(iteration, stats). Rollouts sample and score in the
    Trainer's compute dtype (`PPO.rollout(compute_dtype=)`). hang_timeout: each iteration's `fit` runs under the hang
    watchdog with it (`Trainer.fit`). Each rollout's experience is saved in the workdir (`EXPERIENCE_FILE`, kept
    while a checkpoint lies in its iteration), so a resume trains on the same rows. A SIGTERM / SIGINT between fits
    stops the run, its step saved: `engine.StoppedBySignal`, as `fit` raises. One during a rollout drops the
    rollout (between two steps of the paged engine, or after the static one's generation) and stops so; the resume
    samples it again, the same.
    Returns the stats of the whole iterations run."""
    rows = global_batch_size(trainer.mesh, per_device_batch_size, trainer.accumulate)
    group = ppo.config.samples_per_prompt
    checks = {"max_steps": isinstance(max_steps, int) and max_steps >= 0,
              "rollout_batch_size": isinstance(rollout_batch_size, int) and rollout_batch_size >= rows
              and rollout_batch_size % rows == 0 and rollout_batch_size % group == 0,
              "ppo_epochs": isinstance(ppo_epochs, int) and ppo_epochs >= 1,
              "save_every": save_every is None or (isinstance(save_every, int) and save_every >= 1)}
    for name, ok in checks.items():
        if not ok:
            raise ValueError(f"{name}={locals()[name]!r}; expected max_steps >= 0, a rollout_batch_size that is a "
                             f"positive multiple of the global batch ({rows} rows) and of samples_per_prompt "
                             f"({group}), ppo_epochs >= 1, save_every None or >= 1")
    if not prompts:
        raise ValueError("prompts: none given; expected at least one prompt")
    trained = trainer.trainable_paths()
    for scope in ppo.frozen_paths():  # a shared reference must not move: only adapters may train there
        moving = [p for p in trained if re.search(scope, p) and not re.search(models.LORA_TRAINABLE, p)]
        if moving:
            raise ValueError(f"trainer trains {moving[0]} (and {len(moving) - 1} more), which the reference or "
                             "reward model shares with it (ref_params=None / reward_params without 'backbone'); "
                             "expected trainable=models.LORA_TRAINABLE (plus the critic's score head)")
    steps_per_iteration = ppo_epochs * rollout_batch_size // rows
    history = []
    # The iterations whose experience a restart may read: the current one and those checkpoints lie in.
    needed = lambda it: {it} | {s // steps_per_iteration for s in trainer.checkpoint_steps()}  # noqa: E731
    if trainer.workdir:  # rollouts past the restored step were another run's (a fresh one is exact)
        _prune_experience(trainer.workdir, needed(trainer.step // steps_per_iteration))
    with fit_loop.stop_on_signal() as stop:  # a signal outside `fit`: a rollout stops at its next poll, dropped
        while trainer.step < max_steps:
            _stop_between_fits(trainer, stop)
            it = trainer.step // steps_per_iteration
            loaded = _load_experience(trainer.workdir, it, _STATS) if trainer.workdir else None
            if loaded is None and trainer.step > it * steps_per_iteration:  # resumed mid-iteration
                logging.warning("no saved experience of iteration %d: a fresh rollout from step %d, so this resume "
                                "is not exact", it, trainer.step)
            if loaded is None:
                try:
                    examples, stats = ppo.rollout(
                        trainer.params, iteration_prompts(prompts, it, rollout_batch_size // group, seed),
                        seed=seed * 1_000_003 + it, per_device_batch_size=per_device_batch_size,
                        compute_dtype=trainer.compute_dtype, should_stop=_rollout_poll(stop))
                except RolloutStopped:
                    _stop_between_fits(trainer, stop, f"during iteration {it}'s rollout (dropped: the resume samples "
                                                      "it again)")
                    raise  # a poll said stop: the agreed signal is set
                if trainer.workdir:
                    _save_experience(trainer.workdir, it, examples, stats, needed(it))
            else:  # saved before the restart: trained on as sampled then (changed rollout settings apply later)
                logging.info("iteration %d trains on its rollout saved before the restart, as sampled then", it)
                examples, stats = loaded
            _stop_between_fits(trainer, stop)
            try:
                trainer.fit(examples, per_device_batch_size=per_device_batch_size,
                            total_epochs=(it + 1) * ppo_epochs, max_steps=max_steps, log_every=log_every,
                            checkpoint_at_end=False, hang_timeout=hang_timeout)
            except fit_loop.StoppedBySignal:
                if trainer.step == (it + 1) * steps_per_iteration:  # stopped at the iteration's end: it is done
                    _iteration_done(trainer, it, stats, history, on_iteration)
                    trainer.close()  # its scalars written out before the program ends
                raise
            if trainer.step < (it + 1) * steps_per_iteration:
                break
            _iteration_done(trainer, it, stats, history, on_iteration)
            if trainer.workdir and save_every and (it + 1) % save_every == 0:
                trainer.save_checkpoint()
    if trainer.workdir and trainer.opt_state is not None:
        trainer.save_checkpoint()
    return history
