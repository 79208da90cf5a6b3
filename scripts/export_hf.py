"""Writes the latest checkpoint of a training script's workdir as a Hugging Face (transformers) checkpoint directory:
config.json + safetensors that transformers' `from_pretrained` and every script's --init_from read.

A language model (train_lm.py, train_sft.py, train_dpo.py; a PPO run's policy) becomes a *ForCausalLM, a T5
(finetune_seq2seq.py) a T5ForConditionalGeneration, a reward model (train_reward.py) a *ForSequenceClassification
with one label; LoRA adapters are merged into the weights. The tokenizer file the run used (tokenizer.json or
tokenizer.model) is copied beside it. `--adapter_only` writes a LoRA run's adapters alone as a PEFT adapter
directory (adapter_config.json, adapter_model.safetensors: `peft.PeftModel.from_pretrained(base, out)` reads it onto
the base model it was trained on).

  python scripts/export_hf.py --workdir=workdir --out=hf_model
  python scripts/export_hf.py --workdir=workdir_reward --out=hf_reward_model
  python scripts/export_hf.py --workdir=workdir_sft_lora --out=adapter --adapter_only
"""
import os
import shutil


import jax
from absl import flags

import models
from engine.tasks import cli, run_record, script_flags, text_data

FLAGS = flags.FLAGS
script_flags.define_flags()
flags.DEFINE_string("workdir", "workdir", "A training script's workdir (its run.json and latest checkpoint).")
script_flags.define_checkpoint_flag()
flags.DEFINE_string("out", None, "The directory to write (created; its safetensors files are replaced).")
flags.DEFINE_bool("adapter_only", False, "Write only the run's LoRA adapters, as a PEFT adapter directory.")


def main(argv):
    del argv
    if not FLAGS.out:
        raise ValueError("--out is empty; expected the directory to write the Hugging Face checkpoint to")
    mesh = cli.start()
    task, model, params, tokenizer = run_record.restore_run(FLAGS.workdir, mesh, checkpoint=FLAGS.checkpoint)
    if FLAGS.adapter_only:
        if task == "reward" or not models.has_lora(params):
            raise ValueError(f"--adapter_only: {FLAGS.workdir} holds a {task} run without LoRA adapters; expected "
                             "a language-model run trained with --lora_rank")
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
