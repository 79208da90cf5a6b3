"""RLHF with PPO: the third step of the pipeline SFT -> reward model -> PPO (engine/ppo.py).

The policy (actor) starts from --init_from (a workdir of scripts/train_sft.py or scripts/train_lm.py, or a Hugging Face
directory) and is also the frozen reference of the KL penalty. The reward model is --reward_from (the latest
checkpoint of a scripts/train_reward.py workdir, or a Hugging Face *ForSequenceClassification directory), frozen, and
the critic starts as a copy of it; on the embedded toy task (no --data: lists of animal names to sort) --reward_from
may be left empty, and the reward is then the task's rule (LCS partial credit, 1 for the sorted list) with a critic
that starts from the policy. Each iteration the actor samples responses to --rollout_batch_size prompts, they are
scored, and --ppo_epochs epochs of updates train actor and critic, until --max_steps updates in all. It prints each
iteration's mean reward and KL and, before and after, the held-out greedy answers' mean reward (and, on the toy task,
exact match), and writes TensorBoard scalars and checkpoints under --workdir. Re-running the same command resumes
exactly.

--advantage_estimator=grpo trains by GRPO instead (engine/ppo.py): no critic; each prompt is answered
--samples_per_prompt times and each response's advantage is its reward against its group's; the reward model, if
any, is frozen with weights of its own. --verifiable_reward=exact_match|lcs scores responses against reference
answers ({"prompt", "response"} lines of --data) instead of a reward model.

  python scripts/train_sft.py --workdir=sft --max_steps=60
  python scripts/train_ppo.py --init_from=sft --workdir=ppo                    # the toy task's rule reward
  python scripts/train_reward.py --init_from=sft --workdir=rm
  python scripts/train_ppo.py --init_from=sft --reward_from=rm --workdir=ppo_rm
  python scripts/train_ppo.py --init_from=sft --workdir=grpo --advantage_estimator=grpo
  python scripts/train_ppo.py --init_from=sft --workdir=rlvr --advantage_estimator=grpo --data=answers.jsonl \
      --verifiable_reward=exact_match
"""
import math
import os


import jax
import numpy as np
import optax
from absl import flags

import engine
import models
from engine.tasks import cli, model_start, run_record, script_flags, text_data
from engine.tasks.rlhf import ppo, preference

FLAGS = flags.FLAGS
script_flags.define_training_flags(workdir="workdir_ppo", max_steps=320, learning_rate=1e-3, warmup_steps=4,
                                   log_every=8, save_every=10, evals=False)
FLAGS["save_every"].help = "Iterations between checkpoints (one is always written at the end)."
script_flags.define_decoder_flags(init_from_help="A workdir of scripts/train_sft.py or scripts/train_lm.py (its "
                                  "latest checkpoint and tokenizer) or a Hugging Face model directory: the policy "
                                  "starts there and the reference model is it, frozen. Empty: a fresh model (--model, "
                                  "--model_config, --model_overrides).")
flags.DEFINE_string("reward_from", None, "A workdir of scripts/train_reward.py or a Hugging Face "
                    "*ForSequenceClassification directory (one label): the reward model (frozen) and the critic's "
                    "starting point. Empty: a rule reward (--verifiable_reward; on the toy task by default its own "
                    "rule, LCS partial credit, 1 for the sorted list), and the critic starts from the policy.")
flags.DEFINE_enum("verifiable_reward", "none", ["none", *preference.VERIFIABLE_REWARDS], "Instead of a reward "
                  "model, a rule against each prompt's reference answer (RL with verifiable rewards, e.g. GRPO on "
                  "math or code answers): --data then holds {\"prompt\": ..., \"response\": ...} lines, the response "
                  "being the reference; exact_match scores 1 or 0, lcs partial credit (2 x the longest common "
                  "subsequence of words / the words of both).")
script_flags.define_record_flags(what="prompts", fields=("prompt",), toy_size=4096)
flags.DEFINE_integer("rollout_batch_size", 0, "Responses sampled per iteration (--samples_per_prompt to each "
                     "prompt), a multiple of the global batch and of --samples_per_prompt (0: four global batches, "
                     "or their least multiple that --samples_per_prompt divides).", lower_bound=0)
flags.DEFINE_enum("advantage_estimator", "gae", list(ppo.ADVANTAGE_ESTIMATORS), "gae: PPO with a critic (value "
                  "model) and the KL penalty in the rewards; grpo: GRPO, no critic, each response's reward against "
                  "its prompt's group of --samples_per_prompt responses, the KL to the reference in the loss.")
flags.DEFINE_bool("scale_rewards", True, "grpo: divide each group's centred rewards by their standard deviation "
                  "(--noscale_rewards: Dr. GRPO, which finds that the division favours prompts whose responses score "
                  "alike).")
flags.DEFINE_integer("samples_per_prompt", 0, "Responses sampled per prompt in each rollout (0: 1 with gae, 8 with "
                     "grpo, which needs at least 2).", lower_bound=0)
flags.DEFINE_integer("ppo_epochs", 1, "Epochs of updates on each iteration's experience.", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 16, "Tokens per response at most.", lower_bound=1)
flags.DEFINE_float("temperature", 1.0, "Sampling temperature of the rollouts (0: greedy).", lower_bound=0.0)
flags.DEFINE_float("kl_coef", 0.05, "Per-token KL penalty towards the reference policy (grpo: the weight of the "
                   "KL term of the loss).", lower_bound=0.0)
flags.DEFINE_float("clip_ratio", 0.2, "PPO's clipping of the probability ratio.", lower_bound=1e-3, upper_bound=0.999)
flags.DEFINE_float("value_coef", 0.5, "Weight of the critic's loss.", lower_bound=0.0)
flags.DEFINE_float("critic_learning_rate", None, "Peak learning rate of the critic (default: --learning_rate, one "
                   "optimizer for both).", lower_bound=0.0)
flags.DEFINE_float("unfinished_reward", -5.0, "The reward of a response cut off at --max_new_tokens before its EOS, "
                   "replacing its score (a reward model never learnt to score unfinished responses, and PPO finds "
                   "those it overrates); keep it below the scores of bad finished responses.")
flags.DEFINE_enum("kv_cache_dtype", "auto", ["auto", "int8", "bfloat16", "float32"], "The rollouts' KV cache: auto "
                  "= the actor's compute dtype; int8 = int8 keys and values, a scale per token and head.")
flags.DEFINE_enum("rollout_engine", "static", list(ppo.ROLLOUT_ENGINES), "How the rollouts generate: static = "
                  "one batch through models.generate, a contiguous cache of prompt + --max_new_tokens per row until "
                  "the longest row ends; paged = models.PagedEngine, continuous batching over a paged KV cache, each "
                  "row retiring at its EOS, the --samples_per_prompt rows of a prompt sharing its pages (greedy "
                  "rollouts equal the static ones; sampled ones draw other random streams).")
flags.DEFINE_float("rollout_kv_memory_gb", 0.0, "--rollout_engine=paged: the KV page pool's size in GB (0: pages "
                   "for every row of a rollout at once).", lower_bound=0.0)
flags.DEFINE_integer("eval_answers", 64, "Held-out prompts answered greedily before and after training (0: none).",
                     lower_bound=0)
FLAGS.set_default("per_device_batch_size", 16)


def _read_prompts(patterns, decode_errors="strict", record_columns=None):
    fields = ("prompt",) if FLAGS.verifiable_reward == "none" else preference.SFT_FIELDS
    return text_data.read_records(patterns, fields, decode_errors=decode_errors, record_columns=record_columns)


def _evaluate(task, params, eval_records):
    """(mean reward, exact match or None) of greedy answers to the held-out prompts."""
    records = eval_records[:FLAGS.eval_answers]
    if not records:
        return float("nan"), None
    responses, _, scored = task.generate_and_score(params, [r["prompt"] for r in records], seed=0, temperature=0.0)
    mean_reward = float(np.mean([s["score"] for s in scored]))
    if "response" not in records[0]:
        return mean_reward, None
    eos = task.tokenizer.eos_id
    answers = [task.tokenizer.decode([i for i in r if i != eos]).strip() for r in responses]
    return mean_reward, float(np.mean([a == r["response"].strip() for a, r in zip(answers, records)]))


def _optimizer():
    """The training flags' optimizer; with --critic_learning_rate, one for the actor and one for the critic."""
    if FLAGS.critic_learning_rate is None:
        return script_flags.optimizer()
    # A function of the parameters it updates: with --lora_rank those are the trained ones only.
    labels = lambda tree: {k: jax.tree.map(lambda _, k=k: k, v) for k, v in tree.items()}  # noqa: E731
    return optax.multi_transform({"actor": script_flags.optimizer(),
                                  "critic": script_flags.optimizer(FLAGS.critic_learning_rate)}, labels)


def _report(name, values):
    reward_value, exact = values
    return f"{name}: greedy answers' mean reward {reward_value:.3f}" + (
        "" if exact is None else f", exact match {exact:.3f}")


def _scalars(values):
    reward_value, exact = values
    return {"greedy_reward": reward_value, **({} if exact is None else {"exact_match": exact})}


def _check_flags():
    """The flag combinations PPO and GRPO refuse; returns the samples per prompt."""
    grpo = FLAGS.advantage_estimator == "grpo"
    for name in ("critic_learning_rate", "value_coef"):
        if grpo and FLAGS[name].present:
            raise ValueError(f"--{name} with --advantage_estimator=grpo; expected neither (GRPO has no critic)")
    if not grpo and FLAGS["scale_rewards"].present:
        raise ValueError("--scale_rewards with --advantage_estimator=gae; expected it with grpo only (GAE's "
                         "advantages are whitened over the batch)")
    samples = FLAGS.samples_per_prompt or (8 if grpo else 1)
    if grpo and samples < 2:
        raise ValueError(f"--samples_per_prompt={samples} with --advantage_estimator=grpo; expected at least 2 (a "
                         "group to compare each response with)")
    if FLAGS.rollout_engine == "paged" and FLAGS.kv_cache_dtype not in ("auto", "int8"):
        raise ValueError(f"--kv_cache_dtype={FLAGS.kv_cache_dtype} with --rollout_engine=paged; expected auto or "
                         "int8 (the paged cache's storages)")
    if FLAGS.rollout_engine != "paged" and FLAGS.rollout_kv_memory_gb:
        raise ValueError(f"--rollout_kv_memory_gb={FLAGS.rollout_kv_memory_gb} with --rollout_engine="
                         f"{FLAGS.rollout_engine}; expected it with --rollout_engine=paged only")
    rule = FLAGS.verifiable_reward != "none"
    if not FLAGS.reward_from and FLAGS.data and not rule:
        raise ValueError("--reward_from is empty; expected the workdir of scripts/train_reward.py, or "
                         "--verifiable_reward with reference answers in --data (only the embedded toy task, without "
                         "--data, has a rule reward of its own)")
    if FLAGS.reward_from and rule:
        raise ValueError(f"--reward_from={FLAGS.reward_from} with --verifiable_reward={FLAGS.verifiable_reward}; "
                         "expected one of them (a reward model or a rule)")
    return samples


def _ppo_config(samples):
    return ppo.PPOConfig(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, kl_coef=FLAGS.kl_coef,
                         clip_ratio=FLAGS.clip_ratio, value_coef=FLAGS.value_coef,
                         unfinished_reward=FLAGS.unfinished_reward,
                         kv_cache_dtype=None if FLAGS.kv_cache_dtype == "auto" else FLAGS.kv_cache_dtype,
                         advantage_estimator=FLAGS.advantage_estimator, samples_per_prompt=samples,
                         scale_rewards=FLAGS.scale_rewards, rollout_engine=FLAGS.rollout_engine,
                         rollout_kv_memory_gb=FLAGS.rollout_kv_memory_gb or None)


def _reward_model(mesh, tokenizer):
    """(RewardModel, its params) of --reward_from: a train_reward.py workdir or a transformers classifier directory,
    checked to read the policy's tokens and laid out for the run's pipeline."""
    if os.path.exists(os.path.join(FLAGS.reward_from, run_record.RUN_FILE)):
        _, critic, reward_params, reward_tokenizer = run_record.restore_run(FLAGS.reward_from, mesh, tasks=("reward",))
    elif os.path.isdir(FLAGS.reward_from):  # a transformers sequence classifier
        critic, reward_params = models.load_reward_model(FLAGS.reward_from, layout=engine.auto_layout(mesh))
        reward_tokenizer = text_data.HFTokenizer.from_dir(FLAGS.reward_from, critic.config.vocab_size) or tokenizer
    else:
        raise FileNotFoundError(f"--reward_from={FLAGS.reward_from} is not a directory; expected a workdir of "
                                "scripts/train_reward.py or a Hugging Face *ForSequenceClassification directory")
    if reward_tokenizer.vocab_size != tokenizer.vocab_size or reward_tokenizer.eos_id != tokenizer.eos_id:
        raise ValueError(f"--reward_from={FLAGS.reward_from} reads another tokenizer than --init_from's; "
                         "expected a reward model trained on the policy's tokens")
    backbone, backbone_params = model_start.with_pipeline(critic.backbone, reward_params["backbone"])
    return models.RewardModel(backbone), {**reward_params, "backbone": backbone_params}


def _critic_and_rewards(mesh, actor, actor_params, tokenizer, records):
    """(critic or None for GRPO, its params, PPO's reward keyword arguments): a learnt reward model (--reward_from)
    or a rule (the toy task's, or --verifiable_reward against the reference answers in `records`)."""
    grpo = FLAGS.advantage_estimator == "grpo"
    if not FLAGS.reward_from:  # a rule; the critic starts from the policy with a fresh head
        critic = critic_params = None
        if not grpo:
            critic = models.RewardModel(actor)
            critic_params = models.init_reward_params(critic, actor_params, jax.random.PRNGKey(FLAGS.seed))
        rule = FLAGS.verifiable_reward
        return critic, critic_params, {"reward_fn": preference.verifiable_reward(rule, records) if rule != "none"
                                       else preference.toy_reward}
    critic, reward_params = _reward_model(mesh, tokenizer)
    if grpo:  # no critic: the reward model frozen, with its own weights (--quantize: stored like the base)
        if FLAGS.lora_rank and FLAGS.quantize != "none":
            backbone, backbone_params = models.quantize(critic.backbone, reward_params["backbone"], FLAGS.quantize)
            critic, reward_params = models.RewardModel(backbone), {**reward_params, "backbone": backbone_params}
        return None, None, {"reward_model": critic, "reward_params": reward_params}
    # With --lora_rank the critic gets adapters and the reward model is the critic with them off: one copy of the
    # reward model's weights (engine/tasks/rlhf/ppo.py), frozen.
    critic, critic_params = model_start.with_lora(critic, reward_params, mesh)
    return critic, critic_params, {"reward_model": critic, "reward_params": (
        {"score": critic_params["score"]} if FLAGS.lora_rank else critic_params)}


def rows_per_update(mesh):
    return engine.global_batch_size(mesh, FLAGS.per_device_batch_size, FLAGS.accumulate_grad_batches)


def _rollout_batch_size(mesh, samples):
    rows = rows_per_update(mesh)
    rollout_batch_size = FLAGS.rollout_batch_size or math.lcm(4 * rows, samples)
    if rollout_batch_size % rows or rollout_batch_size % samples:
        raise ValueError(f"--rollout_batch_size={FLAGS.rollout_batch_size}; expected a positive multiple of the "
                         f"global batch ({rows} rows) and of --samples_per_prompt ({samples})")
    return rollout_batch_size, FLAGS.ppo_epochs * rollout_batch_size // rows


def _check_resume(mesh, iteration, examples):
    """A resume's refusals, before the models load: another global batch, rollout shape, critic optimizer, data or
    frozen model than the run in --workdir had."""
    why = "an iteration's rollouts and updates, and which iteration a step is in, would change mid-run"
    recorded = run_record.recorded(FLAGS.workdir, "global_batch")
    if recorded is not None and recorded != rows_per_update(mesh):  # --accumulate_grad_batches given
        raise ValueError(f"--accumulate_grad_batches={FLAGS.accumulate_grad_batches} makes a global batch of "
                         f"{rows_per_update(mesh)} rows where the run in {FLAGS.workdir} had {recorded}: {why}; "
                         "expected the run's global batch (leave --accumulate_grad_batches unset: the restart keeps "
                         "it), or another --workdir")
    run_record.check_kept(FLAGS.workdir, iteration, why)
    then = run_record.recorded(FLAGS.workdir, "critic_learning_rate", default=FLAGS.critic_learning_rate)
    if then is None and FLAGS.critic_learning_rate is not None:
        raise ValueError(f"--critic_learning_rate={FLAGS.critic_learning_rate} where the run in {FLAGS.workdir} had "
                         "it unset: the critic would get an optimizer of its own, whose state its checkpoints do not "
                         "hold; expected --critic_learning_rate unset to resume it, or another --workdir")
    if then is not None and FLAGS.critic_learning_rate is None:
        raise ValueError(f"--critic_learning_rate unset where the run in {FLAGS.workdir} had {then}: its "
                         "checkpoints hold the critic's optimizer state apart from the actor's; expected "
                         "--critic_learning_rate set (to any value) to resume it, or another --workdir")
    script_flags.check_records_run(examples=examples, frozen_from=("init_from", "reward_from"))


def main(argv):
    del argv
    samples = _check_flags()
    train_records, eval_records = script_flags.load_train_eval(_read_prompts, preference.toy_prompt_responses,
                                                               key="prompt", what="prompts")
    mesh = cli.start()
    rollout_batch_size, steps_per_iteration = _rollout_batch_size(mesh, samples)
    iteration = {"rollout_batch_size": rollout_batch_size, "ppo_epochs": FLAGS.ppo_epochs,
                 "samples_per_prompt": samples}
    _check_resume(mesh, iteration, (train_records, eval_records))
    _, actor, actor_params, tokenizer = model_start.start_decoder(mesh, tasks=("lm", "sft"), seq_len=None)
    actor, actor_params = model_start.with_pipeline(actor, actor_params)
    longest = max(len(preference.prompt_tokens(tokenizer, r["prompt"], 1 << 30, f"prompt {n}"))
                  for n, r in enumerate(train_records + eval_records))
    seq_len = longest + FLAGS.max_new_tokens - 1
    model_start.check_positions(actor, seq_len, what=f"rows of {seq_len} tokens (the longest prompt's {longest} with "
                                f"the separator, then --max_new_tokens={FLAGS.max_new_tokens} - 1)",
                                expected="shorter prompts or a smaller --max_new_tokens")
    critic, critic_params, rewards = _critic_and_rewards(mesh, actor, actor_params, tokenizer,
                                                         train_records + eval_records)
    # The Trainer places its own copies (it donates those), so the reference and the reward model may be the very
    # arrays the actor and the critic start from.
    params = {"actor": actor_params, **({"critic": critic_params} if critic is not None else {})}
    # With --lora_rank the reference is the actor with its adapters off (no copy of the policy's weights).
    task = ppo.PPO(actor=actor, critic=critic, ref_params=None if FLAGS.lora_rank else actor_params,
                   tokenizer=tokenizer, mesh=mesh, seq_len=seq_len, config=_ppo_config(samples),
                   implementation=script_flags.loss_implementation(actor, per_token=True), **rewards)
    script_flags.save_records_run("ppo", actor, tokenizer, critic=critic, examples=(train_records, eval_records),
                                  global_batch=rows_per_update(mesh), kept=iteration,
                                  frozen_from=("init_from", "reward_from"))
    flops = models.train_flops_per_example(actor, seq_len) + (
        models.train_flops_per_example(critic.backbone, seq_len) if critic is not None else 0)
    trainer = engine.Trainer(mesh=mesh, collate_fn=preference.collate_preferences, loss_fn=task.loss_fn(),
                             params=params, optimizer=_optimizer(), workdir=FLAGS.workdir,
                             trainable=model_start.trainable(None if critic is None else models.SCORE_TRAINABLE),
                             **script_flags.trainer_kwargs(), logging=engine.Logging(flops_per_example=flops))
    if trainer.step:
        print(f"resumed from {FLAGS.workdir} at step {trainer.step}")
    group = f" ({rollout_batch_size // samples} prompts x {samples})" if samples > 1 else ""
    print(f"{len(train_records)} training prompts; iterations of {rollout_batch_size} rollouts{group} and "
          f"{steps_per_iteration} updates, to step {FLAGS.max_steps}; rows of {seq_len} tokens")
    _train(trainer, task, train_records, eval_records, rollout_batch_size)


def _train(trainer, task, train_records, eval_records, rollout_batch_size):
    """PPO iterations to --max_steps, with the held-out greedy answers' reward before and after."""
    start = _evaluate(task, trainer.params, eval_records)
    print(_report("before training", start))
    cli.log_eval(trainer, _scalars(start))

    def on_iteration(it, stats):
        print(f"iteration {it + 1:4d}  step {trainer.step:5d}  reward {stats['score']:.3f}  kl {stats['kl']:.3f}  "
              f"response tokens {stats['response_tokens']:.1f}  ended {stats['ended']:.2f}", flush=True)

    ppo.fit_ppo(trainer, task, [r["prompt"] for r in train_records],
                max_steps=FLAGS.max_steps, rollout_batch_size=rollout_batch_size,
                per_device_batch_size=FLAGS.per_device_batch_size, ppo_epochs=FLAGS.ppo_epochs, seed=FLAGS.seed,
                log_every=FLAGS.log_every, save_every=FLAGS.save_every, on_iteration=on_iteration,
                hang_timeout=FLAGS.hang_timeout)
    for line in cli.progress_lines(trainer, FLAGS.log_every):
        print(line)
    end = _evaluate(task, trainer.params, eval_records)
    print(_report(f"after training (step {trainer.step})", end) +
          f" (before: {start[0]:.3f}" + ("" if start[1] is None else f", {start[1]:.3f}") + ")")
    cli.log_eval(trainer, _scalars(end))
    trainer.close()


if __name__ == "__main__":
    cli.run(main)
