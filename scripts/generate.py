"""Generates text from a trained workdir (of scripts/train_lm.py, train_sft.py, train_dpo.py, train_ppo.py or
finetune_seq2seq.py) or a Hugging Face directory, with the parameters sharded over --mesh; prints one generation per
prompt.

  python scripts/generate.py --prompts='def ,import '                         # from workdir/ (after `make train`)
  python scripts/generate.py --workdir=workdir_seq2seq --prompts='owl cat yak bee'
  python scripts/generate.py --init_from=/path/to/hf_llama --prompts_file=prompts.txt --mesh=1,1,-1 --temperature=0.7
  python scripts/generate.py --init_from=/path/to/hf_llama --init_adapter=/path/to/peft_adapter --quantize=int8
  python scripts/generate.py --init_from=/path/to/hf_llama --prompts_file=prompts.txt --engine=paged --batch_size=64

--engine=paged serves every prompt through one `models.PagedEngine` (continuous batching over a paged KV cache,
--batch_size sequences in flight, equal prompts sharing their pages): greedy text equal to the static path's;
sampled prompt n draws with seed --seed + n (not the static path's draws); decoder-only models, no beam search.
"""
import os


import jax
from absl import flags

import models
from engine.tasks import cli, lm, model_start, run_record, script_flags
from engine.tasks.rlhf import preference

FLAGS = flags.FLAGS
script_flags.define_flags()
flags.DEFINE_string("workdir", "workdir", "A training script's workdir: its run.json rebuilds the model and its "
                    "latest checkpoint gives the parameters (ignored with --init_from).")
script_flags.define_checkpoint_flag()
flags.DEFINE_string("init_from", None, "A Hugging Face model directory (config.json + safetensors; tokenizer.json, "
                    "else byte-level tokens) instead of a workdir.")
flags.DEFINE_list("prompts", [], "Comma-separated prompts.")
flags.DEFINE_string("prompts_file", None, "A file of prompts, one per line (blank lines skipped).")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt at most (generation stops at EOS).")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0: greedy).")
flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0: all).")
flags.DEFINE_float("top_p", 1.0, "Sample from the smallest set of tokens with this total probability (1: all).")
flags.DEFINE_integer("batch_size", 32, "Prompts per generate call (--engine=paged: sequences in flight).")
flags.DEFINE_enum("engine", "static", ["static", "paged"], "static: models.generate over batches of --batch_size "
                  "prompts; paged: continuous batching of all of them over a paged KV cache (models.PagedEngine).")
flags.DEFINE_integer("page_size", 16, "--engine=paged: tokens per page of the KV cache.", lower_bound=1)
flags.DEFINE_integer("num_beams", 1, "Beam search with this many beams per prompt (1: greedy or sampling); "
                     "deterministic, so not with --temperature > 0.")
flags.DEFINE_float("length_penalty", 1.0, "Beam search: a hypothesis scores its summed log-probability / its length "
                   "** length_penalty (0: the plain sum; larger favours longer answers).")
flags.DEFINE_enum("early_stopping", "false", ["true", "false", "never"], "Beam search: when a prompt's search "
                  "ends, as in transformers: true, once it has --num_beams finished hypotheses; false (their "
                  "default), once no running beam can still beat the worst of them at its current length; never, "
                  "the same bound at --max_new_tokens when --length_penalty > 0.")
flags.DEFINE_string("init_adapter", None, "A PEFT LoRA adapter directory applied to the model (merged into it).")
flags.DEFINE_enum("kv_cache_dtype", "auto", ["auto", "int8", "bfloat16", "float32"], "Storage of the KV cache: "
                  "auto = the model's compute dtype; int8 = int8 keys and values with a scale per token and head "
                  "(half of bf16's bytes, read as int8 by kernels.decode_attention).")
flags.DEFINE_enum("quantize", "none", ["none", "int8", "nf4"], "Generate with the attention and MLP projections "
                  "stored quantised (models.quantize; LoRA adapters merged first): int8, a quarter of float32's "
                  "memory, or nf4, about a seventh.")


def read_prompts():
    prompts = list(FLAGS.prompts)
    if FLAGS.prompts_file:
        if not os.path.isfile(FLAGS.prompts_file):
            raise FileNotFoundError(f"--prompts_file={FLAGS.prompts_file}: no such file")
        with open(FLAGS.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("no prompts; expected --prompts=a,b or --prompts_file=FILE")
    return prompts


def main(argv):
    del argv
    prompts = read_prompts()
    for name, ok in (("max_new_tokens", FLAGS.max_new_tokens >= 1), ("batch_size", FLAGS.batch_size >= 1),
                     ("temperature", FLAGS.temperature >= 0), ("top_k", FLAGS.top_k >= 0),
                     ("top_p", 0 < FLAGS.top_p <= 1), ("num_beams", FLAGS.num_beams >= 1)):
        if not ok:
            raise ValueError(f"--{name}={FLAGS[name].value} is out of range")
    if FLAGS.num_beams > 1 and (FLAGS.temperature > 0 or FLAGS.top_k or FLAGS.top_p < 1):
        raise ValueError(f"--num_beams={FLAGS.num_beams} with --temperature={FLAGS.temperature}, --top_k="
                         f"{FLAGS.top_k}, --top_p={FLAGS.top_p}; expected beam search without sampling (temperature 0)")
    mesh = cli.start()
    task = None
    if FLAGS.init_from:
        model, params, tokenizer = model_start.load_hf(
            FLAGS.init_from, families=[*script_flags.DECODER_FAMILIES, "t5"], mesh=mesh)
        task = models.hf.exported_task(FLAGS.init_from)  # an export_hf.py directory's run: its separator below
    else:
        tasks = ("lm", "seq2seq", "sft", "dpo", "ppo")
        task, model, params, tokenizer = run_record.restore_run(FLAGS.workdir, mesh, tasks=tasks,
                                                                checkpoint=FLAGS.checkpoint)
    model, params = model_start.merge_adapter(model, params, FLAGS.init_adapter, mesh)
    if FLAGS.quantize != "none":
        model, params = models.quantize(*models.merge_lora(model, params), FLAGS.quantize)
    # A model tuned on prompt/response rows (SFT, DPO, PPO) answers after the separator it was trained with.
    sep = preference.separator(tokenizer) if task in ("sft", "dpo", "ppo") else None
    after_prompt = () if sep is None else (sep,)
    kv_cache_dtype = None if FLAGS.kv_cache_dtype == "auto" else FLAGS.kv_cache_dtype
    if FLAGS.engine == "paged":
        show(prompts, paged_texts(model, params, tokenizer, prompts, after_prompt, kv_cache_dtype))
        return
    for start in range(0, len(prompts), FLAGS.batch_size):
        batch = prompts[start:start + FLAGS.batch_size]
        outs = lm.generate_texts(model, params, tokenizer, batch, max_new_tokens=FLAGS.max_new_tokens,
                                   temperature=FLAGS.temperature, top_k=FLAGS.top_k or None,
                                   top_p=FLAGS.top_p if FLAGS.top_p < 1 else None, seed=FLAGS.seed + start,
                                   after_prompt=after_prompt, kv_cache_dtype=kv_cache_dtype,
                                   num_beams=FLAGS.num_beams, length_penalty=FLAGS.length_penalty,
                                   early_stopping={"true": True, "false": False}.get(FLAGS.early_stopping, "never"))
        show(batch, outs)


def show(prompts, outs):
    if jax.process_index() == 0:
        for prompt, out in zip(prompts, outs):
            print(f"--- {prompt!r}:\n{out}", flush=True)


def paged_texts(model, params, tokenizer, prompts, after_prompt, kv_cache_dtype):
    """Every prompt's continuation (decoded up to EOS) through one PagedEngine, --batch_size in flight, a pool that
    holds --batch_size of the longest request."""
    if getattr(model, "is_encoder_decoder", False) or FLAGS.num_beams > 1 or kv_cache_dtype not in (None, "int8"):
        raise ValueError(f"--engine=paged with a {type(model).__name__}, --num_beams={FLAGS.num_beams}, "
                         f"--kv_cache_dtype={FLAGS.kv_cache_dtype}; expected a decoder-only model, --num_beams=1 and "
                         "--kv_cache_dtype auto or int8")
    encoded = [tokenizer.encode(p) + list(after_prompt) for p in prompts]
    for n, (prompt, tokens) in enumerate(zip(prompts, encoded)):
        if not tokens:
            raise ValueError(f"prompt {n} ({prompt!r}) has no tokens; expected a non-empty prompt")
    max_len = max(len(t) for t in encoded) + FLAGS.max_new_tokens
    requests = [dict(prompt_ids=tokens, max_new_tokens=FLAGS.max_new_tokens, eos_id=tokenizer.eos_id,
                     temperature=FLAGS.temperature, top_k=FLAGS.top_k or None,
                     top_p=FLAGS.top_p if FLAGS.top_p < 1 else None, seed=FLAGS.seed + n)
                for n, tokens in enumerate(encoded)]
    new = models.generate_continuous(model, params, requests, max_batch=FLAGS.batch_size, page_size=FLAGS.page_size,
                                     num_pages=FLAGS.batch_size * -(-max_len // FLAGS.page_size),
                                     cache_dtype=kv_cache_dtype, max_len=max_len)
    return [tokenizer.decode([i for i in row if i != tokenizer.eos_id]) for row in new]


if __name__ == "__main__":
    cli.run(main)
