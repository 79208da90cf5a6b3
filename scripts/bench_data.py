"""The input pipeline alone: tokens per second per process, tokenising and packing included, and the share of a
training step spent waiting for input.

A synthetic corpus (--corpus_mb of text: documents of --min_words..--max_words words drawn from a Zipf vocabulary of
pseudo-words; no download) is written once under --workdir as Parquet (what `sources.Mixture` reads) and as an Arrow
IPC file (what a random-access dataset memory-maps, as `datasets` does), beside a byte-level BPE tokenizer trained
on its first --bpe_train_mb with the `tokenizers` package. Then, per tokenizer (--tokenizers: the BPE, and
ByteTokenizer), through `engine.data.iterate_batches` into batches of --batch_rows rows of --seq_len tokens:

- `Mixture`: the Parquet streamed a record batch at a time, every document tokenised and packed end to end into full
  rows (`sources.Mixture`, what `train_lm.py --data=FILE:WEIGHT` trains on); streamed, so built in this process.
- `MapDataset`: `grain.MapDataset.source(text spans of the Arrow file).map(tokenise)`: the documents cut, by their
  lengths alone, into spans of the characters that fill about 97% of a row (the tokenizer's characters per token on a
  sample), each span tokenised into one row (`sources.pack`'s first row: any tokens past it cut, a short row padded);
  random access, so shuffled like a list, with --workers worker processes each (0: in this process).

Tokens per second count the tokens in rows (padding excluded), over --batches batches after the first (the first waits
for the workers to start, reported apart as start s). With --train_steps, a LLaMA (--hidden, --layers, --heads, ...;
tiny by default) trains on the MapDataset's batches through `Trainer.fit` for each --workers value, and the table gives
the share of its step time spent waiting for the next batch (the Trainer's data timer; the first log interval, which
compiles, left out). With --consume_tokens_per_s, a consumer takes each batch from the prefetch thread `fit` runs
(`engine.data.Prefetcher` over `iterate_batches`) and holds it for the time a device training at that rate spends on it
(sleeping: a GPU's step is asynchronous, so the host is idle meanwhile), and the table gives the share of that time
spent waiting for the next batch: the input wait of a run on an accelerator this machine lacks. On a GPU, --train_steps
with TinyLlama's shape measures the wait under the real step (`device_check.sh data` runs it).

  .venv/bin/python scripts/bench_data.py                                        # 256 MB corpus, seq 2048
  .venv/bin/python scripts/bench_data.py --corpus_mb=16 --seq_len=256 --batches=20 --train_steps=30   # a smoke run
  python3 scripts/bench_data.py --corpus_mb=64 --bpe_train_mb=8 --batch_rows=4 --batches=10 --workers=0,2 \
      --tokenizers=bpe --train_steps=25 --hidden=2048 --layers=22 --heads=32 --kv_heads=4 --intermediate=5632  # GPU
"""
import importlib.util
import itertools
import json
import os
import time

import jax
import numpy as np
import optax
from absl import flags

import engine
import models
from engine import data as data_lib
from engine.tasks import cli, lm, run_record, script_flags, sources, text_data

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "/tmp/redline_bench_data", "Where the generated corpus and tokenizer are kept (reused "
                    "when the corpus flags match).")
flags.DEFINE_integer("corpus_mb", 256, "Megabytes of generated text.", lower_bound=1)
flags.DEFINE_integer("min_words", 400, "Shortest document, words.", lower_bound=1)
flags.DEFINE_integer("max_words", 3000, "Longest document, words.", lower_bound=1)
flags.DEFINE_integer("bpe_vocab", 32000, "The trained BPE's vocabulary.", lower_bound=300)
flags.DEFINE_integer("bpe_train_mb", 16, "Megabytes of the corpus the BPE is trained on.", lower_bound=1)
flags.DEFINE_multi_enum("tokenizers", ["bpe", "byte"], ["bpe", "byte"], "Tokenizers to measure.")
flags.DEFINE_integer("seq_len", 2048, "Tokens per row (rows hold seq_len + 1).", lower_bound=2)
flags.DEFINE_integer("batch_rows", 32, "Rows per global batch (a multiple of the local devices).", lower_bound=1)
flags.DEFINE_list("workers", ["0", "1", "2"], "Worker counts of the MapDataset rows.")
flags.DEFINE_integer("batches", 50, "Batches timed per row, after the first.", lower_bound=1)
flags.DEFINE_integer("train_steps", 40, "Training steps per --workers value for the input-wait share (0: none).",
                     lower_bound=0)
flags.DEFINE_float("consume_tokens_per_s", 0, "A paced consumer's rate (0: none): it holds each batch for its tokens "
                   "at this rate, and the table gives the share of time it waited for input.", lower_bound=0)
flags.DEFINE_integer("consume_batches", 100, "Batches the paced consumer takes, after the first.", lower_bound=1)
flags.DEFINE_integer("hidden", 64, "The trained LLaMA's hidden size.", lower_bound=8)
flags.DEFINE_integer("layers", 2, "The trained LLaMA's layers.", lower_bound=1)
flags.DEFINE_integer("heads", 4, "The trained LLaMA's attention heads (dividing --hidden).", lower_bound=1)
flags.DEFINE_integer("kv_heads", 2, "Its key / value heads (dividing --heads).", lower_bound=1)
flags.DEFINE_integer("intermediate", 0, "Its MLP's width (0: 4 x --hidden).", lower_bound=0)
flags.DEFINE_enum("compute_dtype", None, ["float32", "bfloat16"], "Its forward / backward dtype (engine.Precision); "
                  "unset: bfloat16 on GPU and TPU, float32 on CPU, as the training scripts.")
flags.DEFINE_integer("seed", 0, "Seed of the corpus and the shuffle.")

EOS, PAD = "<|endoftext|>", "<|pad|>"


def corpus_files():
    """(parquet path, arrow path, BPE tokenizer.json path), generated unless --workdir holds them for these flags."""
    settings = {k: getattr(FLAGS, k) for k in ("corpus_mb", "min_words", "max_words", "bpe_vocab", "bpe_train_mb",
                                                 "seed")}
    if FLAGS.min_words > FLAGS.max_words:
        raise ValueError(f"--min_words={FLAGS.min_words} > --max_words={FLAGS.max_words}; expected min <= max")
    paths = [os.path.join(FLAGS.workdir, name) for name in ("corpus.parquet", "corpus.arrow", "tokenizer.json")]
    meta = os.path.join(FLAGS.workdir, "settings.json")
    if os.path.exists(meta) and all(map(os.path.exists, paths)):
        with open(meta) as f:
            if json.load(f) == settings:
                return paths
    os.makedirs(FLAGS.workdir, exist_ok=True)
    started = time.perf_counter()
    write_corpus(*paths[:2])
    train_bpe(paths[0], paths[2])
    with open(meta, "w") as f:
        json.dump(settings, f)
    print(f"corpus and tokenizer written to {FLAGS.workdir} in {time.perf_counter() - started:.0f} s", flush=True)
    return paths


def write_corpus(parquet_path, arrow_path):
    """--corpus_mb of documents: Zipf-distributed pseudo-words (a natural text's word frequencies, for a BPE to find
    merges in), with sentence ends; Parquet row groups of 1024 documents, and the same table as an Arrow IPC file."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    rng = np.random.default_rng(FLAGS.seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    lengths = rng.integers(1, 11, 20000)
    words = np.array(["".join(rng.choice(letters, n, p=_letter_freq())) for n in lengths])
    p = 1.0 / np.arange(1, len(words) + 1)
    p /= p.sum()
    schema = pa.schema([("text", pa.string())])
    total, target = 0, FLAGS.corpus_mb << 20
    with pq.ParquetWriter(parquet_path, schema) as parquet, pa.ipc.new_file(arrow_path, schema) as arrow:
        while total < target:
            docs = []
            for n in rng.integers(FLAGS.min_words, FLAGS.max_words + 1, 1024):
                tokens = words[rng.choice(len(words), n, p=p)]
                tokens[rng.random(n) < 0.07] = "."  # sentence ends
                docs.append(" ".join(tokens).replace(" .", ".").capitalize())
            batch = pa.record_batch([pa.array(docs, pa.string())], schema=schema)
            parquet.write_batch(batch, row_group_size=1024)
            arrow.write_batch(batch)
            total += sum(map(len, docs))


def _letter_freq():
    f = np.array([12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4, 2.2, 2.0, 2.0, 1.9,
                  1.5, 1.0, 0.8, 0.2, 0.2, 0.1, 0.1])
    return f / f.sum()


def train_bpe(parquet_path, out):
    """A byte-level BPE (GPT-2's kind) of --bpe_vocab ids, EOS and PAD its special tokens, trained on the first
    --bpe_train_mb of the corpus."""
    import tokenizers  # noqa: PLC0415

    def texts():
        seen = 0
        for text in sources.iter_texts(parquet_path):
            yield text
            seen += len(text)
            if seen >= FLAGS.bpe_train_mb << 20:
                return
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator(texts(), tokenizers.trainers.BpeTrainer(
        vocab_size=FLAGS.bpe_vocab, special_tokens=[EOS, PAD], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(out)


def load_bpe(path):
    import tokenizers  # noqa: PLC0415

    bpe = tokenizers.Tokenizer.from_file(path)
    vocab = -(-bpe.get_vocab_size() // 64) * 64
    return text_data.HFTokenizer(bpe, vocab, eos_id=bpe.token_to_id(EOS), pad_id=bpe.token_to_id(PAD))


class ArrowPieces:
    """Spans of `chars` characters of the documents of an Arrow IPC file, by index: a Grain random-access data
    source whose pieces are cut from the documents' lengths alone (Arrow's utf8_length, no tokenising), so row i
    needs no earlier row. Memory-mapped, so every worker process reads the same pages of the page cache; it pickles
    as its path and index and opens the file lazily."""

    def __init__(self, path, chars, column="text"):
        import pyarrow as pa  # noqa: PLC0415
        import pyarrow.compute as pc  # noqa: PLC0415

        self.path, self.column, self.chars = path, column, chars
        with pa.memory_map(path) as source:
            lengths = pc.utf8_length(pa.ipc.open_file(source).read_all().column(column)).to_numpy()
        pieces = -(-lengths // chars)
        self._docs = np.repeat(np.arange(len(lengths)), pieces)
        self._starts = (np.arange(len(self._docs)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * chars
        self._texts = None

    def __getstate__(self):
        return {**self.__dict__, "_texts": None}

    def __len__(self):
        return len(self._docs)

    def __getitem__(self, i):
        if self._texts is None:
            import pyarrow as pa  # noqa: PLC0415

            self._texts = pa.ipc.open_file(pa.memory_map(self.path)).read_all().column(self.column)
        start = int(self._starts[i])
        return self._texts[int(self._docs[i])].as_py()[start:start + self.chars]


def chars_per_row(tokenizer, documents):
    """Characters whose tokens fill about 97% of a row (a few % padding rather than cut tokens), from the
    tokenizer's characters per token on a sample of `documents`."""
    sample = "".join(documents[i] for i in range(min(20, len(documents))))
    return max(1, int(0.97 * FLAGS.seq_len * len(sample) / len(tokenizer.encode(sample))))


class FirstRow:
    """A text -> its first row of `sources.pack` ({'tokens', 'segment_ids'} [seq_len + 1]; any tokens past it cut):
    the per-example work of the MapDataset, run wherever the batch is built."""

    def __init__(self, tokenizer, seq_len):
        self.tokenizer, self.seq_len = tokenizer, seq_len

    def __call__(self, text):
        return sources.pack([text], self.tokenizer, self.seq_len)[0]


def _batches(mesh, examples, workers):
    """`examples`' global batches of --batch_rows rows, built as `fit` builds them (`iterate_batches`)."""
    return data_lib.iterate_batches(mesh, examples, lm.collate_lm,
                                    per_device_batch_size=FLAGS.batch_rows // data_lib.data_parallel_size(mesh),
                                    seed=FLAGS.seed, workers=workers)


def measure(mesh, examples, workers):
    """(start seconds, tokens per second) of --batches + 1 batches of `examples` through iterate_batches."""
    started = time.perf_counter()
    batches = _batches(mesh, examples, workers)
    try:
        for _ in range(max(1, workers)):  # batch k comes from worker k: each has started before the clock runs
            next(batches)
        first = time.perf_counter()
        tokens = 0
        for n, (_, _, batch) in enumerate(batches, 1):
            tokens += int((np.asarray(batch["segment_ids"]) > 0).sum())
            if n == FLAGS.batches:
                return first - started, tokens / (time.perf_counter() - first)  # the workers' ending not counted
        raise ValueError(f"the corpus holds fewer than {FLAGS.batches + 1} batches of {FLAGS.batch_rows} rows; "
                         "expected a larger --corpus_mb or fewer --batches")
    finally:
        batches.close()


def wait_share(mesh, examples, tokenizer, workers):
    """The share of step time `fit` waited for input over --train_steps steps of a LLaMA (--hidden, --layers, ...) on
    `examples`' batches built with `workers` processes, the first log interval (compiling) left out."""
    model = models.create_model("llama", "tiny", vocab_size=tokenizer.vocab_size, hidden_size=FLAGS.hidden,
                                intermediate_size=FLAGS.intermediate or 4 * FLAGS.hidden, num_layers=FLAGS.layers,
                                num_heads=FLAGS.heads, num_kv_heads=FLAGS.kv_heads,
                                max_position_embeddings=FLAGS.seq_len)
    trainer = engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm, loss_fn=lm.lm_loss_fn(model),
                             params=models.init_params(model, jax.random.PRNGKey(FLAGS.seed)),
                             optimizer=optax.adamw(1e-3), seed=FLAGS.seed,
                             precision=engine.Precision(compute_dtype=script_flags.compute_dtype()))
    log, flush = [], trainer._flush

    def timed_flush(rows, batch):  # the data seconds since the previous log line, read before the line resets them
        log.append((time.perf_counter(), trainer.step, trainer._timers["data"]))
        flush(rows, batch)
    trainer._flush = timed_flush
    trainer.fit(examples, per_device_batch_size=FLAGS.batch_rows // data_lib.data_parallel_size(mesh),
                max_steps=FLAGS.train_steps, log_every=5, data_workers=workers)
    (t0, s0, _), (t1, s1, _) = log[0], log[-1]
    waited = sum(d for _, _, d in log[1:])
    return waited / (t1 - t0), (t1 - t0) / max(1, s1 - s0)


def paced_wait(mesh, examples, workers):
    """(consumed tokens per second, share of the time waited) of a consumer that takes --consume_batches batches of
    `examples` from `fit`'s prefetch thread and holds each for its tokens / --consume_tokens_per_s seconds."""
    hold = FLAGS.batch_rows * FLAGS.seq_len / FLAGS.consume_tokens_per_s
    batches = _batches(mesh, examples, workers)
    prefetch = data_lib.Prefetcher(batches)
    try:
        it = iter(prefetch)
        next(it)  # the workers' start-up, apart
        waited, started = 0.0, time.perf_counter()
        for _ in range(FLAGS.consume_batches):
            asked = time.perf_counter()
            next(it)
            waited += time.perf_counter() - asked
            time.sleep(hold)
        elapsed = time.perf_counter() - started
        return FLAGS.consume_batches * FLAGS.batch_rows * FLAGS.seq_len / elapsed, waited / elapsed
    finally:
        prefetch.close()
        batches.close()


def main(argv):
    del argv
    workers = [int(w) for w in FLAGS.workers]
    if any(w < 0 for w in workers):
        raise ValueError(f"--workers={','.join(FLAGS.workers)}; expected integers >= 0")
    if FLAGS.hidden % FLAGS.heads or FLAGS.heads % FLAGS.kv_heads:
        raise ValueError(f"--hidden={FLAGS.hidden}, --heads={FLAGS.heads}, --kv_heads={FLAGS.kv_heads}; expected "
                         "heads dividing hidden and kv_heads dividing heads")
    if importlib.util.find_spec("grain") is None:
        raise ValueError("bench_data.py measures Grain's pipeline beside the engine's, and grain is not installed: "
                         "pip install -e '.[data]'")
    mesh = engine.make_mesh(data=jax.local_device_count())
    if FLAGS.batch_rows % jax.local_device_count():
        raise ValueError(f"--batch_rows={FLAGS.batch_rows}; expected a multiple of the {jax.local_device_count()} "
                         "local devices")
    parquet_path, arrow_path, bpe_path = corpus_files()
    import pyarrow.parquet as pq  # noqa: PLC0415

    documents = list(itertools.islice(sources.iter_texts(parquet_path), 20))  # the tokenizers' sample
    print(f"corpus: {os.path.getsize(parquet_path) >> 20} MiB Parquet, "
          f"{pq.ParquetFile(parquet_path).metadata.num_rows} documents of "
          f"{FLAGS.min_words}-{FLAGS.max_words} words; rows of {FLAGS.seq_len} tokens, {FLAGS.batch_rows} per batch; "
          f"{os.cpu_count()} CPUs, {jax.local_device_count()} {jax.devices()[0].platform} device(s)", flush=True)
    import grain  # noqa: PLC0415

    def tokenizer_named(name):
        tokenizer = load_bpe(bpe_path) if name == "bpe" else text_data.ByteTokenizer()
        return tokenizer, (f"BPE {tokenizer.vocab_size}" if name == "bpe" else "bytes")

    def spans(tokenizer):
        return grain.MapDataset.source(ArrowPieces(arrow_path, chars_per_row(tokenizer, documents))).map(
            FirstRow(tokenizer, FLAGS.seq_len))

    def each_input(run, name):
        """`run(mesh, examples, workers)` of the Mixture and of the MapDataset per --workers value, as table rows."""
        tokenizer, shown = tokenizer_named(name)
        out = [(shown, "Mixture (packed, streamed)", 0,
                *run(mesh, sources.Mixture(parquet_path, tokenizer, FLAGS.seq_len), 0))]
        print(out[-1], flush=True)
        for w in workers:
            out.append((shown, "MapDataset (text spans)", w, *run(mesh, spans(tokenizer), w)))
            print(out[-1], flush=True)
        return out

    rows = [row for name in FLAGS.tokenizers for row in each_input(measure, name)]
    trained = "bpe" if "bpe" in FLAGS.tokenizers else "byte"  # the tokenizer of the wait measurements
    waits = []
    if FLAGS.train_steps:
        tokenizer, _ = tokenizer_named(trained)
        for w in workers:
            waits.append((w, *wait_share(mesh, spans(tokenizer), tokenizer, w)))
            print(waits[-1], flush=True)
    paced = each_input(paced_wait, trained) if FLAGS.consume_tokens_per_s else []
    print()
    print("| tokenizer | examples | workers | start s | tokens/s per process |")
    print("|---|---|---|---|---|")
    for shown, examples, w, start, rate in rows:
        print(f"| {shown} | {examples} | {w} | {start:.1f} | {rate:,.0f} |")
    if waits:
        print()
        shape = (f"LLaMA, hidden {FLAGS.hidden}, {FLAGS.layers} layers, {FLAGS.heads} / {FLAGS.kv_heads} heads, "
                 f"{run_record.compute_dtype_name()}")
        print(f"| workers | s/step ({shape}) | tokens/s | input wait, share of step |")
        print("|---|---|---|---|")
        for w, share, step in waits:
            print(f"| {w} | {step:.3f} | {FLAGS.batch_rows * FLAGS.seq_len / step:,.0f} | {share:.1%} |")
    if paced:
        print()
        print(f"| tokenizer | examples | workers | consumed tokens/s (paced at {FLAGS.consume_tokens_per_s:,.0f}) | "
              "input wait, share of time |")
        print("|---|---|---|---|---|")
        for shown, examples, w, rate, share in paced:
            print(f"| {shown} | {examples} | {w} | {rate:,.0f} | {share:.2%} |")


if __name__ == "__main__":
    cli.run(main)
