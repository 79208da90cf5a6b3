"""What every checkpoint format shares (`models.hf`'s model directories, `models.lora`'s PEFT adapters): a family's
tensor map expanded to the parameter tree as the model stores it, and getting / setting a leaf by its path.

A family's `hf_tensor_map(config)` lists (our param path, Hugging Face tensor name with '{i}' for the layer index,
transpose, layers[, experts]): layers is None (no layer loop), their number, or the indices of the layers that hold
the tensor (Qwen3-MoE's dense and sparse layers; unscanned models only); experts, when given, is the number of
per-expert tensors ('{e}' in the name) stacked into one leading [experts] dim (after the layers' under a scan)."""
from models import registry
from models.layers import stack


def tensor_entries(config, tensor_map):
    """Expands a family's map to (our path, [hf names], transpose, stacked) with layer loops unrolled the way the
    model stores them (one stacked array under scan_layers, `layers_{i}` sub-trees otherwise). stacked counts the
    leading dims the names are stacked into (0 to 3: layers, as [L] or [V, L / V], experts), the names in row-major
    order of them."""
    for path, name, transpose, layers, *experts in tensor_map:
        def per_expert(name=name, experts=experts, **i):
            return [name.format(e=e, **i) for e in range(experts[0])] if experts else [name.format(**i)]

        extra = 1 if experts else 0
        if layers is None:
            yield path, per_expert(), transpose, extra
            continue
        indices = range(layers) if isinstance(layers, int) else layers
        if config.scan_layers:  # [L] or, stored for an interleaved pipeline, [V, L / V] (row-major: layer order)
            rounds = stack.stored_rounds(config, len(indices))
            yield path, [n for i in indices for n in per_expert(i=i)], transpose, (1 if rounds == 1 else 2) + extra
        else:
            at = path.index("layers")
            for i in indices:
                yield path[:at] + (f"layers_{i}",) + path[at + 1:], per_expert(i=i), transpose, extra


def model_entries(model):
    """`tensor_entries` of a model module's config and family map."""
    config = model.config
    return tensor_entries(config, registry.family(registry.model_type(model)).hf_tensor_map(config))


def get_path(tree, path):
    """The node of a nested dict at `path` (a tuple of keys)."""
    for p in path:
        tree = tree[p]
    return tree


def set_path(tree, path, value):
    """Sets the node of a nested dict at `path`, creating the dicts on the way."""
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def path_str(path):
    """A parameter path as its indexing expression: ('layers', 'attn') -> "['layers']['attn']"."""
    return "".join(f"[{p!r}]" for p in path)
