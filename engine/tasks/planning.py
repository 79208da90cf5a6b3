"""Ahead-of-time plans of a named model config: compile the Trainer's real train step (language-model loss, or the
RLHF update step) on a mesh of simulated devices without allocating a parameter, and read per-device memory and
communication off the compiled program (`engine.plan`'s measurements); `sweep` ranks every mesh and ZeRO stage."""
import dataclasses
import itertools
import math
import re

import jax
import jax.numpy as jnp
import optax
from absl import logging

import engine
import kernels
import models
from engine.plan import (parse_mesh, collective_bytes, compile_step, diloco_bytes, memory_per_device,
                         mesh_shapes)
from engine.tasks import lm
from engine.tasks.rlhf import ppo
from engine.traffic import kernel_traffic


def plan(**kwargs):
    """`compile_plan(**kwargs)`'s result dict alone."""
    return compile_plan(**kwargs)[0]


def compile_plan(*, model, model_config, mesh, num_devices=None, target=None, zero_stage=0, per_device_batch_size=1,
                 seq_len=2048, remat="full", compute_dtype="bfloat16", grad_dtype=None, reduce_dtype=None,
                 accumulate=1, step="shard_map", hbm_gb=None, loss_implementation="default",
                 attention_implementation="default", lora_rank=0, param_dtype="float32", quantize=None, stages=1,
                 pipeline_microbatches=0, pipeline_virtual_stages=1, pipeline_schedule="gpipe",
                 pipeline_fsdp_gather="tick", diloco_inner_steps=0,
                 diloco_fragments=1, diloco_outer_dtype="float32",
                 context=1, zero_quantized_weights=False, zero_quantized_gradients=False, sequence_parallel=False,
                 rlhf=None, config_overrides=None, packed=True):
    """Compiles one train step of `models` family `model`, config `model_config` (scan over layers unless
    config_overrides has scan_layers false, `remat`) with
    AdamW (fp32 master weights and moments; gradients held in `grad_dtype` and reduced in `reduce_dtype`, None:
    fp32) on the first `num_devices` devices (None: all) of `target` (None or 'cpu': this machine's, e.g.
    simulated CPU devices; 'tpu:v5p-8', 'tpu:v5e-16x2': a TPU slice's compile-only devices from libtpu; 'gpu:h100-8':
    GPUs' from JAX's CUDA plugin; `engine.plan.parse_target`), and returns a dict: parameter count, per-device bytes (arguments, outputs,
    aliased, temporaries, total), per-device bytes sent per collective type, their sum, and, with `hbm_gb`, whether
    the total fits; for a GPU target also 'traffic', what the program launches and the bytes each launch moves
    (`engine.traffic.kernel_traffic`). lora_rank > 0: LoRA adapters (float32) on every
    projection and only they train (`models.LORA_TRAINABLE`); the frozen weights are stored in `param_dtype`, or with
    quantize='int8' / 'nf4' the projections quantised (`models.quantize`). stages > 1: a pipeline of that many stages (the
    mesh's `stage` axis, on top of `mesh`'s data, fsdp, model) over `pipeline_microbatches` micro-batches (0: one
    per stage) of each micro-batch's rows, `pipeline_virtual_stages` per device (1: GPipe; more: the interleaved
    schedule, models/pipeline.py), on `pipeline_schedule` ('gpipe' or '1f1b'), with `pipeline_fsdp_gather` ('tick' or
    'step': when a stage's fsdp-split weights are gathered); the result's 'idle_share' is that schedule's
    (`models.pipeline.bubble_fraction`). diloco_inner_steps > 0: DiLoCo over `data` (`engine.DiLoCo` with
    `diloco_fragments` parts and `diloco_outer_dtype` outer gradients; needs zero_stage=0, its own step): the
    collective bytes are then an inner step's, and 'outer_step_bytes' lists what each part's outer step sends.
    context > 1: context parallelism, each row's `seq_len` tokens split over that many devices (the mesh's `context`
    axis, on top of the others; either step). zero_quantized_weights /
    zero_quantized_gradients: ZeRO++'s int8 collectives of the shard_map step (`engine.Trainer`'s options).
    sequence_parallel: the model's residual stream split by tokens over `model` between blocks (`ModelOptions`).
    loss_implementation: None (materialised [tokens, vocab] logits), 'chunked' (`kernels.linear_cross_entropy_sum`)
    or the fused head + loss kernel's implementation; attention_implementation: the flash attention's; 'default'
    for either (None too for attention): what a training script's run on the target's devices takes by default
    (`lm.default_loss_implementation`; each attention call the measured default of the target's device kind and the
    call's shape class, `kernels.default_implementation`; the result names the choice for the model's causal calls
    at `seq_len`); 'auto' for either: the target's own kernels (Mosaic on a TPU target, Triton on a GPU target, the
    blockwise 'xla' path on CPU). packed: rows of packed documents with segment ids (text the scripts pack); False:
    whole rows without them (token windows, `scripts/bench_gpu_step.py`'s rows), attention's unsegmented class.
    step: 'shard_map', 'jit' or 'auto' (the Trainer's choice for the target: shard_map on TPU, jit on CPU).
    rlhf='ppo' | 'grpo': the update step of `engine.tasks.rlhf.ppo` on experience rows instead of the language-model loss: PPO
    trains {'actor', 'critic'} (the critic a `RewardModel` of the same backbone, with its score head also trained
    under LoRA), GRPO {'actor'} alone. The frozen reference and reward model are not in that step: their weights
    add their bytes (none with LoRA, where they are the trained models' frozen base). config_overrides: fields of
    the named config replaced (e.g. {'num_layers': 4}).

    On several TPU slices the result adds 'cross_slice_bytes' (what each device sends over the data-centre network
    per step); every result has 'bytes_by_axes' (bytes sent by the mesh axes the collectives span). A program
    larger than a TPU target's memory is a ValueError quoting the compiler. Returns (the result, the
    `jax.stages.Compiled` step)."""
    settings = _config_fields(dict(locals()))  # the keyword arguments, as given: the result repeats them
    devices = engine.plan.target_devices(target)
    settings["num_devices"] = num_devices = len(devices) if num_devices is None else num_devices
    if hbm_gb is None and engine.plan.parse_target(target):  # a target's chips: their memory is the budget
        settings["hbm_gb"] = engine.plan.device_memory_bytes(devices[0]) / 1e9
    sizes = _check_arguments(settings, devices)
    data, fsdp = sizes["data"], sizes["fsdp"]
    settings.update(attention_implementation=_implementation(attention_implementation, devices))
    dtype = jnp.dtype(compute_dtype)
    network, abstract, n_params = _network(settings)
    settings["loss_implementation"] = (
        lm.default_loss_implementation(network, dtype=dtype, platform=devices[0].platform,
                                       device_kind=devices[0].device_kind, per_token=rlhf is not None)
        if loss_implementation == "default" else _implementation(loss_implementation, devices))
    params, loss_fn, trainable, rows_of = _training(network, abstract, settings)
    n_trained = sum(math.prod(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
                    if trainable is None or re.search(trainable, engine.sharding.path_str(p)))
    diloco = None
    if diloco_inner_steps:
        diloco = engine.DiLoCo(inner_steps=diloco_inner_steps, fragments=diloco_fragments,
                               outer_dtype=diloco_outer_dtype)
        step = "auto"  # DiLoCo has its own step
    trainer = engine.Trainer(
        mesh=engine.make_mesh(stage=stages, context=context, **sizes, devices=devices[:num_devices]),
        collate_fn=lm.collate_lm, loss_fn=loss_fn, params=params, optimizer=optax.adamw(1e-4),
        accumulate_grad_batches=accumulate, trainable=trainable, diloco=diloco,
        precision=engine.Precision(compute_dtype=dtype, grad_dtype=grad_dtype, reduce_dtype=reduce_dtype),
        parallelism=engine.Parallelism(step=step, zero_stage=zero_stage, zero_quantized_weights=zero_quantized_weights,
                                       zero_quantized_gradients=zero_quantized_gradients))
    rows = per_device_batch_size * data * fsdp * sizes.get("expert", 1)
    batch = {k: jax.ShapeDtypeStruct((accumulate, rows, seq_len), t) for k, t in rows_of.items()}
    compiled = _compile(trainer, batch, settings)
    step = trainer._step_kind  # noqa: SLF001 - 'auto' as the Trainer resolved it
    memory = memory_per_device(compiled)
    hlo = compiled.as_text()
    comm, outer = _communication(hlo, diloco, num_devices)
    if settings["attention_implementation"] is None:  # each call's measured default: the causal calls' named
        settings["attention_implementation"] = _default_attention(network.config, settings, devices[0])
    result = _result(settings, step=step, mesh=list(parse_mesh(settings["mesh"])), params=n_params,
                     trained_params=n_trained,
                     param_bytes=sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract)),
                     memory=memory, collective_bytes=comm, outer=outer)
    result["bytes_by_axes"] = engine.plan.bytes_by_axes(hlo, trainer.mesh)
    if devices[0].platform == "gpu":  # what the GPU program launches and the bytes each launch moves
        result["traffic"] = kernel_traffic(hlo)
    hosts = engine.plan.hosts_of(trainer.mesh.devices.flat)  # the program's logical ids: the mesh's devices
    if len(set(hosts)) > 1:
        result["cross_slice_bytes"] = sum(_communication(hlo, diloco, num_devices, hosts)[0].values())
    logging.info("plan %s", result)
    return result, compiled


def _compile(trainer, batch, settings):
    """The step compiled; a TPU target's refusal for want of memory as a ValueError (a plan that does not fit)."""
    try:
        return compile_step(trainer, batch)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        message = " ".join(str(e).split())
        raise ValueError(f"does not fit on {settings['target']}: {message[:400]}") from None


def _implementation(name, devices):
    """A kernel implementation for `plan`: 'auto' -> the devices' own ('mosaic_tpu' on TPU, 'triton' on GPU, else
    'xla'); 'default' -> None (attention's measured default per call); anything else as given (None: no kernel)."""
    if name == "default":
        return None
    return name if name != "auto" else kernels.implementation_for_platform(devices[0].platform)


def _default_attention(config, s, device):
    """The implementation the measured defaults give the model's causal attention calls of `s`'s rows on `device`
    (`kernels.default_implementation`; a call with dropout, a window or a soft cap takes the device's own kernels)."""
    head_dim = getattr(config, "dim_per_head", None)
    if head_dim is None:  # not a decoder family's attention geometry: the device's own kernels
        return kernels.implementation_for_platform(device.platform)
    return kernels.default_implementation(
        "flash_attention", device_kind=device.device_kind, head_dim=head_dim, seq_len=s["seq_len"], causal=True,
        dtype=jnp.dtype(s["compute_dtype"]), segments=s["packed"])


# Config fields that are also arguments of `plan` (with the argument's default): one given in config_overrides moves
# to its argument (the plan's idle share, kernels and result follow them).
_ARGUMENT_FIELDS = {"pipeline_microbatches": 0, "pipeline_virtual_stages": 1, "pipeline_schedule": "gpipe",
                    "pipeline_fsdp_gather": "tick", "remat": "full", "lora_rank": 0,
                    "attention_implementation": "default", "param_dtype": "float32", "quantize": None,
                    "sequence_parallel": False}


def _config_fields(settings):
    """settings with the config fields given in config_overrides that are also its arguments moved to them; one given
    both ways with two values is refused."""
    overrides = dict(settings["config_overrides"] or {})
    for key, default in _ARGUMENT_FIELDS.items():
        if key not in overrides:
            continue
        value = overrides.pop(key)
        if settings[key] not in (default, value):
            raise ValueError(f"{key}={settings[key]!r} and config_overrides={{{key!r}: {value!r}}}; expected one "
                             "value")
        settings[key] = value
    return {**settings, "config_overrides": overrides}


def _check_arguments(settings, devices):
    """`plan`'s argument checks; returns the mesh's sizes ({data, fsdp, model[, expert]})."""
    shape = parse_mesh(settings["mesh"])
    sizes = engine.plan.mesh_sizes(shape)
    n = math.prod(shape)
    stages, context, num_devices = settings["stages"], settings["context"], settings["num_devices"]
    for name, value in (("stages", stages), ("context", context)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}; expected a positive integer")
    if stages * context * n != num_devices:
        extra = "".join(f" with {k}={v}" for k, v in (("stages", stages), ("context", context)) if v > 1)
        raise ValueError(f"mesh={','.join(map(str, shape))}{extra} has {stages * context * n} devices; "
                         f"expected num_devices={num_devices}")
    if num_devices > len(devices):
        where = (f"the target {settings['target']} has {len(devices)}" if engine.plan.parse_target(settings["target"])
                 else f"only {len(devices)} devices exist (set XLA_FLAGS=--xla_force_host_platform_device_count="
                      f"{num_devices} before JAX starts)")
        raise ValueError(f"num_devices={num_devices}; {where}")
    if settings["model"] not in models.FAMILIES:
        raise ValueError(f"model={settings['model']!r}; expected one of {sorted(models.FAMILIES)}")
    if settings["zero_stage"] not in (0, 1, 2):
        raise ValueError(f"zero_stage={settings['zero_stage']!r}; expected 0, 1 or 2")
    if settings["rlhf"] not in (None, "ppo", "grpo"):
        raise ValueError(f"rlhf={settings['rlhf']!r}; expected None, 'ppo' or 'grpo'")
    if not settings["diloco_inner_steps"] and (settings["diloco_fragments"] != 1
                                               or settings["diloco_outer_dtype"] != "float32"):
        raise ValueError(f"diloco_fragments={settings['diloco_fragments']!r}, diloco_outer_dtype="
                         f"{settings['diloco_outer_dtype']!r}; expected diloco_inner_steps > 0 with them")
    return sizes


def _network(s):
    """(the model, its abstract parameters as trained, its parameter count without quantisation)."""
    config = models.get_config(s["model"], s["model_config"], **{"scan_layers": True, **(s["config_overrides"] or {})},
                               remat=s["remat"], lora_rank=s["lora_rank"],
                               attention_implementation=s["attention_implementation"],
                               param_dtype=jnp.dtype(s["param_dtype"]).name, quantize=s["quantize"],
                               pipeline_microbatches=s["pipeline_microbatches"],
                               pipeline_virtual_stages=s["pipeline_virtual_stages"],
                               pipeline_schedule=s["pipeline_schedule"],
                               pipeline_fsdp_gather=s["pipeline_fsdp_gather"], sequence_parallel=s["sequence_parallel"])
    network = models.FAMILIES[s["model"]].Model(config)
    abstract = jax.eval_shape(lambda: models.init_params(network, jax.random.PRNGKey(0)))
    if not s["lora_rank"]:  # master weights in fp32 (with LoRA: the frozen ones in param_dtype, the adapters in fp32)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), abstract)
    unquantized = models.FAMILIES[s["model"]].Model(dataclasses.replace(config, quantize=None))  # nf4: 2 codes a byte
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(
        jax.eval_shape(lambda: models.init_params(unquantized, jax.random.PRNGKey(0)))))
    return network, abstract, n_params


def _training(network, abstract, s):
    """(params, loss_fn, trainable, {batch name: dtype}) of the language-model step, or with rlhf of PPO's / GRPO's
    update step."""
    trainable = models.LORA_TRAINABLE if s["lora_rank"] else None
    # loss_implementation: None materialises [tokens, vocab] logits; 'xla' (default) is the blockwise
    # kernels.linear_cross_entropy path (a Pallas name compiles the same custom_vjp on CPU only in interpret mode).
    loss_fn = lm.lm_loss_fn(network, s["loss_implementation"])
    loss_fn.weight_metric = "tokens"
    params, rows_of = abstract, dict.fromkeys(("input_ids", "labels") + ("segment_ids",) * s["packed"], jnp.int32)
    if s["rlhf"]:
        critic = models.RewardModel(network) if s["rlhf"] == "ppo" else None
        params = {"actor": abstract}
        if critic is not None:
            params["critic"] = models.init_reward_params(critic, abstract, jax.random.PRNGKey(0))
            trainable = trainable and f"{trainable}|{models.SCORE_TRAINABLE}"
        config = ppo.PPOConfig(advantage_estimator="gae" if critic is not None else "grpo", samples_per_prompt=2)
        loss_fn = ppo.ppo_loss_fn(network, critic, config, implementation=s["loss_implementation"])
        rows_of.update(dict.fromkeys(("old_log_probs", "advantages") + (
            ("old_values", "returns") if critic is not None else ("ref_log_probs",)), jnp.float32))
    return params, loss_fn, trainable, rows_of


def _communication(hlo, diloco, num_devices, hosts=None):
    """(bytes sent per collective, each DiLoCo part's outer step's or None) of the compiled step (hosts: only
    across them, `engine.plan.collective_bytes`)."""
    if diloco is None:
        return collective_bytes(hlo, num_devices, hosts=hosts), None
    comm, outer = diloco_bytes(hlo, diloco.fragments, num_devices, hosts=hosts)
    if outer is None:
        raise RuntimeError(f"plan: expected one DiLoCo switch of {diloco.fragments + 1} branches in the compiled "
                           "step")
    return comm, outer


def _result(s, *, step, mesh, params, trained_params, param_bytes, memory, collective_bytes, outer):
    """`plan`'s result dict."""
    microbatches = s["pipeline_microbatches"] or s["stages"]
    # 1F1B runs its ticks as one loop where the jit step's partitioner places the stages' ZeRO-3 gathers (the rule
    # `models.pipeline_1f1b.pipeline_1f1b` applies at trace time as `phased`: keep the two in step).
    one_loop = step == "jit" and mesh[1] > 1 and s["pipeline_fsdp_gather"] == "tick"
    idle = models.pipeline.bubble_fraction(s["stages"], microbatches, s["pipeline_virtual_stages"],
                                           s["pipeline_schedule"], one_loop=one_loop)
    result = {"model": s["model"], "model_config": s["model_config"], "target": s["target"] or "cpu",
              "num_devices": s["num_devices"], "mesh": mesh,
              "stages": s["stages"], "context": s["context"], "pipeline_microbatches": microbatches,
              "pipeline_virtual_stages": s["pipeline_virtual_stages"], "pipeline_schedule": s["pipeline_schedule"],
              "pipeline_fsdp_gather": s["pipeline_fsdp_gather"], "idle_share": idle,
              "zero_stage": s["zero_stage"], "step": step,
              "zero_quantized": {"weights": s["zero_quantized_weights"], "gradients": s["zero_quantized_gradients"]},
              "sequence_parallel": s["sequence_parallel"], "rlhf": s["rlhf"],
              "per_device_batch_size": s["per_device_batch_size"], "seq_len": s["seq_len"], "packed": s["packed"],
              "remat": s["remat"],
              "compute_dtype": jnp.dtype(s["compute_dtype"]).name,
              **{k: None if s[k] is None else jnp.dtype(s[k]).name for k in ("grad_dtype", "reduce_dtype")},
              "loss_implementation": s["loss_implementation"] or "plain",
              "attention_implementation": s["attention_implementation"], "params": params,
              "trained_params": trained_params, "param_bytes": param_bytes, "lora_rank": s["lora_rank"],
              "param_dtype": jnp.dtype(s["param_dtype"]).name, "quantize": s["quantize"], "bytes": memory,
              "state_16psi_per_device": 16 * params // s["num_devices"],
              "collective_bytes": collective_bytes, "collective_bytes_total": sum(collective_bytes.values())}
    if outer is not None:
        result["diloco"] = {"inner_steps": s["diloco_inner_steps"], "fragments": s["diloco_fragments"],
                            "outer_dtype": s["diloco_outer_dtype"]}
        result["outer_step_bytes"] = [sum(o.values()) for o in outer]
    if s["hbm_gb"] is not None:
        result["hbm_gb"] = s["hbm_gb"]
        result["fits"] = memory["total"] <= s["hbm_gb"] * 1e9
    return result


def sweep(*, num_devices, max_stages=1, per_device_batch_size=1, **kwargs):
    """`plan` for every mesh factorisation (with an `expert` axis too for a mixture of experts) and zero stage (1 and 2
    only where `data` > 1), and, up to `max_stages`,
    every pipeline stage count that divides the devices (one micro-batch per stage, `per_device_batch_size` x stages
    rows per data position: the global batch the same mesh would have with its stages turned into data positions),
    ranked by per-device total memory, then bytes sent (the global batch follows data x fsdp, as `plan`'s does); on
    several TPU slices by the bytes crossing slices first.
    A configuration that fails to compile comes back with its 'error'."""
    results = []
    try:
        experts = getattr(models.get_config(kwargs.get("model"), kwargs.get("model_config"),
                                            **(kwargs.get("config_overrides") or {})), "num_experts", 0)
    except (KeyError, TypeError, ValueError):  # a bad model or config: every layout's plan says so
        experts = 0
    stage_counts = [s for s in range(1, max_stages + 1) if num_devices % s == 0]
    for stages in stage_counts:
        for shape, zero in itertools.product(mesh_shapes(num_devices // stages, experts), (0, 1, 2)):
            if zero and shape[0] == 1:
                continue
            try:
                results.append(plan(num_devices=num_devices, mesh=shape, zero_stage=zero, stages=stages,
                                    per_device_batch_size=per_device_batch_size * stages, **kwargs))
            except Exception as e:  # noqa: BLE001 - one bad layout (e.g. heads not divisible) must not end the sweep
                logging.warning("sweep: stages %d mesh %s zero %d failed: %s", stages, shape, zero, e)
                results.append({"mesh": list(shape), "stages": stages, "zero_stage": zero,
                                "error": str(e).splitlines()[0][:200]})
    ok = sorted((r for r in results if "error" not in r),  # several slices: the bytes between them first
                key=lambda r: (not r.get("fits", True), r.get("cross_slice_bytes", 0), r["bytes"]["total"],
                               r["collective_bytes_total"]))
    return ok + [r for r in results if "error" in r]
