"""Ahead-of-time memory and communication plan of the real train step, on simulated CPU devices or for a TPU slice
or GPUs (nothing allocated, no accelerator needed).

  .venv/bin/python scripts/plan_memory.py --model=llama --model_config=llama-7b --num_devices=8 --mesh=1,8,1 \
      --zero_stage=0 --per_device_batch_size=1 --seq_len=2048 --remat=full --compute_dtype=bfloat16

`--target=tpu:v5p-8` (v4-8, v5e-8, v6e-16, ...; `tpu:v5e-16x2` for two slices; needs `jax[tpu]`, e.g. make
test-tpu's .venv-tpu) compiles the same step with XLA:TPU and Mosaic for that slice's compile-only devices (the
engine's TPU compiler flags applied, the Mosaic kernels by default) and reports real per-chip bytes; --mesh then
defaults to FSDP over every chip. `--target=gpu:h100-8` (`gpu:h200`, `gpu:h100-16` for two hosts of 8; needs JAX's
CUDA plugin, make test-gpu-compile's .venv-gpu-compile) compiles it with XLA:GPU for those GPUs' compile-only
devices, without autotuning; the memory is XLA:GPU's buffer assignment, the budget the share of each GPU's memory
JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 by default). The kernels are by default those a training
script's run on the target takes (--loss_implementation / --attention_implementation=default: the measured defaults
of the target's device kind); `auto` names the target's own kernels.

prints one JSON line (parameter count; per-device bytes of arguments, outputs, aliased, temporaries and their total;
per-device bytes sent per collective type in one step); a GPU target's plan prints first a table of what each GPU's
program launches, per kind, and the device-memory bytes those launches move (engine/traffic.py: matmuls, custom
kernels, the fills and copies of a scanned stack's saved activations, elementwise fusions), with the milliseconds
they take at the GPU's memory bandwidth. `--model_overrides='{"scan_layers": false}'` plans the layers unrolled.
`--pipeline_stages` plans a pipeline, `--context_parallel`
splits each row's tokens, `--rlhf=ppo|grpo` plans an RLHF update step, `--diloco_inner_steps`
DiLoCo (with `--diloco_fragments`, `--diloco_outer_dtype`: what each part's outer step sends),
`--expert_exchange=padded|ragged` a mixture's token exchange on an `expert` mesh (default: the target's, ragged on
TPU). `--sweep` compiles
every mesh factorisation and zero stage for `--num_devices` (with `--sweep_max_stages`, pipelines too), prints a JSON
line for each and a table ranked by memory, then bytes sent. The logic lives in engine/plan.py.
"""
import json
import os

import jax
from absl import flags


import models
from engine import compiler, plan, traffic
from engine.tasks import cli, planning, script_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "llama", "Model family (models.FAMILIES).")
flags.DEFINE_string("model_config", "llama-7b", "Named config of the family (e.g. tiny, llama-7b, llama-65b).")
flags.DEFINE_string("target", "cpu", "What to compile for: 'cpu' (simulated CPU devices), a TPU slice "
                    "'tpu:<generation>-<n>[x<slices>]' (tpu:v5p-8, tpu:v5e-8, tpu:v4-8, tpu:v6e-8, tpu:v5e-16x2) or "
                    "GPUs 'gpu:<h100|h200>[-<n>]' (gpu:h100-8; n a multiple of 8 above 8: hosts of 8).")
flags.DEFINE_integer("num_devices", None, "Devices to plan on (default: 8 simulated CPU devices, or every chip of "
                     "--target).", lower_bound=1)
flags.DEFINE_string("model_overrides", None, "JSON object of config fields that replace the named config's (e.g. "
                    "'{\"num_layers\": 8}'), as the training scripts' flag of that name.")
flags.DEFINE_string("mesh", None, "Mesh sizes data,fsdp,model[,expert] (their product is --num_devices; default 1,N,1).")
flags.DEFINE_integer("zero_stage", 0, "0, 1 or 2.")
flags.DEFINE_integer("per_device_batch_size", 1, "Rows per device per micro-batch.", lower_bound=1)
flags.DEFINE_integer("seq_len", 2048, "Tokens per row.", lower_bound=2)
flags.DEFINE_enum("remat", "full", ["none", "full", "dots"], "Remat policy of each layer.")
flags.DEFINE_enum("compute_dtype", "bfloat16", ["float32", "bfloat16"], "Forward/backward dtype.")
flags.DEFINE_enum("grad_dtype", "float32", ["float32", "bfloat16"], "Dtype the gradients are held in until the "
                  "update (engine.Precision.grad_dtype).")
flags.DEFINE_enum("reduce_dtype", "float32", ["float32", "bfloat16"], "Dtype the shard_map step's gradient "
                  "reductions carry and sum in (engine.Precision.reduce_dtype; GPU and TPU targets).")
flags.DEFINE_integer("accumulate", 1, "Micro-batches per update.", lower_bound=1)
flags.DEFINE_enum("train_step", "auto", ["shard_map", "jit", "auto"], "The Trainer's step implementation (auto, as "
                  "the training scripts' --train_step: the Trainer's choice for the target's devices and the mesh, "
                  "so that the plan is of the program a run compiles).")
flags.DEFINE_enum("loss_implementation", "default", ["default", "plain", "chunked", "auto", "xla", "triton",
                                                     "mosaic_tpu"],
                  "default: what the training scripts' --loss_implementation=default takes on the target's devices "
                  "(plain logits on CPU; on GPU / TPU the fastest measured for the device kind, "
                  "kernels.default_implementation), so the plan is of the program a run compiles. plain: "
                  "materialised logits; chunked: kernels.linear_cross_entropy_sum; else the fused linear + "
                  "cross-entropy (no [tokens, vocab] array): xla (blockwise), triton, mosaic_tpu, or auto: the "
                  "target's own (mosaic_tpu on TPU, triton on GPU, xla on CPU).")
flags.DEFINE_enum("attention_implementation", "default", ["default", "auto", "xla", "triton", "cudnn", "mosaic_gpu",
                                                          "mosaic_tpu"],
                  "The flash attention's implementation (default: each call's measured default on the target's "
                  "devices, as in a run there; auto: the target's own kernels, as for --loss_implementation).")
flags.DEFINE_bool("packed", True, "Rows of packed documents with segment ids (as the scripts pack text); "
                  "--nopacked: whole rows without them (token directories, scripts/bench_gpu_step.py's rows), which "
                  "a GPU's measured default may give another attention (cuDNN's).")
flags.DEFINE_float("hbm_gb", None, "Per-device memory budget in GB (1e9 bytes): report whether the plan fits.")
flags.DEFINE_integer("pipeline_stages", 1, "Pipeline stages (the mesh's `stage` axis; devices = stages x the "
                     "--mesh product).", lower_bound=1)
flags.DEFINE_integer("context_parallel", 1, "Context parallelism: devices each row's tokens are split over (the "
                     "mesh's `context` axis; devices = context x stages x the --mesh product; either step).",
                     lower_bound=1)
flags.DEFINE_integer("pipeline_microbatches", 0, "Micro-batches of the pipeline (0: one per stage).", lower_bound=0)
flags.DEFINE_integer("pipeline_virtual_stages", 1, "Virtual stages per device (1: GPipe; more: the interleaved "
                     "schedule).", lower_bound=1)
flags.DEFINE_enum("pipeline_schedule", "gpipe", list(models.pipeline.SCHEDULES), "The pipeline's schedule (1f1b: "
                  "each micro-batch's backward as soon as it leaves the last stage; the idle share is the "
                  "schedule's).")
flags.DEFINE_enum("pipeline_fsdp_gather", "tick", list(models.pipeline.FSDP_GATHERS), "With fsdp inside a stage: "
                  "gather its weights (and reduce their gradients) every tick, or once a step.")
flags.DEFINE_integer("diloco_inner_steps", 0, "> 0: plan DiLoCo over `data` (needs --zero_stage=0): bytes of an "
                     "inner step, and of each part's outer step.", lower_bound=0)
flags.DEFINE_integer("diloco_fragments", 1, "Streaming DiLoCo's parts.", lower_bound=1)
flags.DEFINE_enum("diloco_outer_dtype", "float32", ["float32", "bfloat16", "int8", "int4"], "DiLoCo's outer "
                  "gradients on the wire.")
flags.DEFINE_bool("zero_quantized_weights", False, "ZeRO++'s int8 weight all-gathers (the shard_map step).")
flags.DEFINE_bool("zero_quantized_gradients", False, "ZeRO++'s int8 gradient reductions, over fsdp and data (the "
                  "shard_map step).")
flags.DEFINE_bool("sequence_parallel", False, "Megatron-LM's sequence parallelism: the residual stream between the "
                  "tensor-parallel blocks split by tokens over `model` (with --sweep: in every layout with model > 1).")
flags.DEFINE_enum("rlhf", "none", ["none", "ppo", "grpo"], "Plan the update step of PPO (actor and critic trained) "
                  "or GRPO (the actor alone) on experience rows instead of language-model training (engine/ppo.py).")
flags.DEFINE_enum("expert_exchange", "auto", ["auto", "ragged", "padded"], "A mixture's token exchange on an "
                  "`expert` mesh (models.layers.MoEOptions.expert_exchange): auto the target's (ragged all-to-all on "
                  "TPU, padded on CPU), ragged (TPU targets only) or padded.")
flags.DEFINE_bool("sweep", False, "Every mesh factorisation x zero stage, ranked.")
flags.DEFINE_integer("sweep_max_stages", 1, "--sweep also tries pipelines of every stage count up to this that "
                     "divides --num_devices (--per_device_batch_size x stages rows per data position: the batch of the "
                     "stages turned into data positions; one micro-batch per stage).", lower_bound=1)
flags.DEFINE_integer("lora_rank", 0, "> 0: train only LoRA adapters of this rank on every projection.", lower_bound=0)
flags.DEFINE_enum("param_dtype", "float32", ["float32", "bfloat16"], "Storage dtype of the frozen weights with "
                  "--lora_rank (trained weights are always float32 masters).")
flags.DEFINE_enum("quantize", "none", ["none", "int8", "nf4"], "The frozen projections stored as int8 or nf4 "
                  "(--lora_rank).")


def main(argv):
    del argv
    target = plan.parse_target(FLAGS.target)  # a bad name fails here, before JAX starts
    num_devices = FLAGS.num_devices or (None if target else 8)
    if target is None:  # the simulated devices exist only if XLA sees the flag before JAX starts its backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={num_devices}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"  # a target's devices are compile-only ones (libtpu's, CUDA's), not a backend
    jax.config.update("jax_platforms", "cpu")  # (JAX read the variable when imported; a CUDA plugin without a GPU
    # fails to start as a backend, and the topology then fails with it)
    compiler.configure(("gpu" if target[0] in plan.GPU_TARGETS else "tpu") if target else "cpu")  # as a run there
    if FLAGS.mesh is None:
        n = num_devices or len(plan.target_devices(FLAGS.target))
        FLAGS.mesh = f"1,{n // (FLAGS.pipeline_stages * FLAGS.context_parallel)},1"
    kwargs = dict(model=FLAGS.model, model_config=FLAGS.model_config, target=FLAGS.target, num_devices=num_devices,
                  per_device_batch_size=FLAGS.per_device_batch_size, seq_len=FLAGS.seq_len, remat=FLAGS.remat,
                  compute_dtype=FLAGS.compute_dtype, grad_dtype=FLAGS.grad_dtype, reduce_dtype=FLAGS.reduce_dtype,
                  accumulate=FLAGS.accumulate, step=FLAGS.train_step,
                  hbm_gb=FLAGS.hbm_gb, lora_rank=FLAGS.lora_rank, param_dtype=FLAGS.param_dtype,
                  quantize=None if FLAGS.quantize == "none" else FLAGS.quantize,
                  sequence_parallel=FLAGS.sequence_parallel, rlhf=None if FLAGS.rlhf == "none" else FLAGS.rlhf,
                  loss_implementation=None if FLAGS.loss_implementation == "plain" else FLAGS.loss_implementation,
                  attention_implementation=FLAGS.attention_implementation, packed=FLAGS.packed,
                  config_overrides=script_flags.parse_json("model_overrides", FLAGS.model_overrides) or None)
    if FLAGS.expert_exchange != "auto":
        if not hasattr(models.get_config(FLAGS.model, FLAGS.model_config), "expert_exchange"):
            raise ValueError(f"--expert_exchange={FLAGS.expert_exchange} with --model={FLAGS.model}; expected a "
                             "mixture of experts (mixtral, qwen3_moe) or --expert_exchange=auto")
        if FLAGS.expert_exchange == "ragged" and target is None:
            raise ValueError("--expert_exchange=ragged with --target=cpu; XLA:CPU has no ragged all-to-all: expected a "
                             "TPU --target or --expert_exchange=auto / padded")
        kwargs["config_overrides"] = {**(kwargs["config_overrides"] or {}), "expert_exchange": FLAGS.expert_exchange}
    if FLAGS.sweep:
        kwargs["num_devices"] = num_devices or len(plan.target_devices(FLAGS.target))
        results = planning.sweep(max_stages=FLAGS.sweep_max_stages, **kwargs)
        for r in results:
            print(json.dumps(r), flush=True)
        print(plan.format_table(results))
        return
    result = planning.plan(mesh=FLAGS.mesh, zero_stage=FLAGS.zero_stage, stages=FLAGS.pipeline_stages,
                           pipeline_microbatches=FLAGS.pipeline_microbatches,
                           pipeline_virtual_stages=FLAGS.pipeline_virtual_stages,
                           pipeline_schedule=FLAGS.pipeline_schedule,
                           pipeline_fsdp_gather=FLAGS.pipeline_fsdp_gather, context=FLAGS.context_parallel,
                           diloco_inner_steps=FLAGS.diloco_inner_steps, diloco_fragments=FLAGS.diloco_fragments,
                           diloco_outer_dtype=FLAGS.diloco_outer_dtype,
                           zero_quantized_weights=FLAGS.zero_quantized_weights,
                           zero_quantized_gradients=FLAGS.zero_quantized_gradients, **kwargs)
    if "traffic" in result:  # a GPU target: what each device's program launches, before the JSON line
        print(traffic.format_traffic(result["traffic"], plan.GPU_TARGETS[target[0]][1]))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    cli.run(main)
