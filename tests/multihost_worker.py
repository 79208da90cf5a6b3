"""One process of the 2-process x 4-device test: joins the runtime, builds one 8-device mesh, runs a tensor-parallel
forward with auto_shard specs, and (process 0) saves the replicated result.

usage: python -m tests.multihost_worker COORDINATOR NUM_PROCESSES PROCESS_ID OUT.npy [TIMEOUT_S]
       [forward|train|diloco|streaming|ppo|grpo|
       pipeline|context|signal|workdirs|killed|whole|crash|resume|hang|
       local_crash|local_resume|local_lost|replica_crash|replica_lost|replica_corrupt]

`train` instead runs a few Trainer steps (each process collating only its own rows) and saves the losses; `diloco`
the same with DiLoCo, one replica per process (data 2 x model 4), and saves the losses and the global parameters;
`ppo` two PPO iterations (rollouts generated on the mesh, gathered to every process) and saves their stats and the
parameters, `grpo` the same with GRPO; `pipeline` a few Trainer steps of a 4-layer LLaMA pipelined over 2 stages, one per process, and saves
the losses; `context` the same LLaMA with each row's tokens split over context 2 inside each process (data 2 x
context 2 x model 2, data across the processes); `signal` a long run with a workdir that the test stops with a
signal to one process, each process saving [step, stopped]; `workdirs` the same with a workdir per process (refused);
`killed` the same run with a 5 s heartbeat time-out, for a test that kills one process; `whole` two epochs (saving
the parameters), `crash` the same on a workdir until every process dies at once in epoch 1 (status 3), `resume` the
same call again on that workdir (saving the parameters); `local_crash` / `local_resume` the same with local
checkpoints every 2 steps beside them (`local_lost`: process 1's local copy deleted before the resume; both resumes
save the step restored first); `replica_crash` / `replica_lost` the same with a local directory per process, as on
hosts with their own disks, and process 1's deleted before the resume (its own copy and the replica of process 0's
it held; `replica_corrupt`: and a bit of process 0's replica flipped); `hang` a run whose process 1 blocks for ever
collating its 5th batch, under a 5 s hang watchdog.
"""
import os
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import engine
from tests import toy_models as tm
from tests.xla_flags import cpu_devices

IDS = (np.arange(32, dtype=np.int32).reshape(4, 8) * 7) % 64


def forward_fn():
    module = tm.LlamaLike()
    params = module.init(jax.random.key(0), IDS)["params"]
    return module, params


def train_losses(mesh, steps=4, diloco=None):
    """Losses of a short Trainer run, and its trainer; the same call gives the single-process reference."""
    import optax
    from tests import trainer_task as task
    trainer = engine.Trainer(mesh=mesh, collate_fn=task.collate_fn, loss_fn=task.loss_fn,
                             params=task.init_params(), optimizer=optax.adam(1e-2), accumulate_grad_batches=2,
                             diloco=diloco)
    history = trainer.fit(task.make_examples(64), per_device_batch_size=2, max_steps=steps, log_every=2)
    return np.array([h["loss"] for h in history]), trainer


def diloco_run(mesh, **streaming):
    """(losses, flat global parameters) of a short DiLoCo run: an outer step every 2 of 4 steps (`streaming`:
    DiLoCo's fragments and outer_dtype)."""
    losses, trainer = train_losses(mesh, diloco=engine.DiLoCo(inner_steps=2, **streaming))
    gather = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))  # replicated: readable on every process
    params = [np.asarray(x.addressable_shards[0].data).ravel() for x in jax.tree.leaves(gather(trainer.params))]
    return losses, np.concatenate(params)


STREAMING = dict(fragments=2, outer_dtype="int8", overlap=True)


def ppo_run(mesh, estimator="gae"):
    """Rollout scores and KLs of two PPO (or GRPO: estimator='grpo', 4 prompts x 2 responses an iteration)
    iterations with the toy rule reward from a fresh tiny LLaMA (created on the mesh), then the flat actor and (PPO)
    critic parameters."""
    import optax

    import models
    from engine.tasks import text_data
    from engine.tasks.rlhf import ppo, preference
    tok = text_data.WordTokenizer(text_data.TOY_WORDS)
    actor = models.create_model("llama", "tiny", vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64)
    params = models.init_params(actor, jax.random.PRNGKey(0), layout=engine.auto_layout(mesh))
    critic = models.RewardModel(actor) if estimator == "gae" else None
    config = ppo.PPOConfig(max_new_tokens=6, advantage_estimator=estimator, samples_per_prompt=1 + (critic is None))
    task = ppo.PPO(actor=actor, critic=critic, ref_params=params, tokenizer=tok, mesh=mesh, seq_len=7 + 6 - 1,
                   reward_fn=preference.toy_reward, config=config)
    both = {"actor": params}
    if critic is not None:
        both["critic"] = models.init_reward_params(critic, params, jax.random.PRNGKey(1))
    trainer = engine.Trainer(mesh=mesh, collate_fn=preference.collate_preferences, loss_fn=task.loss_fn(),
                             params=both, optimizer=optax.adam(1e-3))
    prompts = [p["prompt"] for p in preference.toy_prompt_responses(64, seed=0)]
    stats = ppo.fit_ppo(trainer, task, prompts, max_steps=4, rollout_batch_size=8, per_device_batch_size=1)
    gather = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))  # replicated: readable on every process
    flat = [np.asarray(x.addressable_shards[0].data).ravel() for x in jax.tree.leaves(gather(trainer.params))]
    return np.concatenate([[s["score"] for s in stats], [s["kl"] for s in stats], *flat])


def train_until_signal(mesh, workdir):
    """[step, stopped_by_signal] of a long run that a test stops with a signal to one process; prints STARTED once
    a few batches were collated."""
    import optax
    from tests import trainer_task as task
    calls = []

    def collate(examples):
        calls.append(1)
        if len(calls) == 3:
            print("STARTED", flush=True)
        return task.collate_fn(examples)

    trainer = engine.Trainer(mesh=mesh, collate_fn=collate, loss_fn=task.loss_fn, params=task.init_params(),
                             optimizer=optax.adam(1e-2), workdir=workdir)
    try:
        trainer.fit(task.make_examples(64), per_device_batch_size=2, max_steps=100_000, n_epochs=10_000,
                    log_every=2)
    except engine.StoppedBySignal:
        pass
    trainer.close()
    return np.array([trainer.step, trainer.stopped_by_signal])


def restart_run(mesh, workdir, mode):
    """The flat parameters after `fit(n_epochs=2)`; mode 'crash': every process ends with status 3 (a lost job's
    stand-in) when collating its 12th batch, after the checkpoints of steps 3, 6 and 9; 'local_crash' with local
    checkpoints every 2 steps beside them, right after the local one of step 10 is written (the resumes put the
    step restored first)."""
    import optax
    from tests import trainer_task as task
    calls = []

    def collate(examples):
        calls.append(1)
        if mode == "crash" and len(calls) == 12:
            os._exit(3)
        return task.collate_fn(examples)

    local = os.path.join(os.path.dirname(workdir), "local")
    if mode.startswith("replica"):  # each host's own local disk
        local += str(jax.process_index())
    if mode in ("local_lost", "replica_lost", "replica_corrupt") and jax.process_index() == 1:
        import shutil
        shutil.rmtree(local)  # this host's local disk is gone
    if mode == "replica_corrupt" and jax.process_index() == 0:  # one bit of the replica of process 1's blocks
        import glob
        with open(glob.glob(os.path.join(local, "run-*", "replica_of_process_1", "10", "blocks.bin"))[0], "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0x10]))
    checkpointing = engine.Checkpointing(local_dir=local, local_every=2, local_replicas=int(mode.startswith(
        "replica"))) if mode.startswith(("local", "replica")) else None
    trainer = engine.Trainer(mesh=mesh, collate_fn=collate, loss_fn=task.loss_fn, params=task.init_params(),
                             optimizer=optax.adam(1e-2), workdir=None if mode == "whole" else workdir,
                             checkpointing=checkpointing or engine.Checkpointing())
    restored = trainer.step
    if mode in ("local_crash", "replica_crash"):  # dies once its local save of 10 (and the persistent 9) is written
        save_local = trainer._checkpointer.save_local

        def save_then_die(step, *args):
            save_local(step, *args)
            if step == 10:
                trainer._checkpointer.wait()
                os._exit(3)
        trainer._checkpointer.save_local = save_then_die
    trainer.fit(task.make_examples(64), per_device_batch_size=2, n_epochs=2, save_every=3)
    trainer.close()
    gather = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))  # replicated: readable on every process
    flat = [np.asarray(x.addressable_shards[0].data).ravel() for x in jax.tree.leaves(gather(trainer.params))]
    resumes = ("local_resume", "local_lost", "replica_lost", "replica_corrupt")
    return np.concatenate([[restored] if mode in resumes else [], [trainer.step], *flat])


def hang_run(mesh):
    """Process 1's input pipeline blocks for ever at its 5th batch; every process's watchdog (5 s) ends it."""
    import threading

    import optax
    from tests import trainer_task as task
    calls, never = [], threading.Event()

    def collate(examples):
        calls.append(1)
        if jax.process_index() == 1 and len(calls) == 5:
            never.wait()
        return task.collate_fn(examples)

    trainer = engine.Trainer(mesh=mesh, collate_fn=collate, loss_fn=task.loss_fn, params=task.init_params(),
                             optimizer=optax.adam(1e-2))
    trainer.fit(task.make_examples(64), per_device_batch_size=1, n_epochs=100, log_every=1, hang_timeout=5)


def llama_losses(mesh, steps=4):
    """Losses of a short Trainer run of a native 4-layer LLaMA (scanned; a pipeline where `mesh` has stages, each
    row's tokens split where it has `context`)."""
    import optax

    import models
    from tests import trainer_task as task
    model = models.create_model("llama", "tiny", vocab_size=task.VOCAB, num_layers=4, scan_layers=True,
                                remat="full", pipeline_microbatches=2)

    def loss_fn(params, batch, rng, is_training):
        logits = model.apply({"params": params}, batch["input_ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean(), {}

    trainer = engine.Trainer(mesh=mesh, collate_fn=task.collate_fn, loss_fn=loss_fn,
                             params=models.init_params(model, jax.random.PRNGKey(0)), optimizer=optax.adam(1e-2))
    history = trainer.fit(task.make_examples(64), per_device_batch_size=4, max_steps=steps, log_every=2)
    return np.array([h["loss"] for h in history])


def main(coordinator, num_processes, process_id, out, timeout_s=60, mode="forward"):
    engine.initialize_distributed(coordinator, int(num_processes), int(process_id), timeout_s=float(timeout_s),
                                  heartbeat_timeout_s=5 if mode == "killed" else 100)
    assert jax.device_count() == 8 and jax.local_device_count() == 4, (jax.device_count(), jax.local_device_count())
    mesh = engine.make_mesh(data=2, model=4)
    # The model axis stays inside one process (host).
    for row in mesh.devices.reshape(-1, 4):
        assert len({d.process_index for d in row}) == 1
    if mode == "pipeline":  # each process holds one stage: only activations cross between them
        mesh = engine.make_mesh(stage=2, data=2, model=2)
        stage = mesh.axis_names.index("stage")
        assert [{d.process_index for d in mesh.devices.take(s, axis=stage).flat} for s in range(2)] == [{0}, {1}]
    if mode == "context":  # each context group inside one process
        mesh = engine.make_mesh(data=2, context=2, model=2)
        assert all(len({d.process_index for d in group.flat}) == 1 for group in mesh.devices.reshape(2, -1))
    if mode == "workdirs":  # a workdir per process, as on hosts without a shared filesystem
        train_until_signal(engine.make_mesh(data=4, model=2), f"{out}.w{jax.process_index()}")
    if mode == "killed":  # runs until the test kills a process
        train_until_signal(engine.make_mesh(data=4, model=2), os.path.join(os.path.dirname(out), "w"))
    if mode == "signal":  # every process writes its own result: they must agree on the stop
        np.save(f"{out}.{jax.process_index()}.npy", train_until_signal(engine.make_mesh(data=4, model=2),
                                                                       os.path.join(os.path.dirname(out), "w")))
        jax.distributed.shutdown()
        return
    if mode == "hang":
        hang_run(engine.make_mesh(data=4, model=2))
    if mode in ("whole", "crash", "resume", "local_crash", "local_resume", "local_lost", "replica_crash",
                "replica_lost", "replica_corrupt"):
        result = restart_run(engine.make_mesh(data=4, model=2), os.path.join(os.path.dirname(out), "w"), mode)
        if jax.process_index() == 0:
            np.save(out, result)
        jax.distributed.shutdown()
        return
    if mode in ("train", "diloco", "streaming", "ppo", "grpo", "pipeline", "context"):
        result = {"train": lambda: train_losses(engine.make_mesh(data=4, model=2))[0],
                  "pipeline": lambda: llama_losses(mesh),
                  "context": lambda: llama_losses(mesh),
                  "diloco": lambda: np.concatenate(diloco_run(mesh)),
                  "streaming": lambda: np.concatenate(diloco_run(mesh, **STREAMING)),
                  "ppo": lambda: ppo_run(engine.make_mesh(data=4, model=2)),
                  "grpo": lambda: ppo_run(engine.make_mesh(data=4, model=2), "grpo")}[mode]()
        if jax.process_index() == 0:
            np.save(out, result)
        jax.distributed.shutdown()
        return
    module, params = forward_fn()
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: module.apply({"params": p}, IDS))
    place = lambda x, s: jax.make_array_from_callback(x.shape, NamedSharding(mesh, s), lambda i: x[i])  # noqa: E731
    sharded = jax.tree.map(lambda x, s: place(np.asarray(x), s), params, specs)
    ids = place(IDS, P("data"))
    fwd = jax.jit(lambda p, i: module.apply({"params": p}, i), out_shardings=NamedSharding(mesh, P()))
    logits = fwd(sharded, ids)
    if jax.process_index() == 0:
        np.save(out, np.asarray(logits.addressable_shards[0].data))
    jax.distributed.shutdown()


if __name__ == "__main__":
    # JAX creates its backends on first use, so setting these after `import jax` is early enough.
    os.environ["XLA_FLAGS"] = cpu_devices(4)
    os.environ["JAX_PLATFORMS"] = "cpu"
    main(*sys.argv[1:])
