"""A training workdir's run.json (task, model family and config, tokenizer) and what reads it: `save_run`,
`load_run`, `restore_run` (the parameters of its latest or best checkpoint on any mesh)."""
import dataclasses
import hashlib
import json
import os

import jax
import numpy as np
from absl import flags, logging

import engine
import models
from engine import checkpoint_tiers
from engine.tasks import lm, seq2seq, text_data
from engine.tasks.rlhf import ppo, preference, reward

FLAGS = flags.FLAGS


# Runtime options are not recorded in run.json; the LoRA, quantisation, FP8 history and layer-stacking fields are
# (they change the parameters and their checkpoint layout: an interleaved pipeline's virtual stages store the stack
# [V, L / V, ...], `models.layers.stack.stored_rounds`).
_RECORDED_DEFAULTS = {f.name: f.default for f in dataclasses.fields(models.ModelOptions)
                      if f.name in ("lora_rank", "lora_alpha", "lora_targets", "quantize", "fp8_history", "scan_layers",
                                    "pipeline_virtual_stages")}
RUNTIME_FIELDS = {f.name for f in dataclasses.fields(models.ModelOptions)} - set(_RECORDED_DEFAULTS) | {"hf_config"}
RUN_FILE = "run.json"


def config_tuples(x):
    """JSON lists back to the tuples config fields hold (configs are hashed: the model is a jit cache key)."""
    if isinstance(x, dict):
        return {k: config_tuples(v) for k, v in x.items()}
    return tuple(config_tuples(v) for v in x) if isinstance(x, list) else x


def family_of(model):
    return next(name for name, fam in models.FAMILIES.items() if isinstance(model, fam.Model))


def _model_fields(model):
    """The config fields that fix the parameters (not the runtime options)."""
    return {k: v for k, v in dataclasses.asdict(model.config).items() if k not in RUNTIME_FIELDS}


def save_run(workdir, task, model, tokenizer, critic=None, global_batch=None, eval_rows=None, data=None, kept=None):
    """Writes workdir/run.json (task, family, config fields, tokenizer; an HF tokenizer.json is copied beside it) so
    that scripts/generate.py can rebuild the model of a workdir. critic: a PPO run's `models.RewardModel`
    (its backbone's family and config are recorded too). If the workdir already holds a run of a different model,
    ValueError: its checkpoints would not fit. global_batch: the examples per update (`engine.global_batch_size`),
    recorded so that a restart on another device count keeps it (`keep_global_batch`); eval_rows: the rows held out
    for eval, which a restart holds out again (`recorded`), whatever its device count; data: the `data_digest` of
    what the run trains on, which a restart checks (`check_data`); kept: {flag: value} a resume must keep
    (`check_kept`)."""
    run = {"task": task, "family": family_of(model), "config": _model_fields(model)}
    if critic is not None:
        run["critic"] = {"family": family_of(critic.backbone), "config": _model_fields(critic.backbone)}
    path = os.path.join(workdir, RUN_FILE)
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        # run.json files written before the LoRA / scan fields existed hold none of them: theirs are the defaults.
        full = lambda config: config and config_tuples({**_RECORDED_DEFAULTS, **config})  # noqa: E731
        old_config, new_config = full(old.get("config")), full(run["config"])
        old_critic = old.get("critic") and {**old["critic"], "config": full(old["critic"]["config"])}
        new_critic = run.get("critic") and {**run["critic"], "config": full(run["critic"]["config"])}
        if (old.get("task"), old.get("family"), old_config, config_tuples(old_critic)) != (
                task, run["family"], new_config, config_tuples(new_critic)):
            changed = sorted(k for k in set(old_config or {}) | set(new_config)
                             if (old_config or {}).get(k) != new_config.get(k))
            hint = ""
            if "scan_layers" in changed:
                was = bool((old_config or {}).get("scan_layers"))
                hint = (f": its layers were {'' if was else 'not '}scanned (stacked), so --model_overrides with "
                        f'"scan_layers": {str(was).lower()} (GPU and TPU runs default to true, CPU runs to false), '
                        f"and --pipeline_stages {'> 1 if it ran as a pipeline' if was else '=1'}")
            if "pipeline_virtual_stages" in changed:
                was = (old_config or {}).get("pipeline_virtual_stages") or 1
                hint += (f"{'; ' if hint else ': '}its layers are stored for --pipeline_virtual_stages={was} (its "
                         "export_hf.py directory, or the workdir as --init_from of the scripts that take one, "
                         "starts a run under another value)")
            if "fp8_history" in changed:
                was = (old_config or {}).get("fp8_history") or 0
                hint += (f"{'; ' if hint else ': '}it ran with " + (f"--fp8 --fp8_history={was}" if was else
                                                                     "--fp8_history=0 (no FP8 amax histories)"))
            values = ", ".join(f"{k} {(old_config or {}).get(k)} there, {new_config.get(k)} here" for k in changed)
            raise ValueError(f"--workdir={workdir} holds a {old.get('task')} run of another model ({old.get('family')}"
                             f"{', fields ' + str(changed) if changed else ''} differ{': ' + values if values else ''}"
                             f"); use another --workdir or the flags of that run{hint}")
    binding = _training_record(workdir)  # the record the newest checkpoint was saved under
    if os.path.exists(path):
        _note_changed_training_flags(workdir, binding)
    run["training"] = _noted_values()
    for name, value in (("global_batch", global_batch), ("eval_rows", eval_rows), ("data", data)):
        if value is not None:
            run["training"][name] = value
    run["training"].update(kept or {})
    if FLAGS.is_parsed() and "max_steps" in FLAGS and "lr_extension" in FLAGS:  # a script's, not a library call's
        # The run's horizon: a re-run with a smaller --max_steps than the steps trained trains nothing and moves
        # no later --lr_extension=rewarm's start back.
        run["training"].update(max_steps=max(FLAGS.max_steps, trained_step(workdir)),
                               lr_cycles=lr_cycles(workdir, note=True))
    # This start's record binds once it saves a checkpoint past `since`; until then the one bound before does (a
    # start stopped before its first save, an extension's included, leaves the run as it was).
    run["training"]["since"], run["bound"] = trained_step(workdir), binding
    if jax.process_index() != 0:
        return
    os.makedirs(workdir, exist_ok=True)
    run["tokenizer"] = text_data.tokenizer_spec(tokenizer, workdir)
    with open(path + ".tmp", "w") as f:
        json.dump(run, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)


# The flags a resumed run may change (it continues, under the new values) but should say it did: the optimisation's
# and the numerics' (compute_dtype as it resolves on the platform).
_NOTED_FLAGS = ("learning_rate", "lr_schedule", "warmup_steps", "min_learning_rate_ratio", "weight_decay", "adam_b1",
                "adam_b2", "adam_eps", "max_grad_norm", "seed", "compute_dtype", "fp8", "dropout_rate",
                "attention_dropout_rate", "beta", "dpo_loss", "label_smoothing", "kl_coef", "clip_ratio", "value_coef",
                "critic_learning_rate", "temperature", "max_new_tokens", "unfinished_reward", "scale_rewards",
                "rollout_engine", "kv_cache_dtype", "verifiable_reward", "lora_dropout", "diloco_inner_steps",
                "diloco_outer_learning_rate", "diloco_outer_dtype")


def compute_dtype_name():
    """--compute_dtype's name as a run uses it: unset, bfloat16 on GPU and TPU and float32 on CPU."""
    return FLAGS.compute_dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")


_ROLLOUT_FLAGS = ("temperature", "max_new_tokens")  # PPO's rollouts; elsewhere they shape only sample answers


def _noted_values():
    values = {name: FLAGS[name].value for name in _NOTED_FLAGS
              if name in FLAGS and (name not in _ROLLOUT_FLAGS or "rollout_batch_size" in FLAGS)}
    if "compute_dtype" in values:
        values["compute_dtype"] = compute_dtype_name()
    return values


def _note_changed_training_flags(workdir, before):
    for name, value in _noted_values().items():
        if name in before and before[name] != value:
            now = f"--{name} unset (its default)" if value is None else f"--{name}={value}"
            then = "it unset (its default)" if before[name] is None else before[name]
            logging.warning("%s where the run in %s had %s: the resumed run continues under the new value", now,
                            workdir, then)


def trained_step(workdir):
    """The newest step a checkpoint in `workdir` holds (its `checkpoints` directory's, or in a one-process run with
    --local_checkpoint_dir the local tier's too), 0 for none: what a Trainer on `workdir` restores at most. A run of
    several processes reads the shared directory only, so that every process gives the same answer (a host's local
    copies may be gone)."""
    directories = [os.path.join(workdir, "checkpoints")]
    local = FLAGS.local_checkpoint_dir if FLAGS.is_parsed() and "local_checkpoint_dir" in FLAGS else None
    if local and jax.process_count() == 1:
        run_dir = checkpoint_tiers.local_run_dir(local, workdir)
        directories += [os.path.join(run_dir, d) for d in (os.listdir(run_dir) if os.path.isdir(run_dir) else ())]
    return max((step for d in directories for step in checkpoint_tiers.steps_in(d)), default=0)


def _training_record(workdir):
    """The `training` entry of `workdir`'s run.json that binds a re-run: the newest start's once it saved a
    checkpoint (one past the step it started from, its `since`), else the one bound when it started (`bound`); {}
    when no checkpoint was saved at all. A start that stopped before its first save (a bad flag refused after the
    model was built, a kill, an extension's first steps) trained nothing, and its global batch, data and schedule
    bind no later run."""
    path = os.path.join(workdir, RUN_FILE) if workdir else None
    step = trained_step(workdir) if path is not None and os.path.exists(path) else 0
    if not step:
        return {}
    with open(path) as f:
        run = json.load(f)
    record = run.get("training", {})
    return record if step > record.get("since", 0) or "bound" not in run else run["bound"]


def recorded(workdir, name, default=None):
    """The value `save_run` recorded as `name` (`'eval_rows'`, `'global_batch'`) for the run `workdir` resumes;
    `default` for a new run or a value not recorded."""
    return _training_record(workdir).get(name, default)


_DATA_SAMPLE = 64  # rows a data digest reads, evenly spaced: its cost does not grow with the corpus


def data_digest(rows, seq_len, *, stream=None, mixture=None):
    """{'digest', 'about'} of the rows a run trains on (a sequence of `{'tokens', 'segment_ids'}` rows; a stream's
    first windows, its eval rows, with `stream` naming it; or records, dicts of strings): their count, length
    (`seq_len`, None where rows have none) and 64 evenly spaced rows' contents.
    Files appended to, added or removed, another --seq_len, tokenizer or text column change it; so, most likely, do
    edits. mixture: a mixture's weights and text columns, which its own resume check compares (naming both)."""
    digest = hashlib.sha256(f"{len(rows)} {seq_len} {stream is not None}".encode())
    for i in sorted(set(np.linspace(0, len(rows) - 1, min(len(rows), _DATA_SAMPLE)).astype(int).tolist())):
        row = rows[i]
        for key in sorted(row):
            digest.update(key.encode() + np.ascontiguousarray(row[key]).tobytes())
    about = f"{stream}'s first {len(rows)} windows" if stream is not None else f"{len(rows)} rows"
    about += f" of {seq_len + 1} tokens" if seq_len is not None else ""
    data = {"digest": digest.hexdigest()[:16], "about": about}
    return data if mixture is None else {**data, "mixture": list(mixture)}


def check_data(workdir, data, shown, *, seq_len, change="refuse"):
    """A run resumed on `workdir` trains on the data its checkpoints were trained on (`data`: `data_digest`'s, of
    --data `shown` at --seq_len `seq_len`): the eval rows it holds out and each epoch's order are drawn from it, so
    other data would change the eval set (rows trained on among it) and the order mid-epoch. Other data is a
    ValueError in one line, or with change='continue' (--data_change) a warning line, the run going on from its step
    on the new data. A mixture of other weights or text columns is left to the mixture's own check, which names both
    mixtures."""
    before = _training_record(workdir).get("data")
    if before is None or before["digest"] == data["digest"] or before.get("mixture") != data.get("mixture"):
        return
    what = (f"then {before['about']}, now {data['about']}" if before["about"] != data["about"] else
            f"{data['about']} both, with other contents")
    if change == "continue":
        logging.warning("--data=%s is not the data the run in %s trained on (%s); --data_change=continue: it trains on "
                        "from step %d on this data, its eval rows and the epoch's order drawn from it (some eval rows "
                        "may have been trained on)", shown, workdir, what, trained_step(workdir))
        return
    length, same = (f" (--seq_len={seq_len})", " and --seq_len") if seq_len is not None else ("", "")
    raise ValueError(f"--data={shown}{length} is not the data the run in {workdir} trained on ({what}): its eval "
                     f"rows and the epoch's order would change; expected the same files{same} to resume it, "
                     f"--data_change=continue to train on from step {trained_step(workdir)} on this data (eval rows "
                     "drawn again), or another --workdir")


def check_kept(workdir, values, why):
    """A resumed run's `values` ({flag: value}) that `save_run` recorded as `kept`: another value is a ValueError in
    one line naming the flag, both values and `why` it must stay."""
    record = _training_record(workdir)
    for name, value in values.items():
        if name in record and record[name] != value:
            raise ValueError(f"--{name}={value} (as this run resolves it) where the run in {workdir} had "
                             f"{record[name]}: {why}; expected --{name}={record[name]} to resume it, or another "
                             "--workdir")


def keep_global_batch(workdir, rows_per_step):
    """An elastic restart: a workdir whose run.json records a global batch, restarted where one step of
    --per_device_batch_size rows per data position takes `rows_per_step` examples (another device count or mesh),
    keeps that global batch by setting --accumulate_grad_batches (logged in one line), unless the flag is given on
    the command line; ValueError in one line when no whole number of micro-batches makes it."""
    if FLAGS["accumulate_grad_batches"].present:
        return
    recorded = _training_record(workdir).get("global_batch")
    if recorded is None or recorded == rows_per_step * FLAGS.accumulate_grad_batches:
        return
    if recorded % rows_per_step:
        raise ValueError(f"--workdir={workdir} was trained with a global batch of {recorded} examples, which "
                         f"{rows_per_step} rows a step (--per_device_batch_size={FLAGS.per_device_batch_size} on "
                         f"this mesh) do not divide; expected a --per_device_batch_size or --mesh whose rows a step "
                         f"divide {recorded}, or --accumulate_grad_batches to train on with another global batch")
    FLAGS.accumulate_grad_batches = recorded // rows_per_step
    logging.warning("--workdir=%s was trained with a global batch of %d examples: --accumulate_grad_batches=%d keeps "
                    "it on this mesh (%d rows a step); pass --accumulate_grad_batches to choose another",
                    workdir, recorded, FLAGS.accumulate_grad_batches, rows_per_step)


def lr_cycles(workdir, note=False):
    """The learning-rate schedule's cycles `[[start, end], ...]` (each a warm-up and a decay ending at `end`; the
    last cycle's final rate after it) of a run on `workdir` with these flags: `[[0, --max_steps]]` for a new run;
    the recorded cycles when run.json has them; a --max_steps past the recorded run's keeps them
    (--lr_extension=keep: the old schedule goes on at its last rate) or adds a cycle from the old --max_steps to the
    new one (rewarm). The same answer before and after `save_run` records it. note: log what an extension does."""
    record = _training_record(workdir)
    if "lr_cycles" not in record:
        return [[0, FLAGS.max_steps]]
    cycles, before = [list(c) for c in record["lr_cycles"]], record.get("max_steps", record["lr_cycles"][-1][1])
    if FLAGS.max_steps <= before or FLAGS.max_steps <= cycles[-1][1]:
        return cycles
    last = cycles[-1][1]  # where the old schedule's last rate starts
    if FLAGS.lr_extension == "rewarm":
        cycles.append([before, FLAGS.max_steps])
    if note:
        how = ("a new warm-up (--warmup_steps) and decay from step {0} to step {1} (--lr_extension=rewarm; keep: "
               "the old schedule's last rate from step {2})" if FLAGS.lr_extension == "rewarm" else
               "the schedule the run started with, whose last rate holds from step {2} to step {1} "
               "(--lr_extension=keep; rewarm: a new warm-up and decay from step {0})")
        logging.warning("--max_steps=%d extends the run in %s, which had --max_steps=%d: the learning rate follows %s",
                        FLAGS.max_steps, workdir, before, how.format(before, FLAGS.max_steps, last))
    return cycles


def load_run(workdir, tasks=None, **options):
    """(task, model, tokenizer) of a workdir written by a training script (see save_run). tasks: the tasks the
    caller accepts (None: any). options: ModelOptions fields (scan_layers, attention_implementation, ...)."""
    run = _read_run(workdir, tasks)
    return run["task"], _model_of(run, options), text_data.tokenizer_from_spec(run["tokenizer"], workdir)


def _model_of(entry, options):
    family = entry["family"]
    return models.FAMILIES[family].Model(
        models.FAMILIES[family].Config(**{**config_tuples(entry["config"]), **options}))


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
