"""The engine: device mesh, automatic sharding, multi-host start-up, the Trainer and the Predictor."""
from engine.diloco import DiLoCo
from engine.distributed import initialize_distributed
from engine.mesh import AXES, make_mesh
from engine.predictor import Predictor
from engine.sharding import add_axis, auto_shard, describe_sharding
from engine.step import LossScale
from engine.trainer import Trainer, global_batch_size

__all__ = ["AXES", "make_mesh", "auto_shard", "describe_sharding", "add_axis", "initialize_distributed", "Trainer",
           "Predictor", "global_batch_size", "DiLoCo", "LossScale"]
