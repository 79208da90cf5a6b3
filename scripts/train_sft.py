"""Supervised fine-tuning on prompt/response pairs: the first step of an RLHF pipeline (SFT -> reward model -> PPO,
or SFT -> DPO).

Each pair becomes one row, prompt + separator (the tokenizer's BOS, else EOS) + response + EOS, and only the response
and its EOS are labelled, so the model learns to answer prompts rather than to write them. The model starts from
--init_from (a workdir of scripts/train_lm.py, e.g. a pre-training run, or a Hugging Face directory) or, without it,
from a fresh small LLaMA. With no --data it uses an embedded toy task (a list of animal names; the response is the
list sorted). It prints the falling response loss and the held-out exact match of greedy answers, and writes
TensorBoard scalars and checkpoints under --workdir. Re-running the same command resumes.

  python scripts/train_sft.py                                              # the toy task
  python scripts/train_sft.py --init_from=/path/to/hf_llama --data=pairs.jsonl --seq_len=512
  python scripts/train_sft.py --workdir=sft && python scripts/train_dpo.py --init_from=sft --workdir=dpo
"""


from absl import flags

import engine
import models
from engine.tasks import cli, lm, mesh_choice, model_start, script_flags
from engine.tasks.rlhf import preference

FLAGS = flags.FLAGS
script_flags.define_training_flags(workdir="workdir_sft", max_steps=200, learning_rate=3e-3, warmup_steps=10,
                                   log_every=20, save_every=100)
FLAGS.set_default("per_device_batch_size", 16)
script_flags.define_decoder_flags(init_from_help="A workdir of scripts/train_lm.py or scripts/train_sft.py (its "
                                  "latest checkpoint and tokenizer) or a Hugging Face model directory to fine-tune. "
                                  "Empty: a fresh model (--model, --model_config, --model_overrides).")
script_flags.define_record_flags(what="pairs", fields=preference.SFT_FIELDS, toy_size=4096)
flags.DEFINE_integer("seq_len", 64, "Tokens per row: prompt, separator, response and EOS (longer rows lose their end).")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens per greedy answer of the held-out exact match.")
flags.DEFINE_integer("eval_answers", 64, "Held-out prompts answered greedily for the exact match (0: none).")
script_flags.define_auto_mesh_flag()
TASKS = ("lm", "sft")


def make_trainer(mesh, model, params, **kwargs):
    return engine.Trainer(mesh=mesh, collate_fn=preference.collate_preferences,
                          loss_fn=lm.lm_loss_fn(model, script_flags.loss_implementation(model)), params=params,
                          optimizer=script_flags.optimizer(), trainable=model_start.trainable(),
                          **script_flags.trainer_kwargs(), **kwargs)


def main(argv):
    del argv
    profile = script_flags.parse_profile_steps(FLAGS.profile_steps)
    train_pairs, eval_pairs = script_flags.load_train_eval(preference.read_prompt_responses,
                                                           preference.toy_prompt_responses, key="prompt", what="pairs")
    mesh, batch = cli.start(auto=True), FLAGS.per_device_batch_size
    if mesh is None:
        mesh, batch = mesh_choice.choose_decoder_mesh(make_trainer, preference.collate_preferences,
                                                      preference.encode_prompt_responses, train_pairs, tasks=TASKS)
    _, model, params, tokenizer = model_start.start_decoder(mesh, tasks=TASKS, seq_len=FLAGS.seq_len)
    model, params = model_start.with_flags(model, params)
    train, evals = script_flags.encode_rows(preference.encode_prompt_responses, tokenizer, train_pairs, eval_pairs,
                                            mesh, what="pairs", per_device_batch_size=batch)
    script_flags.save_records_run("sft", model, tokenizer, examples=(train, evals), seq_len=FLAGS.seq_len,
                                  global_batch=engine.global_batch_size(mesh, batch, FLAGS.accumulate_grad_batches))
    print(f"{len(train)} training and {len(evals)} held-out pairs; e.g. {train_pairs[0]['prompt']!r} -> "
          f"{train_pairs[0]['response']!r}")
    trainer = make_trainer(mesh, model, params, workdir=FLAGS.workdir,
                           logging=engine.Logging(
                               flops_per_example=models.train_flops_per_example(model, FLAGS.seq_len)))
    answered = eval_pairs[:FLAGS.eval_answers]
    exact = lambda: preference.answer_exact_match(  # noqa: E731
        model, trainer.params, tokenizer, answered, max_new_tokens=FLAGS.max_new_tokens) if answered else float("nan")
    if trainer.step:
        print(f"resumed from {FLAGS.workdir} at step {trainer.step}")
    start_loss, start_exact = trainer.eval_loss(evals, per_device_batch_size=batch), exact()
    print(f"eval response loss before training: {start_loss:.4f}, exact match {start_exact:.3f}")
    cli.log_eval(trainer, {"loss": start_loss, "exact_match": start_exact})
    trainer.fit(train, per_device_batch_size=batch, n_epochs=FLAGS.n_epochs, max_steps=FLAGS.max_steps,
                eval_examples=evals, log_every=FLAGS.log_every, save_every=FLAGS.save_every, profile_steps=profile,
                **script_flags.fit_kwargs())
    for line in cli.progress_lines(trainer, FLAGS.log_every):
        print(line)
    end_loss, end_exact = trainer.eval_loss(evals, per_device_batch_size=batch), exact()
    print(f"eval response loss after training: {end_loss:.4f} (was {start_loss:.4f}), exact match {end_exact:.3f} "
          f"(was {start_exact:.3f}) of {len(answered)} held-out greedy answers at step {trainer.step}")
    cli.log_eval(trainer, {"loss": end_loss, "exact_match": end_exact})
    trainer.close()


if __name__ == "__main__":
    cli.run(main)
