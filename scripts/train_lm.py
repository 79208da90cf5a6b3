"""Pre-trains or fine-tunes a decoder-only language model (LLaMA, GPT-J, OPT) — the engine's main job.

With no flags it trains a small LLaMA on an embedded corpus (the source of Python's standard library, byte-level
tokens, no download), prints the falling loss and sample generations, and writes TensorBoard scalars and checkpoints
under --workdir. Re-running the same command resumes from the latest checkpoint; SIGTERM or Ctrl-C saves and exits.

  python scripts/train_lm.py                                   # the default job
  python scripts/train_lm.py --init_from=/path/to/hf_llama --data='corpus/*.jsonl' --mesh=1,-1,2 --compute_dtype=bfloat16
  tensorboard --logdir workdir/tensorboard
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import engine  # noqa: E402
import models  # noqa: E402
from engine import cli, text  # noqa: E402

FLAGS = flags.FLAGS
cli.define_flags()
flags.DEFINE_enum("model", "llama", ["llama", "gptj", "opt"], "Model family (ignored with --init_from).")
flags.DEFINE_string("model_config", "tiny", "Named config of the family (tiny, llama-7b, ...) or a path to a JSON "
                    "file of config fields (ignored with --init_from).")
flags.DEFINE_string("init_from", None, "A Hugging Face model directory (config.json + safetensors) to fine-tune; its "
                    "tokenizer.json is used when present.")
flags.DEFINE_list("data", [], ".txt or .jsonl files or globs; empty: the embedded Python-stdlib corpus.")
flags.DEFINE_string("model_overrides", '{"hidden_size": 128, "intermediate_size": 384, "num_layers": 4}',
                    "JSON object of config fields that replace the named config's (ignored with --init_from); "
                    "the default makes the tiny config a little larger for the embedded job.")
flags.DEFINE_integer("seq_len", 128, "Tokens per packed training row.")
flags.DEFINE_string("workdir", "workdir", "Checkpoints and TensorBoard scalars go here; re-running resumes.")
FLAGS.set_default("per_device_batch_size", 8)
flags.DEFINE_integer("max_steps", 400, "Optimizer updates in total (resumes included).")
flags.DEFINE_integer("n_epochs", 100, "Passes over the data at most.")
flags.DEFINE_float("learning_rate", 3e-3, "Peak learning rate (linear warm-up, cosine decay to 10%).")
flags.DEFINE_integer("warmup_steps", 30, "Warm-up updates.")
flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay.")
flags.DEFINE_integer("log_every", 20, "Updates between log lines (the only host syncs of the loop).")
flags.DEFINE_integer("save_every", 100, "Updates between checkpoints (one is always written at the end).")
flags.DEFINE_list("profile_steps", [], "START,END: write a jax.profiler trace of those steps to workdir/tensorboard.")
flags.DEFINE_list("prompts", ["def ", "import ", "class "], "Prompts for the sample generations after training.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens per sample generation.")
flags.DEFINE_float("temperature", 0.7, "Sampling temperature of the sample generations (0: greedy).")
flags.DEFINE_integer("top_k", 20, "Sample among the k most likely tokens (0: all).")


def build_model(tokenizer_vocab):
    """(model, host params, tokenizer) from the flags."""
    if FLAGS.init_from:
        model, params = models.load_pretrained(FLAGS.init_from)
        hf = models.load_tokenizer(FLAGS.init_from)
        config = model.config
        if hf is None:
            tokenizer = text.ByteTokenizer()
            if config.vocab_size < tokenizer.vocab_size:
                raise app.UsageError(f"--init_from={FLAGS.init_from} has no tokenizer.json and a vocabulary of "
                                     f"{config.vocab_size} < {tokenizer.vocab_size} needed for byte-level tokens")
        else:
            with open(os.path.join(FLAGS.init_from, "config.json")) as f:
                hf_config = json.load(f)
            eos = hf_config.get("eos_token_id")
            tokenizer = text.HFTokenizer(hf, config.vocab_size, bos_id=hf_config.get("bos_token_id"),
                                         eos_id=eos[0] if isinstance(eos, list) else eos,
                                         pad_id=hf_config.get("pad_token_id"))
        return model, params, tokenizer
    tokenizer = text.ByteTokenizer()
    if FLAGS.model_config.endswith(".json"):
        with open(FLAGS.model_config) as f:
            fields = json.load(f)
        config = models.FAMILIES[FLAGS.model].Config(**fields)
    else:
        try:
            overrides = json.loads(FLAGS.model_overrides or "{}")
        except json.JSONDecodeError as e:
            raise app.UsageError(f"--model_overrides={FLAGS.model_overrides!r} is not JSON: {e}") from None
        overrides = {"vocab_size": tokenizer_vocab, "max_position_embeddings": max(FLAGS.seq_len, 128), **overrides}
        config = models.get_config(FLAGS.model, FLAGS.model_config, **overrides)
    model = models.FAMILIES[FLAGS.model].Model(config)
    params = models.init_params(model, jax.random.PRNGKey(FLAGS.seed))
    return model, params, tokenizer


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    profile = None
    if FLAGS.profile_steps:
        try:
            profile = tuple(int(x) for x in FLAGS.profile_steps)
        except ValueError:
            profile = None
        if profile is None or len(profile) != 2:
            raise app.UsageError(f"--profile_steps={','.join(FLAGS.profile_steps)}; expected START,END")
    mesh = cli.start()
    model, params, tokenizer = build_model(text.ByteTokenizer.vocab_size)
    docs = text.read_texts(FLAGS.data) if FLAGS.data else text.default_corpus()
    rows = text.pack(docs, tokenizer, FLAGS.seq_len)
    global_batch = engine.global_batch_size(mesh, FLAGS.per_device_batch_size, FLAGS.accumulate_grad_batches)
    n_eval = max(global_batch // FLAGS.accumulate_grad_batches, len(rows) // 50)
    if len(rows) < n_eval + global_batch:
        raise app.UsageError(f"the data packs into {len(rows)} rows of {FLAGS.seq_len + 1} tokens; at least "
                             f"{n_eval + global_batch} are needed for one eval and one global batch")
    train_rows, eval_rows = rows[:-n_eval], rows[-n_eval:]
    logging.info("%d documents -> %d train rows and %d eval rows of %d tokens; global batch %d", len(docs),
                 len(train_rows), len(eval_rows), FLAGS.seq_len, global_batch)
    schedule = optax.warmup_cosine_decay_schedule(0.0, FLAGS.learning_rate, max(1, FLAGS.warmup_steps),
                                                  max(FLAGS.max_steps, FLAGS.warmup_steps + 1),
                                                  end_value=FLAGS.learning_rate / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(
        learning_rate=schedule, weight_decay=FLAGS.weight_decay))
    trainer = engine.Trainer(mesh=mesh, collate_fn=text.collate_lm, loss_fn=text.lm_loss_fn(model), params=params,
                             optimizer=optimizer, workdir=FLAGS.workdir, **cli.trainer_kwargs())
    if trainer.step:
        print(f"resumed from {FLAGS.workdir} at step {trainer.step}")
    start_loss = trainer.eval_loss(eval_rows, per_device_batch_size=FLAGS.per_device_batch_size)
    print(f"eval loss before training: {start_loss:.4f}")
    trainer.fit(train_rows, per_device_batch_size=FLAGS.per_device_batch_size, n_epochs=FLAGS.n_epochs,
                max_steps=FLAGS.max_steps, eval_examples=eval_rows, log_every=FLAGS.log_every,
                save_every=FLAGS.save_every, profile_steps=profile)
    for record in trainer.history:
        if "loss" in record and record["step"] % FLAGS.log_every == 0:
            print(f"step {record['step']:5d}  loss {record['loss']:.4f}  accuracy {record.get('accuracy', 0):.3f}")
    end_loss = trainer.eval_loss(eval_rows, per_device_batch_size=FLAGS.per_device_batch_size)
    print(f"eval loss after training: {end_loss:.4f} (was {start_loss:.4f}) at step {trainer.step}")
    if FLAGS.prompts:  # every process takes part (the parameters may span hosts); process 0 prints
        prompts = [tokenizer.encode(p) for p in FLAGS.prompts]
        ids, mask = text.left_pad(prompts, tokenizer)
        out = models.generate(model, trainer.params, ids, attention_mask=mask, max_new_tokens=FLAGS.max_new_tokens,
                              temperature=FLAGS.temperature, top_k=FLAGS.top_k or None,
                              rng=jax.random.PRNGKey(FLAGS.seed),
                              eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
        out = np.asarray(multihost_utils.process_allgather(out, tiled=True))
        if jax.process_index() == 0:
            for prompt, row in zip(FLAGS.prompts, out):
                print(f"--- sample for {prompt!r}:\n{tokenizer.decode(row[ids.shape[1]:])}")
    trainer.close()
    if trainer.stopped_by_signal:
        print(f"stopped by a signal at step {trainer.step}; checkpoint saved in {FLAGS.workdir}; re-run to resume")


if __name__ == "__main__":
    app.run(main)
