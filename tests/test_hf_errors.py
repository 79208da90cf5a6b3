"""Broken Hugging Face directories and bad sharding overrides are refused at the boundary: one ValueError line that
names the file (or parameter) and the problem, raised without a chained traceback from inside the engine."""
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import engine


@pytest.mark.parametrize("spec, axis", [(P("model", "model"), "model"), (P(("data", "model"), "model"), "model"),
                                        (P(("data", "data")), "data"), (P("fsdp", ("model", "fsdp")), "fsdp")])
def test_auto_shard_refuses_an_override_naming_a_mesh_axis_twice(spec, axis):
    mesh = engine.make_mesh(data=2, fsdp=2, model=2)
    params = {"mlp": {"kernel": jax.ShapeDtypeStruct((64, 128), np.float32)}}
    with pytest.raises(ValueError, match=rf"sharding rule 'mlp' gives {re.escape(str(spec))}, which "
                                         rf"names mesh axis '{axis}' twice, for parameter 'mlp/kernel' of shape "
                                         r"\(64, 128\); a mesh axis may split at most one dim, once") as info:
        engine.auto_shard(params, mesh, rules=[("mlp", spec)])
    assert "\n" not in str(info.value)
