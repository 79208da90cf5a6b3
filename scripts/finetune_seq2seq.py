"""Fine-tunes (or trains from scratch) a T5 encoder-decoder on input/target pairs, evaluated by exact match of its
greedy generations.

With no flags it trains a small T5 on an embedded toy task (sort a list of animal names alphabetically, generated
from --seed; word tokens, no download), prints the falling loss, the exact match of greedy generation on held-out
lists and a few samples, and writes TensorBoard scalars (loss, eval loss, eval exact match) and checkpoints under
--workdir. Re-running the same command resumes; SIGTERM or Ctrl-C saves and exits.

  python scripts/finetune_seq2seq.py                                   # the toy task
  python scripts/finetune_seq2seq.py --init_from=/path/to/hf_flan_t5 --data=train.jsonl --eval_data=dev.jsonl
  python scripts/generate.py --workdir=workdir_seq2seq --prompts='owl cat yak bee'
"""


import jax
from absl import flags, logging

import engine
import models
from engine.tasks import cli, lm, mesh_choice, model_start, script_flags, seq2seq

FLAGS = flags.FLAGS
script_flags.define_training_flags(workdir="workdir_seq2seq", max_steps=400, learning_rate=3e-3, warmup_steps=30,
                                   log_every=50, save_every=200)
FLAGS.set_default("per_device_batch_size", 32)
flags.DEFINE_string("model_config", "tiny", "Named T5 config (tiny, t5-small, flan-t5-base, ...) or a path to a JSON "
                    "file of config fields (ignored with --init_from).")
flags.DEFINE_string("model_overrides", '{"d_model": 128, "d_ff": 256, "num_layers": 2, "num_heads": 4, "d_kv": 32}',
                    "JSON object of config fields that replace the named config's (ignored with --init_from).")
flags.DEFINE_string("init_from", None, "A Hugging Face T5 directory (config.json + safetensors) to fine-tune; its "
                    "tokenizer.json is used when present, else byte-level tokens.")
script_flags.define_record_flags(what="pairs", fields=("input", "target"), toy_size=8192)
script_flags.define_lora_flags()
flags.DEFINE_integer("max_input_len", 128, "Input tokens at most (longer inputs are cut; rows are as long as the "
                     "longest input up to this).")
flags.DEFINE_integer("max_target_len", 128, "Target tokens at most, EOS included (also the generation length).")
flags.DEFINE_bool("pack_pairs", False, "Pack several training pairs into rows --max_input_len / --max_target_len "
                  "wide (engine.tasks.seq2seq.pack_pairs; each target still sees only its own input): fewer rows, less "
                  "padding, the same per-token loss. A global batch counts rows.")
flags.DEFINE_integer("samples", 4, "Held-out examples whose generations are printed at the end.")
script_flags.define_auto_mesh_flag()


def build_model(mesh):
    """(model, params, tokenizer) from the flags (with --init_adapter merged and --lora_rank adapters added)."""
    model, params, tokenizer = _build_model(mesh)
    return (*model_start.apply_lora_flags(model, params, mesh), tokenizer)


def _build_model(mesh):
    if FLAGS.init_from:
        return model_start.load_hf(FLAGS.init_from, families=["t5"], mesh=mesh)
    model, tokenizer = fresh_model()
    return model, models.init_params(model, jax.random.PRNGKey(FLAGS.seed)), tokenizer


def fresh_model():
    """(model, tokenizer) of --model_config / --model_overrides for `model_start.fresh_tokenizer()`."""
    tokenizer = model_start.fresh_tokenizer()
    return model_start.fresh_model(tokenizer, {"decoder_start_token_id": tokenizer.bos_id}, family="t5",
                                   families=["t5"]), tokenizer


def describe_model():
    """(model, params as jax.ShapeDtypeStructs, tokenizer) of build_model + model_start.with_flags, no weight read
    (--mesh=auto; --init_adapter, merged into the weights, changes no shape)."""
    if FLAGS.init_from:
        model = model_start.load_hf_model(FLAGS.init_from, families=["t5"])
        tokenizer = model_start.hf_tokenizer(FLAGS.init_from, model)
    else:
        model, tokenizer = fresh_model()
    return (*mesh_choice.describe(model), tokenizer)


def encode(model, tokenizer, train_pairs, eval_pairs):
    """(train rows, eval rows, training pairs, (input, target) row lengths, (input, target) tokens at most)."""
    longest = lambda key: max(len(tokenizer.encode(p[key])) + 1 for p in train_pairs + eval_pairs)  # noqa: E731
    in_len, out_len = min(FLAGS.max_input_len, longest("input")), min(FLAGS.max_target_len, longest("target"))
    rows = lambda pairs: seq2seq.encode_pairs(pairs, tokenizer, max_input_len=in_len, max_target_len=out_len,  # noqa
                                           decoder_start_id=model.config.decoder_start_token_id)
    (train, cut), (evals, eval_cut) = rows(train_pairs), rows(eval_pairs)
    if cut + eval_cut:
        logging.warning("%d pairs were cut to --max_input_len=%d / --max_target_len=%d", cut + eval_cut, in_len,
                        out_len)
    n_pairs = len(train)
    row_lens = (in_len, out_len)
    if FLAGS.pack_pairs:
        row_lens = (max(in_len, FLAGS.max_input_len), max(out_len, FLAGS.max_target_len))
        train = seq2seq.pack_pairs(train, *row_lens)
    return train, evals, n_pairs, row_lens, (in_len, out_len)


def make_trainer(mesh, model, params, **kwargs):
    return engine.Trainer(mesh=mesh, collate_fn=seq2seq.collate_seq2seq,
                          loss_fn=seq2seq.seq2seq_loss_fn(model, script_flags.loss_implementation(model)),
                          params=params, optimizer=script_flags.optimizer(), trainable=model_start.trainable(),
                          **script_flags.trainer_kwargs(), **kwargs)


def load_pairs():
    """(train pairs, eval pairs) from the flags."""
    return script_flags.load_train_eval(seq2seq.read_pairs, seq2seq.toy_pairs, key="input", what="pairs")


def main(argv):
    del argv
    profile = script_flags.parse_profile_steps(FLAGS.profile_steps)
    train_pairs, eval_pairs = load_pairs()
    mesh, batch = cli.start(auto=True), FLAGS.per_device_batch_size
    if mesh is None:  # the first training row stands for every row
        model, params, tokenizer = describe_model()
        first = encode(model, tokenizer, train_pairs, eval_pairs)[0][0]
        mesh, batch = mesh_choice.choose_mesh(lambda mesh: make_trainer(mesh, model, params), seq2seq.collate_seq2seq,
                                              first, memory_gb=FLAGS.mesh_memory_gb)
    model, params, tokenizer = build_model(mesh)
    model, params = model_start.with_flags(model, params)
    train, evals, n_pairs, row_lens, (in_len, out_len) = encode(model, tokenizer, train_pairs, eval_pairs)
    global_batch = engine.global_batch_size(mesh, batch, FLAGS.accumulate_grad_batches)
    if len(train) < global_batch:
        raise ValueError(f"{len(train)} training rows are fewer than one global batch of {global_batch}")
    script_flags.save_records_run("seq2seq", model, tokenizer, examples=(train, evals), global_batch=global_batch)
    packed = f" (packed into {len(train)} rows)" if FLAGS.pack_pairs else ""
    print(f"{n_pairs} training{packed} and {len(evals)} held-out pairs, {in_len} input and {out_len} target tokens at "
          f"most; e.g. {train_pairs[0]['input']!r} -> {train_pairs[0]['target']!r}")

    trainer = make_trainer(mesh, model, params, workdir=FLAGS.workdir,
                           logging=engine.Logging(flops_per_example=models.train_flops_per_example(model, *row_lens)))
    predictor = engine.Predictor(mesh=mesh, collate_fn=seq2seq.collate_seq2seq, pred_fn=seq2seq.seq2seq_pred_fn(
        model, max_new_tokens=out_len, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id))
    metric_fn = lambda examples, preds: seq2seq.exact_match(examples, preds, tokenizer.eos_id)  # noqa: E731
    if trainer.step:
        print(f"resumed from {FLAGS.workdir} at step {trainer.step}")
    start_loss = trainer.eval_loss(evals, per_device_batch_size=batch)
    print(f"eval loss before training: {start_loss:.4f}")
    cli.log_eval(trainer, {"loss": start_loss})
    trainer.fit(train, per_device_batch_size=batch, n_epochs=FLAGS.n_epochs,
                max_steps=FLAGS.max_steps, eval_examples=evals, eval_predictor=predictor, eval_metric_fn=metric_fn,
                log_every=FLAGS.log_every, save_every=FLAGS.save_every, profile_steps=profile,
                **script_flags.fit_kwargs())
    for line in cli.progress_lines(trainer, FLAGS.log_every):
        print(line)
    end_loss = trainer.eval_loss(evals, per_device_batch_size=batch)
    print(f"eval loss after training: {end_loss:.4f} (was {start_loss:.4f}) at step {trainer.step}")
    preds = predictor.predict(evals, per_device_batch_size=batch, params=trainer.params)
    end_exact = metric_fn(evals, preds)["exact_match"]
    print(f"eval exact match: {end_exact:.4f} on {len(evals)} held-out pairs")
    cli.log_eval(trainer, {"loss": end_loss, "exact_match": end_exact})
    for pair, pred in list(zip(eval_pairs, preds))[:FLAGS.samples]:
        got = tokenizer.decode([i for i in lm.until_eos(pred, tokenizer.eos_id) if i != tokenizer.eos_id])
        print(f"--- {pair['input']!r} -> {got!r} (target {pair['target']!r})")
    trainer.close()


if __name__ == "__main__":
    cli.run(main)
