"""The absl flags the scripts share (data, mesh, scale, precision, multi-host, training loop, model start, LoRA,
records, checkpoint) and what they build: parsers (`parse_mesh`, `parse_json`, ...), `compute_dtype`,
`loss_implementation`, `trainer_kwargs`, `fit_kwargs`, `optimizer` / `lr_schedule`, the training and eval records.
Every flag a script shares is defined here (`cli.run`'s --help lists this module's)."""
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import optax
from absl import flags, logging

import engine
import kernels
import models
from engine import diloco as diloco_lib
from engine.tasks import lm, run_record, text_data
from engine.tasks.files import RECORD_SUFFIXES, expand_files

FLAGS = flags.FLAGS


# The scripts whose `cli.start(auto=True)` takes --mesh=auto.
AUTO_MESH_SCRIPTS = "train_lm.py, train_sft.py, train_dpo.py, train_reward.py and finetune_seq2seq.py"
_DTYPES = {"float32": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def define_data_flags():
    """--tokenizer, --decode_errors and --text_column (idempotent)."""
    if "tokenizer" in FLAGS:
        return
    flags.DEFINE_string("tokenizer", None, "The tokenizer: a tokenizer.json or SentencePiece tokenizer.model file, a "
                        "directory holding one, 'byte' (byte-level ids) or 'word' (the toy task's words). Unset: a "
                        "Hugging Face --init_from directory's own file (none there is an error, never a silent "
                        "byte-level fallback); a fresh model's byte-level ids with --data, else the toy words.")
    flags.DEFINE_enum("decode_errors", "strict", list(text_data.DECODE_ERRORS), "Text and JSONL files must be UTF-8: "
                      "'strict' stops at the first invalid byte, naming the file and its offset; 'replace' replaces "
                      "invalid bytes with U+FFFD.")
    flags.DEFINE_string("text_column", "text", "The column of Parquet, Arrow and datasets.save_to_disk data (and the "
                        "field of JSONL objects) that holds the documents.")


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
                         "axis; the devices are stages x the --mesh product). Decoder-only models; GPipe's "
                         "schedule, or the interleaved one with --pipeline_virtual_stages.")
    flags.DEFINE_integer("context_parallel", 1, "Context (sequence) parallelism: devices each row's tokens are split "
                         "over (the mesh's `context` axis; the devices are context x stages x the --mesh product). "
                         "Attention exchanges sequence for heads (all-to-all) where heads / model divide by it, "
                         "else passes key / value blocks round a ring.")
    flags.DEFINE_bool("sequence_parallel", False, "Megatron-LM's sequence parallelism with --mesh's model > 1: the "
                      "residual stream between the tensor-parallel attention and MLP blocks holds 1/model of the "
                      "tokens per device (each block all-gathers them; its output is reduce-scattered).")
    flags.DEFINE_integer("pipeline_microbatches", 0, "Micro-batches each pipeline step cuts its rows into (0: one "
                         "per stage); the idle share of a stage is (stages - 1) / (V x micro-batches + stages - 1) "
                         "for V --pipeline_virtual_stages.")
    flags.DEFINE_integer("pipeline_virtual_stages", 1, "With --pipeline_stages > 1: times each micro-batch passes "
                         "every stage (1: GPipe; V > 1: the interleaved schedule, each stage holding V chunks of "
                         "layers, its stack stored [V, layers / V] and recorded in run.json; needs "
                         "--pipeline_microbatches >= stages).", lower_bound=1)
    flags.DEFINE_enum("pipeline_schedule", "gpipe", list(models.pipeline.SCHEDULES), "With --pipeline_stages > 1: "
                      "'gpipe' (all forwards, then all backwards: every micro-batch's activations alive at once) or "
                      "'1f1b' (each micro-batch's backward as soon as it leaves the last stage: at most 2 x stages "
                      "- 1 alive; the LM loss, --pipeline_virtual_stages=1).")
    flags.DEFINE_enum("pipeline_fsdp_gather", "tick", list(models.pipeline.FSDP_GATHERS), "With --pipeline_stages "
                      "> 1 and fsdp > 1 in --mesh: 'tick' (each tick gathers its layers' weight shards and reduces "
                      "their gradients; a device holds 1/fsdp of its stage) or 'step' (once a step: every device "
                      "holds its stage's whole weights and gradients, and sends far fewer bytes).")
    flags.DEFINE_integer("zero_stage", 0, "0, 1 (split optimizer state over data) or 2 (gradients too).")
    flags.DEFINE_integer("per_device_batch_size", 4, "Examples per device (along data x fsdp) per micro-batch.")
    flags.DEFINE_integer("accumulate_grad_batches", 1, "Micro-batches per optimizer update.")
    flags.DEFINE_enum("compute_dtype", None, list(_DTYPES), "Forward/backward dtype: every matmul of the model runs "
                      "in it; master weights and optimizer state stay fp32. Unset: bfloat16 on GPU and TPU "
                      "(MaxText's default), float32 on CPU.")
    flags.DEFINE_bool("fp8", False, "The attention and MLP projections' matmuls in FP8 (models.ModelOptions.fp8): "
                      "e4m3 operands, e5m2 output gradients, per-tensor scales from each tensor's amax in the step; "
                      "the rest in --compute_dtype, master weights and optimizer as they are. FP8 tensor cores on "
                      "Hopper GPUs; emulated (FP8 rounding, float32 products) on CPU.")
    flags.DEFINE_integer("fp8_history", 0, "With --fp8: 0 (scales from each tensor's own amax, current scaling) or "
                         "the length of each projection's amax history (delayed scaling: scales from the largest of "
                         "the last N amaxes, models.ModelOptions.fp8_history; the histories are parameters the step "
                         "updates, saved with the checkpoints and recorded in run.json). 16 is a common length.")
    flags.DEFINE_enum("grad_dtype", "float32", ["float32", "bfloat16"], "Dtype the gradients are held in until the "
                      "optimizer update (engine.Precision.grad_dtype): bfloat16 halves their memory.")
    flags.DEFINE_enum("reduce_dtype", "float32", ["float32", "bfloat16"], "Dtype the shard_map step's gradient "
                      "reductions carry and sum in (engine.Precision.reduce_dtype; GPU and TPU only).")
    flags.DEFINE_bool("remat", False, "Rematerialise the forward pass in the backward pass (less memory).")
    flags.DEFINE_enum("train_step", "auto", list(engine.config.STEPS), "The Trainer's step (engine.Parallelism.step): "
                      "auto (shard_map on GPU and TPU, jit on CPU and on context meshes), shard_map (explicit ZeRO "
                      "collectives, each device on its own rows and, with --context_parallel, its own tokens) or "
                      "jit (the partitioner's collectives).")
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 for multi-process runs (else "
                        "ENGINE_COORDINATOR_ADDRESS or SLURM).")
    flags.DEFINE_integer("num_processes", None, "Number of processes of a multi-process run.")
    flags.DEFINE_integer("process_id", None, "This process's index in a multi-process run.")
    flags.DEFINE_float("coordinator_timeout", 300, "Seconds a multi-process start waits for the coordinator to "
                       "answer and for every process to join before it fails, naming which did not.")
    flags.DEFINE_float("peer_timeout", 100, "Seconds without a heartbeat after which a running multi-process job "
                       "counts a process as lost (killed, its host gone) and ends every process.")
    flags.DEFINE_integer("seed", 0, "Fixes initialisation, shuffling and dropout.")
    flags.DEFINE_string("compilation_cache_dir", None, "Where compiled programs are kept (JAX's persistent "
                        "compilation cache), so that a restarted or re-run script loads them instead of compiling "
                        "again (on a GPU, its autotuning too): a directory or a gs:// URL; '' compiles afresh. "
                        "Unset: $JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/redline/jax (~/.cache/redline/jax).")


def define_training_flags(*, workdir, max_steps, learning_rate, warmup_steps, log_every, save_every, evals=True):
    """The training-loop flags of the training scripts (each script chooses its defaults); evals: the script
    evaluates on held-out data during `fit` (--eval_every, --save_best)."""
    define_flags()
    flags.DEFINE_string("workdir", workdir, "Checkpoints, TensorBoard scalars and the model description "
                        "(run.json) go here; re-running the same command resumes.")
    flags.DEFINE_integer("max_steps", max_steps, "Optimizer updates in total (resumes included).")
    flags.DEFINE_float("hang_timeout", None, "Seconds without a finished step (compiles excluded) after which the "
                       "process logs every thread's stack, names what it waited for and exits with status 75, so "
                       "that the job is restarted; unset: 10x the slowest step so far, at least 600; 0: off.")
    flags.DEFINE_integer("n_epochs", 1000, "Passes over the data (a re-run of the same command continues the "
                         "interrupted run to the same end).")
    flags.DEFINE_float("learning_rate", learning_rate, "Peak learning rate (after a linear warm-up; --lr_schedule).")
    flags.DEFINE_integer("warmup_steps", warmup_steps, "Warm-up updates.")
    flags.DEFINE_enum("lr_schedule", "cosine", list(_SCHEDULES), "After the warm-up: cosine or linear decay to "
                      "--min_learning_rate_ratio of the peak at --max_steps, or constant.")
    flags.DEFINE_float("min_learning_rate_ratio", 0.1, "The decayed schedules' last learning rate / the peak.")
    flags.DEFINE_enum("lr_extension", "keep", ["keep", "rewarm"], "A re-run with a --max_steps past the workdir's "
                      "run: keep its schedule (its last rate from its end on), or rewarm (a new warm-up and decay "
                      "from the old --max_steps to the new one). Either way one line says what happens.")
    flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay.")
    flags.DEFINE_float("adam_b1", 0.9, "AdamW's first-moment decay.")
    flags.DEFINE_float("adam_b2", 0.999, "AdamW's second-moment decay (0.95 is common for large models).")
    flags.DEFINE_float("adam_eps", 1e-8, "AdamW's epsilon.")
    flags.DEFINE_float("max_grad_norm", 1.0, "Clip the global gradient norm to this before the update (0: no "
                       "clipping).")
    flags.DEFINE_integer("log_every", log_every, "Updates between log lines (the only host syncs of the loop).")
    flags.DEFINE_integer("save_every", save_every, "Updates between checkpoints (one is always written at the end).")
    flags.DEFINE_string("local_checkpoint_dir", None, "Fast storage on each host (a local disk, /dev/shm) for a second "
                        "tier of checkpoints: every --local_save_every updates each process writes its own shards "
                        "there, and a re-run restores the newest copy of either tier. Unset: --workdir's only.")
    flags.DEFINE_integer("local_save_every", 10, "Updates between local checkpoints (with --local_checkpoint_dir).")
    flags.DEFINE_integer("local_replicas", engine.Checkpointing.local_replicas, "With --local_checkpoint_dir and "
                         "several processes: 1: each local save also sends the process's shards to a peer, which "
                         "keeps them, so a re-run where one host lost its local copy still restores the local step; "
                         "0: none.", lower_bound=0, upper_bound=1)
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


def define_record_flags(*, what, fields, toy_size):
    """--data, --eval_data, --record_columns, --eval_size and --toy_size of a script that trains on records with
    string `fields` (read by `load_train_eval`); `what` names the records in the help."""
    shown = ", ".join(f'"{f}": ...' for f in fields)
    flags.DEFINE_list("data", [], f".jsonl files (or .jsonl.gz, .jsonl.zst, ...) of {{{shown}}} lines (or a .json "
                      "file of them or of one array of them), or .parquet / .arrow files or save_to_disk directories "
                      "with those columns; paths, globs or directories; empty: the embedded toy task.")
    flags.DEFINE_list("eval_data", [], f"Held-out {what}, as --data; empty: the last --eval_size {what} of --data "
                      f"(or fresh toy {what}).")
    flags.DEFINE_list("record_columns", [], f"FIELD:NAME,...: read a field of the {what} from a key or column of "
                      f"another name (e.g. {fields[0]}:question).")
    flags.DEFINE_integer("eval_size", 256, f"Held-out {what} when --eval_data is not given.")
    flags.DEFINE_integer("toy_size", toy_size, f"Training {what} of the embedded toy task.")
    define_data_change_flag()


def define_data_change_flag():
    """--data_change, of a script whose run.json records a digest of its data (`run_record.check_data`)."""
    flags.DEFINE_enum("data_change", "refuse", ["refuse", "continue"], "A re-run on a --workdir whose checkpoints "
                      "were trained on other data (files appended to, added, removed or edited, another --seq_len): "
                      "refuse it, or continue from its step on this data (a warning line: the eval rows and the "
                      "epoch's order are drawn from the new rows, some eval rows may have been trained on).")


def check_records_run(*, examples, seq_len=None, frozen_from=()):
    """The resume checks of `save_records_run`, which a script may run before it loads its models; returns what it
    records of them: (the data digest, {'<flag>_step': step} of the frozen models' workdirs)."""
    train, evals = examples
    parts = [run_record.data_digest(rows, seq_len) for rows in (train, evals)]
    data = {"digest": hashlib.sha256("".join(p["digest"] for p in parts).encode()).hexdigest()[:16],
            "about": f"{parts[0]['about']} and {len(evals)} held out"}
    shown = (",".join(FLAGS.data) + (f" --eval_data={','.join(FLAGS.eval_data)}" if FLAGS.eval_data else "")
             if FLAGS.data or FLAGS.eval_data else "(none: the toy task of --toy_size and --seed)")
    run_record.check_data(FLAGS.workdir, data, shown, seq_len=seq_len, change=FLAGS.data_change)
    steps = {}
    for name in frozen_from:
        path = FLAGS[name].value
        if path and os.path.exists(os.path.join(path, run_record.RUN_FILE)):
            steps[f"{name}_step"] = now = run_record.trained_step(path)
            then = run_record.recorded(FLAGS.workdir, f"{name}_step")
            if then is not None and then != now:
                frozen = "reference" if name == "init_from" else "reward model"
                raise ValueError(f"--{name}={path} holds step {now}, but the run in {FLAGS.workdir} took its {frozen} "
                                 f"from its step {then}: the {frozen} would differ from here on; expected the run "
                                 "resumed on the models it started from, or another --workdir")
    return data, steps


def save_records_run(task, model, tokenizer, *, global_batch, examples, seq_len=None, frozen_from=(), kept=None,
                     **kwargs):
    """`run_record.save_run` of a script that trains on records, with the run's global batch (a restart on another
    device count keeps it) and a digest of its `examples` (train, eval): encoded rows, or records, which a resume on
    other data or another split refuses unless --data_change=continue (`run_record.check_data`). frozen_from: the
    flags (`'init_from'`: the reference; `'reward_from'`: the reward model) whose workdirs give the run frozen
    models: the step each holds is recorded, and a resume after one trained further is refused
    (`check_records_run`). kwargs: save_run's."""
    data, steps = check_records_run(examples=examples, seq_len=seq_len, frozen_from=frozen_from)
    run_record.save_run(FLAGS.workdir, task, model, tokenizer, global_batch=global_batch, data=data,
                        kept={**steps, **(kept or {})}, **kwargs)


def record_columns():
    """--record_columns as {field: name}; a ValueError naming an entry that is not FIELD:NAME."""
    columns = {}
    for entry in FLAGS.record_columns:
        field, colon, name = entry.partition(":")
        if not (colon and field.strip() and name.strip()) or ":" in name:
            raise ValueError(f"--record_columns={','.join(FLAGS.record_columns)}: {entry!r} is not FIELD:NAME; "
                             "expected e.g. --record_columns=response:completion,prompt:question")
        if field.strip() in columns:
            raise ValueError(f"--record_columns names the field {field.strip()!r} twice; expected one NAME per field")
        columns[field.strip()] = name.strip()
    return columns


def define_auto_mesh_flag():
    """--mesh_memory_gb, of a script whose `start(auto=True)` takes --mesh=auto."""
    flags.DEFINE_float("mesh_memory_gb", None, "--mesh=auto's memory budget per device in GB (1e9 bytes); unset: the "
                       "device's own limit (GPU, TPU; a CPU has none).")


def define_checkpoint_flag():
    """--checkpoint: which checkpoint of a workdir a reading script (generate.py, export_hf.py) takes."""
    flags.DEFINE_enum("checkpoint", "latest", ["latest", "best"], "The workdir's checkpoint to read: the latest, "
                      "or the best eval's (kept by a training script's --save_best).")


DECODER_FAMILIES = ("llama", "gptj", "opt", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "mixtral",
                    "qwen3_moe")


def define_decoder_flags(*, init_from_help,
                         model_overrides='{"hidden_size": 64, "intermediate_size": 128, "num_layers": 2}'):
    """--init_from, --model, --model_config and --model_overrides of a script that starts a decoder-only model from
    a workdir, a Hugging Face directory or scratch (read by `model_start.start_decoder`)."""
    flags.DEFINE_string("init_from", None, init_from_help)
    flags.DEFINE_enum("model", "llama", list(DECODER_FAMILIES), "Model family of a fresh model.")
    flags.DEFINE_string("model_config", "tiny", "Named config of a fresh model, or a path to a JSON file of config "
                        "fields.")
    flags.DEFINE_string("model_overrides", model_overrides, "JSON object of config fields that replace the named "
                        "config's; with --init_from, model options only (scan_layers, remat, "
                        "attention_implementation, ...; a workdir's: runtime options only).")
    define_lora_flags()


def define_lora_flags():
    """--init_adapter, --lora_rank, --lora_alpha and --lora_targets (read by `model_start.start_decoder` /
    `with_lora`)."""
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


def loss_implementation(model=None, *, per_token=False):
    """--loss_implementation as the tasks' loss helpers take it (None: plain logits). 'default' (see the flag)
    resolves here for this device and --compute_dtype; `model` (when given) with a final logit soft-cap keeps plain
    logits, which the fused kernel does not cap; per_token (DPO's and PPO's per-token log-probabilities): a measured
    'chunked' (a summed loss) resolves to plain logits."""
    if FLAGS.loss_implementation != "default":
        return None if FLAGS.loss_implementation == "plain" else FLAGS.loss_implementation
    return lm.default_loss_implementation(model, dtype=compute_dtype() or jnp.float32, platform=jax.default_backend(),
                                          device_kind=jax.devices()[0].device_kind, per_token=per_token)


def compute_dtype():
    """--compute_dtype as `engine.Precision` takes it (None: float32); unset: bfloat16 on GPU and TPU, float32 on
    CPU."""
    return _DTYPES[run_record.compute_dtype_name()]


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


def check_diloco_flags():
    """ValueError when the DiLoCo flags contradict each other (streaming options without --diloco_inner_steps)."""
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
    inner, end = FLAGS.diloco_inner_steps, FLAGS.max_steps if "max_steps" in FLAGS else 0
    if inner and FLAGS.diloco_fragments == 1 and end > 0:
        # An outer step falls due after every `inner` steps; with overlap it is taken in the step after that.
        last = (end - FLAGS.diloco_overlap) // inner * inner
        if last < end:
            why = (f"with --diloco_overlap an outer step is taken in the step after it falls due, so step {end}'s "
                   "is not" if end % inner == 0 else f"--max_steps={end} is not a multiple of --diloco_inner_steps="
                   f"{inner}")
            model = (f"its global model of step {last}, its last outer step" if last else
                     "the initial model (no outer step yet)")
            logging.warning("%s: the model the run ends with (its checkpoint's parameters, the eval after training, "
                            "generate.py and export_hf.py) is %s; the replicas' %d steps since reach it at the next "
                            "outer step, which a resume to a larger --max_steps takes", why, model, end - last)


def trainer_kwargs():
    """The Trainer arguments the shared flags set: its seed, accumulation, `engine.Precision`,
    `engine.Parallelism`, `engine.Checkpointing` (the local tier) and DiLoCo."""
    kwargs = dict(accumulate_grad_batches=FLAGS.accumulate_grad_batches, seed=FLAGS.seed,
                  precision=engine.Precision(compute_dtype=compute_dtype(),
                                            grad_dtype=_DTYPES[FLAGS.grad_dtype],
                                            reduce_dtype=_DTYPES[FLAGS.reduce_dtype]),
                  parallelism=engine.Parallelism(step=FLAGS.train_step, zero_stage=FLAGS.zero_stage, remat=FLAGS.remat,
                                                 offload_optimizer=FLAGS.offload_optimizer,
                                                 zero_quantized_weights=FLAGS.zero_quantized_weights,
                                                 zero_quantized_gradients=FLAGS.zero_quantized_gradients),
                  checkpointing=engine.Checkpointing(local_dir=FLAGS.local_checkpoint_dir,
                                                     local_every=FLAGS.local_save_every,
                                                     local_replicas=FLAGS.local_replicas))
    if FLAGS.diloco_inner_steps:
        kwargs["diloco"] = engine.DiLoCo(
            inner_steps=FLAGS.diloco_inner_steps, fragments=FLAGS.diloco_fragments,
            outer_dtype=FLAGS.diloco_outer_dtype, overlap=FLAGS.diloco_overlap,
            outer_optimizer=optax.sgd(FLAGS.diloco_outer_learning_rate, momentum=0.9, nesterov=True))
    return kwargs


def fit_kwargs():
    """`fit`'s eval_every, save_best, early_stopping_patience and hang_timeout from their flags."""
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
                early_stopping_patience=FLAGS.early_stopping_patience or None, hang_timeout=FLAGS.hang_timeout)


_SCHEDULES = ("cosine", "linear", "constant")


def check_optimizer_flags():
    """ValueError naming an optimizer flag (learning rate, warm-up, AdamW, clipping) out of its range."""
    for name, ok, expected in (
            ("learning_rate", FLAGS.learning_rate > 0, "> 0"), ("warmup_steps", FLAGS.warmup_steps >= 0, ">= 0"),
            ("min_learning_rate_ratio", 0 <= FLAGS.min_learning_rate_ratio <= 1, "in [0, 1]"),
            ("weight_decay", FLAGS.weight_decay >= 0, ">= 0"), ("adam_b1", 0 <= FLAGS.adam_b1 < 1, "in [0, 1)"),
            ("adam_b2", 0 <= FLAGS.adam_b2 < 1, "in [0, 1)"), ("adam_eps", FLAGS.adam_eps > 0, "> 0"),
            ("max_grad_norm", FLAGS.max_grad_norm >= 0, ">= 0 (0: no clipping)")):
        if not ok:
            raise ValueError(f"--{name}={FLAGS[name].value}; expected {expected}")


def lr_schedule(peak, cycles=None):
    """The learning rate by update number from the flags (see `optimizer`), peaking at `peak`. cycles: `[[start,
    end], ...]` (`run_record.lr_cycles`), each a warm-up and a decay ending at `end`; default one to --max_steps."""
    def cycle(steps):
        warmup, total = max(1, FLAGS.warmup_steps), max(steps, FLAGS.warmup_steps + 1)
        end = peak * FLAGS.min_learning_rate_ratio
        if FLAGS.lr_schedule == "cosine":
            return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, total, end_value=end)
        after = (optax.linear_schedule(peak, end, total - warmup) if FLAGS.lr_schedule == "linear"
                 else optax.constant_schedule(peak))
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])

    cycles = [[0, FLAGS.max_steps]] if cycles is None else cycles
    if len(cycles) == 1:
        return cycle(cycles[0][1])
    return optax.join_schedules([cycle(end - start) for start, end in cycles], [start for start, _ in cycles[1:]])


def optimizer(learning_rate=None):
    """AdamW (--adam_b1/b2/eps, --weight_decay) after global-norm clipping (--max_grad_norm), on a linear warm-up
    (--warmup_steps) then --lr_schedule: cosine (default) or linear decay to --min_learning_rate_ratio of the peak at
    --max_steps, or constant. learning_rate: a peak other than --learning_rate. Every training script builds its
    optimizer here."""
    check_optimizer_flags()
    cycles = run_record.lr_cycles(FLAGS.workdir) if "lr_extension" in FLAGS else None
    schedule = lr_schedule(FLAGS.learning_rate if learning_rate is None else learning_rate, cycles)
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, b1=FLAGS.adam_b1, b2=FLAGS.adam_b2,
                                                  eps=FLAGS.adam_eps, weight_decay=FLAGS.weight_decay)
    return optax.chain(optax.clip_by_global_norm(FLAGS.max_grad_norm), adamw) if FLAGS.max_grad_norm else adamw


def load_train_eval(read, toy, *, key, what):
    """(train records, eval records) from --data / --eval_data / --record_columns / --eval_size / --toy_size /
    --seed: `read(patterns, decode_errors=, record_columns=)` reads files; without --data, `toy(n, seed)` makes the
    embedded task, and its eval records are fresh ones (another seed) whose `key` field no training record has.
    `what` names the records in errors."""
    columns = record_columns()
    if columns and not (FLAGS.data or FLAGS.eval_data):
        raise ValueError("--record_columns names the columns of --data / --eval_data files, and neither is given")
    if FLAGS.data:
        train = read(FLAGS.data, decode_errors=FLAGS.decode_errors, record_columns=columns)
        if not train:
            raise ValueError(f"--data={','.join(FLAGS.data)} holds no {what}")
    else:
        train = toy(FLAGS.toy_size, FLAGS.seed)
    if FLAGS.eval_data:
        evals = read(FLAGS.eval_data, decode_errors=FLAGS.decode_errors, record_columns=columns)
        if not evals:
            raise ValueError(f"--eval_data={','.join(FLAGS.eval_data)} holds no {what}")
        check_held_out(train, evals, what, FLAGS.data, FLAGS.eval_data)
    elif FLAGS.data:
        if len(train) <= FLAGS.eval_size:
            raise ValueError(f"--data holds {len(train)} {what}; more than --eval_size={FLAGS.eval_size} are needed "
                             "when there is no --eval_data")
        train, evals = train[:-FLAGS.eval_size], train[-FLAGS.eval_size:]
    else:
        seen = {r[key] for r in train}
        evals = [r for r in toy(4 * FLAGS.eval_size, FLAGS.seed + 1) if r[key] not in seen][:FLAGS.eval_size]
    return train, evals


def check_held_out(train, evals, what, data, eval_data):
    """--eval_data (`eval_data`, read as `evals`) that --data (`data`, read as `train`) trains on: the same files
    refused in one line; records also among the training ones a warning line (their eval loss is not held out)."""
    files = lambda patterns: {os.path.realpath(f) for f in expand_files(patterns, RECORD_SUFFIXES)}  # noqa: E731
    shared = sorted(files(eval_data) & files(data)) if data else []
    if shared:
        raise ValueError(f"--eval_data names {shared[0]}, which --data trains on; expected held-out files, or no "
                         f"--eval_data (the last --eval_size {what} of --data are held out)")
    seen = {json.dumps(r, sort_keys=True) for r in train}
    repeated = sum(json.dumps(r, sort_keys=True) in seen for r in evals)
    if repeated:
        logging.warning("%d of the %d --eval_data %s are also training %s: their eval loss is not held out", repeated,
                        len(evals), what, what)


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
