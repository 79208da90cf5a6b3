"""Writes the latest checkpoint of a training script's workdir as a Hugging Face (transformers) checkpoint directory:
config.json + safetensors that transformers' `from_pretrained` and every script's --init_from read.

A language model (train_lm.py, train_sft.py, train_dpo.py; a PPO run's policy) becomes a *ForCausalLM, a T5
(finetune_seq2seq.py) a T5ForConditionalGeneration, a reward model (train_reward.py) a *ForSequenceClassification
with one label; LoRA adapters are merged into the weights. The tokenizer file the run used (tokenizer.json or
tokenizer.model) is copied beside it. `--adapter_only` writes a LoRA run's adapters alone as a PEFT adapter
directory (adapter_config.json, adapter_model.safetensors: `peft.PeftModel.from_pretrained(base, out)` reads it onto
the base model it was trained on). --out is a new or empty directory; --overwrite writes into one that is not,
removing first the files an export writes (so none of an earlier export is read beside this one). config.json
gets the run's EOS and padding ids where the model's config had none (transformers' `generate` then stops at EOS),
and the run's task (generate.py --init_from then answers an SFT, DPO or PPO model after its separator, as from the
workdir).

  python scripts/export_hf.py --workdir=workdir --out=hf_model
  python scripts/export_hf.py --workdir=workdir_reward --out=hf_reward_model
  python scripts/export_hf.py --workdir=workdir_sft_lora --out=adapter --adapter_only
"""
import json
import os
import shutil


import jax
from absl import flags, logging

import models
from engine.tasks import cli, run_record, script_flags, text_data

FLAGS = flags.FLAGS
script_flags.define_flags()
flags.DEFINE_string("workdir", "workdir", "A training script's workdir (its run.json and latest checkpoint).")
script_flags.define_checkpoint_flag()
flags.DEFINE_string("out", None, "The directory to write (created): new or empty, or with --overwrite.")
flags.DEFINE_bool("adapter_only", False, "Write only the run's LoRA adapters, as a PEFT adapter directory.")
flags.DEFINE_bool("overwrite", False, "Write into a non-empty --out: the files an export writes there (config, "
                  "weights, tokenizer, adapter files) are removed first; others stay.")

# What an export may write: removed from a non-empty --out by --overwrite, so that no file of an earlier export (a
# tokenizer this run lacks, the other kind of directory's weights) is read as this one's.
_EXPORTED = ("config.json", "generation_config.json", "adapter_config.json", *text_data.TOKENIZER_FILES)
_EXPORTED_SUFFIXES = (".safetensors", ".safetensors.index.json")


def _check_out():
    """--out is a new or empty directory, or --overwrite is given; ValueError in one line (before any checkpoint is
    read). Returns the names in --out."""
    if not FLAGS.out:
        raise ValueError("--out is empty; expected the directory to write the Hugging Face checkpoint to")
    if os.path.exists(FLAGS.out) and not os.path.isdir(FLAGS.out):
        raise ValueError(f"--out={FLAGS.out} is a file; expected a directory to write the checkpoint to")
    present = sorted(os.listdir(FLAGS.out)) if os.path.isdir(FLAGS.out) else []
    if run_record.RUN_FILE in present:  # --overwrite would remove the tokenizer file its run.json reads
        raise ValueError(f"--out={FLAGS.out} is a training workdir (it holds {run_record.RUN_FILE}); expected "
                         "another directory for the export")
    if present and not FLAGS.overwrite:
        shown = ", ".join(present[:4]) + (f" and {len(present) - 4} more" if len(present) > 4 else "")
        raise ValueError(f"--out={FLAGS.out} is not empty ({shown}); expected a new or empty directory, or "
                         "--overwrite to replace the files an export writes there")
    return present


def _clear_exported(present):
    """--overwrite: removes from --out the files an export writes (once the checkpoint restored)."""
    for name in present:
        if name in _EXPORTED or name.endswith(_EXPORTED_SUFFIXES):
            os.remove(os.path.join(FLAGS.out, name))


def _note_run(task, tokenizer):
    """config.json's eos / pad ids from the run's tokenizer where the model's config had none, so that transformers'
    `generate` stops at EOS; and the run's task (`models.hf.EXPORTED_TASK`), by which generate.py --init_from answers
    a model tuned on prompt / response rows after the separator it was trained with."""
    path = os.path.join(FLAGS.out, "config.json")
    with open(path) as f:
        config = json.load(f)
    for key, value in (("eos_token_id", tokenizer.eos_id), ("pad_token_id", tokenizer.pad_id)):
        if config.get(key) is None and value is not None:
            config[key] = int(value)
    config[models.hf.EXPORTED_TASK] = task
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def main(argv):
    del argv
    present = _check_out()
    mesh = cli.start()
    task, model, params, tokenizer = run_record.restore_run(FLAGS.workdir, mesh, checkpoint=FLAGS.checkpoint)
    if FLAGS.adapter_only and (task == "reward" or not models.has_lora(params)):
        raise ValueError(f"--adapter_only: {FLAGS.workdir} holds a {task} run without LoRA adapters; expected "
                         "a language-model run trained with --lora_rank")
    if jax.process_index() == 0:
        _clear_exported(present)
    if FLAGS.adapter_only:
        if model.config.quantize is not None:  # QLoRA: the adapters learnt the quantized base's weights
            logging.warning("--adapter_only: the adapters were trained on the %s-quantized base; onto the float base "
                            "they answer otherwise (quantize the base as the run did, or export without "
                            "--adapter_only: the adapters merged into the run's own base)", model.config.quantize)
        if jax.process_index() == 0:
            models.save_lora_adapter(model, params, FLAGS.out)
            print(f"wrote the {task} run's LoRA adapters (rank {model.config.lora_rank}) as a PEFT adapter to "
                  f"{FLAGS.out}")
        return
    if jax.process_index() == 0:
        if task == "reward":
            models.save_reward_model(model, params, FLAGS.out, pad_token_id=tokenizer.pad_id)
        else:
            models.save_pretrained(model, params, FLAGS.out)
        _note_run(task, tokenizer)
        copied = [name for name in text_data.TOKENIZER_FILES if os.path.exists(os.path.join(FLAGS.workdir, name))]
        for name in copied:
            shutil.copy(os.path.join(FLAGS.workdir, name), os.path.join(FLAGS.out, name))
        kind = {"reward": "sequence classifier", "seq2seq": "encoder-decoder"}.get(task, "causal language model")
        print(f"wrote the {task} run's checkpoint as a Hugging Face {kind} to {FLAGS.out}")
        if not copied:
            print(f"no tokenizer file: the run's tokens are the {type(tokenizer).__name__}'s; the scripts read this "
                  "directory with --tokenizer=" + ("byte" if isinstance(tokenizer, text_data.ByteTokenizer)
                                                   else "word"))

if __name__ == "__main__":
    cli.run(main)
