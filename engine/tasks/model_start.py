"""A script's starting model from its flags: a training workdir, a Hugging Face directory or a fresh config
(`start_decoder`, `create_model`, `load_hf`), the runtime options (`model_options`, `with_flags`) and LoRA /
quantisation (`with_lora`, `trainable`)."""
import dataclasses
import json
import os

import jax
from absl import flags

import engine
import models
from engine.tasks import text_data
from engine.tasks.run_record import RUNTIME_FIELDS, RUN_FILE, config_tuples, family_of, restore_run
from engine.tasks.script_flags import DECODER_FAMILIES, parse_json

FLAGS = flags.FLAGS


def start_decoder(mesh, *, tasks, seq_len):
    """(task, model, params, tokenizer) of the starting point from --init_from / --model / --model_config /
    --model_overrides: the latest checkpoint of a training script's workdir whose task is one of `tasks` (task is
    then that run's), a Hugging Face directory (task None) or a fresh model (task None) with byte-level tokens when
    --data is given and the toy tasks' word tokens otherwise; then the --lora_* flags (`with_lora`). Parameters are
    placed on `mesh`. seq_len: the tokens of a training row (a fresh model's positions, at least 128; checked against
    an --init_from model's learned positions), None when the script learns it later (and checks it then)."""
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


def check_positions(model, length, what=None, expected=None):
    """ValueError in one line when rows of `length` tokens reach past the learned position table of `model` (OPT's;
    a position past it reads no embedding and the loss turns NaN). Rotary models take any position. what / expected:
    the rows and the remedy as the message names them (default: --seq_len's)."""
    backbone = getattr(model, "backbone", model)
    positions = backbone.config.max_position_embeddings
    if getattr(backbone, "position_offset", None) is not None and length > positions:
        raise ValueError(f"{what or f'--seq_len={length}'} with a model of {positions} learned positions (its "
                         f"max_position_embeddings); expected {expected or f'--seq_len <= {positions}'}")


def _start_decoder(mesh, tasks, seq_len):
    if FLAGS.init_from:
        if os.path.exists(os.path.join(FLAGS.init_from, RUN_FILE)):
            check_no_tokenizer_flag(FLAGS.init_from)
            started = restore_run(FLAGS.init_from, mesh, tasks=tasks, **model_options(runtime_only=True))
        else:
            started = (None, *load_hf(FLAGS.init_from, families=DECODER_FAMILIES, mesh=mesh))
        if seq_len is not None:  # None: the script knows its rows' length later (and checks it then)
            check_positions(started[1], seq_len)
        return started
    model, tokenizer = fresh_decoder(seq_len)
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


def fresh_decoder(seq_len):
    """(model, tokenizer) of a fresh decoder: `fresh_model` of --model for `fresh_tokenizer()`, with room for
    seq_len positions (at least 128)."""
    tokenizer = fresh_tokenizer()
    return fresh_model(tokenizer, {"max_position_embeddings": max(seq_len or 0, 128)}, family=FLAGS.model,
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
    return models.FAMILIES[family].Model(config_cls(**config_tuples(fields)))


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
    allowed = RUNTIME_FIELDS - {"hf_config"} if runtime_only else _OPTION_FIELDS
    options = {} if runtime_only else accelerator_options()
    if "model_overrides" not in FLAGS or not FLAGS["model_overrides"].present:
        return options
    given = parse_json("model_overrides", FLAGS.model_overrides)
    refused = sorted(set(given) - allowed)
    if refused:
        what = "a training workdir's run.json" if runtime_only else "the Hugging Face config.json"
        raise ValueError(f"--model_overrides sets {refused} with --init_from={FLAGS.init_from}: {what} fixes them; "
                         f"expected only model options of {sorted(allowed)}")
    return {**options, **config_tuples(given)}


def load_hf_model(path, *, families):
    """The model of a Hugging Face directory, from its config alone, with `model_options()`; ValueError naming
    --init_from otherwise."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--init_from={path} is not a directory; expected a Hugging Face model directory")
    if os.path.exists(os.path.join(path, RUN_FILE)) and not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"--init_from={path} is a training script's workdir, which this script does not start "
                         "from; expected a Hugging Face model directory (scripts/export_hf.py writes one from the "
                         "workdir; generate.py reads a workdir as --workdir, train_sft.py and the RLHF scripts as "
                         "--init_from)")
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
        try:
            model, params = models.quantize(model, params, FLAGS.quantize)
        except ValueError as e:
            raise ValueError(f"--quantize={FLAGS.quantize}: {e}; expected --quantize=int8 (or a model whose "
                             "widths the format's blocks divide)") from None
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


def with_flags(model, params):
    """(model, params) with the runtime options the flags set: --dropout_rate / --attention_dropout_rate (each
    unchanged when unset), --fp8 (the projections' matmuls in FP8 when set; like --compute_dtype a setting of each
    run, not recorded in run.json), --fp8_history (delayed scaling: fresh amax histories added where `params` lack
    them; recorded in run.json, as they are parameters) and, for a pipeline (--pipeline_stages > 1), --pipeline_microbatches,
    --pipeline_virtual_stages, --pipeline_schedule and the layers stacked (`models.stack_layers`; run.json records
    the layout, so a resume needs the same flags)."""
    options = {name: getattr(FLAGS, name) for name in ("dropout_rate", "attention_dropout_rate")
               if getattr(FLAGS, name) is not None}
    if FLAGS.fp8:
        options["fp8"] = True
    if FLAGS.fp8_history:
        if not FLAGS.fp8:
            raise ValueError(f"--fp8_history={FLAGS.fp8_history} without --fp8; expected --fp8 (the histories scale "
                             "FP8 matmuls) or --fp8_history=0")
        options["fp8_history"] = FLAGS.fp8_history
    model, params = with_pipeline(model, params)
    if not options:
        return model, params
    try:
        model = model.clone(config=dataclasses.replace(model.config, **options))
    except ValueError as e:
        if not FLAGS.fp8:
            raise
        raise ValueError(f"--fp8{'_history' if FLAGS.fp8_history else ''}: {e}") from None
    return model, models.add_fp8_histories(model, params) if FLAGS.fp8_history else params


def with_pipeline(model, params):
    """(model, params) laid out for the mesh flags: --sequence_parallel set; for --pipeline_stages > 1 the layers
    stacked as --pipeline_virtual_stages stores them (`models.stack_layers`), --pipeline_microbatches,
    --pipeline_schedule and --pipeline_fsdp_gather set."""
    if FLAGS.sequence_parallel:
        model = model.clone(config=dataclasses.replace(model.config, sequence_parallel=True))
    if FLAGS.pipeline_stages == 1:
        return model, params
    try:
        model, params = models.stack_layers(model, params, virtual_stages=FLAGS.pipeline_virtual_stages)
    except ValueError as e:
        raise ValueError(f"--pipeline_stages={FLAGS.pipeline_stages}: {e}") from None
    config = dataclasses.replace(model.config, pipeline_microbatches=FLAGS.pipeline_microbatches,
                                 pipeline_schedule=FLAGS.pipeline_schedule,
                                 pipeline_fsdp_gather=FLAGS.pipeline_fsdp_gather)
    return model.clone(config=config), params
