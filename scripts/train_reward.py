"""Trains a reward model on preference triples: the second step of an RLHF pipeline (SFT -> reward model -> PPO).

The reward model is a decoder-only language model whose output head is replaced by a scalar score
(`models.RewardModel`); a response's reward is the score at its EOS. It starts from --init_from (a workdir of
scripts/train_sft.py or scripts/train_lm.py, or a Hugging Face directory) with a fresh score head or, without it,
from a fresh small LLaMA, and learns the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) on `{"prompt",
"chosen", "rejected"}` jsonl triples (--data). With no --data it uses the embedded toy task (a list of animal names;
the sorted list is preferred to another order). It prints the falling loss and the held-out accuracy (the chosen
response gets the higher reward), and writes TensorBoard scalars and checkpoints under --workdir. Re-running the same
command resumes. scripts/train_ppo.py reads the workdir.

  python scripts/train_reward.py                                          # the toy task
  python scripts/train_sft.py --workdir=sft && python scripts/train_reward.py --init_from=sft --workdir=rm
"""


import jax
from absl import flags

import engine
import models
from engine.tasks import cli, mesh_choice, model_start, script_flags
from engine.tasks.rlhf import preference, reward

FLAGS = flags.FLAGS
script_flags.define_training_flags(workdir="workdir_reward", max_steps=200, learning_rate=1e-3, warmup_steps=10,
                                   log_every=20, save_every=100)
FLAGS.set_default("per_device_batch_size", 16)
script_flags.define_decoder_flags(init_from_help="A workdir of scripts/train_sft.py or scripts/train_lm.py (its "
                                  "latest checkpoint and tokenizer) or a Hugging Face model directory: the reward "
                                  "model's backbone starts there, with a fresh score head. Empty: a fresh model (--model, "
                                  "--model_config, --model_overrides).")
script_flags.define_record_flags(what="triples", fields=preference.FIELDS, toy_size=4096)
flags.DEFINE_integer("seq_len", 64, "Tokens per row: prompt, separator, response and EOS (longer rows lose their end).")
script_flags.define_auto_mesh_flag()
TASKS = ("lm", "sft")


def make_trainer(mesh, backbone, backbone_params, **kwargs):
    """The reward model's Trainer over a backbone and its parameters (a fresh score head is added)."""
    model = models.RewardModel(backbone)
    params = models.init_reward_params(model, backbone_params, jax.random.PRNGKey(FLAGS.seed))
    return engine.Trainer(mesh=mesh, collate_fn=preference.collate_preferences, loss_fn=reward.reward_loss_fn(model),
                          params=params, optimizer=script_flags.optimizer(),
                          trainable=model_start.trainable(models.SCORE_TRAINABLE), **script_flags.trainer_kwargs(),
                          **kwargs)


def main(argv):
    del argv
    profile = script_flags.parse_profile_steps(FLAGS.profile_steps)
    train_triples, eval_triples = script_flags.load_train_eval(preference.read_preferences, preference.toy_preferences,
                                                               key="prompt", what="triples")
    mesh, batch = cli.start(auto=True), FLAGS.per_device_batch_size
    if mesh is None:
        mesh, batch = mesh_choice.choose_decoder_mesh(make_trainer, preference.collate_preferences,
                                                      preference.encode_preferences, train_triples, tasks=TASKS)
    _, backbone, backbone_params, tokenizer = model_start.start_decoder(mesh, tasks=TASKS, seq_len=FLAGS.seq_len)
    backbone, backbone_params = model_start.with_flags(backbone, backbone_params)
    model = models.RewardModel(backbone)
    train, evals = script_flags.encode_rows(preference.encode_preferences, tokenizer, train_triples, eval_triples, mesh,
                                            what="triples", per_device_batch_size=batch)
    script_flags.save_records_run("reward", backbone, tokenizer, examples=(train, evals), seq_len=FLAGS.seq_len,
                                  global_batch=engine.global_batch_size(mesh, batch, FLAGS.accumulate_grad_batches))
    print(f"{len(train)} training and {len(evals)} held-out triples; e.g. {train_triples[0]['prompt']!r}: "
          f"{train_triples[0]['chosen']!r} over {train_triples[0]['rejected']!r}")
    trainer = make_trainer(mesh, backbone, backbone_params, workdir=FLAGS.workdir,
                           logging=engine.Logging(
                               flops_per_example=2 * models.train_flops_per_example(backbone, FLAGS.seq_len)))
    predictor = engine.Predictor(mesh=mesh, collate_fn=preference.collate_preferences,
                                 pred_fn=reward.reward_pred_fn(model))
    accuracy = lambda: reward.reward_accuracy(  # noqa: E731
        evals, predictor.predict(evals, per_device_batch_size=batch, params=trainer.params))["reward_accuracy"]
    if trainer.step:
        print(f"resumed from {FLAGS.workdir} at step {trainer.step}")
    start_loss, start_accuracy = trainer.eval_loss(evals, per_device_batch_size=batch), accuracy()
    print(f"eval reward loss before training: {start_loss:.4f}, accuracy {start_accuracy:.4f}")
    cli.log_eval(trainer, {"loss": start_loss, "reward_accuracy": start_accuracy})
    trainer.fit(train, per_device_batch_size=batch, n_epochs=FLAGS.n_epochs, max_steps=FLAGS.max_steps,
                eval_examples=evals, eval_predictor=predictor, eval_metric_fn=reward.reward_accuracy,
                log_every=FLAGS.log_every, save_every=FLAGS.save_every, profile_steps=profile,
                **script_flags.fit_kwargs())
    for line in cli.progress_lines(trainer, FLAGS.log_every):
        print(line)
    end_loss, end_accuracy = trainer.eval_loss(evals, per_device_batch_size=batch), accuracy()
    print(f"eval reward loss after training: {end_loss:.4f} (was {start_loss:.4f}), accuracy {end_accuracy:.4f} "
          f"(was {start_accuracy:.4f}) on {len(evals)} held-out triples at step {trainer.step}")
    cli.log_eval(trainer, {"loss": end_loss, "reward_accuracy": end_accuracy})
    trainer.close()


if __name__ == "__main__":
    cli.run(main)
