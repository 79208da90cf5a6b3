"""--mesh=auto: every layout compiled ahead of time over abstract parameters and the best one chosen
(`choose_mesh`, `choose_decoder_mesh`), the starting model described without reading a weight (`describe_decoder`,
`describe`)."""
import os
import time

import jax
import numpy as np
from absl import flags
from jax.experimental import multihost_utils

import engine
import models
from engine.tasks.model_start import fresh_decoder, hf_tokenizer, load_hf_model, model_options, with_flags, with_lora
from engine.tasks.run_record import RUN_FILE, load_run
from engine.tasks.script_flags import DECODER_FAMILIES

FLAGS = flags.FLAGS


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
    """--mesh=auto for a script that starts from `model_start.start_decoder`: `choose_mesh` over `describe_decoder`'s
    model and abstract parameters. make_trainer(mesh, model, params): the run's Trainer (no workdir needed);
    encode(records, tokenizer, seq_len=) -> (examples, cut): the script's encoding, whose first record's example
    stands for every row. Returns (mesh, rows per data position)."""
    model, params, tokenizer = describe_decoder(tasks=tasks, seq_len=FLAGS.seq_len)
    (example, *_), _ = encode(records[:1], tokenizer, seq_len=FLAGS.seq_len)
    return choose_mesh(lambda mesh: make_trainer(mesh, model, params), collate_fn, example,
                       memory_gb=FLAGS.mesh_memory_gb, experts=getattr(model.config, "num_experts", 0))


def describe_decoder(*, tasks, seq_len):
    """(model, params, tokenizer) of `model_start.start_decoder`'s starting point with the --lora_* flags and
    `with_flags` applied, the parameters as jax.ShapeDtypeStructs: no weight is read or allocated (--mesh=auto's
    description, from a workdir's run.json, a Hugging Face directory's config.json and tokenizer, or the fresh
    model's flags). --init_adapter is not read: merged into the weights, it changes no shape."""
    if FLAGS.init_from and os.path.exists(os.path.join(FLAGS.init_from, RUN_FILE)):
        _, model, tokenizer = load_run(FLAGS.init_from, tasks, **model_options(runtime_only=True))
    elif FLAGS.init_from:
        model = load_hf_model(FLAGS.init_from, families=DECODER_FAMILIES)
        tokenizer = hf_tokenizer(FLAGS.init_from, model)
    else:
        model, tokenizer = fresh_decoder(seq_len)
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
