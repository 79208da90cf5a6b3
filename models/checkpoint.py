"""What every checkpoint format shares (`models.hf`'s model directories, `models.lora`'s PEFT adapters): a family's
tensor map expanded to the parameter tree as the model stores it, and getting / setting a leaf by its path.

A family's `hf_tensor_map(config)` lists (our param path, Hugging Face tensor name with '{i}' for the layer index,
transpose, number of layers or None)."""
from models import registry


def tensor_entries(config, tensor_map):
    """Expands a family's map to (our path, [hf names], transpose, stacked) with layer loops unrolled the way the
    model stores them (one stacked array under scan_layers, `layers_{i}` sub-trees otherwise)."""
    for path, name, transpose, num_layers in tensor_map:
        if num_layers is None:
            yield path, [name], transpose, False
        elif config.scan_layers:
            yield path, [name.format(i=i) for i in range(num_layers)], transpose, True
        else:
            at = path.index("layers")
            for i in range(num_layers):
                yield path[:at] + (f"layers_{i}",) + path[at + 1:], [name.format(i=i)], transpose, False


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
