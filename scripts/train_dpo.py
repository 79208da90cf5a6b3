"""Preference-tunes a decoder-only language model with DPO: the step after supervised fine-tuning in an RLHF pipeline.

The policy starts from --init_from (a workdir of scripts/train_sft.py or scripts/train_lm.py, or a Hugging Face
directory) or, without it, from a fresh small LLaMA. The reference model is that starting point, frozen: its
log-probabilities of every response are computed once, before training, so only the policy is in device memory while
it trains. With no --data it uses an embedded toy task (a list of animal names; the sorted list is preferred to
another order). It prints the falling DPO loss and the held-out preference accuracy (the chosen response gains more
log-probability than the rejected one), and writes TensorBoard scalars (loss, reward accuracy and margin, eval
preference accuracy) and checkpoints under --workdir. Re-running the same command resumes.

  python scripts/train_dpo.py                                              # the toy task
  python scripts/train_sft.py --workdir=sft && python scripts/train_dpo.py --init_from=sft --workdir=dpo
  python scripts/train_dpo.py --init_from=/path/to/hf_llama --data=prefs.jsonl --beta=0.1
"""


import numpy as np
from absl import flags

import engine
import models
from engine.tasks import cli, mesh_choice, model_start, script_flags
from engine.tasks.rlhf import preference

FLAGS = flags.FLAGS
script_flags.define_training_flags(workdir="workdir_dpo", max_steps=200, learning_rate=1e-3, warmup_steps=10,
                                   log_every=20, save_every=100)
FLAGS.set_default("per_device_batch_size", 16)
script_flags.define_decoder_flags(init_from_help="A workdir of scripts/train_sft.py or scripts/train_lm.py (its "
                                  "latest checkpoint and tokenizer) or a Hugging Face model directory; the policy "
                                  "starts there and the reference model is it, frozen. Empty: a fresh model (--model, "
                                  "--model_config, --model_overrides).")
script_flags.define_record_flags(what="triples", fields=preference.FIELDS, toy_size=4096)
flags.DEFINE_integer("seq_len", 64, "Tokens per row: prompt, separator, response and EOS (longer rows lose their end).")
flags.DEFINE_float("beta", 0.1, "DPO's beta: the strength of the pull towards the reference model.", lower_bound=1e-6)
flags.DEFINE_enum("dpo_loss", "sigmoid", list(preference.DPO_LOSSES), "sigmoid: DPO's loss; ipo: IPO's squared "
                  "loss, which stays bounded on deterministic preferences.")
flags.DEFINE_float("label_smoothing", 0.0, "Conservative DPO: the preference labels' assumed flip probability "
                   "(sigmoid loss only).", lower_bound=0.0, upper_bound=0.49)
script_flags.define_auto_mesh_flag()
TASKS = ("lm", "sft", "dpo")


def make_trainer(mesh, model, params, **kwargs):
    loss_fn = preference.dpo_loss_fn(model, beta=FLAGS.beta, loss_type=FLAGS.dpo_loss,
                                     label_smoothing=FLAGS.label_smoothing,
                                     implementation=script_flags.loss_implementation(model, per_token=True))
    return engine.Trainer(mesh=mesh, collate_fn=preference.collate_preferences, loss_fn=loss_fn, params=params,
                          optimizer=script_flags.optimizer(), trainable=model_start.trainable(),
                          **script_flags.trainer_kwargs(), **kwargs)


def encode_with_reference(triples, tokenizer, *, seq_len):
    """encode_preferences's rows with zero reference log-probabilities: --mesh=auto's example (the same shapes)."""
    rows, cut = preference.encode_preferences(triples, tokenizer, seq_len=seq_len)
    return preference.with_reference(rows, [np.zeros(2, np.float32)] * len(rows)), cut


def main(argv):
    del argv
    profile = script_flags.parse_profile_steps(FLAGS.profile_steps)
    train_triples, eval_triples = script_flags.load_train_eval(preference.read_preferences, preference.toy_preferences,
                                                               key="prompt", what="triples")
    mesh, batch = cli.start(auto=True), FLAGS.per_device_batch_size
    if mesh is None:
        mesh, batch = mesh_choice.choose_decoder_mesh(make_trainer, preference.collate_preferences,
                                                      encode_with_reference, train_triples, tasks=TASKS)
    _, model, params, tokenizer = model_start.start_decoder(mesh, tasks=TASKS, seq_len=FLAGS.seq_len)
    model, params = model_start.with_flags(model, params)
    train, evals = script_flags.encode_rows(preference.encode_preferences, tokenizer, train_triples, eval_triples, mesh,
                                            what="triples", per_device_batch_size=batch)
    script_flags.save_records_run("dpo", model, tokenizer, examples=(train, evals), seq_len=FLAGS.seq_len,
                                  global_batch=engine.global_batch_size(mesh, batch, FLAGS.accumulate_grad_batches),
                                  frozen_from=("init_from",))
    print(f"{len(train)} training and {len(evals)} held-out triples; e.g. {train_triples[0]['prompt']!r}: "
          f"{train_triples[0]['chosen']!r} over {train_triples[0]['rejected']!r}")

    # The reference: the starting parameters (a resumed run recomputes the same numbers from the same start).
    implementation = script_flags.loss_implementation(model, per_token=True)
    train, evals = (preference.with_reference(ex, preference.reference_log_probs(
        model, params, ex, mesh=mesh, per_device_batch_size=batch, implementation=implementation,
        compute_dtype=script_flags.compute_dtype()))
        for ex in (train, evals))
    trainer = make_trainer(mesh, model, params, workdir=FLAGS.workdir,
                           logging=engine.Logging(
                               flops_per_example=2 * models.train_flops_per_example(model, FLAGS.seq_len)))
    predictor = engine.Predictor(mesh=mesh, collate_fn=preference.collate_preferences,
                                 pred_fn=preference.preference_pred_fn(model, implementation=implementation))
    accuracy = lambda: preference.preference_accuracy(  # noqa: E731
        evals, predictor.predict(evals, per_device_batch_size=batch, params=trainer.params))["preference_accuracy"]
    if trainer.step:
        print(f"resumed from {FLAGS.workdir} at step {trainer.step}")
    start_loss, start_accuracy = trainer.eval_loss(evals, per_device_batch_size=batch), accuracy()
    print(f"eval DPO loss before training: {start_loss:.4f}, preference accuracy {start_accuracy:.4f}")
    cli.log_eval(trainer, {"loss": start_loss, "preference_accuracy": start_accuracy})
    trainer.fit(train, per_device_batch_size=batch, n_epochs=FLAGS.n_epochs, max_steps=FLAGS.max_steps,
                eval_examples=evals, eval_predictor=predictor, eval_metric_fn=preference.preference_accuracy,
                log_every=FLAGS.log_every, save_every=FLAGS.save_every, profile_steps=profile,
                **script_flags.fit_kwargs())
    for line in cli.progress_lines(trainer, FLAGS.log_every):
        print(line)
    end_loss, end_accuracy = trainer.eval_loss(evals, per_device_batch_size=batch), accuracy()
    print(f"eval DPO loss after training: {end_loss:.4f} (was {start_loss:.4f}), preference accuracy "
          f"{end_accuracy:.4f} (was {start_accuracy:.4f}) on {len(evals)} held-out triples at step {trainer.step}")
    cli.log_eval(trainer, {"loss": end_loss, "preference_accuracy": end_accuracy})
    trainer.close()


if __name__ == "__main__":
    cli.run(main)
