"""The Trainer's state: parameters and optimizer state on the mesh, their layout, and where training stands.

`TrainState` decides the layout once (the parameters' specs from `auto_shard` traced on the first micro-batch, or
the user's rules; gradients and optimizer state after them, with ZeRO's extra `data` split), places the state on it
(fresh, or restored from a checkpoint onto any mesh) and carries the data position a checkpoint records: step, epoch,
batch in the epoch, a streamed input's iterator state, examples per update, the running `fit` call and the best eval
so far. `restore_params` lays out a checkpoint's parameters the same way for a caller without a Trainer.
"""
import hashlib
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from engine import data as data_lib
from engine import diloco as diloco_lib
from engine import step as step_lib
from engine.checkpoint import Checkpointer, abstract_like
from engine.config import RESTORE_CHECKPOINTS, check
from engine.sharding import add_axis, auto_shard, device_tile, log_sharding, path_str
from engine.step import overwrite_tree, partition, split_loss

# A `fit` call's target epoch when only `max_steps` bounds it (an int, as every target, for the checkpoint's JSON).
UNBOUNDED = 2**62


def place(x, sharding):
    """Host or device array -> global array on `sharding` (every process must pass the same host values)."""
    if isinstance(x, jax.Array):
        # A fresh buffer, never the caller's: the train step donates its inputs, and device_put may reuse the
        # caller's buffer for one shard (then the donation would delete the caller's array).
        return jax.jit(jnp.copy, out_shardings=sharding)(x)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _state_specs(state, param_specs, param_shapes, scalar):
    """A PartitionSpec for every leaf of an (abstract) optimizer state. Optax keeps per-parameter values (moments,
    the inner states of masked or multi_transform optimizers, ...) in trees of the parameters' structure, so a leaf
    whose path ends with a parameter's path and whose shape is that parameter's takes its spec; any other leaf
    (step counts, hyperparameters) gets `scalar`. (optax.tree_map_params cannot see through multi_transform's
    masked states.)"""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    table = {}
    for (path, spec), shape in zip(jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=is_spec)[0],
                                   jax.tree.leaves(param_shapes, is_leaf=lambda x: isinstance(x, tuple))):
        table[tuple(path)] = (spec, tuple(shape))

    def spec_of(path, leaf):
        for start in range(len(path)):  # the longest suffix first
            found = table.get(tuple(path[start:]))
            if found is not None and found[1] == tuple(leaf.shape):
                return found[0]
        return scalar
    return jax.tree_util.tree_map_with_path(spec_of, state)


def trainable_mask(trainable, params):
    """Trainer's `trainable` argument -> None (everything trains) or a tree of bools of `params`' structure. Refuses
    a selection that holds an integer parameter (quantised weights cannot train)."""
    mask = None if trainable is None else _mask_of(trainable, params)
    if mask is not None:  # FP8 amax histories are the step's to update whatever trains (engine/step/update.py)
        mask = jax.tree.map(lambda m, o: bool(m or o), mask, overwrite_tree(params))
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    wants = jax.tree.leaves(mask) if mask is not None else [True] * len(leaves)
    integer = [path_str(p) for (p, x), m in zip(leaves, wants) if m and not jnp.issubdtype(x.dtype, jnp.inexact)]
    if integer:
        raise ValueError(f"trainable={trainable!r} selects integer parameter {integer[0]} (and {len(integer) - 1} "
                         "more), which cannot train (quantised weights); expected a trainable set of floating "
                         "parameters, e.g. models.LORA_TRAINABLE")
    return mask


def _mask_of(trainable, params):
    """A regex or a tree of bools -> a tree of bools of `params`' structure that selects at least one parameter."""
    if isinstance(trainable, str):
        try:
            pattern = re.compile(trainable)
        except re.error as e:
            raise ValueError(f"trainable={trainable!r} is not a regular expression: {e}") from None
        mask = jax.tree_util.tree_map_with_path(lambda p, _: bool(pattern.search(path_str(p))), params)
    else:
        try:
            mask = jax.tree.map(lambda _, m: m, params, trainable)
        except (ValueError, TypeError):
            mask = None
        if mask is None or not all(isinstance(m, (bool, np.bool_)) for m in jax.tree.leaves(mask)):
            raise ValueError(f"trainable={trainable!r}; expected None, a regex matched against the '/'-joined "
                             "parameter paths, or a tree of bools of the parameters' structure")
        mask = jax.tree.map(bool, mask)
    if not any(jax.tree.leaves(mask)):
        example = path_str(jax.tree_util.tree_flatten_with_path(params)[0][0][0])
        raise ValueError(f"trainable={trainable!r} selects no parameter; parameter paths look like {example!r}")
    return mask


def _auto_specs(params, mesh, loss_fn, batch_spec, rules=None):
    """`engine.auto_shard`'s PartitionSpecs of `params` for `loss_fn` traced (abstractly) on one global micro-batch
    of `batch_spec` (a pytree of `jax.ShapeDtypeStruct`): the layout a Trainer picks."""
    example = data_lib.example_batch(batch_spec)
    trace_fn = lambda p: split_loss(loss_fn(p, example, jax.random.key(0), True))[0]  # noqa: E731
    return auto_shard(params, mesh, trace_fn=trace_fn, rules=rules)


def micro_batch_spec(batch):
    """A global batch [accumulate, rows, ...] (arrays or jax.ShapeDtypeStruct) -> the pytree of one micro-batch's
    jax.ShapeDtypeStruct [rows, ...]."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape[1:]), np.dtype(x.dtype)), batch)


def _saved_batch_spec(meta):
    """The micro-batch spec a checkpoint's metadata recorded (a flat {name: [shape, dtype]} before pytree batches)."""
    if "batch" in meta:
        return data_lib.spec_from_json(meta["batch"])
    return {k: jax.ShapeDtypeStruct(tuple(v[0]), np.dtype(v[1])) for k, v in meta["batch_spec"].items()}


def check_shared_workdir(workdir):
    """Every process of a multi-process run must see the same workdir (a shared filesystem): process 0 writes a fresh
    token there, the others read it back. Without this, checkpoint saves waited on files no other process could see,
    with no message and no bound. Raises the same one-line error on every process."""
    token = int(np.random.default_rng().integers(1, 2**31 - 1))
    token = int(multihost_utils.broadcast_one_to_all(np.int32(token)))
    path = os.path.join(workdir, ".run_token")
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(path, "w") as f:
            f.write(str(token))
    multihost_utils.sync_global_devices("engine.trainer.workdir_token")
    try:
        with open(path) as f:
            seen = int(f.read())
    except (OSError, ValueError):
        seen = None
    agree = multihost_utils.process_allgather(np.int32(seen == token))
    if not np.all(agree):
        missing = [i for i, ok in enumerate(np.ravel(agree)) if not ok]
        raise ValueError(f"workdir={workdir} is not the same directory on every process: process(es) {missing} do "
                         "not see what process 0 wrote there; expected a workdir on a filesystem all processes share")


class TrainState:
    """Parameters and optimizer state on the mesh, their layout and the data position, owned by one Trainer.

    The first global batch (or a restored checkpoint) fixes the micro-batch spec, and with it the layout
    (`lay_out`); the state is placed at the first batch (`note_batch`) or restored (`restore`) onto that layout.
    Until then `arrays` is None and `init_params` holds the caller's parameters."""

    def __init__(self, *, mesh, params, trainable, optimizer, loss_fn, parallelism, diloco, loss_scale, seed):
        if diloco is not None and any(jax.tree.leaves(overwrite_tree(params))):
            # A replica's amax histories are not weights its outer step could average and move with momentum.
            raise ValueError("diloco with FP8 amax histories in params (models.ModelOptions.fp8_history > 0); "
                             "expected fp8_history=0 (FP8's current scaling) with DiLoCo")
        self.trainable = trainable_mask(trainable, params)  # None, or a tree of bools of the parameters' structure
        self.mesh, self.optimizer, self.loss_fn, self.diloco = mesh, optimizer, loss_fn, diloco
        self.rules, self.zero_stage = parallelism.sharding_rules, parallelism.zero_stage
        self.offload_optimizer, self.loss_scale = parallelism.offload_optimizer, loss_scale
        self.seed, self.key = seed, jax.random.key(seed)
        self.init_params = params
        self.arrays = None            # {'params', 'opt_state'} on the mesh once set up
        self.layout = None            # the abstract state and its shardings, once the first batch fixed them
        self.param_specs = None
        self.batch_spec = None        # one global micro-batch as a pytree of jax.ShapeDtypeStruct: fixes the trace
        self.diloco_plan = None
        self._init_opt_fn = None      # the optimizer's init, compiled once for the layout
        # The data position (what a checkpoint records besides the arrays).
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        # A stateful stream's iterator state (engine.data.iterate_batches) after the last batch trained on, in the
        # current epoch's iterator (None at an epoch's start, and for random-access or stateless inputs).
        self.iterator_state = None
        self.rows = None              # examples per update of the running fit
        self.examples = None          # the running epoch's examples, when they are random-access (len): checkpointed
        self.restored_examples = None  # the restored epoch's, compared once with the resumed epoch's
        # The running `fit` call's record (where it started, its target), saved in every checkpoint; the record a
        # checkpoint restored, which the first `fit` of this Trainer continues.
        self.fit_call, self.resumed_call = None, None
        self.restored_rows = None  # examples per update of the restored run (its data position counts them)
        self.restored_spec = None  # its micro-batch spec, compared with the first batch trained on after it
        self.best = None  # {'step', 'metric', 'mode', 'value'} of the checkpoint fit(save_best=...) keeps
        self.evals_since_best = 0  # evals since the best improved (early stopping); checkpointed

    # ------------------------------------------------------------------------------------------------ layout
    def note_spec(self, batch):
        """Records the shapes of one global micro-batch (drops the micro-batch axis), once."""
        if self.batch_spec is None:
            self.batch_spec = micro_batch_spec(batch)

    def note_batch(self, batch):
        """Records the batch's shapes and sets up the state on first sight."""
        self.note_spec(batch)
        if self.arrays is None:
            self._setup()

    def lay_out(self):
        """Decides the shardings of parameters, gradients and optimizer state for the recorded batch shapes, once.
        Returns the abstract, sharded state."""
        if self.layout is not None:
            return self.layout
        abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), self.init_params)
        sizes, mask = dict(self.mesh.shape), self.trainable
        if mask is not None:
            counts = [sum(int(np.prod(x.shape)) for x, m in zip(jax.tree.leaves(abstract_params), jax.tree.leaves(
                mask)) if m == want) for want in (True, False)]
            logging.info("training %d parameters, %d frozen (%.3g%% trained)", counts[0], counts[1],
                         100 * counts[0] / max(1, sum(counts)))
        rules = self.rules
        self.param_specs = (rules if rules is not None and not isinstance(rules, (list, tuple)) else
                            _auto_specs(abstract_params, self.mesh, self.loss_fn, self.batch_spec, rules))
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        shapes = jax.tree.map(lambda x: x.shape, abstract_params)
        overwrite = overwrite_tree(abstract_params)  # FP8 amax histories: whole on every device, in every layout
        self.param_specs = jax.tree.map(lambda s, o: P() if o else s, self.param_specs, overwrite, is_leaf=is_spec)
        data_axis = lambda spec, shape, o: spec if o else add_axis(  # noqa: E731
            spec, shape, "data", sizes, tile=device_tile(self.mesh))
        grad_specs = (jax.tree.map(data_axis, self.param_specs, shapes, overwrite, is_leaf=is_spec)
                      if self.zero_stage >= 2 else self.param_specs)
        self.update_specs = (jax.tree.map(data_axis, self.param_specs, shapes, overwrite, is_leaf=is_spec)
                             if self.zero_stage >= 1 else self.param_specs)  # parameter-shaped, of the update
        if self.diloco is None:
            self._init_opt = lambda p: step_lib.init_opt_state(self.optimizer, partition(p, mask)[0],  # noqa: E731
                                                               self.loss_scale)
            abstract_opt = jax.eval_shape(self._init_opt, abstract_params)
            opt_specs = _state_specs(abstract_opt, self.update_specs, shapes, P())
        else:
            abstract_opt, opt_specs = self._diloco_layout(abstract_params, shapes)
        named = lambda specs: jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=is_spec)  # noqa
        self.param_sh, self.grad_sh, self.opt_sh = (named(self.param_specs), partition(named(grad_specs), mask)[0],
                                                    named(opt_specs))
        self.opt_device_sh = self.opt_sh  # where the update reads and writes it
        if self.offload_optimizer:  # where it rests between steps (and in init, restore and checkpoints)
            self.opt_sh = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), self.opt_sh)
        log_sharding(abstract_params, self.param_specs, self.mesh)
        self.layout = {"params": abstract_like(abstract_params, self.param_sh),
                       "opt_state": abstract_like(abstract_opt, self.opt_sh)}
        return self.layout

    def _diloco_layout(self, abstract_params, shapes):
        """DiLoCo's optimizer state and its specs: the replicas, their inner optimizer states (a leading [replicas]
        dim over `data`), the outer state (one per part with fragments)."""
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        mask, replicas, parts = self.trainable, self.mesh.shape["data"], self.diloco.fragments
        trained_specs, trained_shapes = partition(self.param_specs, mask)[0], partition(shapes, mask)[0]
        plan = self.diloco_plan = diloco_lib.fragment_plan(self.diloco, trained_shapes, trained_specs,
                                                           dict(self.mesh.shape))
        self._init_opt = lambda p: diloco_lib.init_state(self.diloco, self.optimizer, partition(p, mask)[0],  # noqa
                                                         replicas, plan, self.loss_scale)
        abstract_opt = jax.eval_shape(self._init_opt, abstract_params)
        replica_specs = jax.tree.map(lambda spec: P("data", *spec), trained_specs, is_leaf=is_spec)
        replica_shapes = jax.tree.map(lambda shape: (replicas, *shape), trained_shapes,
                                      is_leaf=lambda x: isinstance(x, tuple))
        part_shapes = lambda p: jax.tree.map(lambda x: x.shape, jax.eval_shape(  # noqa: E731
            lambda t: diloco_lib.fragment(t, plan, p, parts), partition(abstract_params, mask)[0]))
        outer_specs = (_state_specs(abstract_opt["outer"], self.param_specs, shapes, P()) if parts == 1 else
                       [_state_specs(state, diloco_lib.fragment_specs(plan, trained_specs, p), part_shapes(p), P())
                        for p, state in enumerate(abstract_opt["outer"])])
        return abstract_opt, {"replicas": replica_specs,
                              "inner": _state_specs(abstract_opt["inner"], replica_specs, replica_shapes, P("data")),
                              "outer": outer_specs}

    def diloco_replicas(self):
        return None if self.diloco is None else self.mesh.shape["data"]

    # ------------------------------------------------------------------------------------------------ placement
    def _setup(self, restore_step=None, checkpointer=None, params_only=False):
        """Lays out the state and places it (or restores step `restore_step` from `checkpointer`)."""
        layout = self.lay_out()
        if restore_step is None:
            params = jax.tree.map(place, self.init_params, self.param_sh)
            self.arrays = {"params": params, "opt_state": self.fresh_opt_state(params)}
        elif params_only:
            params = checkpointer.restore_params(restore_step, layout["params"])
            self.arrays = {"params": params, "opt_state": self.fresh_opt_state(params)}
        else:
            self.arrays, _ = checkpointer.restore(restore_step, layout)
        self.init_params = None  # the master copy lives on the mesh from here on

    def fresh_opt_state(self, params):
        if self._init_opt_fn is None:
            self._init_opt_fn = jax.jit(self._init_opt, out_shardings=self.opt_sh)
        return self._init_opt_fn(params)

    def current_params(self):
        """The parameters on the mesh, or the initial ones before they were placed."""
        return self.arrays["params"] if self.arrays is not None else self.init_params

    def set_params(self, params, *, reset_optimizer=False):
        """Trainer.set_params: checks `params` against the current parameters and places them on the layout."""
        current = self.current_params()
        flat, treedef = jax.tree_util.tree_flatten_with_path(current)
        try:
            new = treedef.flatten_up_to(params)
        except (ValueError, TypeError):
            raise ValueError(f"set_params: params has structure {jax.tree.structure(params)}; expected the "
                             f"Trainer's {treedef}") from None
        for (path, old), x in zip(flat, new):
            dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
            if np.shape(x) != np.shape(old) or np.dtype(dtype) != np.dtype(old.dtype):
                raise ValueError(f"set_params: leaf {path_str(path)} is {np.dtype(dtype)}{list(np.shape(x))}; "
                                 f"expected {np.dtype(old.dtype)}{list(np.shape(old))}")
        if self.arrays is None:
            self.init_params = params
            return
        placed = jax.tree.map(place, params, self.param_sh)
        self.arrays = {"params": placed, "opt_state": self.arrays["opt_state"]}
        if reset_optimizer:
            self.reset_optimizer()

    def reset_optimizer(self):
        """Trainer.reset_optimizer: a fresh optimizer state for the current parameters (none before set-up)."""
        if self.arrays is None:
            return  # set up fresh at the first batch
        self.arrays = {"params": self.arrays["params"], "opt_state": self.fresh_opt_state(self.arrays["params"])}

    # ------------------------------------------------------------------------------------------------ restore
    def restore(self, step, checkpointer, *, params_only, workdir):
        """Restores step `step` of `checkpointer` (the whole state, or its parameters only) and the data position
        its metadata records."""
        self.layout = None  # a step tried before may have laid out another batch spec
        meta = checkpointer.read_meta(step)
        if meta.get("seed") != self.seed:
            logging.warning("restoring a checkpoint made with seed=%s into a Trainer with seed=%s",
                            meta.get("seed"), self.seed)
        self.batch_spec = _saved_batch_spec(meta)
        if not params_only:
            self._check_diloco_matches(meta, workdir)
        self._setup(restore_step=step, checkpointer=checkpointer, params_only=params_only)
        self.step, self.epoch, self.batch_in_epoch = meta["step"], meta["epoch"], meta["batch_in_epoch"]
        self.iterator_state = meta.get("iterator_state")
        self.restored_rows, self.resumed_call = meta.get("rows"), meta.get("fit_call")
        self.restored_examples = meta.get("examples")
        self.restored_spec = self.batch_spec
        self.best = meta.get("best")
        self.evals_since_best = meta.get("evals_since_best", 0)
        logging.info("restored checkpoint of step %d (epoch %d, batch %d) from %s", self.step, self.epoch,
                     self.batch_in_epoch, checkpointer.directory)

    def _check_diloco_matches(self, meta, workdir):
        """A whole-state restore needs the checkpoint's DiLoCo replicas, fragments and overlap."""
        saved, mine = meta.get("diloco_replicas"), self.diloco_replicas()
        only = ("or Checkpointing(params_only=True) to take its parameters only (the scripts: --init_from=<that "
                "workdir> in another --workdir)")
        if saved != mine:
            have = f"DiLoCo with {saved} replicas" if saved else "no DiLoCo"
            want = (f"diloco on a mesh with data={saved} (--diloco_inner_steps > 0, a --mesh of data={saved})"
                    if saved else "diloco=None (--diloco_inner_steps=0)")
            raise ValueError(f"workdir={workdir} holds a checkpoint of a run with {have}; expected {want} to "
                             f"resume it, {only}")
        saved = meta.get("diloco_fragments") or (1 if meta.get("diloco_replicas") else None)
        mine = None if self.diloco is None else self.diloco.fragments
        if saved != mine and mine is not None:
            raise ValueError(f"workdir={workdir} holds a checkpoint of a DiLoCo run with fragments={saved}; "
                             f"expected DiLoCo(fragments={saved}) (--diloco_fragments={saved}) to resume it (each "
                             f"part has its own outer optimizer state), {only}")
        saved = meta.get("diloco_overlap")  # None: no DiLoCo, or a checkpoint saved before it was recorded
        mine = None if self.diloco is None else self.diloco.overlap
        if saved is not None and mine is not None and saved != mine:
            raise ValueError(f"workdir={workdir} holds a checkpoint of a DiLoCo run with overlap={saved}; expected "
                             f"DiLoCo(overlap={saved}) (--diloco_overlap={str(saved).lower()}) to resume it (an outer "
                             "step falling due at the checkpoint's step is taken in that step without overlap, in "
                             f"the next one with it: a switch would take it twice or never), {only}")

    def meta(self):
        """What a checkpoint records besides the arrays: the data position, the seed and rng, the batch spec."""
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "iterator_state": self._agreed_iterator_state(), "seed": self.seed,
                "batch": data_lib.spec_to_json(self.batch_spec), "rows": self.rows,
                "rng": np.asarray(jax.random.key_data(self.key)).tolist(), "diloco_replicas": self.diloco_replicas(),
                "diloco_fragments": None if self.diloco is None else self.diloco.fragments,
                "diloco_overlap": None if self.diloco is None else self.diloco.overlap,
                "evals_since_best": self.evals_since_best, "fit_call": self.fit_call, "examples": self.examples}

    def _agreed_iterator_state(self):
        """The iterator state, the same on every process: each draws the whole stream and collates its own rows of
        every batch, so the states agree unless the processes were handed different streams, which the one meta
        process 0 writes could not resume (refused in one line on every process)."""
        if jax.process_count() > 1:
            text = json.dumps(self.iterator_state, sort_keys=True).encode()
            digest = np.int32(int.from_bytes(hashlib.sha256(text).digest()[:4], "little") >> 1)
            digests = np.ravel(multihost_utils.process_allgather(digest))
            if len(set(digests.tolist())) > 1:
                raise ValueError(f"train_examples: the iterator states differ between processes at step {self.step} "
                                 "(a stream read differently per process); expected every process to iterate the "
                                 "same stream, which each process takes its own rows of every global batch from")
        return self.iterator_state

    # ------------------------------------------------------------------------------------------------ a fit call
    def next_epoch(self):
        """Moves the data position to the next epoch's start (a stream's next epoch is a fresh iterator)."""
        self.epoch, self.batch_in_epoch, self.iterator_state = self.epoch + 1, 0, None

    def note_examples(self, count):
        """Records the running epoch's number of random-access examples (None for a stream). The first epoch after a
        resume mid-epoch over another number than the restored epoch's logs that its order is drawn anew: the
        permutation of (seed, epoch) over other examples, so that the rest of the epoch may repeat examples trained
        on before the restart or pass over others."""
        old, self.examples, self.restored_examples = self.restored_examples, count, None
        if old is not None and count is not None and old != count and self.batch_in_epoch:
            logging.warning("resuming epoch %d at batch %d over %d examples where the checkpoint's epoch had %d: its "
                            "order is drawn anew over these, so the rest of the epoch may repeat examples trained on "
                            "before the restart or pass over others", self.epoch, self.batch_in_epoch, count, old)

    def set_rows(self, rows):
        """Records the running fit's examples per update. After a resume with another number, the data position
        (batches into the epoch) is converted exactly, or refused where the examples already seen are not a whole
        number of new batches."""
        self.rows = rows
        old = self.restored_rows
        if old is None or old == rows:
            return
        seen = self.batch_in_epoch * old
        if seen % rows:
            raise ValueError(f"fit: {rows} examples per update, but the checkpoint of step {self.step} was trained "
                             f"with {old} and stopped {seen} examples into epoch {self.epoch}, not a whole number of "
                             f"batches of {rows}; expected a batch size (per_device_batch_size x data x fsdp x expert "
                             f"x accumulate_grad_batches) that divides {seen}, or {old}")
        logging.warning("resuming with %d examples per update instead of the checkpoint's %d: the data position "
                        "(%d examples into epoch %d) is batch %d of the new size", rows, old, seen, self.epoch,
                        seen // rows)
        self.batch_in_epoch, self.restored_rows = seen // rows, rows

    def note_resumed_shapes(self, batch):
        """Logs, once after a restore, the leaves whose shape past the batch dimension differs from the restored
        run's first batch (a changed sequence length changes what one example is; its data position still counts
        examples)."""
        if self.restored_spec is None:
            return
        old, self.restored_spec = self.restored_spec, None
        new = micro_batch_spec(batch)
        if jax.tree.structure(old) != jax.tree.structure(new):
            logging.warning("resumed with a batch of structure %s; the checkpoint's run had %s",
                            jax.tree.structure(new), jax.tree.structure(old))
            return
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(old)[0], jax.tree.leaves(new)):
            if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
                logging.warning("resumed with batch leaf %s of %s%s per example; the checkpoint's run had %s%s",
                                jax.tree_util.keystr(path), b.dtype, list(b.shape[1:]), a.dtype, list(a.shape[1:]))

    def start_call(self, n_epochs, total_epochs, max_steps):
        """Records this `fit` call and returns the epoch index it stops before: `total_epochs`, or `n_epochs` whole
        epochs after the one the call starts in, that one included when a previous call left it unfinished (so a
        call never finds nothing left to train); with `max_steps` alone, no epoch bound (`UNBOUNDED`: the updates
        end the call, as the Hugging Face Trainer's and Lightning's `max_steps`), else one epoch. The first call
        after a restore starts where the checkpoint's interrupted call started."""
        resumed, self.resumed_call = self.resumed_call, None
        start = ([resumed["start_epoch"], resumed["start_batch"]] if resumed
                 else [self.epoch, self.batch_in_epoch])
        if total_epochs is not None:
            target = total_epochs
        elif n_epochs is None and max_steps is not None:
            target = UNBOUNDED
        else:
            target = start[0] + (1 if n_epochs is None else n_epochs) + (1 if start[1] else 0)
        self.fit_call = {"start_epoch": start[0], "start_batch": start[1], "n_epochs": n_epochs,
                         "total_epochs": total_epochs, "max_steps": max_steps, "target_epoch": target}
        if resumed and total_epochs is None:
            ended = self.epoch >= target or (max_steps is not None and self.step >= max_steps)
            bounds = ([f"epoch {target}"] if target != UNBOUNDED else []) + (
                [f"step {max_steps}"] if max_steps is not None else [])
            logging.info("fit continues the restored run's call, started at epoch %d%s: to %s%s", start[0],
                         f" batch {start[1]}" if start[1] else "", " or ".join(bounds) + (
                             ", whichever comes first" if len(bounds) > 1 else ""),
                         " (reached: nothing to train; a further fit call trains on)" if ended else "")
        return target

    def planned_steps(self, train_examples, per_device_batch_size, accumulate, last_epoch, max_steps):
        """The step `fit` will stop at, for the progress line; None when streaming without max_steps."""
        rows = self.rows
        if callable(train_examples) or not data_lib.is_random_access(train_examples):
            return max_steps
        if len(train_examples) < rows:
            raise ValueError(f"train_examples has {len(train_examples)} examples, fewer than one global batch of "
                             f"{rows} (per_device_batch_size={per_device_batch_size} x data*fsdp*expert="
                             f"{data_lib.data_parallel_size(self.mesh)} x accumulate_grad_batches={accumulate})")
        remaining = max(0, last_epoch - self.epoch) * (len(train_examples) // rows) - self.batch_in_epoch
        return self.step + remaining if max_steps is None else min(max_steps, self.step + remaining)

    # ------------------------------------------------------------------------------------------------ the best
    def read_best(self, source, save_best, workdir):
        """Reads the best so far from `source` (workdir/best, on a resume) and refuses a different criterion:
        replacing a best chosen by another metric would lose it."""
        if self.best is None and source.latest_step() is not None:
            try:  # an unreadable best is moved aside: the next eval's result takes its place
                self.best = source.restore_newest(source.read_meta, set_aside=True)[1].get("best")
            except ValueError as e:
                logging.warning("save_best: %s; moved aside, the next eval's result becomes the best", e)
                source.set_aside(source.all_steps())
        best = self.best
        if best is not None and (best["metric"], best["mode"]) != save_best:
            raise ValueError(f"save_best={save_best!r}: workdir={workdir} keeps the best checkpoint by "
                             f"{(best['metric'], best['mode'])!r} (step {best['step']}); expected "
                             "the same save_best, or another workdir")

    def note_eval(self, save_best, results):
        """Counts an eval against the best so far; returns whether it is the new best (then recorded)."""
        metric, mode = save_best
        if metric not in results:
            raise ValueError(f"save_best={save_best!r}: the eval reports no {metric!r}; expected one of "
                             f"{sorted(results)}")
        value = results[metric]
        better = bool(np.isfinite(value)) and (self.best is None or (
            value < self.best["value"] if mode == "min" else value > self.best["value"]))
        if not better:
            self.evals_since_best += 1
            return False
        self.evals_since_best = 0
        self.best = {"step": self.step, "metric": metric, "mode": mode, "value": value}
        return True

    def early_stop_note(self):
        best = "no finite value yet" if self.best is None else \
            f"the best {self.best['metric']} {self.best['value']:.4f} at step {self.best['step']}"
        return f"{self.evals_since_best} evals in a row without improving on {best}"

def restore_params(workdir, *, mesh, params, loss_fn, checkpoint="latest"):
    """The parameters of `workdir`'s latest checkpoint (checkpoint='best': the one `fit(save_best=...)` kept), laid
    out over `mesh` as a Trainer with `loss_fn` lays them out (`engine.auto_shard`, traced on the checkpoint's batch
    shapes), whatever mesh, optimizer or DiLoCo replicas trained them. params: the parameter pytree (arrays or
    `jax.ShapeDtypeStruct`s: only shapes and dtypes are read). Returns (params, the checkpoint's step)."""
    check("checkpoint", checkpoint, checkpoint in RESTORE_CHECKPOINTS, f"one of {RESTORE_CHECKPOINTS}")
    name = "best" if checkpoint == "best" else "checkpoints"
    source = Checkpointer(workdir, name=name, read_only=True) if os.path.isdir(os.path.join(workdir, name)) else None
    step = None if source is None else source.latest_step()
    if step is None:
        raise FileNotFoundError(f"checkpoint={checkpoint!r}: workdir={workdir} has no {checkpoint} checkpoint "
                                "yet; expected a workdir a Trainer saved to"
                                + (" with fit(save_best=...) (--save_best)" if name == "best" else ""))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)

    def restore(step):
        specs = _auto_specs(abstract, mesh, loss_fn, _saved_batch_spec(source.read_meta(step)))
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        return source.restore_params(step, abstract_like(abstract, shardings))
    try:  # the newest step that restores, each skipped one named in a warning; nothing moved (only reading here)
        step, restored = source.restore_newest(restore, set_aside=False)
        return restored, step
    finally:
        source.close()
