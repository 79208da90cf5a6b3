"""Checkpoints with Orbax: asynchronous saves, keep the last k, atomic finalisation, restore onto any sharding.

Orbax writes each step into a temporary directory and renames it only once every process has finished, so a save
interrupted mid-write never replaces the previous good checkpoint; `latest_step` only sees finalised steps.
"""
import os

import jax
import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:
    """`workdir/<name>/<step>/{state, meta}`: `state` is a pytree of arrays, `meta` a JSON dict. The Trainer keeps
    its last `keep` states under 'checkpoints' and, with `fit(save_best=...)`, the best evaluated one under 'best'."""

    def __init__(self, workdir, *, keep=3, async_save=True, name="checkpoints"):
        self.directory = os.path.abspath(os.path.join(workdir, name))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=True, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self):
        return self._manager.latest_step()

    def all_steps(self):
        return list(self._manager.all_steps())

    def save(self, step, state, meta):
        """Starts an asynchronous save; returns at once (the previous save is awaited first)."""
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)), force=True)
        logging.info("checkpoint: saving step %d to %s", step, self.directory)

    def restore(self, step, abstract_state):
        """Restores `step` onto the shardings of `abstract_state` (a pytree of `jax.ShapeDtypeStruct` with
        `sharding`), whatever mesh it was saved from. Returns `(state, meta)`."""
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return restored["state"], dict(restored["meta"])

    def restore_params(self, step, abstract_params):
        """Only the 'params' of `step`'s state, onto the shardings of `abstract_params` (whatever the rest of the
        state holds: another optimizer, DiLoCo replicas of another mesh)."""
        target = {"params": abstract_params}
        restored = ocp.PyTreeCheckpointer().restore(
            os.path.join(self.directory, str(step), "state"),
            args=ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                        partial_restore=True))
        return restored["params"]

    def read_meta(self, step):
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])

    def wait(self):
        self._manager.wait_until_finished()

    def close(self):
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(tree, shardings):
    """`ShapeDtypeStruct`s with the given shardings: the restore target."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
