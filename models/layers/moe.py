"""The mixture-of-experts feed-forward block (`MoE`): a softmax top-k router and dropless experts on
`kernels.grouped_matmul`, the per-family options it reads (`MoEOptions`), which layers are sparse
(`is_sparse_layer`), and the router's auxiliary losses (`router_losses`) from the statistics each layer sows.

Dropless (MegaBlocks, Gale et al., 2022): every token's k copies are sorted by expert into ragged groups, so no
capacity factor drops a token and none is padded; the expert weights are stacked with the expert dim first
([E, D, F] / [E, F, D]). On a mesh with an `expert` axis the experts are split over it (`engine.auto_shard`) and each
layer exchanges its tokens with their experts' devices (`_expert_parallel`): the routed rows alone by
`jax.lax.ragged_all_to_all` on GPU and TPU, a block padded to the most one device could send by `all_to_all` on CPU
(XLA:CPU has no ragged all-to-all)."""
import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import kernels
from kernels import axes
from kernels.matmul.formats import DEQUANTIZERS
from models.layers.linear import Linear, activate, lora_a_init, quantized_params
from models.layers.options import Dtype, layer_dtype
from models.layers.parallel import gather_tokens, split_tokens

STATS = "router_stats"  # the name each MoE layer sows its router statistics under, in 'intermediates'
EXPERT_WEIGHTS = ("gate", "up", "down")  # the stacked expert weights, under `experts/`
EXPERT_EXCHANGES = (None, "ragged", "padded")  # how expert parallelism moves the tokens (`_expert_parallel`)


@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """The mixture-of-experts fields of a family's config (models/mixtral.py, qwen3_moe.py: the first base of its
    config class, before the dense family's config).

    num_experts E, num_experts_per_tok k (the top-k), moe_intermediate_size (each expert's hidden width; None:
    intermediate_size), norm_topk_prob (the k routing weights renormalised to sum to 1: Mixtral always, Qwen3-MoE
    by its config), decoder_sparse_step and mlp_only_layers (Qwen3-MoE: layer i is sparse when (i + 1) is a
    multiple of the step and i is not listed; the others have the dense MLP of intermediate_size),
    router_aux_loss_coef (the weight of the load-balancing loss in the LM loss, transformers' field) and
    router_z_loss_coef (ST-MoE's router z-loss weight; no transformers field, 0: off). expert_exchange: how an
    expert mesh's layers send their tokens to the experts' devices and back (`EXPERT_EXCHANGES`; a runtime option,
    no transformers field): None the platform's (ragged on GPU / TPU, padded on CPU, decided when the program is
    lowered), 'ragged' (`jax.lax.ragged_all_to_all`: the routed rows alone; not on CPU) or 'padded' (`all_to_all`
    of blocks of the most rows a device could send: `expert` times the routed rows' bytes)."""
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    expert_exchange: str | None = None

    def __post_init__(self):
        """The family's checks (MoEOptions comes first in its bases), then a ValueError naming the first bad MoE
        field."""
        super().__post_init__()
        positive = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
        if not positive(self.num_experts):
            raise ValueError(f"num_experts={self.num_experts!r}; expected a positive integer")
        if not positive(self.num_experts_per_tok) or self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok!r}; expected an integer in 1 ... "
                             f"{self.num_experts} (num_experts)")
        if self.moe_intermediate_size is not None and not positive(self.moe_intermediate_size):
            raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size!r}; expected a positive integer "
                             "or None")
        if not positive(self.decoder_sparse_step):
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step!r}; expected a positive integer")
        bad = [i for i in self.mlp_only_layers if not (isinstance(i, int) and 0 <= i < self.num_layers)]
        if isinstance(self.mlp_only_layers, (str, list)) or bad:
            raise ValueError(f"mlp_only_layers={self.mlp_only_layers!r}; expected a tuple of layer indices in 0 ... "
                             f"{self.num_layers - 1}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}; expected a number >= 0")
        if self.expert_exchange not in EXPERT_EXCHANGES:
            raise ValueError(f"expert_exchange={self.expert_exchange!r}; expected one of {EXPERT_EXCHANGES} (None: "
                             "ragged on GPU / TPU, padded on CPU)")
        experts_adapted = sorted(set(self.lora_targets) & set(EXPERT_WEIGHTS)) if self.lora_rank else []
        if self.lora_dropout and experts_adapted:
            raise ValueError(f"lora_dropout={self.lora_dropout} with LoRA on the experts ({', '.join(experts_adapted)} "
                             "in lora_targets of a mixture of experts); expected lora_dropout=0 or lora_targets "
                             "without gate, up and down")
        if self.scan_layers and len(set(sparse_layers(self))) > 1:
            raise ValueError(f"scan_layers=True with dense layers among the sparse ones (mlp_only_layers="
                             f"{self.mlp_only_layers}, decoder_sparse_step={self.decoder_sparse_step}); expected "
                             "scan_layers=False: a scan needs one kind of layer")


def sparse_layers(config):
    """One bool per layer: does it have the MoE block (transformers' Qwen3-MoE rule; every layer for Mixtral)."""
    return tuple(i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0
                 for i in range(config.num_layers))


def is_sparse_layer(config, block_name):
    """Whether the block named `block_name` ('layers_{i}' unscanned; a scanned stack has one kind, checked by
    `MoEOptions`) of a decoder config has the MoE block; False for a config without experts."""
    if not getattr(config, "num_experts", 0):
        return False
    index = re.fullmatch(r".*_(\d+)", block_name or "")
    return sparse_layers(config)[int(index.group(1)) if index and not config.scan_layers else 0]


class MoE(nn.Module):
    """Mixture-of-experts gated MLP: y = sum over the token's top-k experts e of p_e · down_e(act(gate_e(x)) ·
    up_e(x)), p the router's softmax (float32) over its E logits, renormalised over the k when norm_topk_prob.

    Parameters: router/kernel [D, E] and experts/{gate, up} [E, D, F], experts/down [E, F, D]. x [B, T, D], valid
    [B, T] bool (False: padding, left out of the router statistics) -> [B, T, D]. The k copies of the tokens are
    sorted by expert and run through `kernels.grouped_matmul` (`implementation`: None = the backend's best, 'xla' on
    CPU), then unsorted and summed with their weights. Each call sows {'counts': top-k assignments per expert [E],
    'probs': router probabilities summed per expert [E], 'z': sum of logsumexp(logits)^2, 'tokens'} over the valid
    tokens into 'intermediates' under `STATS` when that collection is mutable (`router_losses`). expert_exchange:
    the exchange on an expert mesh (`MoEOptions`, `_expert_parallel`)."""
    num_experts: int
    top_k: int
    hidden: int
    act: str = "silu"
    norm_topk_prob: bool = True
    std: float = 0.02
    implementation: str | None = None
    interpret: bool = False
    sequence_parallel: bool = False
    quantize: str | None = None
    lora_rank: int = 0
    lora_scale: float = 1.0
    lora_targets: tuple = ()
    dtype: Dtype | None = None  # None: the router's and the experts' weights' dtype
    param_dtype: Dtype = jnp.float32
    expert_exchange: str | None = None

    @nn.compact
    def __call__(self, x, valid=None):
        x = gather_tokens(x, self.sequence_parallel)
        B, T, D = x.shape
        E, k, F = self.num_experts, self.top_k, self.hidden
        router = Linear(D, E, std=self.std, dtype=self.dtype, param_dtype=self.param_dtype, name="router")
        tokens = x.reshape(B * T, D).astype(router.compute_dtype())
        logits = router(tokens)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, chosen = jax.lax.top_k(probs, k)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        valid = jnp.ones((B * T,), bool) if valid is None or valid.shape != (B, T) else valid.reshape(B * T)
        self._sow_stats(logits.astype(jnp.float32), probs, chosen, valid)

        w = _Experts(E, D, F, self.std, self.quantize, self.lora_rank, self.lora_targets, self.dtype,
                     self.param_dtype, name="experts")()
        ep = kernels.auto_axis_size(axes.EXPERT)
        if w["gate"].shape[0] < E:  # inside the engine's shard_map step: this device's experts and rows
            out = _expert_parallel(self._ffn, tokens, chosen, w, E // w["gate"].shape[0], self.expert_exchange,
                                   manual=True)
        elif ep > 1 and E % ep == 0:
            out = _expert_parallel(self._ffn, tokens, chosen, w, ep, self.expert_exchange)
        else:
            order, group_sizes = _sorted_copies(chosen, E)
            out = self._ffn(tokens[order // k], group_sizes, w)[jnp.argsort(order)].reshape(B * T, k, D)
        y = jnp.einsum("nkd,nk->nd", out, weights.astype(out.dtype)).reshape(B, T, D)
        return split_tokens(y, self.sequence_parallel)

    def _ffn(self, rows, group_sizes, w):
        """The experts' gated MLP on rows sorted by expert (group_sizes rows each; the rows past them come out zero),
        w = {'gate', 'up', 'down'} stacked over those experts, and the LoRA pairs '<name>_lora_a' / '_lora_b' of
        the adapted ones (x W + (x A) B alpha / rank, per expert)."""
        mm = lambda a, b: kernels.grouped_matmul(a, b, group_sizes, implementation=self.implementation,  # noqa
                                                 interpret=self.interpret)

        def project(x, name):
            y = mm(x, w[name])
            if f"{name}_lora_a" in w:
                y = y + mm(mm(x, w[f"{name}_lora_a"]), w[f"{name}_lora_b"]) * jnp.asarray(self.lora_scale, y.dtype)
            return y
        return project(activate(project(rows, "gate"), project(rows, "up"), self.act), "down")

    def _sow_stats(self, logits, probs, chosen, valid):
        mask = valid.astype(jnp.float32)
        counts = jnp.zeros((self.num_experts,), jnp.float32).at[chosen.reshape(-1)].add(
            jnp.repeat(mask, self.top_k))
        z = jax.nn.logsumexp(logits, axis=-1) ** 2
        self.sow("intermediates", STATS, {"counts": counts, "probs": (probs * mask[:, None]).sum(0),
                                          "z": (z * mask).sum(), "tokens": mask.sum()})


def _sorted_copies(chosen, num_experts):
    """(order, group_sizes): the token copies chosen [N, k] (copy j of token n at n * k + j) sorted by expert, and
    how many each expert got (int32 [num_experts])."""
    flat = chosen.reshape(-1)
    return jnp.argsort(flat, stable=True), jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def _expert_parallel(ffn, tokens, chosen, w, ep, exchange=None, manual=False):
    """Expert parallelism (GShard's dispatch, dropless): `ffn` over the experts split into `ep` blocks on the ambient
    mesh's automatic `expert` axis, each token copy sent to the device holding its expert and its output sent back.
    tokens [N, D], chosen [N, k] -> the copies' outputs [N, k, D]. manual: `expert` is already manual (the engine's
    shard_map step, which splits the rows over it like `data`): tokens are this device's rows and w its own experts
    (E / ep of them), exchanged as they are. exchange (`EXPERT_EXCHANGES`): None the platform's, chosen when the
    program is lowered (`jax.lax.platform_dependent`, so a CPU host lowering for GPU or TPU gets theirs):
    `jax.lax.ragged_all_to_all` ('ragged': the routed rows alone) on GPU and TPU, `_padded_exchange` ('padded':
    XLA:CPU has no ragged all-to-all) on CPU.

    Runs in a shard_map manual over every automatic axis (XLA's partitioner fails on the exchange beside an automatic
    `model`; with `manual`, over the automatic axes left, `model` among them): the rows split over the batch axes
    that divide N (each device routes its own rows; rows whole over `expert` are routed by every device of it,
    which gives the same result), each expert's hidden units over `model` where it divides them (Megatron's split:
    the outputs are summed over `model`), whole otherwise. Each device sorts its n * k copies by expert, so those for
    one expert are one slice; the devices' counts per expert (all-gathered, [ep, E] int32) tell every device where
    each slice lands: a receiver holds its rows sorted by local expert, then by source, ready for the grouped
    matmul, in a buffer of ep * n * k rows (the most it could get: dropless, static shapes; the grouped matmul skips
    the rows past its groups). The outputs go back slice by slice into the senders' sorted order."""
    N, k = chosen.shape
    P = jax.sharding.PartitionSpec
    rows = P(kernels.batch_axes(kernels.automatic_axes(), N))
    model = kernels.auto_axis_size(axes.MODEL)
    tp = axes.MODEL if model > 1 and w["gate"].shape[2] % model == 0 else None

    def local(tokens, chosen, w):
        n, D = tokens.shape
        el, copies = w["gate"].shape[0], n * k  # experts per device; the copies each device routes
        order, counts = _sorted_copies(chosen, el * ep)
        me = jax.lax.axis_index(axes.EXPERT)
        every = jax.lax.all_gather(counts, axes.EXPERT).reshape(ep, ep, el)  # [source, device, local expert]
        # where each slice starts among its source's sorted copies
        starts = _exclusive_cumsum(every.reshape(ep, ep * el), 1).reshape(ep, ep, el)
        totals = every.sum(0)  # [device, local expert]: rows each expert gets
        # where source s's rows for expert (d, e) land on device d: after d's earlier experts, then earlier sources
        lands = _exclusive_cumsum(totals, 1)[None] + _exclusive_cumsum(every, 0)
        # a[me]: this device as the source, [device, local expert]; a[:, me]: as the device, [source, local expert]
        mine = lambda a: jax.lax.dynamic_index_in_dim(a, me, 0, keepdims=False).reshape(-1)  # noqa: E731
        for_me = lambda a: jax.lax.dynamic_index_in_dim(a, me, 1, keepdims=False).reshape(-1)  # noqa: E731
        send = _exchange(exchange, copies)
        # there: my sorted copies, slice (d, e) to device d; back: the slices [source, local expert] to their sources
        received = send(tokens[order // k], jnp.zeros((ep * copies, D), tokens.dtype), mine(starts), counts,
                        mine(lands), for_me(every))
        out = ffn(received, jax.lax.dynamic_index_in_dim(totals, me, 0, keepdims=False).astype(jnp.int32), w)
        if tp:  # each model device holds a slice of every expert's hidden units: partial sums
            out = jax.lax.psum(out, tp)
        back = send(out, jnp.zeros((copies, D), out.dtype), for_me(lands), for_me(every), for_me(starts), counts)
        return back[jnp.argsort(order)].reshape(n, k, D)

    # Megatron's pair over `model`: gate and up (and their B) split by columns, down (and its A) by rows
    split = None if manual else axes.EXPERT
    columns, rows_split = P(split, None, tp), P(split, tp, None)
    specs = {name: columns if name in ("gate", "up", "gate_lora_b", "up_lora_b") else rows_split
             if name in ("down", "down_lora_a") else P(split) for name in w}
    return kernels.shard(local, (tokens, chosen, w), (rows, rows, specs), rows, "xla", every_axis=True)


def _exclusive_cumsum(x, axis):
    return jnp.cumsum(x, axis=axis) - x


def _exchange(exchange, capacity):
    """`jax.lax.ragged_all_to_all`'s signature and result over `expert` by `exchange` ('ragged', 'padded', None: by
    the platform the program is lowered for), capacity the most rows one device sends another."""
    def ragged(*args):
        return jax.lax.ragged_all_to_all(*args, axis_name=axes.EXPERT)

    def padded(*args):
        return _padded_exchange(*args, axis_name=axes.EXPERT, capacity=capacity)

    if exchange is not None:
        return {"ragged": ragged, "padded": padded}[exchange]
    return lambda *args: jax.lax.platform_dependent(*args, cpu=padded, default=ragged)


def _padded_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, capacity):
    """`jax.lax.ragged_all_to_all`'s result by one `all_to_all` of padded blocks (where the platform has no ragged
    one): the slices for each device gathered into a block of `capacity` rows (at least the rows it sends any one
    device), the blocks exchanged, each received slice written at its offset. Sends axis size x capacity rows
    whatever the sizes, and the output offsets (int32)."""
    ep = jax.lax.axis_size(axis_name)
    per_device = input_offsets.shape[0] // ep

    def rows(offsets, sizes):
        """For one device's slices: each of the block's `capacity` rows' index at its slice's offset, and whether a
        slice holds it."""
        ends = jnp.cumsum(sizes)
        j = jnp.arange(capacity)
        i = jnp.minimum(jnp.searchsorted(ends, j, side="right"), per_device - 1)
        return offsets[i] + j - (ends - sizes)[i], j < ends[-1]

    source, taken = jax.vmap(rows)(input_offsets.reshape(ep, per_device), send_sizes.reshape(ep, per_device))
    blocks = jnp.where(taken.reshape(ep, capacity, *[1] * (operand.ndim - 1)), operand[jnp.where(taken, source, 0)],
                       jnp.zeros((), operand.dtype))
    exchange = lambda x: jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)  # noqa: E731
    received = exchange(blocks)  # [source, capacity, ...]
    lands = exchange(output_offsets)  # where each source's slices for this device go in its output
    target, written = jax.vmap(rows)(lands.reshape(ep, per_device), recv_sizes.reshape(ep, per_device))
    target = jnp.where(written, target, output.shape[0]).reshape(-1)  # past the end: dropped
    return output.at[target].set(received.reshape(ep * capacity, *operand.shape[1:]), mode="drop")


class _Experts(nn.Module):
    """The stacked expert weights: gate and up [E, D, F], down [E, F, D] (a module of their own so they sit under
    `experts/` apart from the router), returned as {'gate', 'up', 'down'} in the compute dtype (dtype None: each
    weight's own, a quantised one's scale's). quantize='int8' /
    'nf4' (a frozen base, `models.quantize`): each stored quantised with its `<name>_scale` (layers.Linear's
    formats, per expert), dequantised here, one layer at a time inside a scanned stack. lora_rank > 0: the weights
    named in lora_targets get a LoRA pair per expert under `lora/<name>/` (lora_a [E, in, r], lora_b [E, r, out]),
    returned as '<name>_lora_a' / '<name>_lora_b'."""
    num_experts: int
    features: int
    hidden: int
    std: float
    quantize: str | None
    lora_rank: int
    lora_targets: tuple
    dtype: Dtype
    param_dtype: Dtype

    @nn.compact
    def __call__(self):
        E, D, F = _held_experts(self, self.num_experts), self.features, self.hidden
        shapes = {"gate": (E, D, F), "up": (E, D, F), "down": (E, F, D)}
        if not self.quantize:
            init = nn.initializers.normal(self.std)
            w = {}
            for name, shape in shapes.items():
                weight = self.param(name, init, shape, self.param_dtype)
                w[name] = weight.astype(layer_dtype(self.dtype, weight))
        else:
            dequantize = DEQUANTIZERS[self.quantize]
            w = {}
            for name, shape in shapes.items():
                codes, scale = quantized_params(self, name, self.quantize, shape, self.std)
                w[name] = dequantize(codes, scale, layer_dtype(self.dtype, scale))
        adapted = {name: shape for name, shape in shapes.items() if self.lora_rank and name in self.lora_targets}
        if adapted:
            pairs = _ExpertAdapters(adapted, self.lora_rank, name="lora")()
            w.update({f"{name}_{part}": v.astype(w[name].dtype) for name, pair in pairs.items()
                      for part, v in pair.items()})
        return w


def _held_experts(module, num_experts):
    """The experts `module`'s stacked weights hold: all of them, or, where `expert` is a manual axis (the engine's
    shard_map step) and the weights came split over it, this device's E / expert (its `expert` block, not gathered:
    the tokens travel to their experts instead)."""
    ep = kernels.manual_axis_size(axes.EXPERT)
    if ep > 1 and num_experts % ep == 0 and module.has_variable("params", "gate"):
        held = module.get_variable("params", "gate").shape[0]
        return held if held == num_experts // ep else num_experts
    return num_experts


class _ExpertAdapters(nn.Module):
    """LoRA pairs per expert, {name: {'lora_a' [E, in, r], 'lora_b' [E, r, out]}} (B zero: a fresh pair changes
    nothing), float32 like every adapter."""
    shapes: dict
    rank: int

    @nn.compact
    def __call__(self):
        return {name: _ExpertPair(shape, self.rank, name=name)() for name, shape in self.shapes.items()}


class _ExpertPair(nn.Module):
    shape: tuple
    rank: int

    @nn.compact
    def __call__(self):
        E, fan_in, fan_out = self.shape
        return {"lora_a": self.param("lora_a", lora_a_init, (E, fan_in, self.rank), jnp.float32),
                "lora_b": self.param("lora_b", nn.initializers.zeros, (E, self.rank, fan_out), jnp.float32)}


def moe_block(config, **kw):
    """The `MoE` of a decoder config with `MoEOptions` (the MLP's hidden_act, initializer_range, mlp_implementation
    and kernel_interpret)."""
    c = config
    return MoE(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size or c.intermediate_size, c.hidden_act,
               c.norm_topk_prob, std=c.initializer_range, implementation=c.mlp_implementation,
               interpret=c.kernel_interpret, sequence_parallel=c.sequence_parallel, quantize=c.quantize,
               lora_rank=c.lora_rank, lora_scale=c.lora_alpha / max(c.lora_rank, 1),
               lora_targets=tuple(t for t in c.lora_targets if t in EXPERT_WEIGHTS),
               expert_exchange=c.expert_exchange, **kw)


def _sown(intermediates):
    """Every router statistics dict sown into `intermediates` (a collection's nested dicts), in order."""
    found = []

    def walk(node):
        for key, value in node.items():
            if key == STATS:
                found.extend(value)
            elif isinstance(value, dict):
                walk(value)

    walk(intermediates)
    return found


def empty_stats(num_experts):
    """Zeros of the router statistics one MoE call sows (host arrays): the start of their sum over the layers and
    micro-batches of a pipeline (`models.pipeline.pipeline`'s aux), which then sows the whole batch's."""
    zero = np.zeros((), np.float32)
    return {"counts": np.zeros((num_experts,), np.float32), "probs": np.zeros((num_experts,), np.float32),
            "z": zero, "tokens": zero}


def summed_stats(intermediates, num_experts):
    """The router statistics sown into `intermediates` (stacked or not) summed into `empty_stats`' structure."""
    return _summed(_sown(intermediates), num_experts)


def _summed(found, num_experts):
    total = {k: jnp.asarray(v) for k, v in empty_stats(num_experts).items()}
    for stats in found:
        for name, value in stats.items():
            total[name] = total[name] + value.reshape(-1, *total[name].shape).sum(0)
    return total


def router_losses(intermediates):
    """(load_balancing, z_loss) float32 scalars from the statistics the MoE layers sowed into `intermediates` (the
    collection of a `model.apply(..., mutable=['intermediates'])`), or None when there are none.

    load_balancing is transformers' `load_balancing_loss_func` (Switch Transformer, eq. 4-6, as Mixtral and
    Qwen3-MoE train): E · Σ_e f_e P_e, with f_e the top-k assignments to expert e and P_e its summed router
    probability, both over every layer's valid tokens and divided by their count (so Σ f = k, and a uniform
    router gives k). z_loss is ST-MoE's (Zoph et al., 2022): the mean of logsumexp(router logits)^2 over the
    layers' valid tokens. Every statistic is a sum, so inside a shard_map over batch axes (the engine's shard_map
    step: each device runs the loss on its own rows) they are summed over those axes first: both terms are the whole
    batch's, as in the jit step and on one device, not a mean of per-device products."""
    found = _sown(intermediates)
    if not found:
        return None
    E = found[0]["counts"].shape[-1]
    manual = kernels.manual_batch_axes()
    sums = _summed(found, E)
    total = {k: jax.lax.psum(v, manual) if manual else v for k, v in sums.items()}
    tokens = jnp.maximum(total["tokens"], 1.0)
    load_balancing = E * jnp.sum(total["counts"] / tokens * total["probs"] / tokens)
    return load_balancing, total["z"] / tokens
