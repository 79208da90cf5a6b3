"""The mesh axis names, spelled once for every package (kernels are the bottom layer: models and the engine both
read them here). `engine.make_mesh` builds a mesh with the axes in `AXES` order."""
DATA = "data"        # data parallelism: examples split, weights replicated
FSDP = "fsdp"        # ZeRO-3: examples split, and weights, gradients and optimizer state too
EXPERT = "expert"    # expert parallelism: examples split, and a mixture-of-experts layer's experts
STAGE = "stage"      # pipeline parallelism: the layer stack split into contiguous blocks
CONTEXT = "context"  # context parallelism: every row's tokens split
MODEL = "model"      # tensor parallelism: weight matrices and attention heads split

AXES = (DATA, FSDP, EXPERT, CONTEXT, STAGE, MODEL)  # the mesh's order (the shard_map step's manual axes first)
BATCH = (DATA, FSDP, EXPERT)  # the axes a batch's rows are split over


def entry_axes(entry):
    """The mesh axes of one PartitionSpec entry: None, an axis name or a tuple of them."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
