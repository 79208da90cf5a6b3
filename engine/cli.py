"""absl flags shared by every script (mesh, scale, precision, multi-host), and what they build. Scripts import this
module; tests can too."""
import jax.numpy as jnp
from absl import flags

import engine

FLAGS = flags.FLAGS

_DTYPES = {"float32": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def define_flags():
    """Defines the shared flags once (idempotent, so several modules may ask)."""
    if "mesh" in FLAGS:
        return
    flags.DEFINE_string("mesh", "-1,1,1", "Device mesh sizes data,fsdp,model; one may be -1 (the rest of the "
                        "devices). data: replicated weights; fsdp: ZeRO-3; model: tensor parallel.")
    flags.DEFINE_integer("zero_stage", 0, "0, 1 (split optimizer state over data) or 2 (gradients too).")
    flags.DEFINE_integer("per_device_batch_size", 4, "Examples per device (along data x fsdp) per micro-batch.")
    flags.DEFINE_integer("accumulate_grad_batches", 1, "Micro-batches per optimizer update.")
    flags.DEFINE_enum("compute_dtype", "float32", list(_DTYPES), "Forward/backward dtype; master weights stay fp32.")
    flags.DEFINE_bool("remat", False, "Rematerialise the forward pass in the backward pass (less memory).")
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 for multi-process runs (else "
                        "ENGINE_COORDINATOR_ADDRESS or SLURM).")
    flags.DEFINE_integer("num_processes", None, "Number of processes of a multi-process run.")
    flags.DEFINE_integer("process_id", None, "This process's index in a multi-process run.")
    flags.DEFINE_integer("seed", 0, "Fixes initialisation, shuffling and dropout.")


def parse_mesh(text):
    """'2,2,2' or '-1,1,2' -> dict(data=, fsdp=, model=); ValueError naming the flag otherwise."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) != 3:
        raise ValueError(f"--mesh={text!r}; expected three integers data,fsdp,model such as 2,2,2 or -1,1,2")
    return dict(zip(("data", "fsdp", "model"), sizes))


def start():
    """Joins the multi-process runtime (if asked) and builds the mesh from the flags."""
    engine.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    return engine.make_mesh(**parse_mesh(FLAGS.mesh))


def trainer_kwargs():
    """The Trainer arguments the shared flags set."""
    return dict(zero_stage=FLAGS.zero_stage, compute_dtype=_DTYPES[FLAGS.compute_dtype],
                accumulate_grad_batches=FLAGS.accumulate_grad_batches, remat=FLAGS.remat, seed=FLAGS.seed)
