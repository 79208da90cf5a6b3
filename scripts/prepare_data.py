"""Tokenises a text corpus once into a directory that `train_lm.py --data=DIR` reads: for a corpus larger than
memory, or to stop re-tokenising it on every run. Documents stream from the files one at a time. --format=bin writes
tokens.bin (read through a memory map); --format=array_record writes ArrayRecord files of one document's int32 ids
per record (read by random access, also by Grain's ArrayRecordDataSource), each with its document index beside it
(`<file>.index.npz`: the documents' lengths, so opening the files reads no record).

  python scripts/prepare_data.py --data='corpus/*.jsonl' --out=tokens                 # byte-level tokens
  python scripts/prepare_data.py --data='corpus/*.txt' --tokenizer=/path/to/hf_llama --out=tokens
  python scripts/prepare_data.py --data='corpus/*.parquet' --format=array_record --out=records
  python scripts/train_lm.py --data=tokens --init_from=/path/to/hf_llama
"""
import os

from absl import flags

from engine.tasks import cli, script_flags, text_data

FLAGS = flags.FLAGS
flags.DEFINE_list("data", [], ".txt, .jsonl, .parquet or .arrow files (JSON Lines and text also compressed: .gz, "
                  ".zst, .bz2, .xz), globs or save_to_disk directories (as train_lm.py's --data); empty: the "
                  "embedded Python-stdlib corpus.")
flags.DEFINE_string("out", None, "The directory to write (tokens.bin, or tokens-*.array_record with their "
                    "*.index.npz; meta.json; created).")
flags.DEFINE_enum("format", "bin", ["bin", "array_record"], "bin: tokens.bin, the documents end to end (uint16 or "
                  "uint32); array_record: ArrayRecord files, one document per record as little-endian int32 ids.")
script_flags.define_data_flags()
FLAGS.set_default("tokenizer", "byte")


def main(argv):
    del argv
    if not FLAGS.out:
        raise ValueError("--out is empty; expected the directory to write the tokens to")
    if text_data.is_token_dir(FLAGS.out):
        raise ValueError(f"--out={FLAGS.out} already holds tokens ({text_data.TOKENS_META}); expected a new directory")
    tok = text_data.load_tokenizer(FLAGS.tokenizer)
    docs = (text_data.iter_texts(FLAGS.data, decode_errors=FLAGS.decode_errors, text_column=FLAGS.text_column)
            if FLAGS.data else text_data.default_corpus())
    meta = text_data.write_tokens(docs, tok, FLAGS.out, format=FLAGS.format)
    if meta["num_tokens"] == (meta["num_documents"] if tok.eos_id is not None else 0):  # nothing but EOS tokens
        for name in [text_data.TOKENS_META] + meta.get("files", [text_data.TOKENS_FILE]):
            os.remove(os.path.join(FLAGS.out, name))
        raise ValueError(f"--data={','.join(FLAGS.data)} holds no text")
    written = (f"{meta['dtype']}" if FLAGS.format == "bin" else
               f"{len(meta['files'])} ArrayRecord file{'s' if len(meta['files']) > 1 else ''} of int32")
    print(f"{meta['num_documents']} documents -> {meta['num_tokens']} tokens ({written}, largest id "
          f"{meta['max_id']}) in {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)
