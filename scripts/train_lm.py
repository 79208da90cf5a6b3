"""Pre-trains or fine-tunes a decoder-only language model (LLaMA, GPT-J, OPT, Qwen2, Qwen3) — the engine's main job.

With no flags it trains a small LLaMA on an embedded corpus (the source of Python's standard library, byte-level
tokens, no download), prints the falling loss and sample generations, and writes TensorBoard scalars and checkpoints
under --workdir. Re-running the same command resumes from the latest checkpoint; SIGTERM or Ctrl-C saves and exits.

  python scripts/train_lm.py                                   # the default job
  python scripts/train_lm.py --init_from=/path/to/hf_llama --data='corpus/*.jsonl' --mesh=1,-1,2
  tensorboard --logdir workdir/tensorboard
"""


import jax
import numpy as np
from absl import flags, logging

import engine
import models
from engine.tasks import cli, lm, mesh_choice, model_start, run_record, script_flags, sources, text_data

FAMILIES = list(script_flags.DECODER_FAMILIES)
FLAGS = flags.FLAGS
script_flags.define_training_flags(workdir="workdir", max_steps=400, learning_rate=3e-3, warmup_steps=30, log_every=20,
                                   save_every=100)
flags.DEFINE_enum("model", "llama", FAMILIES, "Model family (ignored with --init_from).")
flags.DEFINE_string("model_config", "tiny", "Named config of the family (tiny, llama-7b, ...) or a path to a JSON "
                    "file of config fields (ignored with --init_from).")
flags.DEFINE_string("init_from", None, "A Hugging Face model directory (config.json + safetensors) to fine-tune; its "
                    "tokenizer.json is used when present, else byte-level tokens.")
flags.DEFINE_list("data", [], ".txt, .jsonl, .parquet or .arrow files (JSON Lines and text also compressed: .gz, "
                  ".zst, .bz2, .xz), globs or datasets.save_to_disk directories (--text_column); a weighted "
                  "mixture of such sources, 'code/*.parquet#content:0.7,web/*.jsonl:0.3' "
                  "(each packed on its own, rows interleaved by weight; '#COLUMN': that source's text column instead "
                  "of --text_column; needs --max_steps; ArrayRecord sources, "
                  "'tok/*.array_record:0.5,web/*.jsonl:0.5', give their ids as they are); or one directory of tokens "
                  "written by scripts/prepare_data.py (read through a memory map or by random access); or "
                  "pre-tokenised .array_record files, globs or directories of them (one document per record: int32 "
                  "ids, or a tf.train.Example whose int64 feature --text_column holds them); empty: the embedded "
                  "Python-stdlib corpus.")
flags.DEFINE_string("model_overrides", '{"hidden_size": 128, "intermediate_size": 384, "num_layers": 4}',
                    "JSON object of config fields that replace the named config's; the default makes the tiny "
                    "config a little larger for the embedded job. With --init_from: model options only (e.g. "
                    '{"remat": "dots", "attention_implementation": "triton"}; the checkpoint fixes the rest).')
flags.DEFINE_integer("seq_len", 128, "Tokens per packed training row.")
flags.DEFINE_integer("data_workers", 0, "Worker processes that read and collate each batch (random-access data: "
                     "packed text, a prepare_data.py directory or ArrayRecord files; not a mixture's stream); 0: in "
                     "this process.")
script_flags.define_data_change_flag()
FLAGS.set_default("per_device_batch_size", 8)
flags.DEFINE_list("prompts", ["def ", "import ", "class "], "Prompts for the sample generations after training.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens per sample generation.")
flags.DEFINE_float("temperature", 0.7, "Sampling temperature of the sample generations (0: greedy).")
flags.DEFINE_integer("top_k", 20, "Sample among the k most likely tokens (0: all).")
script_flags.define_auto_mesh_flag()


def named_model():
    """(model, tokenizer) of --model / --model_config for --tokenizer (default: byte-level tokens)."""
    tokenizer = model_start.fresh_tokenizer(default=text_data.ByteTokenizer())
    return model_start.fresh_model(tokenizer, {"max_position_embeddings": max(FLAGS.seq_len, 128)}, family=FLAGS.model,
                                   families=FAMILIES), tokenizer


def build_model(mesh):
    """(model, params, tokenizer) from the flags."""
    if FLAGS.init_from:
        model, params, tokenizer = model_start.load_hf(FLAGS.init_from, families=FAMILIES, mesh=mesh)
        model_start.check_positions(model, FLAGS.seq_len)
        return model, params, tokenizer
    model, tokenizer = named_model()
    return model, models.init_params(model, jax.random.PRNGKey(FLAGS.seed), layout=engine.auto_layout(mesh)), tokenizer


def auto_mesh():
    """--mesh=auto: the run's model and Trainer over abstract parameters (no weight read or allocated) on every
    layout; returns (mesh, rows per data position)."""
    model, abstract = mesh_choice.describe(model_start.load_hf_model(FLAGS.init_from, families=FAMILIES)
                                           if FLAGS.init_from else named_model()[0])
    loss_fn = lm.lm_loss_fn(model, script_flags.loss_implementation(model))
    example = {"tokens": np.zeros(FLAGS.seq_len + 1, np.int32), "segment_ids": np.ones(FLAGS.seq_len + 1, np.int32)}
    return mesh_choice.choose_mesh(lambda mesh: engine.Trainer(
        mesh=mesh, collate_fn=lm.collate_lm, loss_fn=loss_fn, params=abstract, optimizer=script_flags.optimizer(),
        **script_flags.trainer_kwargs()), lm.collate_lm, example, memory_gb=FLAGS.mesh_memory_gb)


def main(argv):
    del argv
    profile = script_flags.parse_profile_steps(FLAGS.profile_steps)
    tokens, mixture = None, sources.is_mixture(FLAGS.data)
    if mixture:
        sources.parse_mixture(FLAGS.data)  # a bad weight is refused before any model is built
        if FLAGS.data_workers:
            raise ValueError(f"--data_workers={FLAGS.data_workers} with a mixture --data; a mixture is a stream, "
                             "tokenised and interleaved in the training process: expected --data_workers=0")
    elif text_data.is_token_data(FLAGS.data):  # opened (ArrayRecord files indexed) before any model is built
        tokens = text_data.token_windows(FLAGS.data, FLAGS.seq_len, feature=FLAGS.text_column)
    else:
        docs = (text_data.read_texts(FLAGS.data, decode_errors=FLAGS.decode_errors, text_column=FLAGS.text_column)
                if FLAGS.data else text_data.default_corpus())
        if not any(doc.strip() for doc in docs):
            raise ValueError(f"--data={','.join(FLAGS.data)} holds no text")
    mesh, batch = cli.start(auto=True), FLAGS.per_device_batch_size
    if mesh is None:
        mesh, batch = auto_mesh()
    model, params, tokenizer = build_model(mesh)
    model, params = model_start.with_flags(model, params)
    global_batch = engine.global_batch_size(mesh, batch, FLAGS.accumulate_grad_batches)
    if mixture:  # an endless stream: the first windows are the eval rows, the training stream starts after them
        for pattern, _ in sources.parse_mixture(FLAGS.data):  # a prepare_data.py source names its tokenizer
            path = sources.split_column(pattern)[0]
            if text_data.is_token_dir(path):
                text_data.check_token_dir(path, tokenizer, model.config.vocab_size)
        n_eval = (run_record.recorded(FLAGS.workdir, "eval_rows")
                  or max(global_batch // FLAGS.accumulate_grad_batches, 256))
        train_rows, eval_rows = mixture_rows(tokenizer, n_eval)
        data = run_record.data_digest(eval_rows, FLAGS.seq_len, stream="the mixture",
                                      mixture=train_rows.weights + train_rows.columns)
        run_record.check_data(FLAGS.workdir, data, ",".join(FLAGS.data), seq_len=FLAGS.seq_len,
                              change=FLAGS.data_change)
        run_record.save_run(FLAGS.workdir, "lm", model, tokenizer, global_batch=global_batch, eval_rows=n_eval,
                            data=data)
        return train(mesh, batch, model, params, tokenizer, train_rows, eval_rows, profile)
    if tokens is None:
        rows = text_data.pack(docs, tokenizer, FLAGS.seq_len)
    else:  # a Sequence of windows (memory-mapped or ArrayRecord): only each batch's rows are read
        text_data.check_token_windows(tokens, tokenizer, model.config.vocab_size)
        rows = tokens
    # 2% of the rows, at most 1024 (a large corpus's eval stays short), at least one micro-batch; a resumed run's
    # own (recorded: a restart on another device count, whose micro-batch differs, splits the rows as it did).
    n_eval = (run_record.recorded(FLAGS.workdir, "eval_rows")
              or max(global_batch // FLAGS.accumulate_grad_batches, min(len(rows) // 50, 1024)))
    if len(rows) < n_eval + global_batch:
        raise ValueError(f"the data packs into {len(rows)} rows of {FLAGS.seq_len + 1} tokens; at least "
                         f"{n_eval + global_batch} are needed for one eval and one global batch (more data, or a "
                         "smaller --seq_len or --per_device_batch_size)")
    data = run_record.data_digest(rows, FLAGS.seq_len)
    run_record.check_data(FLAGS.workdir, data, ",".join(FLAGS.data) or "(the default corpus)", seq_len=FLAGS.seq_len,
                          change=FLAGS.data_change)
    run_record.save_run(FLAGS.workdir, "lm", model, tokenizer, global_batch=global_batch, eval_rows=n_eval, data=data)
    train_rows, eval_rows = rows[:-n_eval], rows[-n_eval:]
    logging.info("%s -> %d train rows and %d eval rows of %d tokens; global batch %d",
                 ",".join(FLAGS.data) if tokens is not None else f"{len(docs)} documents", len(train_rows),
                 len(eval_rows), FLAGS.seq_len, global_batch)
    train(mesh, batch, model, params, tokenizer, train_rows, eval_rows, profile)


def mixture_rows(tokenizer, n_eval):
    """(training stream, eval rows) of a weighted --data mixture: its first `n_eval` windows are held out."""
    stream = iter(sources.Mixture(FLAGS.data, tokenizer, FLAGS.seq_len, text_column=FLAGS.text_column,
                                  decode_errors=FLAGS.decode_errors))
    eval_rows = [next(stream) for _ in range(n_eval)]
    logging.info("data mixture %s: %d eval rows of %d tokens held out; the training rows follow them",
                 ",".join(FLAGS.data), n_eval, FLAGS.seq_len)
    train_rows = sources.Mixture.from_state(stream.get_state(), tokenizer, decode_errors=FLAGS.decode_errors,
                                            hold_out=True)  # no document of the eval rows is trained on
    return train_rows, eval_rows


def train(mesh, batch, model, params, tokenizer, train_rows, eval_rows, profile):
    """Trains on `train_rows` with the eval before, during and after, then prints the sample generations."""
    trainer = engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm,
                             loss_fn=lm.lm_loss_fn(model, script_flags.loss_implementation(model)), params=params,
                             optimizer=script_flags.optimizer(), workdir=FLAGS.workdir,
                             **script_flags.trainer_kwargs(),
                             logging=engine.Logging(
                                 flops_per_example=models.train_flops_per_example(model, FLAGS.seq_len)))
    if trainer.step:
        print(f"resumed from {FLAGS.workdir} at step {trainer.step}")
    if isinstance(train_rows, sources.Mixture) and trainer.iterator_state is not None:
        iter(train_rows).set_state(trainer.iterator_state)  # another mixture's state: refused before any eval
    start_loss = trainer.eval_loss(eval_rows, per_device_batch_size=batch)
    print(f"eval loss before training: {start_loss:.4f}")
    cli.log_eval(trainer, {"loss": start_loss})
    trainer.fit(train_rows, per_device_batch_size=batch, n_epochs=FLAGS.n_epochs,
                max_steps=FLAGS.max_steps, eval_examples=eval_rows, log_every=FLAGS.log_every,
                save_every=FLAGS.save_every, profile_steps=profile, data_workers=FLAGS.data_workers,
                **script_flags.fit_kwargs())
    for line in cli.progress_lines(trainer, FLAGS.log_every):
        print(line)
    if isinstance(trainer.iterator_state, dict) and "windows" in trainer.iterator_state:  # a mixture's
        logging.info("%s (the held-out eval windows first)", sources.shares_line(trainer.iterator_state))
    end_loss = trainer.eval_loss(eval_rows, per_device_batch_size=batch)
    print(f"eval loss after training: {end_loss:.4f} (was {start_loss:.4f}) at step {trainer.step}")
    cli.log_eval(trainer, {"loss": end_loss})
    if FLAGS.prompts:  # every process takes part (the parameters may span hosts); process 0 prints
        samples = lm.generate_texts(model, trainer.params, tokenizer, FLAGS.prompts,
                                      max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                                      top_k=FLAGS.top_k or None, seed=FLAGS.seed)
        if jax.process_index() == 0:
            for prompt, sample in zip(FLAGS.prompts, samples):
                print(f"--- sample for {prompt!r}:\n{sample}")
    trainer.close()


if __name__ == "__main__":
    cli.run(main)
