"""The engine: device mesh, automatic sharding, multi-host start-up, and (later) the Trainer and Predictor."""
from engine.distributed import initialize_distributed
from engine.mesh import AXES, make_mesh
from engine.sharding import add_axis, auto_shard, describe_sharding

__all__ = ["AXES", "make_mesh", "auto_shard", "describe_sharding", "add_axis", "initialize_distributed"]
