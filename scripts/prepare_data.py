"""Tokenises a text corpus once into a directory that `train_lm.py --data=DIR` reads through a memory map: for a
corpus larger than memory, or to stop re-tokenising it on every run. Documents stream from the files one at a time.

  python scripts/prepare_data.py --data='corpus/*.jsonl' --out=tokens                 # byte-level tokens
  python scripts/prepare_data.py --data='corpus/*.txt' --tokenizer=/path/to/hf_llama --out=tokens
  python scripts/train_lm.py --data=tokens --init_from=/path/to/hf_llama
"""
import os


from absl import flags

from engine.tasks import cli, script_flags, text_data

FLAGS = flags.FLAGS
flags.DEFINE_list("data", [], ".txt, .jsonl, .parquet or .arrow files, globs or save_to_disk directories (as "
                  "train_lm.py's --data); empty: the embedded Python-stdlib corpus.")
flags.DEFINE_string("out", None, "The directory to write (tokens.bin, meta.json; created).")
script_flags.define_data_flags()
FLAGS.set_default("tokenizer", "byte")


def main(argv):
    del argv
    if not FLAGS.out:
        raise ValueError("--out is empty; expected the directory to write the tokens to")
    if text_data.is_token_dir(FLAGS.out):
        raise ValueError(f"--out={FLAGS.out} already holds tokens ({text_data.TOKENS_META}); expected a new directory")
    tok = text_data.load_tokenizer(FLAGS.tokenizer)
    docs = (text_data.iter_texts(FLAGS.data, decode_errors=FLAGS.decode_errors, text_column=FLAGS.text_column) if FLAGS.data
            else text_data.default_corpus())
    meta = text_data.write_tokens(docs, tok, FLAGS.out)
    if meta["num_tokens"] == (meta["num_documents"] if tok.eos_id is not None else 0):  # nothing but EOS tokens
        for name in (text_data.TOKENS_META, text_data.TOKENS_FILE):
            os.remove(os.path.join(FLAGS.out, name))
        raise ValueError(f"--data={','.join(FLAGS.data)} holds no text")
    print(f"{meta['num_documents']} documents -> {meta['num_tokens']} tokens ({meta['dtype']}, largest id "
          f"{meta['max_id']}) in {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)
