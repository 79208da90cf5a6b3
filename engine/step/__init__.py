"""Train-step bodies: `step(params, opt_state, batch, step) -> (params, opt_state, metrics)`, to be wrapped in
`jax.jit` by the Trainer with the parameter / optimizer-state / batch shardings.

One module per concern: `update` (the micro-batch loss and its casts, trained / frozen split, gradient accumulation,
the guarded update, `LossScale`), `jit_step` (the reference `jit_train_step`), `shard_map_step` (the ZeRO
`shard_map_train_step`), `gathering` (its evaluation of the traced loss on parameter shards), `layer_scan` (its
hand-pipelined layer stack), `collectives` (its float and int8 gathers and gradient reductions, `Int8`) and
`shards` (`Sharded`, a parameter still split inside the traced loss).
"""
from engine.step.collectives import Int8
from engine.step.jit_step import jit_train_step
from engine.step.shard_map_step import MANUAL_AXES, check_token_parallel, shard_map_train_step
from engine.step.update import (LossScale, accumulate_gradients, apply_update, cast_floating, combine,
                                current_loss_scale, find_learning_rate, init_opt_state, is_overwrite, micro_loss_fn,
                                micro_weight, overwrite_tree, partition, select_guard, split_loss,
                                trained_grad_fn, weight_metric_of)

__all__ = ["Int8", "LossScale", "MANUAL_AXES", "accumulate_gradients", "apply_update", "cast_floating",
           "check_token_parallel", "combine", "current_loss_scale", "find_learning_rate", "init_opt_state",
           "is_overwrite", "jit_train_step", "micro_loss_fn", "micro_weight", "overwrite_tree", "partition",
           "select_guard", "shard_map_train_step", "split_loss", "trained_grad_fn", "weight_metric_of"]
