"""The engine core: device mesh, automatic sharding, multi-host start-up, the train steps, the Trainer and the
Predictor, checkpoints, data loading and ahead-of-time plans. The applications built on it live in `engine.tasks`."""
from engine.config import Checkpointing, Logging, Parallelism, Precision
from engine.diloco import DiLoCo
from engine.distributed import initialize_distributed
from engine.fit_loop import StoppedBySignal
from engine.mesh import AXES, make_mesh
from engine.predictor import Predictor
from engine.sharding import add_axis, auto_layout, auto_shard, describe_sharding
from engine.step import LossScale
from engine.train_state import restore_params
from engine.trainer import Trainer, global_batch_size

__all__ = ["AXES", "make_mesh", "auto_shard", "auto_layout", "describe_sharding", "add_axis",
           "initialize_distributed", "Trainer", "Precision", "Parallelism", "Checkpointing", "Logging",
           "restore_params", "Predictor", "global_batch_size", "DiLoCo", "LossScale",
           "StoppedBySignal"]
