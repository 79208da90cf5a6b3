"""absl flags shared by every script (mesh, scale, precision, multi-host, training loop), what they build, and
`run(main)`: the scripts' entry point, which turns a bad flag or bad input into a one-line `error:` and exit code 2
instead of a traceback. Scripts import this module; tests can too."""
import atexit
import dataclasses
import errno
import json
import logging as std_logging
import os
import re
import signal
import sys
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from jax.experimental import multihost_utils

import engine
import kernels
import models
from engine import compiler
from engine import diloco as diloco_lib
from engine import distributed
from engine import fit_loop
from engine.tasks import lm, seq2seq, text_data
from engine.tasks.rlhf import ppo, preference, reward

FLAGS = flags.FLAGS

# The scripts whose `start(auto=True)` takes --mesh=auto.
AUTO_MESH_SCRIPTS = "train_lm.py, train_sft.py, train_dpo.py, train_reward.py and finetune_seq2seq.py"
_DTYPES = {"float32": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# User-input errors: reported in one line. Anything else (a bug) keeps its traceback.
_USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, app.UsageError, flags.Error)
USAGE_EXIT_CODE = 2


def define_data_flags():
    """--tokenizer and --decode_errors (idempotent)."""
    if "tokenizer" in FLAGS:
        return
    flags.DEFINE_string("tokenizer", None, "The tokenizer: a tokenizer.json or SentencePiece tokenizer.model file, a "
                        "directory holding one, 'byte' (byte-level ids) or 'word' (the toy task's words). Unset: a "
                        "Hugging Face --init_from directory's own file (none there is an error, never a silent "
                        "byte-level fallback); a fresh model's byte-level ids with --data, else the toy words.")
    flags.DEFINE_enum("decode_errors", "strict", list(text_data.DECODE_ERRORS), "Text and JSONL files must be UTF-8: "
                      "'strict' stops at the first invalid byte, naming the file and its offset; 'replace' replaces "
                      "invalid bytes with U+FFFD.")


def define_flags():
    """Defines the shared flags once (idempotent, so several modules may ask)."""
    if "mesh" in FLAGS:
        return
    define_data_flags()
    flags.DEFINE_string("mesh", "-1,1,1", "Device mesh sizes data,fsdp,model[,expert]; one may be -1 (the rest of "
                        "the devices). data: replicated weights; fsdp: ZeRO-3; model: tensor parallel; expert: a "
                        f"mixture-of-experts model's experts split (rows too, as over data). {AUTO_MESH_SCRIPTS} "
                        "also take 'auto': every layout compiled ahead of time, the one that fits and sends least "
                        "chosen, --per_device_batch_size rows per device kept as the global batch.")
    flags.DEFINE_integer("pipeline_stages", 1, "Pipeline parallelism: stages of the layer stack (the mesh's `stage` "
                         "axis; the devices are stages x the --mesh product). Decoder-only models; GPipe schedule.")
    flags.DEFINE_integer("context_parallel", 1, "Context (sequence) parallelism: devices each row's tokens are split "
                         "over (the mesh's `context` axis; the devices are context x stages x the --mesh product). "
                         "Attention exchanges sequence for heads (all-to-all), so heads / model must divide by it.")
    flags.DEFINE_bool("sequence_parallel", False, "Megatron-LM's sequence parallelism with --mesh's model > 1: the "
                      "residual stream between the tensor-parallel attention and MLP blocks holds 1/model of the "
                      "tokens per device (each block all-gathers them; its output is reduce-scattered).")
    flags.DEFINE_integer("pipeline_microbatches", 0, "Micro-batches each pipeline step cuts its rows into (0: one "
                         "per stage); the idle share of a stage is (stages - 1) / (micro-batches + stages - 1).")
    flags.DEFINE_integer("zero_stage", 0, "0, 1 (split optimizer state over data) or 2 (gradients too).")
    flags.DEFINE_integer("per_device_batch_size", 4, "Examples per device (along data x fsdp) per micro-batch.")
    flags.DEFINE_integer("accumulate_grad_batches", 1, "Micro-batches per optimizer update.")
    flags.DEFINE_enum("compute_dtype", None, list(_DTYPES), "Forward/backward dtype: every matmul of the model runs "
                      "in it; master weights and optimizer state stay fp32. Unset: bfloat16 on GPU and TPU "
                      "(MaxText's default), float32 on CPU.")
    flags.DEFINE_enum("grad_dtype", "float32", ["float32", "bfloat16"], "Dtype the gradients are held in until the "
                      "optimizer update (engine.Precision.grad_dtype): bfloat16 halves their memory.")
    flags.DEFINE_enum("reduce_dtype", "float32", ["float32", "bfloat16"], "Dtype the shard_map step's gradient "
                      "reductions carry and sum in (engine.Precision.reduce_dtype; GPU and TPU only).")
    flags.DEFINE_bool("remat", False, "Rematerialise the forward pass in the backward pass (less memory).")
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 for multi-process runs (else "
                        "ENGINE_COORDINATOR_ADDRESS or SLURM).")
    flags.DEFINE_integer("num_processes", None, "Number of processes of a multi-process run.")
    flags.DEFINE_integer("process_id", None, "This process's index in a multi-process run.")
    flags.DEFINE_float("coordinator_timeout", 300, "Seconds a multi-process start waits for the coordinator to "
                       "answer and for every process to join before it fails, naming which did not.")
    flags.DEFINE_float("peer_timeout", 100, "Seconds without a heartbeat after which a running multi-process job "
                       "counts a process as lost (killed, its host gone) and ends every process.")
    flags.DEFINE_integer("seed", 0, "Fixes initialisation, shuffling and dropout.")


def define_training_flags(*, workdir, max_steps, learning_rate, warmup_steps, log_every, save_every, evals=True):
    """The training-loop flags of the training scripts (each script chooses its defaults); evals: the script
    evaluates on held-out data during `fit` (--eval_every, --save_best)."""
    define_flags()
    flags.DEFINE_string("workdir", workdir, "Checkpoints, TensorBoard scalars and the model description "
                        "(run.json) go here; re-running the same command resumes.")
    flags.DEFINE_integer("max_steps", max_steps, "Optimizer updates in total (resumes included).")
    flags.DEFINE_integer("n_epochs", 1000, "Passes over the data at most.")
    flags.DEFINE_float("learning_rate", learning_rate, "Peak learning rate (after a linear warm-up; --lr_schedule).")
    flags.DEFINE_integer("warmup_steps", warmup_steps, "Warm-up updates.")
    flags.DEFINE_enum("lr_schedule", "cosine", list(_SCHEDULES), "After the warm-up: cosine or linear decay to "
                      "--min_learning_rate_ratio of the peak at --max_steps, or constant.")
    flags.DEFINE_float("min_learning_rate_ratio", 0.1, "The decayed schedules' last learning rate / the peak.")
    flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay.")
    flags.DEFINE_float("adam_b1", 0.9, "AdamW's first-moment decay.")
    flags.DEFINE_float("adam_b2", 0.999, "AdamW's second-moment decay (0.95 is common for large models).")
    flags.DEFINE_float("adam_eps", 1e-8, "AdamW's epsilon.")
    flags.DEFINE_float("max_grad_norm", 1.0, "Clip the global gradient norm to this before the update (0: no "
                       "clipping).")
    flags.DEFINE_integer("log_every", log_every, "Updates between log lines (the only host syncs of the loop).")
    flags.DEFINE_integer("save_every", save_every, "Updates between checkpoints (one is always written at the end).")
    if evals:
        flags.DEFINE_integer("eval_every", 0, "Updates between evals on the held-out data (0: after each epoch "
                             "only).")
        flags.DEFINE_string("save_best", None, "METRIC:min or METRIC:max, e.g. loss:min: keep the state of the best "
                            "eval so far under workdir/best (generate.py / export_hf.py --checkpoint=best read it).")
        flags.DEFINE_integer("early_stopping_patience", 0, "With --save_best: stop after this many evals in a row "
                             "without a new best (0: never).")
    flags.DEFINE_list("profile_steps", [], "START,END: write a jax.profiler trace of those steps to "
                      "workdir/tensorboard (TensorBoard's profile tab).")
    flags.DEFINE_enum("loss_implementation", "default",
                      ["default", "plain", "chunked", "auto", *kernels.IMPLEMENTATIONS],
                      "plain: logits [tokens, vocab] then cross-entropy. chunked: the head and the loss over chunks "
                      "of rows with the gradients taken in the forward (kernels.linear_cross_entropy_sum; mean "
                      "losses only, not DPO / PPO). Otherwise the output head and the loss run fused in "
                      "kernels.linear_cross_entropy, blockwise over the vocabulary, so the logits never exist: auto "
                      "(the backend's kernel), xla, triton (GPU) or mosaic_tpu (TPU). default: plain on CPU; on GPU / "
                      "TPU what kernels.default_implementation measured fastest on this device (plain where plain "
                      "logits won, and for a model whose logits are soft-capped).")
    flags.DEFINE_float("dropout_rate", None, "Dropout of the model in training steps; default the model's own (a "
                       "Hugging Face config's rate with --init_from, else 0).", lower_bound=0.0, upper_bound=0.95)
    flags.DEFINE_float("attention_dropout_rate", None, "Dropout of the attention probabilities in training steps; "
                       "default the model's own (a Hugging Face config's: LLaMA/OPT attention_dropout, GPT-J "
                       "attn_pdrop, T5 dropout_rate; else 0).", lower_bound=0.0, upper_bound=0.95)
    flags.DEFINE_bool("offload_optimizer", False, "Keep the optimizer state in pinned host memory between steps "
                      "(ZeRO-Offload's placement): less device memory, two host transfers of it per step.")
    flags.DEFINE_bool("zero_quantized_weights", False, "ZeRO++'s qwZ: the shard_map step all-gathers every ZeRO-3 "
                      "weight matrix over fsdp as int8 with per-row scales (needs fsdp > 1).")
    flags.DEFINE_bool("zero_quantized_gradients", False, "ZeRO++'s qgZ, on every gradient reduction: reduce-scatters "
                      "(ZeRO-3's over fsdp, ZeRO-1/2's over data) as int8 chunks by an all-to-all, all-reduces over "
                      "data as that plus an int8 all-gather (the shard_map step; needs data or fsdp > 1).")
    flags.DEFINE_integer("diloco_inner_steps", 0, "> 0: DiLoCo (engine.DiLoCo): every position along the mesh's "
                         "data axis trains its own replica and they communicate once every this many steps; 0: "
                         "plain data parallelism.", lower_bound=0)
    flags.DEFINE_float("diloco_outer_learning_rate", 0.7, "DiLoCo's outer learning rate (SGD with Nesterov momentum "
                       "0.9, as in the paper).", lower_bound=0.0)
    flags.DEFINE_integer("diloco_fragments", 1, "Streaming DiLoCo: the parameters in this many parts that take "
                         "their outer steps in turn (each link then carries 1/this of the model at a time); at most "
                         "--diloco_inner_steps.", lower_bound=1)
    flags.DEFINE_enum("diloco_outer_dtype", "float32", list(diloco_lib.OUTER_DTYPES), "Wire format of DiLoCo's "
                      "outer gradients: float32 (all-reduce), or bfloat16 / int8 / int4 (blockwise-scaled, "
                      "2x / 3.9x / 7.8x fewer bytes).")
    flags.DEFINE_bool("diloco_overlap", False, "Streaming DiLoCo's overlap: each outer step runs in the step after its "
                      "part falls due, exchanged while that step's inner update computes (one step late; the "
                      "replicas keep that inner update).")


def with_flags(model, params):
    """(model, params) with the runtime options the flags set: --dropout_rate / --attention_dropout_rate (each
    unchanged when unset) and, for a pipeline (--pipeline_stages > 1), --pipeline_microbatches and the layers
    stacked (`models.stack_layers`; run.json records the layout, so a resume needs the same flags)."""
    options = {name: getattr(FLAGS, name) for name in ("dropout_rate", "attention_dropout_rate")
               if getattr(FLAGS, name) is not None}
    model, params = with_pipeline(model, params)
    return (model.clone(config=dataclasses.replace(model.config, **options)) if options else model), params


def with_pipeline(model, params):
    """(model, params) laid out for the mesh flags: --sequence_parallel set; for --pipeline_stages > 1 the layers
    stacked (`models.stack_layers`) and --pipeline_microbatches set."""
    if FLAGS.sequence_parallel:
        model = model.clone(config=dataclasses.replace(model.config, sequence_parallel=True))
    if FLAGS.pipeline_stages == 1:
        return model, params
    try:
        model, params = models.stack_layers(model, params)
    except ValueError as e:
        raise ValueError(f"--pipeline_stages={FLAGS.pipeline_stages}: {e}") from None
    config = dataclasses.replace(model.config, pipeline_microbatches=FLAGS.pipeline_microbatches)
    return model.clone(config=config), params


def loss_implementation(model=None, *, per_token=False):
    """--loss_implementation as the tasks' loss helpers take it (None: plain logits). 'default' (see the flag)
    resolves here for this device and --compute_dtype; `model` (when given) with a final logit soft-cap keeps plain
    logits, which the fused kernel does not cap; per_token (DPO's and PPO's per-token log-probabilities): a measured
    'chunked' (a summed loss) resolves to plain logits."""
    if FLAGS.loss_implementation != "default":
        return None if FLAGS.loss_implementation == "plain" else FLAGS.loss_implementation
    if jax.default_backend() == "cpu" or getattr(getattr(model, "config", None), "final_logit_softcap", None):
        return None
    choice = kernels.default_implementation("linear_cross_entropy", dtype=compute_dtype() or jnp.float32)
    return None if choice == "plain" or (per_token and choice == "chunked") else choice


def compute_dtype():
    """--compute_dtype as `engine.Precision` takes it (None: float32); unset: bfloat16 on GPU and TPU, float32 on
    CPU."""
    name = FLAGS.compute_dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    return _DTYPES[name]


def parse_mesh(text):
    """'2,2,2', '-1,1,2' or '2,1,1,4' -> dict(data=, fsdp=, model=[, expert=]); ValueError naming the flag
    otherwise."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) not in (3, 4):
        raise ValueError(f"--mesh={text!r}; expected three or four integers data,fsdp,model[,expert] such as 2,2,2, "
                         "-1,1,2 or 2,1,1,4")
    return engine.plan.mesh_sizes(sizes)


def parse_profile_steps(values):
    """--profile_steps ['10', '15'] -> (10, 15); [] -> None."""
    if not values:
        return None
    try:
        steps = tuple(int(x) for x in values)
    except ValueError:
        steps = ()
    if len(steps) != 2 or not 0 <= steps[0] < steps[1]:
        raise ValueError(f"--profile_steps={','.join(values)}; expected START,END with 0 <= START < END")
    return steps


def parse_json(flag, value):
    """A JSON-object flag -> dict; ValueError naming the flag otherwise."""
    try:
        out = json.loads(value or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"--{flag}={value!r} is not JSON: {e}") from None
    if not isinstance(out, dict):
        raise ValueError(f"--{flag}={value!r}; expected a JSON object such as {{\"hidden_size\": 128}}")
    return out


def _check_diloco_flags():
    if "diloco_fragments" not in FLAGS:
        return
    streaming = FLAGS.diloco_fragments > 1 or FLAGS.diloco_outer_dtype != "float32" or FLAGS.diloco_overlap
    if streaming and not FLAGS.diloco_inner_steps:
        raise ValueError(f"--diloco_fragments={FLAGS.diloco_fragments} --diloco_outer_dtype="
                         f"{FLAGS.diloco_outer_dtype} --diloco_overlap={FLAGS.diloco_overlap}; expected "
                         "--diloco_inner_steps > 0 with them (they set DiLoCo's outer steps)")
    if FLAGS.diloco_fragments > max(1, FLAGS.diloco_inner_steps):
        raise ValueError(f"--diloco_fragments={FLAGS.diloco_fragments}; expected at most --diloco_inner_steps="
                         f"{FLAGS.diloco_inner_steps} (each part takes its outer step at its own inner step)")


def define_auto_mesh_flag():
    """--mesh_memory_gb, of a script whose `start(auto=True)` takes --mesh=auto."""
    flags.DEFINE_float("mesh_memory_gb", None, "--mesh=auto's memory budget per device in GB (1e9 bytes); unset: the "
                       "device's own limit (GPU, TPU; a CPU has none).")


def start(auto=False):
    """Joins the multi-process runtime (if asked) and builds the mesh from the flags. auto: the script takes
    --mesh=auto (then None is returned and the script calls `choose_mesh` once its model is described)."""
    if auto and FLAGS.mesh_memory_gb is not None and (FLAGS.mesh != "auto" or FLAGS.mesh_memory_gb <= 0):
        raise ValueError(f"--mesh_memory_gb={FLAGS.mesh_memory_gb} with --mesh={FLAGS.mesh}; expected a positive "
                         "budget with --mesh=auto")
    for name in ("per_device_batch_size", "accumulate_grad_batches", "pipeline_stages", "context_parallel"):
        if FLAGS[name].value < 1:
            raise ValueError(f"--{name}={FLAGS[name].value}; expected an integer >= 1")
    engine.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                                  timeout_s=FLAGS.coordinator_timeout, heartbeat_timeout_s=FLAGS.peer_timeout)
    if jax.process_count() > 1 and FLAGS.verbosity < 1:
        _StdoutFilter.install()
    if FLAGS.pipeline_microbatches < 0:
        raise ValueError(f"--pipeline_microbatches={FLAGS.pipeline_microbatches}; expected an integer >= 0")
    _check_diloco_flags()
    if "save_best" in FLAGS:
        eval_kwargs()  # bad --eval_every / --save_best fail before any model is built
    if "lr_schedule" in FLAGS:
        _check_optimizer_flags()
    if FLAGS.mesh == "auto":
        if not auto:
            raise ValueError("--mesh=auto; expected integers data,fsdp,model[,expert] such as 2,2,2 (this script does "
                             f"not choose a layout: {AUTO_MESH_SCRIPTS} do)")
        return None
    mesh = engine.make_mesh(stage=FLAGS.pipeline_stages, context=FLAGS.context_parallel, **parse_mesh(FLAGS.mesh))
    if "zero_quantized_weights" in FLAGS:  # the training scripts': checked before any workdir file is written
        engine.trainer.check_zero_quantized(engine.step.Int8(FLAGS.zero_quantized_weights,
                                                             FLAGS.zero_quantized_gradients),
                                            mesh, diloco=bool(FLAGS.diloco_inner_steps))
    return mesh


def choose_mesh(make_trainer, collate_fn, example, memory_gb=None, devices=None, experts=0):
    """--mesh=auto: the layout `engine.plan.rank_meshes` ranks first for one global batch of --per_device_batch_size
    rows per device (those left after --pipeline_stages x --context_parallel), `example` (one training example)
    standing for every row; the ranking is printed. make_trainer(mesh): the run's Trainer over abstract parameters
    (no workdir). memory_gb: the per-device budget (default: the device's own limit; none on CPU). devices: default
    all. experts: the model's expert count (a mixture of experts: layouts with an `expert` axis ranked too).
    Returns (mesh, rows per data position of that mesh)."""
    stages, context = FLAGS.pipeline_stages, FLAGS.context_parallel
    devices = jax.devices() if devices is None else list(devices)
    positions = len(devices) // (stages * context)
    rows = FLAGS.per_device_batch_size * positions
    batch = {k: jax.ShapeDtypeStruct((FLAGS.accumulate_grad_batches, *np.shape(v)), np.asarray(v).dtype)
             for k, v in collate_fn([example] * rows).items()}
    budget = memory_gb * 1e9 if memory_gb is not None else engine.plan.device_memory_bytes(devices[0])
    started = time.perf_counter()
    ranked = engine.plan.rank_meshes(make_trainer, batch, devices=devices, stages=stages, context=context,
                                     memory_bytes=budget, experts=experts)
    if jax.process_index() == 0:
        print(f"--mesh=auto: {len(ranked)} layouts of {positions} devices for {rows} rows per step"
              + (f", {budget / 1e9:.2f} GB per device" if budget else "")
              + f" (compiled in {time.perf_counter() - started:.0f} s):")
        print(engine.plan.format_table(ranked))
    best = ranked[0]
    if jax.process_count() > 1:  # every process ranked the same programs; one choice still binds them all (two
        # processes on different meshes would wait for each other's collectives for ever)
        chosen = tuple(int(x) for x in multihost_utils.broadcast_one_to_all(
            np.asarray(best["mesh"] + [1] * (4 - len(best["mesh"])), np.int32)))
        best = next(r for r in ranked if tuple(r["mesh"] + [1] * (4 - len(r["mesh"]))) == chosen)
    if "error" in best:
        raise ValueError(f"--mesh=auto: no layout of {positions} devices compiles (mesh {best['mesh']}: "
                         f"{best['error']}); expected a model and flags that train on some --mesh")
    if not best["fits"]:
        least = min((r for r in ranked if "error" not in r), key=lambda r: r["bytes"]["total"])
        raise ValueError(f"--mesh=auto: no layout fits {budget / 1e9:.2f} GB per device (the least, mesh "
                         f"{','.join(map(str, least['mesh']))}, needs {least['bytes']['total'] / 1e9:.2f} GB); "
                         "expected a larger budget, --remat, a smaller --per_device_batch_size or more devices")
    sizes = engine.plan.mesh_sizes(best["mesh"])
    per_position = rows // (sizes["data"] * sizes["fsdp"] * sizes.get("expert", 1))
    if jax.process_index() == 0:
        print(f"--mesh=auto chose {','.join(map(str, best['mesh']))}: {per_position} rows per data position")
    mesh = engine.make_mesh(stage=stages, context=context, **sizes, devices=devices)
    return mesh, per_position


def choose_decoder_mesh(make_trainer, collate_fn, encode, records, *, tasks):
    """--mesh=auto for a script that starts from `start_decoder`: `choose_mesh` over `describe_decoder`'s model and
    abstract parameters. make_trainer(mesh, model, params): the run's Trainer (no workdir needed); encode(records,
    tokenizer, seq_len=) -> (examples, cut): the script's encoding, whose first record's example stands for every
    row. Returns (mesh, rows per data position)."""
    model, params, tokenizer = describe_decoder(tasks=tasks, seq_len=FLAGS.seq_len)
    (example, *_), _ = encode(records[:1], tokenizer, seq_len=FLAGS.seq_len)
    return choose_mesh(lambda mesh: make_trainer(mesh, model, params), collate_fn, example,
                       memory_gb=FLAGS.mesh_memory_gb, experts=getattr(model.config, "num_experts", 0))


def trainer_kwargs():
    """The Trainer arguments the shared flags set: its seed, accumulation, `engine.Precision`,
    `engine.Parallelism` and DiLoCo."""
    kwargs = dict(accumulate_grad_batches=FLAGS.accumulate_grad_batches, seed=FLAGS.seed,
                  precision=engine.Precision(compute_dtype=compute_dtype(),
                                            grad_dtype=_DTYPES[FLAGS.grad_dtype],
                                            reduce_dtype=_DTYPES[FLAGS.reduce_dtype]),
                  parallelism=engine.Parallelism(zero_stage=FLAGS.zero_stage, remat=FLAGS.remat,
                                                 offload_optimizer=FLAGS.offload_optimizer,
                                                 zero_quantized_weights=FLAGS.zero_quantized_weights,
                                                 zero_quantized_gradients=FLAGS.zero_quantized_gradients))
    if FLAGS.diloco_inner_steps:
        kwargs["diloco"] = engine.DiLoCo(
            inner_steps=FLAGS.diloco_inner_steps, fragments=FLAGS.diloco_fragments,
            outer_dtype=FLAGS.diloco_outer_dtype, overlap=FLAGS.diloco_overlap,
            outer_optimizer=optax.sgd(FLAGS.diloco_outer_learning_rate, momentum=0.9, nesterov=True))
    return kwargs


def eval_kwargs():
    """`fit`'s eval_every, save_best and early_stopping_patience from their flags."""
    if FLAGS.eval_every < 0:
        raise ValueError(f"--eval_every={FLAGS.eval_every}; expected an integer >= 0 (0: after each epoch only)")
    save_best = None
    if FLAGS.save_best:
        metric, _, mode = FLAGS.save_best.rpartition(":")
        if not metric or mode not in ("min", "max"):
            raise ValueError(f"--save_best={FLAGS.save_best}; expected METRIC:min or METRIC:max, e.g. loss:min")
        save_best = (metric, mode)
    if FLAGS.early_stopping_patience < 0 or (FLAGS.early_stopping_patience and save_best is None):
        raise ValueError(f"--early_stopping_patience={FLAGS.early_stopping_patience}; expected 0, or an integer >= 1 "
                         "with --save_best (the metric it watches)")
    return dict(eval_every=FLAGS.eval_every or None, save_best=save_best,
                early_stopping_patience=FLAGS.early_stopping_patience or None)


_SCHEDULES = ("cosine", "linear", "constant")


def _check_optimizer_flags():
    for name, ok, expected in (
            ("learning_rate", FLAGS.learning_rate > 0, "> 0"), ("warmup_steps", FLAGS.warmup_steps >= 0, ">= 0"),
            ("min_learning_rate_ratio", 0 <= FLAGS.min_learning_rate_ratio <= 1, "in [0, 1]"),
            ("weight_decay", FLAGS.weight_decay >= 0, ">= 0"), ("adam_b1", 0 <= FLAGS.adam_b1 < 1, "in [0, 1)"),
            ("adam_b2", 0 <= FLAGS.adam_b2 < 1, "in [0, 1)"), ("adam_eps", FLAGS.adam_eps > 0, "> 0"),
            ("max_grad_norm", FLAGS.max_grad_norm >= 0, ">= 0 (0: no clipping)")):
        if not ok:
            raise ValueError(f"--{name}={FLAGS[name].value}; expected {expected}")


def lr_schedule(peak):
    """The learning rate by update number from the flags (see `optimizer`), peaking at `peak`."""
    warmup, total = max(1, FLAGS.warmup_steps), max(FLAGS.max_steps, FLAGS.warmup_steps + 1)
    end = peak * FLAGS.min_learning_rate_ratio
    if FLAGS.lr_schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, total, end_value=end)
    after = (optax.linear_schedule(peak, end, total - warmup) if FLAGS.lr_schedule == "linear"
             else optax.constant_schedule(peak))
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def optimizer(learning_rate=None):
    """AdamW (--adam_b1/b2/eps, --weight_decay) after global-norm clipping (--max_grad_norm), on a linear warm-up
    (--warmup_steps) then --lr_schedule: cosine (default) or linear decay to --min_learning_rate_ratio of the peak at
    --max_steps, or constant. learning_rate: a peak other than --learning_rate. Every training script builds its
    optimizer here."""
    _check_optimizer_flags()
    schedule = lr_schedule(FLAGS.learning_rate if learning_rate is None else learning_rate)
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, b1=FLAGS.adam_b1, b2=FLAGS.adam_b2,
                                                  eps=FLAGS.adam_eps, weight_decay=FLAGS.weight_decay)
    return optax.chain(optax.clip_by_global_norm(FLAGS.max_grad_norm), adamw) if FLAGS.max_grad_norm else adamw


def progress_lines(trainer, log_every):
    """The lines a training script prints after `fit`: one per `log_every` steps of the history (loss, and token
    accuracy when the loss reports it), one per eval, the best checkpoint kept (`--save_best`), then the throughput
    of the last logged steps."""
    lines = []
    for record in trainer.history:
        if "loss" in record and record["step"] % log_every == 0:
            accuracy = f"  token accuracy {record['accuracy']:.3f}" if "accuracy" in record else ""
            lines.append(f"step {record['step']:5d}  loss {record['loss']:.4f}{accuracy}")
        elif "eval_loss" in record:
            results = " | ".join(f"{k[len('eval_'):]} {v:.4f}" for k, v in record.items() if k != "step")
            lines.append(f"eval at step {record['step']}: {results}")
    if trainer.best is not None:
        best = trainer.best
        lines.append(f"best eval {best['metric']} {best['value']:.4f} at step {best['step']} "
                     f"(kept under {trainer.workdir}/best; --checkpoint=best reads it)")
    fig = trainer.throughput
    if fig:
        flops = ""
        if fig.get("model_tflops_per_device") is not None:
            mfu = f", MFU {100 * fig['mfu']:.1f}%" if fig.get("mfu") is not None else ""
            flops = f", {fig['model_tflops_per_device']:.3g} model TFLOP/s per device{mfu}"
        lines.append(f"throughput of the last logged steps: {fig['seconds_per_step']:.3f} s/step, "
                     f"{fig['examples_per_second']:.1f} examples/s{flops}")
    return lines


def define_record_flags(*, what, fields, toy_size):
    """--data, --eval_data, --eval_size and --toy_size of a script that trains on jsonl records with string `fields`
    (read by `load_train_eval`); `what` names the records in the help."""
    shown = ", ".join(f'"{f}": ...' for f in fields)
    flags.DEFINE_list("data", [], f".jsonl files or globs of {{{shown}}} lines; empty: the embedded toy task.")
    flags.DEFINE_list("eval_data", [], f"Held-out .jsonl {what}; empty: the last --eval_size {what} of --data (or "
                      f"fresh toy {what}).")
    flags.DEFINE_integer("eval_size", 256, f"Held-out {what} when --eval_data is not given.")
    flags.DEFINE_integer("toy_size", toy_size, f"Training {what} of the embedded toy task.")


def load_train_eval(read, toy, *, key, what):
    """(train records, eval records) from --data / --eval_data / --eval_size / --toy_size / --seed: `read(patterns)`
    reads files; without --data, `toy(n, seed)` makes the embedded task, and its eval records are fresh ones
    (another seed) whose `key` field no training record has. `what` names the records in errors."""
    if FLAGS.data:
        train = read(FLAGS.data, decode_errors=FLAGS.decode_errors)
        if not train:
            raise ValueError(f"--data={','.join(FLAGS.data)} holds no {what}")
    else:
        train = toy(FLAGS.toy_size, FLAGS.seed)
    if FLAGS.eval_data:
        evals = read(FLAGS.eval_data, decode_errors=FLAGS.decode_errors)
        if not evals:
            raise ValueError(f"--eval_data={','.join(FLAGS.eval_data)} holds no {what}")
    elif FLAGS.data:
        if len(train) <= FLAGS.eval_size:
            raise ValueError(f"--data holds {len(train)} {what}; more than --eval_size={FLAGS.eval_size} are needed "
                             "when there is no --eval_data")
        train, evals = train[:-FLAGS.eval_size], train[-FLAGS.eval_size:]
    else:
        seen = {r[key] for r in train}
        evals = [r for r in toy(4 * FLAGS.eval_size, FLAGS.seed + 1) if r[key] not in seen][:FLAGS.eval_size]
    return train, evals


def encode_rows(encode, tokenizer, train_records, eval_records, mesh, *, what, per_device_batch_size=None):
    """(train examples, eval examples) from `encode(records, tokenizer, seq_len=--seq_len) -> (examples, cut)` on
    both record lists: logs how many records were cut to --seq_len, and a ValueError when the training examples are
    fewer than one global batch (of per_device_batch_size rows per data position; default
    --per_device_batch_size)."""
    (train, cut), (evals, eval_cut) = (encode(records, tokenizer, seq_len=FLAGS.seq_len)
                                       for records in (train_records, eval_records))
    if cut + eval_cut:
        logging.warning("%d %s were cut to --seq_len=%d tokens", cut + eval_cut, what, FLAGS.seq_len)
    global_batch = engine.global_batch_size(mesh, per_device_batch_size or FLAGS.per_device_batch_size,
                                            FLAGS.accumulate_grad_batches)
    if len(train) < global_batch:
        raise ValueError(f"{len(train)} training {what} are fewer than one global batch of {global_batch}")
    return train, evals


def log_eval(trainer, results):
    """Writes an eval the script prints (`{name: value}`, e.g. the losses before and after training) to TensorBoard
    as `eval/<name>` at the trainer's current step, so every eval on the console is also in TensorBoard."""
    trainer.write_scalars("eval", results)


def finish(trainer, workdir):
    """Ends a training script: closes the trainer (waits for its last checkpoint). When a signal stopped the run it
    prints where it can be resumed and exits with 128 + the signal's number (143 for SIGTERM, 130 for Ctrl-C), as a
    shell does, so a scheduler can tell a preempted run from a finished one."""
    trainer.close()
    if trainer.stopped_by_signal:
        print(f"stopped by a signal at step {trainer.step}; checkpoint saved in {workdir}; re-run to resume")
        # A peer's signal stopped this process: the run was preempted all the same.
        _exit(128 + (trainer.stop_signal or signal.SIGTERM))


# ----------------------------------------------------------------------------------------------- models and workdirs

DECODER_FAMILIES = ("llama", "gptj", "opt", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "mixtral",
                    "qwen3_moe")


def define_decoder_flags(*, init_from_help,
                         model_overrides='{"hidden_size": 64, "intermediate_size": 128, "num_layers": 2}'):
    """--init_from, --model, --model_config and --model_overrides of a script that starts a decoder-only model from
    a workdir, a Hugging Face directory or scratch (read by `start_decoder`)."""
    flags.DEFINE_string("init_from", None, init_from_help)
    flags.DEFINE_enum("model", "llama", list(DECODER_FAMILIES), "Model family of a fresh model.")
    flags.DEFINE_string("model_config", "tiny", "Named config of a fresh model, or a path to a JSON file of config "
                        "fields.")
    flags.DEFINE_string("model_overrides", model_overrides, "JSON object of config fields that replace the named "
                        "config's; with --init_from, model options only (scan_layers, remat, "
                        "attention_implementation, ...; a workdir's: runtime options only).")
    define_lora_flags()


def define_lora_flags():
    """--init_adapter, --lora_rank, --lora_alpha and --lora_targets (read by `start_decoder` / `with_lora`)."""
    flags.DEFINE_string("init_adapter", None, "A PEFT LoRA adapter directory (export_hf.py --adapter_only, or PEFT's "
                        "own save_pretrained) merged into --init_from's model before training.")
    flags.DEFINE_integer("lora_rank", 0, "> 0: train only LoRA adapters of this rank (models.lora) on the projections "
                         "in --lora_targets, the rest of the model frozen; adapters of the starting workdir are "
                         "merged first. 0: train every parameter.", lower_bound=0)
    flags.DEFINE_float("lora_alpha", 16.0, "LoRA's alpha: the adapters' output is scaled by alpha / rank.",
                       lower_bound=0.0)
    flags.DEFINE_list("lora_targets", list(models.layers.LORA_TARGETS), "Projections that get LoRA adapters, of "
                      f"{','.join(models.layers.LORA_TARGETS)}.")
    flags.DEFINE_float("lora_dropout", 0.0, "Dropout on the adapters' input in training steps (PEFT's lora_dropout).",
                       lower_bound=0.0, upper_bound=0.95)
    flags.DEFINE_enum("quantize", "none", ["none", "int8", "nf4"], "Store the frozen base's attention and MLP "
                      "projections quantised (models.quantize; needs --lora_rank): int8 with a float32 scale per "
                      "column, or nf4 (QLoRA's 4-bit NormalFloat, an absmax per 64 rows).")


def start_decoder(mesh, *, tasks, seq_len):
    """(task, model, params, tokenizer) of the starting point from --init_from / --model / --model_config /
    --model_overrides: the latest checkpoint of a training script's workdir whose task is one of `tasks` (task is
    then that run's), a Hugging Face directory (task None) or a fresh model (task None) with byte-level tokens when
    --data is given and the toy tasks' word tokens otherwise; then the --lora_* flags (`with_lora`). Parameters are
    placed on `mesh`."""
    task, model, params, tokenizer = _start_decoder(mesh, tasks, seq_len)
    return (task, *apply_lora_flags(model, params, mesh), tokenizer)


def apply_lora_flags(model, params, mesh):
    """(model, params) of a script's starting point with --init_adapter merged in, then `with_lora`."""
    return with_lora(*merge_adapter(model, params, FLAGS.init_adapter, mesh), mesh)


def _layout(mesh):
    """Where the models' loaders put parameters: `engine.auto_layout` on `mesh`; host arrays without one."""
    return None if mesh is None else engine.auto_layout(mesh)


def merge_adapter(model, params, adapter, mesh):
    """(model, params) with the PEFT adapter directory `adapter` (--init_adapter; None: none) merged into the
    weights, after any adapters `params` already hold."""
    if not adapter:
        return model, params
    if not os.path.isdir(adapter):
        raise FileNotFoundError(f"--init_adapter={adapter} is not a directory; expected a PEFT adapter directory")
    return models.merge_lora(*models.load_lora_adapter(*models.merge_lora(model, params), adapter,
                                                         layout=_layout(mesh)))


def _start_decoder(mesh, tasks, seq_len):
    if FLAGS.init_from:
        if os.path.exists(os.path.join(FLAGS.init_from, RUN_FILE)):
            check_no_tokenizer_flag(FLAGS.init_from)
            return restore_run(FLAGS.init_from, mesh, tasks=tasks, **model_options(runtime_only=True))
        return (None, *load_hf(FLAGS.init_from, families=DECODER_FAMILIES, mesh=mesh))
    model, tokenizer = _fresh_decoder(seq_len)
    params = models.init_params(model, jax.random.PRNGKey(FLAGS.seed), layout=_layout(mesh))
    return None, model, params, tokenizer


def check_no_tokenizer_flag(workdir):
    if FLAGS.tokenizer is not None:
        raise ValueError(f"--tokenizer={FLAGS.tokenizer} with the workdir {workdir}: its {RUN_FILE} fixes the "
                         "tokenizer it was trained with; expected no --tokenizer")


def fresh_tokenizer(default=None):
    """A fresh model's tokenizer: --tokenizer's, else `default`, else byte-level ids with --data and the toy task's
    words without."""
    if FLAGS.tokenizer is not None:
        return text_data.load_tokenizer(FLAGS.tokenizer)
    if default is not None:
        return default
    return text_data.ByteTokenizer() if FLAGS.data else text_data.WordTokenizer(text_data.TOY_WORDS)


def _fresh_decoder(seq_len):
    tokenizer = fresh_tokenizer()
    return fresh_model(tokenizer, {"max_position_embeddings": max(seq_len, 128)}, family=FLAGS.model,
                       families=DECODER_FAMILIES), tokenizer


def fresh_model(tokenizer, fields, *, family, families):
    """A fresh model of --model_config for `tokenizer`: a named config with the tokenizer's vocab_size, `fields`
    (the script's) and --model_overrides; a .json file of config fields as it is. ValueError when its vocabulary
    is smaller than the tokenizer's."""
    overrides = {}
    if not FLAGS.model_config.endswith(".json"):
        overrides = {"vocab_size": tokenizer.vocab_size, **accelerator_options(), **fields,
                     **parse_json("model_overrides", FLAGS.model_overrides)}
    model = create_model(family, FLAGS.model_config, overrides, families=families)
    if model.config.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"vocab_size={model.config.vocab_size}; the {type(tokenizer).__name__} needs at least "
                         f"{tokenizer.vocab_size}")
    return model


def describe_decoder(*, tasks, seq_len):
    """(model, params, tokenizer) of `start_decoder`'s starting point with the --lora_* flags and `with_flags`
    applied, the parameters as jax.ShapeDtypeStructs: no weight is read or allocated (--mesh=auto's description,
    from a workdir's run.json, a Hugging Face directory's config.json and tokenizer, or the fresh model's flags).
    --init_adapter is not read: merged into the weights, it changes no shape."""
    if FLAGS.init_from and os.path.exists(os.path.join(FLAGS.init_from, RUN_FILE)):
        _, model, tokenizer = load_run(FLAGS.init_from, tasks, **model_options(runtime_only=True))
    elif FLAGS.init_from:
        model = load_hf_model(FLAGS.init_from, families=DECODER_FAMILIES)
        tokenizer = hf_tokenizer(FLAGS.init_from, model)
    else:
        model, tokenizer = _fresh_decoder(seq_len)
    return (*describe(model), tokenizer)


def describe(model):
    """(model, params) of a fresh `model` with the --lora_* flags (`with_lora`, in a script that defines them) and
    `with_flags` applied, the parameters as jax.ShapeDtypeStructs (the functions of a script's real start, traced
    for shapes)."""
    described = {}

    def laid_out():
        model_params = (model, models.init_params(model, jax.random.PRNGKey(0)))
        if "lora_rank" in FLAGS:
            model_params = with_lora(*model_params, None)
        described["model"], params = with_flags(*model_params)
        return params

    params = jax.eval_shape(laid_out)
    return described["model"], params


def with_lora(model, params, mesh):
    """(model, params) with --lora_rank / --lora_alpha / --lora_targets applied: any adapters `params` hold are
    merged into their kernels, then (--lora_rank > 0) fresh ones are added, placed on `mesh`. `model` may be an
    `models.RewardModel` (params {'backbone', 'score'}): its backbone gets them."""
    if isinstance(model, models.RewardModel):
        backbone, inner = with_lora(model.backbone, params["backbone"], mesh)
        return models.RewardModel(backbone), {**params, "backbone": inner}
    model, params = models.merge_lora(model, params)
    if FLAGS.quantize != "none" and not FLAGS.lora_rank:
        raise ValueError(f"--quantize={FLAGS.quantize} with --lora_rank=0; expected --lora_rank > 0 (quantised "
                         "weights cannot train: adapters train on them)")
    if not FLAGS.lora_rank:
        return model, params
    if FLAGS.quantize != "none":
        model, params = models.quantize(model, params, FLAGS.quantize)
    try:
        config = dataclasses.replace(model.config, lora_rank=FLAGS.lora_rank, lora_alpha=FLAGS.lora_alpha,
                                     lora_targets=tuple(FLAGS.lora_targets), lora_dropout=FLAGS.lora_dropout)
    except ValueError as e:
        raise ValueError(f"--lora_rank/--lora_alpha/--lora_targets: {e}") from None
    model = model.clone(config=config)
    return model, models.add_lora(model, params, jax.random.PRNGKey(FLAGS.seed), layout=_layout(mesh))


def trainable(also=None):
    """The Trainer's `trainable` for --lora_rank: None (everything trains) at 0, else the adapters and the paths the
    regex `also` matches (e.g. a reward model's fresh score head)."""
    if not FLAGS.lora_rank:
        return None
    return models.LORA_TRAINABLE + (f"|{also}" if also else "")


# Runtime options are not recorded in run.json; the LoRA, quantisation and layer-stacking fields are (they change the
# parameters and their checkpoint layout).
_RECORDED_DEFAULTS = {f.name: f.default for f in dataclasses.fields(models.ModelOptions)
                  if f.name in ("lora_rank", "lora_alpha", "lora_targets", "quantize", "scan_layers")}
_RUNTIME_FIELDS = {f.name for f in dataclasses.fields(models.ModelOptions)} - set(_RECORDED_DEFAULTS) | {"hf_config"}
RUN_FILE = "run.json"


def create_model(family, model_config, overrides=None, *, families):
    """A fresh model of `family` from a named config or a JSON file of config fields, plus `overrides`.
    families: the families the calling script accepts. ValueError / FileNotFoundError on bad input."""
    if family not in families:
        raise ValueError(f"--model={family!r}; expected one of {list(families)}")
    overrides = dict(overrides or {})
    if model_config.endswith(".json"):
        if not os.path.isfile(model_config):
            raise FileNotFoundError(f"--model_config={model_config}: no such file")
        with open(model_config) as f:
            try:
                fields = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"--model_config={model_config} is not JSON: {e}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"--model_config={model_config} holds {type(fields).__name__}; expected a JSON object "
                             "of config fields")
        fields = {**fields, **overrides}
    else:
        named = models.FAMILIES[family].NAMED_CONFIGS
        if model_config not in named:
            raise ValueError(f"--model_config={model_config!r} is not a config of {family}; expected a .json file "
                             f"or one of {sorted(named)}")
        fields = {**named[model_config], **overrides}
    config_cls = models.FAMILIES[family].Config
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{family} config has no field(s) {unknown}; expected some of {sorted(known - {'hf_config'})}")
    return models.FAMILIES[family].Model(config_cls(**_tuples(fields)))


# What the scripts' models default to on a GPU or TPU: the layer stack compiled once (one scanned layer). Remat
# stays off (it trades step time for memory): --model_overrides='{"remat": "dots"}' (or "full") chooses a policy.
ACCELERATOR_OPTIONS = {"scan_layers": True}
_OPTION_FIELDS = {f.name for f in dataclasses.fields(models.ModelOptions)}


def accelerator_options():
    """`ACCELERATOR_OPTIONS` on a GPU or TPU backend; nothing on CPU."""
    return {} if jax.default_backend() == "cpu" else dict(ACCELERATOR_OPTIONS)


def model_options(runtime_only=False):
    """The ModelOptions fields of a model read from --init_from: `accelerator_options()`, then --model_overrides
    when the command line sets it. A checkpoint fixes the architecture, so only ModelOptions fields (scan_layers,
    remat, attention_implementation, mlp_implementation, ...) may be overridden; runtime_only (a workdir, whose
    run.json also fixes the layer stacking, LoRA and quantisation): only the runtime ones. ValueError otherwise."""
    allowed = _RUNTIME_FIELDS - {"hf_config"} if runtime_only else _OPTION_FIELDS
    options = {} if runtime_only else accelerator_options()
    if "model_overrides" not in FLAGS or not FLAGS["model_overrides"].present:
        return options
    given = parse_json("model_overrides", FLAGS.model_overrides)
    refused = sorted(set(given) - allowed)
    if refused:
        what = "a training workdir's run.json" if runtime_only else "the Hugging Face config.json"
        raise ValueError(f"--model_overrides sets {refused} with --init_from={FLAGS.init_from}: {what} fixes them; "
                         f"expected only model options of {sorted(allowed)}")
    return {**options, **_tuples(given)}


def _tuples(x):
    """JSON lists back to the tuples config fields hold (configs are hashed: the model is a jit cache key)."""
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def family_of(model):
    return next(name for name, fam in models.FAMILIES.items() if isinstance(model, fam.Model))


def load_hf_model(path, *, families):
    """The model of a Hugging Face directory, from its config alone, with `model_options()`; ValueError naming
    --init_from otherwise."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--init_from={path} is not a directory; expected a Hugging Face model directory")
    model = models.load_model(path, **model_options())
    if family_of(model) not in families:
        raise ValueError(f"--init_from={path} holds a {family_of(model)} model; this script takes {list(families)}")
    return model


def load_hf(path, *, families, mesh=None):
    """(model, params, tokenizer) from a Hugging Face directory; params placed on `mesh`'s auto_shard shardings as
    they are read; the tokenizer as `hf_tokenizer` finds it."""
    model = load_hf_model(path, families=families)  # bad input fails before any weight is read
    tokenizer = hf_tokenizer(path, model)
    model, params = models.load_pretrained(path, layout=_layout(mesh), **model_options())
    return model, params, tokenizer


def hf_tokenizer(path, model):
    """The tokenizer --tokenizer names or, unset, the Hugging Face directory's own tokenizer.json / tokenizer.model
    (`text_data.load_tokenizer`), for `model`'s vocabulary."""
    return text_data.load_tokenizer(FLAGS.tokenizer, model_dir=path, vocab_size=model.config.vocab_size)


def _model_fields(model):
    """The config fields that fix the parameters (not the runtime options)."""
    return {k: v for k, v in dataclasses.asdict(model.config).items() if k not in _RUNTIME_FIELDS}


def save_run(workdir, task, model, tokenizer, critic=None):
    """Writes workdir/run.json (task, family, config fields, tokenizer; an HF tokenizer.json is copied beside it) so
    that scripts/generate.py can rebuild the model of a workdir. critic: a PPO run's `models.RewardModel`
    (its backbone's family and config are recorded too). If the workdir already holds a run of a different model,
    ValueError: its checkpoints would not fit."""
    run = {"task": task, "family": family_of(model), "config": _model_fields(model)}
    if critic is not None:
        run["critic"] = {"family": family_of(critic.backbone), "config": _model_fields(critic.backbone)}
    path = os.path.join(workdir, RUN_FILE)
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        # run.json files written before the LoRA / scan fields existed hold none of them: theirs are the defaults.
        full = lambda config: config and _tuples({**_RECORDED_DEFAULTS, **config})  # noqa: E731
        old_config, new_config = full(old.get("config")), full(run["config"])
        old_critic = old.get("critic") and {**old["critic"], "config": full(old["critic"]["config"])}
        new_critic = run.get("critic") and {**run["critic"], "config": full(run["critic"]["config"])}
        if (old.get("task"), old.get("family"), old_config, _tuples(old_critic)) != (
                task, run["family"], new_config, _tuples(new_critic)):
            changed = sorted(k for k in set(old_config or {}) | set(new_config)
                             if (old_config or {}).get(k) != new_config.get(k))
            hint = ""
            if "scan_layers" in changed:
                was = bool((old_config or {}).get("scan_layers"))
                hint = (f": its layers were {'' if was else 'not '}scanned (stacked), so --model_overrides with "
                        f'"scan_layers": {str(was).lower()} (GPU and TPU runs default to true, CPU runs to false), '
                        f"and --pipeline_stages {'> 1 if it ran as a pipeline' if was else '=1'}")
            raise ValueError(f"--workdir={workdir} holds a {old.get('task')} run of another model ({old.get('family')}"
                             f"{', fields ' + str(changed) if changed else ''} differ); use another --workdir or the "
                             f"flags of that run{hint}")
        _note_changed_training_flags(workdir, old.get("training", {}))
    run["training"] = {name: FLAGS[name].value for name in _NOTED_FLAGS if name in FLAGS}
    if jax.process_index() != 0:
        return
    os.makedirs(workdir, exist_ok=True)
    run["tokenizer"] = text_data.tokenizer_spec(tokenizer, workdir)
    with open(path + ".tmp", "w") as f:
        json.dump(run, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)


# The optimisation flags a resumed run may change (it continues, under the new values) but should say it did.
_NOTED_FLAGS = ("learning_rate", "lr_schedule", "warmup_steps", "weight_decay", "max_grad_norm", "seed")


def _note_changed_training_flags(workdir, before):
    for name in _NOTED_FLAGS:
        if name in FLAGS and name in before and before[name] != FLAGS[name].value:
            logging.warning("--%s=%s where the run in %s had %s: the resumed run continues under the new value",
                            name, FLAGS[name].value, workdir, before[name])


def load_run(workdir, tasks=None, **options):
    """(task, model, tokenizer) of a workdir written by a training script (see save_run). tasks: the tasks the
    caller accepts (None: any). options: ModelOptions fields (scan_layers, attention_implementation, ...)."""
    run = _read_run(workdir, tasks)
    return run["task"], _model_of(run, options), text_data.tokenizer_from_spec(run["tokenizer"], workdir)


def _model_of(entry, options):
    family = entry["family"]
    return models.FAMILIES[family].Model(models.FAMILIES[family].Config(**{**_tuples(entry["config"]), **options}))


def _read_run(workdir, tasks):
    path = os.path.join(workdir, RUN_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{workdir} has no {RUN_FILE}; expected the workdir of a training script "
                                "(scripts/train_*.py, scripts/finetune_seq2seq.py) or, where a script takes one, a "
                                "Hugging Face directory")
    with open(path) as f:
        run = json.load(f)
    if tasks is not None and run["task"] not in tasks:
        raise ValueError(f"{workdir} holds a {run['task']} run; expected one of {list(tasks)}")
    return run


def define_checkpoint_flag():
    """--checkpoint: which checkpoint of a workdir a reading script (generate.py, export_hf.py) takes."""
    flags.DEFINE_enum("checkpoint", "latest", ["latest", "best"], "The workdir's checkpoint to read: the latest, "
                      "or the best eval's (kept by a training script's --save_best).")


def restore_run(workdir, mesh, tasks=None, checkpoint="latest", **options):
    """(task, model, params, tokenizer) of the latest checkpoint of a training script's workdir (checkpoint='best':
    the one --save_best kept), the parameters sharded over `mesh` (the layout engine.auto_shard picks for this mesh,
    whatever mesh trained them). tasks: as in load_run. The model of a 'reward' run is its
    `models.RewardModel`; of a 'ppo' run, the policy."""
    task, model, tokenizer = load_run(workdir, tasks, **options)
    if task == "reward":
        model = models.RewardModel(model)
    abstract = jax.eval_shape(lambda: models.init_params(model))
    loss = {"lm": lm.lm_loss_fn, "seq2seq": seq2seq.seq2seq_loss_fn, "sft": lm.lm_loss_fn,
            "dpo": preference.dpo_loss_fn, "reward": reward.reward_loss_fn, "ppo": ppo.ppo_loss_fn}[task]
    if task == "ppo":  # the checkpoint holds {'actor', 'critic'}, or {'actor'} after GRPO (no critic)
        entry = _read_run(workdir, tasks).get("critic")
        critic = None if entry is None else models.RewardModel(_model_of(entry, options))
        abstract = {"actor": abstract}
        if critic is not None:
            abstract["critic"] = jax.eval_shape(lambda: models.init_params(critic))
        loss = loss(model, critic)
    else:
        loss = loss(model)
    # The loss lays the parameters out as the run's Trainer did, whatever optimizer (or DiLoCo) trained them.
    params, step = engine.restore_params(workdir, mesh=mesh, params=abstract, loss_fn=loss, checkpoint=checkpoint)
    logging.info("restored step %d of %s (%s checkpoint)", step, workdir, checkpoint)
    return task, model, params["actor"] if task == "ppo" else params, tokenizer


# The exit status of a run that failed at run time (diverged, disk full): not a usage error.
RUNTIME_EXIT_CODE = 1
# The project's code: INFO lines from anywhere else (Orbax, JAX) go to the workdir's log file only.
_PROJECT_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), d)
                      + os.sep for d in ("engine", "kernels", "models", "scripts"))


def _exit(code):
    # os._exit: background threads (prefetch, async checkpoints, the distributed client) must not keep a failed or
    # stopped run alive or print at shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    _StdoutFilter.close()
    os._exit(code)


class _StdoutFilter:
    """Gloo (XLA's CPU collectives) prints a `[Gloo] Rank ... is connected to ...` line on the C++ stdout for every
    communicator it opens, a dozen per process; no setting turns them off. In a multi-process run the process's
    stdout goes through a pipe whose reader drops those lines into the log file and passes every other byte on.
    `close` (at exit) drains the pipe before the process ends, so no output is lost."""
    _original, _thread = None, None

    @classmethod
    def install(cls):
        if cls._thread is not None:
            return
        sys.stdout.flush()
        cls._original = os.dup(1)
        read, write = os.pipe()
        os.dup2(write, 1)
        os.close(write)
        cls._thread = threading.Thread(target=cls._pump, args=(read, cls._original), daemon=True,
                                       name="stdout-filter")
        cls._thread.start()
        atexit.register(cls.close)

    @staticmethod
    def _pump(read, original):
        with os.fdopen(read, "rb") as lines:
            for line in lines:
                if line.startswith(b"[Gloo] "):
                    logging.info("%s", line.decode(errors="replace").rstrip(), extra={"console": False})
                else:
                    os.write(original, line)

    @classmethod
    def close(cls):
        if cls._thread is None:
            return
        sys.stdout.flush()
        os.dup2(cls._original, 1)  # the pipe's last writer goes: its reader sees the end once drained
        cls._thread.join(timeout=10)
        cls._thread = None


def _fail(error, code=USAGE_EXIT_CODE):
    message = " ".join(str(error).split()) or type(error).__name__
    logging.debug("error", exc_info=error)  # the traceback, with --verbosity=1
    print(f"error: {message}", file=sys.stderr, flush=True)
    _exit(code)


def _disk_full(error):
    """A full disk, as Python (ENOSPC, EDQUOT) or Orbax's writers (a ValueError quoting the OS error) report it."""
    return ((isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT))
            or "No space left on device" in str(error))


class _ConsoleFormatter(logging.PythonFormatter):
    """absl's format, without the tracebacks that libraries (Orbax's writer threads) attach to their error records:
    on the console those are one line each; the log file keeps the traceback."""

    def format(self, record):
        if record.exc_info is None or record.pathname.startswith(_PROJECT_DIRS) or FLAGS.verbosity >= 1:
            return super().format(record)
        exc_info, exc_text = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return super().format(record)
        finally:
            record.exc_info, record.exc_text = exc_info, exc_text


class _ConsoleFilter:
    """What reaches the console at the default verbosity: every warning and error, and the INFO lines of the
    project's own code (progress, evals, compile summary, where things were written) except those logged with
    `extra={"console": False}` (detail such as the parameter table). Libraries' INFO lines and the detail go to the
    workdir's log file; `--verbosity=1` shows everything."""

    @staticmethod
    def filter(record):
        if record.levelno >= std_logging.WARNING or FLAGS.verbosity >= 1:
            return True
        return record.pathname.startswith(_PROJECT_DIRS) and getattr(record, "console", True)


def _console_logging():
    """The console filter above and, for a training script, the whole log (every library, INFO and up) in
    `--workdir`'s `log.txt` (`log.process<i>.txt` for the further processes of a multi-process run)."""
    logging.get_absl_handler().addFilter(_ConsoleFilter)
    logging.get_absl_handler().setFormatter(_ConsoleFormatter())
    sys.unraisablehook = _unraisable
    if "save_every" not in FLAGS or not FLAGS.workdir:
        return
    process = FLAGS.process_id or int(os.environ.get("ENGINE_PROCESS_ID", os.environ.get("SLURM_PROCID", "0")))
    os.makedirs(FLAGS.workdir, exist_ok=True)
    name = "log.txt" if process == 0 else f"log.process{process}.txt"
    file_handler = _LogFile(os.path.join(FLAGS.workdir, name))
    file_handler.setFormatter(logging.PythonFormatter())
    std_logging.getLogger().addHandler(file_handler)


def _unraisable(unraisable):
    """Exceptions no caller can catch (raised in a callback, a finaliser) from libraries' code, such as the
    `RuntimeError: Event loop is closed` of tensorstore's callbacks that complete after a failed Orbax save closed its
    loop: a traceback each on the console at a race's whim. They go to the log file; the project's own still go to
    the console through Python's default hook."""
    frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
    if any(frame.filename.startswith(_PROJECT_DIRS) for frame in frames):
        sys.__unraisablehook__(unraisable)
        return
    logging.info("%s: %s", unraisable.err_msg or "Exception ignored", unraisable.object, extra={"console": False},
                 exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))


class _LogFile(std_logging.FileHandler):
    """The workdir's log file. A write that fails (a full disk) stops it with one note on the console instead of
    logging's traceback for every later line."""
    failed = False

    def emit(self, record):
        if not self.failed:
            super().emit(record)

    def handleError(self, record):
        if not self.failed:
            self.failed = True
            error = sys.exc_info()[1]
            print(f"warning: stopped writing the log file {self.baseFilename}: {error}", file=sys.stderr, flush=True)


def _help(argv):
    """--help / -h: the script's own flags and the shared ones it uses (mesh, steps, workdir, ...); exit 0."""
    for flag in FLAGS.get_flags_for_module(__name__):
        FLAGS.register_key_flag_for_module(argv[0], flag)
    print(FLAGS.module_help(argv[0]))
    print("\n--helpfull lists every flag, the libraries' included.")
    _exit(0)


def run(main):
    """`absl.app.run(main)` for scripts: a bad flag value, a missing or malformed file or any other bad input
    (ValueError, FileNotFoundError, app.UsageError, flags.Error) ends with one line `error: <message>` on stderr
    and exit code 2, never a traceback; a diverged run (FloatingPointError), a multi-process start that failed
    (DistributedError) or a full disk with one line and exit code 1; a second signal with one line and 128 + its
    number. `--help` lists the script's flags (exit 0). The console shows the project's own lines; everything is in
    the workdir's log file."""
    def parse(argv):
        if any(a in ("--help", "-h", "-?", "--helpshort") for a in argv[1:]):
            _help(argv)
        try:
            return FLAGS(argv)
        except flags.Error as e:
            _fail(e)

    def guarded(argv):
        if len(argv) > 1:
            _fail(app.UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag (see --help)"))
        _console_logging()
        compiler.configure()  # the overlap flags, before anything in `main` starts JAX's backend
        try:
            return main(argv)
        except Exception as e:  # noqa: BLE001 - sorted below; anything else re-raised with its traceback
            if _disk_full(e):
                where = re.search(r'"(/[^"]+)"', str(e))
                _fail(f"disk full: {'writing ' + where.group(1) + ': ' if where else ''}no space left on the device; "
                      "the checkpoints finished earlier are kept", RUNTIME_EXIT_CODE)
            if isinstance(e, _USER_ERRORS):
                _fail(e)
            if isinstance(e, (FloatingPointError, distributed.DistributedError)):
                _fail(e, RUNTIME_EXIT_CODE)
            raise
        except fit_loop.SecondSignal as e:
            print(f"stopped: {e}; the last finished checkpoint stays", file=sys.stderr, flush=True)
            _exit(128 + e.signum)

    app.run(guarded, flags_parser=parse)
