"""Continuous batching over a paged KV cache (vLLM's scheme) for the decoder-only families: `PagedEngine`,
`generate_continuous`.

The cache is one pool of pages for every layer, k and v [kv_heads, num_layers * (num_pages + 1), page_size, head_dim]
(`paged_cache`; each layer's last page a scratch page that padding and idle slots write to), and a page table per
sequence slot (models/layers/attention.py has the layout of a layer's pages), shifted to each layer's pages as the
layers run; a scanned model runs its layers as one scan carrying the pool. A host-side free list hands a sequence
pages as it grows and takes them back when it ends. The scheduler keeps up to `max_batch` sequences in flight: it
admits waiting requests first come, first served when a slot is free and the pool can hold the request's whole length
on top of what the running ones may still take (so no sequence ever waits for a page, and none needs preempting),
prefills each alone through the model's normal forward (flash attention; its keys and values written into its pages),
then decodes every slot together, one token each, in one compiled step of fixed shape, attention read through
`kernels.paged_attention`, and one sampling program draws the tokens (first tokens too). A sequence retires at its own
EOS or length limit and its pages return to the free list. Compiled once per prompt-length bucket (prefill; once in
all with `prompt_len`, as `generate_continuous` sets it) and once per page-table width (decode), never per request
mix.

Shared prompt pages (GRPO's G samples of one prompt, best-of-n): a request whose prompt equals that of a running
request is not prefilled again; it takes the same prompt pages (a reference count per page; a page returns to the
free list at count 0) and draws its first token from the prompt's stored last logits with its own sampling settings
and seed. So for G samples, submit G requests with the same prompt (and different seeds); nothing else changes. Full
prompt pages are only ever read. A partially filled last prompt page is copied on write: a sample about to write
its own token into it while others still hold it gets a private copy first (a sole holder writes in place). A prompt
is offered while all its pages are held. Admission counts a shared page once: a request joining a prompt reserves
only its own pages (and one copy). `share_prompts=False` prefills and stores every request's prompt alone.
"""
import collections
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import kernels
from models.generate import COMPILER_OPTIONS, _bucket, _mesh_of
from models.layers.decoder import DecoderLM
from models.layers.options import compute_dtype
from models.layers.stack import layer_major, stored_rounds


def paged_cache(model, num_pages, page_size, dtype=None):
    """Zeroed page pools of a decoder, its layers folded into the page axis: {'k_pages', 'v_pages': [kv_heads,
    num_layers * (num_pages + 1), page_size, head_dim]}, layer l's page p at index l * (num_pages + 1) + p (each
    layer's last page its scratch page), in `dtype` (default the compute dtype; int8 adds float32 'k_scale',
    'v_scale' [kv_heads, num_layers * (num_pages + 1), page_size], `kernels.quantize_kv`'s). One array for every
    layer, so the layer stack is one scan carrying it (`_Stack`); folded rather than stacked on a leading layer axis,
    so a layer reads and writes its pages through its shifted page table, never a slice of the pool (slicing a
    stacked pool out and back copied it every step: models/README.md)."""
    c = model.config
    dtype = jnp.dtype(dtype or compute_dtype(c))
    shape = (c.kv_heads, c.num_layers * (num_pages + 1), page_size, c.dim_per_head)
    pools = {"k_pages": jnp.zeros(shape, dtype), "v_pages": jnp.zeros(shape, dtype)}
    if dtype == jnp.int8:
        pools.update(k_scale=jnp.ones(shape[:-1], jnp.float32), v_scale=jnp.ones(shape[:-1], jnp.float32))
    return pools


def page_bytes(model, page_size, dtype=None):
    """Bytes one page takes over every layer, keys and values (int8: with their float32 scales; dtype None:
    `models.layers.compute_dtype(config)`; pass the parameters' dtype for a model without a config dtype)."""
    c = model.config
    dtype = jnp.dtype(dtype or compute_dtype(c))
    per_token = c.dim_per_head * dtype.itemsize + (4 if dtype == jnp.int8 else 0)
    return 2 * c.num_layers * c.kv_heads * page_size * per_token


@dataclasses.dataclass
class _Request:
    id: int
    prompt: list
    max_new_tokens: int
    eos_id: int | None
    temperature: float
    top_k: int  # 0: none
    top_p: float  # 1.0: none
    seed: int
    tokens: list = dataclasses.field(default_factory=list)  # generated so far
    logits_row: int = 0  # the row of `PagedEngine._logits` holding its prompt's last logits
    pages: list = dataclasses.field(default_factory=list)  # its page table row (prompt pages possibly shared)
    reserved: int = 0  # pages it may take from the free list over its life (`PagedEngine._reserve`)
    taken: int = 0  # pages it has taken so far

    def pages_needed(self, page_size):
        """Pages of its whole length: the prompt and every generated token but the last (never fed back)."""
        return -(-(len(self.prompt) + self.max_new_tokens - 1) // page_size)


@dataclasses.dataclass
class _Prompt:
    """A prompt's pages, prefilled once, and the row of `PagedEngine._logits` holding its last position's float32
    logits, from which every request sharing it draws its first token."""
    pages: list
    row: int


class PagedEngine:
    """Continuous batching of greedy or sampled generation over a paged KV cache (the module docstring).

    PagedEngine(model, params, *, max_batch, page_size=16, num_pages=None, memory_bytes=None, cache_dtype=None,
    max_len=None, share_prompts=True, prompt_len=None): max_batch sequence slots decoded together; the pool holds
    num_pages pages of page_size tokens, or as many as memory_bytes holds (`page_bytes`). max_len: the longest
    request (prompt + new tokens) it takes, which fixes the decode step's shape; None: the page table widens (one more
    compile) when a longer request arrives. prompt_len: the longest prompt it takes, which fixes the prefill's shape
    (every prompt right-padded to it: one prefill program, where each program is a GPU run's compile and
    autotuning); None: a prefill program per prompt-length bucket (powers of two), which pads short prompts less.
    cache_dtype None keeps pages in the compute dtype; 'int8' stores keys and values as int8 with a float32 scale per
    token and head (`kernels.quantize_kv`; the prefill attends to its float keys, as
    `generate(kv_cache_dtype='int8')`). share_prompts: requests with equal prompts share their prompt's pages (the
    module docstring). add_request(prompt_ids, max_new_tokens, ...) queues a request and returns its id; run() serves
    every queued request and returns {id: generated token ids} (the EOS included when met); step() is one round of
    it, so requests can arrive while others run. Greedy outputs equal `models.generate`'s up to each
    EOS, sampled ones the same tokens whether their prompt is shared or not. Once idle, the free list is full again.
    """

    def __init__(self, model, params, *, max_batch, page_size=16, num_pages=None, memory_bytes=None,
                 cache_dtype=None, max_len=None, share_prompts=True, prompt_len=None):
        if not isinstance(model, DecoderLM):
            raise ValueError(f"model={type(model).__name__}; expected a decoder-only model (a layers.DecoderLM)")
        for name, value in (("max_batch", max_batch), ("page_size", page_size), ("max_len", max_len or 1),
                            ("prompt_len", 1 if prompt_len is None else prompt_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}; expected a positive int")
        if cache_dtype is not None and cache_dtype not in ("int8", jnp.int8):
            # paged_attention reads float pages in the queries' dtype: the compute dtype
            raise ValueError(f"cache_dtype={cache_dtype!r}; expected None (the compute dtype) or 'int8'")
        if (num_pages is None) == (memory_bytes is None):
            raise ValueError(f"num_pages={num_pages!r}, memory_bytes={memory_bytes!r}; expected exactly one of them")
        cache_dtype = cache_dtype or compute_dtype(model.config, params)
        if num_pages is None:
            num_pages = int(memory_bytes) // page_bytes(model, page_size, cache_dtype)
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages={num_pages!r} (memory_bytes={memory_bytes!r}); expected at least one page")
        self.model, self.params = model, params
        self.max_batch, self.page_size, self.num_pages = max_batch, page_size, num_pages
        self.free_pages = list(range(num_pages))  # the free list; page num_pages is the scratch page
        self.share_prompts = bool(share_prompts)
        self._refs = np.zeros(num_pages, np.int64)  # the page tables naming each page
        self._prompts = {}  # prompt tokens -> _Prompt, while every one of its pages is held
        self._prompt_of_page = {}  # page -> the prompt tokens whose _Prompt lists it
        self.traces = collections.Counter()  # traces of each compiled function ('prefill', 'decode', 'sample')
        self.admission_order = []  # request ids as admitted
        self.peak_pages = 0  # most pages in use at once
        self.prefills = 0  # prompts prefilled (a shared prompt once)
        mesh = _mesh_of(params)
        # Abstract parameters (ShapeDtypeStructs) make abstract pools: an engine whose programs are lowered for a
        # device this machine lacks (scripts/bench_rollout.py --target), never run.
        abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
        build = jax.eval_shape if abstract else lambda make: make()
        self._pools = _placed(build(lambda: paged_cache(model, num_pages, page_size, cache_dtype)), mesh)
        # Each prompt's last logits wait in a row of one buffer (rows as held: at most one prompt per running
        # request), so first tokens and decoded ones are drawn by one sampling program of one shape.
        self._logits = _placed(build(lambda: jnp.zeros((max_batch, model.config.vocab_size), jnp.float32)), mesh,
                               split=False)
        self._free_rows = list(range(max_batch))
        self._waiting = collections.deque()
        self._next_id = 0
        self._slots = [None] * max_batch  # the running request of each slot
        self.max_len, self.prompt_len = max_len, prompt_len
        # Page-table entries per slot: max_len's pages (paged_attention reads every entry's block, so none spare),
        # else a power of two grown (a new compile) when a longer request arrives.
        self._table_width = 1 if max_len is None else -(-max_len // page_size)
        options = dict(compiler_options=COMPILER_OPTIONS)
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1, 2), **options)
        self._decode = jax.jit(self._decode_fn, donate_argnums=1, **options)
        self._sample = jax.jit(self._sample_fn, **options)
        self._copy = jax.jit(self._copy_fn, donate_argnums=0, **options)

    def add_request(self, prompt_ids, max_new_tokens, *, eos_id=None, temperature=0.0, top_k=None, top_p=None,
                    seed=0):
        """Queues a prompt (a sequence of token ids) for up to max_new_tokens new tokens, ending early at eos_id.
        temperature 0 is greedy; otherwise sampling from softmax(logits / temperature), restricted to the top_k
        tokens and / or the smallest set with probability >= top_p, its keys drawn from `seed`. Returns its id."""
        prompt = [int(t) for t in np.asarray(prompt_ids).reshape(-1)]
        vocab = self.model.config.vocab_size
        if np.ndim(prompt_ids) != 1 or not prompt or not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt_ids of shape {np.shape(prompt_ids)}; expected a non-empty 1-D sequence of "
                             f"token ids in [0, {vocab})")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}; expected a positive int")
        if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
            raise ValueError(f"temperature={temperature}, top_k={top_k}, top_p={top_p}; expected temperature >= 0, "
                             "top_k >= 1, 0 < top_p <= 1")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 32:
            raise ValueError(f"seed={seed!r}; expected an int in [0, 2**32)")
        request = _Request(self._next_id, prompt, max_new_tokens, eos_id, float(temperature), top_k or 0,
                           1.0 if top_p is None else float(top_p), int(seed))
        if self.prompt_len is not None and len(prompt) > self.prompt_len:
            raise ValueError(f"prompt_ids of {len(prompt)} tokens; expected at most prompt_len={self.prompt_len} "
                             "(the engine's prefill shape)")
        if self.max_len is not None and len(prompt) + max_new_tokens > self.max_len:
            raise ValueError(f"a request of {len(prompt)} prompt + {max_new_tokens} new tokens; expected at most "
                             f"max_len={self.max_len} tokens")
        if request.pages_needed(self.page_size) > self.num_pages:
            raise ValueError(f"a request of {len(prompt)} prompt + {max_new_tokens} new tokens needs "
                             f"{request.pages_needed(self.page_size)} pages of {self.page_size}; expected at most "
                             f"num_pages={self.num_pages}")
        self._next_id += 1
        self._waiting.append(request)
        return request.id

    def step(self):
        """One round of the scheduler: admits (and prefills) the waiting requests that fit, first come first served,
        then decodes one token of every running sequence. Returns {id: generated token ids} of the requests that
        finished in it. Requests may be added between steps (arriving while others run)."""
        if self.max_len is None:
            width = max((r.pages_needed(self.page_size) for r in self._waiting), default=1)
            self._table_width = max(self._table_width, _power_of_two(width))
        slots, done = self._slots, {}
        with kernels.under_mesh(_mesh_of(self.params)):
            started = True
            while started:  # rounds, as a request ending at its first token frees its slot for the next
                started = []
                for i in range(self.max_batch):
                    if slots[i] is None and self._waiting and self._fits(self._waiting[0]):
                        slots[i] = self._start(self._waiting.popleft())
                        started.append(i)
                if started:
                    self._draw_first(slots, started, done)
            if any(slots):
                self._decode_all(slots, done)
        return done

    def run(self):
        """Steps until every queued request is served; returns {id: generated token ids}."""
        done = {}
        while self.busy:
            done.update(self.step())
        return done

    @property
    def busy(self):
        """Whether a request is waiting or running."""
        return bool(self._waiting) or any(r is not None for r in self._slots)

    @property
    def pools(self):
        """The page pools of every layer (`paged_cache`), as they lie on the devices now."""
        return self._pools

    @property
    def cache_dtype(self):
        """The pages' dtype (int8 for a quantised cache)."""
        return self._pools["k_pages"].dtype

    @property
    def held_pages(self):
        """{request id: its pages} of the running sequences (a shared prompt page under each of its holders)."""
        return {r.id: list(r.pages) for r in self._slots if r is not None}

    @property
    def page_refs(self):
        """int [num_pages]: how many running sequences hold each page (0: on the free list)."""
        return self._refs.copy()

    def _fits(self, request):
        """Whether the free pages cover what the request may take besides what the running ones may still take."""
        owed = sum(r.reserved - r.taken for r in self._slots if r is not None)
        return len(self.free_pages) - owed >= self._reserve(request, tuple(request.prompt) in self._prompts)

    def _reserve(self, request, shared):
        """Pages a request may take from the free list: its prompt's unless it joins a prompt held already, the pages
        past the prompt, and when it joins one, a copy of its partly filled last page (the first of the prompt's
        holders to write there copies, the last writes in place: one copy fewer than writers, which the first
        holder's missing reservation pays for)."""
        n, m, size = len(request.prompt), request.max_new_tokens, self.page_size
        prompt_pages = -(-n // size)
        past = request.pages_needed(size) - prompt_pages
        return past + (int(n % size > 0 and m > 1) if shared else prompt_pages)

    def _take(self, request):
        page = self.free_pages.pop()
        self._refs[page] = 1
        request.taken += 1
        self.peak_pages = max(self.peak_pages, self.num_pages - len(self.free_pages))
        return page

    def _allocate(self, request, length):
        """Gives the request pages up to `length` tokens."""
        while len(request.pages) * self.page_size < length:
            request.pages.append(self._take(request))

    def _write_at(self, request, position, copies):
        """Makes the page of `position` the request's own before it writes there: a page others hold too is copied
        (copy on write; (source, copy) appended to `copies`). A sole holder writes a prompt's last page in place and
        the prompt stays shared: its slots past the prompt are never read by a newcomer, who copies the page (and
        overwrites them) before writing there itself."""
        i = position // self.page_size
        page = request.pages[i]
        if self._refs[page] > 1:
            self._refs[page] -= 1
            request.pages[i] = self._take(request)
            copies.append((page, request.pages[i]))

    def _forget_prompt(self, key):
        prompt = self._prompts.pop(key)
        self._free_rows.append(prompt.row)
        for page in prompt.pages:
            del self._prompt_of_page[page]

    def _release(self, request):
        for page in reversed(request.pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self.free_pages.append(page)
                if page in self._prompt_of_page:
                    self._forget_prompt(self._prompt_of_page[page])
        request.pages = []

    def _table(self, requests):
        table = np.full((len(requests), self._table_width), self.num_pages, np.int32)
        for i, r in enumerate(requests):
            if r is not None:
                table[i, :len(r.pages)] = r.pages
        return table

    @staticmethod
    def _sampling(requests):
        """Per-row temperature, top_k, top_p, seed and tokens generated so far (its next key's index)."""
        rows = [r or _Request(-1, [], 1, None, 0.0, 0, 1.0, 0) for r in requests]
        return (np.array([r.temperature for r in rows], np.float32), np.array([r.top_k for r in rows], np.int32),
                np.array([r.top_p for r in rows], np.float32), np.array([r.seed for r in rows], np.uint32),
                np.array([len(r.tokens) for r in rows], np.int32))

    def _start(self, request):
        """Admits a request: it joins the running prompt equal to its own, or its prompt is prefilled (alone, right-
        padded to a bucket) into fresh pages, its last logits into a row of `_logits` (`_draw_first` draws from it)."""
        self.admission_order.append(request.id)
        key = tuple(request.prompt)
        prompt = self._prompts.get(key)
        request.reserved = self._reserve(request, prompt is not None)
        if prompt is None:
            n = len(request.prompt)
            self._allocate(request, n)
            ids = np.zeros((1, self.prompt_len or _bucket(n)), np.int32)
            ids[0, :n] = request.prompt
            mask = (np.arange(ids.shape[1]) < n).astype(np.int32)[None]
            prompt = _Prompt(list(request.pages), self._free_rows.pop())
            self._pools, self._logits = self._prefill(self.params, self._pools, self._logits, ids, mask,
                                                      self._table([request]), np.int32(n - 1), np.int32(prompt.row))
            self.prefills += 1
            if self.share_prompts:
                self._prompts[key] = prompt
                self._prompt_of_page.update((page, key) for page in prompt.pages)
        else:
            request.pages = list(prompt.pages)
            self._refs[request.pages] += 1
        request.logits_row = prompt.row
        return request

    def _draw_first(self, slots, started, done):
        """The first tokens of the requests just started in `slots[i]`, i in `started`, drawn together from their
        prompts' rows; retires those they end. A row no stored prompt names (`share_prompts=False`) is free after."""
        rows = np.zeros(self.max_batch, np.int32)
        rows[started] = [slots[i].logits_row for i in started]
        new = np.asarray(self._sample(self._logits, rows, *self._sampling([slots[i] if i in started else None
                                                                           for i in range(self.max_batch)])))
        stored = {p.row for p in self._prompts.values()}
        for i in started:
            r = slots[i]
            r.tokens.append(int(new[i]))
            if r.logits_row not in stored:
                self._free_rows.append(r.logits_row)
            self._retire_if_done(slots, i, done)

    def _decode_all(self, slots, done):
        """One decode step of every slot; retires the sequences it ends."""
        copies = []
        for r in slots:
            if r is not None:  # the token fed in goes at position len(prompt) + len(tokens) - 1
                self._allocate(r, len(r.prompt) + len(r.tokens))
                self._write_at(r, len(r.prompt) + len(r.tokens) - 1, copies)
        if copies:  # at most one per slot: padded to a fixed shape with scratch-to-scratch copies
            pairs = np.full((2, self.max_batch), self.num_pages, np.int32)
            pairs[:, :len(copies)] = np.array(copies, np.int32).T
            self._pools = self._copy(self._pools, *pairs)
        tokens = np.array([r.tokens[-1] if r else 0 for r in slots], np.int32)
        lengths = np.array([len(r.prompt) + len(r.tokens) - 1 if r else 0 for r in slots], np.int32)
        active = np.array([r is not None for r in slots], np.int32)
        logits, self._pools = self._decode(self.params, self._pools, tokens, self._table(slots), lengths, active)
        new = np.asarray(self._sample(logits, np.arange(self.max_batch, dtype=np.int32), *self._sampling(slots)))
        for i, r in enumerate(slots):
            if r is not None:
                r.tokens.append(int(new[i]))
                self._retire_if_done(slots, i, done)

    def _retire_if_done(self, slots, i, done):
        r = slots[i]
        if len(r.tokens) >= r.max_new_tokens or (r.eos_id is not None and r.tokens[-1] == r.eos_id):
            self._release(r)
            done[r.id] = r.tokens
            slots[i] = None

    def _prefill_fn(self, params, pools, rows, ids, mask, table, last, row):
        self.traces["prefill"] += 1
        logits, pools = self._forward(params, pools, ids, mask, table, jnp.zeros((1,), jnp.int32))
        rows = jax.lax.dynamic_update_slice(rows, logits[:, last].astype(rows.dtype), (row, 0))
        return pools, rows

    def _decode_fn(self, params, pools, tokens, table, lengths, active):
        self.traces["decode"] += 1
        logits, pools = self._forward(params, pools, tokens[:, None], active[:, None], table, lengths)
        return logits[:, -1].astype(jnp.float32), pools

    def _sample_fn(self, logits, rows, *sampling):
        self.traces["sample"] += 1
        return _select(logits, rows, *sampling)

    def _forward(self, params, pools, ids, mask, table, lengths):
        """(logits [B, T, vocab], pools) of the model's own forward (embedding, head, whatever its family adds),
        its layer stack run by `_Stack` over the pools."""
        stack = _Stack(self.model, params, pools, self.num_pages + 1)
        cache = {"layers": [_LayerSlot(i) for i in range(stack.num_layers)], "page_table": table,
                 "lengths": lengths}
        with nn.intercept_methods(stack):
            logits, _ = self.model.apply({"params": params}, ids, mask, cache=cache)
        return logits, stack.pools

    def _copy_fn(self, pools, source, copy):
        """The pools with page source[i] copied to page copy[i] in every layer."""
        shift = (self.num_pages + 1) * jnp.arange(self.model.config.num_layers, dtype=jnp.int32)[:, None]
        source, copy = (source[None] + shift).reshape(-1), (copy[None] + shift).reshape(-1)
        return jax.tree.map(lambda x: x.at[:, copy].set(x[:, source]), pools)


@dataclasses.dataclass(frozen=True)
class _LayerSlot:
    """What layer `index` of the model's stack is handed as its cache (`PagedEngine._forward`): a stand-in that
    `_Stack` recognises in the blocks' calls."""
    index: int


class _Stack:
    """The model's layer stack over the folded pools (`paged_cache`), as an interceptor of its blocks' calls
    (`flax.linen.intercept_methods`): the model's forward runs as it is around the stack, while each layer gets the
    whole pool and the page table shifted to its pages (`layer_ctx`), and the pool goes from layer to layer.

    Stacked weights (scan_layers=True, the accelerators' default): the blocks' calls only collect each layer's
    per-layer values (Gemma's sliding flags), and the last runs every layer as one `lax.scan` of the block over the
    weights, the pool in its carry, so the program holds one layer at any depth. Separate `layers_{i}` sub-trees
    (or layers that differ, Qwen3-MoE's dense among sparse) run at their own calls, one after the other."""

    def __init__(self, model, params, pools, pages_per_layer):
        self.pools, self.pages_per_layer = pools, pages_per_layer
        self.num_layers = model.config.num_layers
        c = model.config  # the stacked weights [L, ...] (an interleaved pipeline's model stores [V, L / V, ...])
        self.weights = layer_major(params["layers"], stored_rounds(c, c.num_layers)) if c.scan_layers else None
        self.values = []  # each layer's per-layer arguments, as the model passes them

    def layer_ctx(self, ctx, index):
        return {**ctx, "page_table": ctx["page_table"] + index * self.pages_per_layer}

    def __call__(self, next_fun, args, kwargs, context):
        if len(args) < 3 or not isinstance(args[2], _LayerSlot):
            return next_fun(*args, **kwargs)
        x, ctx, slot, *values = args
        if self.weights is None:
            x, self.pools = next_fun(x, self.layer_ctx(ctx, slot.index), self.pools, *values, **kwargs)
            return x, None
        self.values.append(values)
        if slot.index < self.num_layers - 1:
            return x, None  # unchanged: every layer runs in the scan at the last layer's call
        block = context.module.clone(parent=None)
        values = jax.tree.map(lambda *v: jnp.asarray(v), *self.values)  # [num_layers] each, scanned

        def layer(carry, xs):
            x, pools = carry
            index, weights, values = xs
            return block.apply({"params": weights}, x, self.layer_ctx(ctx, index), pools, *values, **kwargs), None

        (x, self.pools), _ = jax.lax.scan(layer, (x, self.pools), (jnp.arange(self.num_layers), self.weights,
                                                                   values))
        return x, None


def _placed(arrays, mesh, split=True):
    """The arrays on the parameters' mesh (None: as they are): the pools with their kv heads over `model` where it
    divides them, as the attention's k / v projections are split (each device then holds and reads only its heads'
    pages), whole on every device otherwise (and without `split`)."""
    if mesh is None:
        return arrays
    model = dict(mesh.shape).get(kernels.MODEL_AXIS, 1)

    def place(x):
        spec = jax.sharding.PartitionSpec(kernels.MODEL_AXIS if split and x.shape[0] % model == 0 else None)
        sharding = jax.sharding.NamedSharding(mesh, spec)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.device_put(x, sharding)
    return jax.tree.map(place, arrays)


def _power_of_two(n):
    return 1 << (n - 1).bit_length()


def _select(logits, rows, temperature, top_k, top_p, seed, count):
    """Each row's next token from float32 logits[rows] [B, V]: argmax where its temperature is 0, else a sample of its
    temperature, top_k (0: all) and top_p (1: all) (`models.generate`'s filters, row by row) drawn with the key
    fold_in(PRNGKey(seed), tokens generated so far), so a request's draws do not depend on its neighbours."""
    logits = logits[rows]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample():
        x = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        ordered = jnp.sort(x, axis=-1)[:, ::-1]
        kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, x.shape[-1] - 1)[:, None], axis=1)
        x = jnp.where((top_k[:, None] > 0) & (x < kth), -jnp.inf, x)
        # x's masking maps values monotonically, so it commutes with the sort: no second sort
        ordered = jnp.where((top_k[:, None] > 0) & (ordered < kth), -jnp.inf, ordered)
        probs = jax.nn.softmax(ordered, axis=-1)
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]  # the top token is always kept
        threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where((top_p[:, None] < 1) & (x < threshold), -jnp.inf, x)
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(seed, count)
        sampled = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
        return jnp.where(temperature > 0, sampled, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), sample, lambda: greedy)


def generate_continuous(model, params, requests, *, max_batch, page_size=16, num_pages=None, memory_bytes=None,
                        cache_dtype=None, max_len=None, share_prompts=True):
    """Generation for many requests through one `PagedEngine`. requests: dicts of `PagedEngine.add_request`'s arguments
    (prompt_ids, max_new_tokens, and optionally eos_id, temperature, top_k, top_p, seed). Returns each request's
    generated token ids, in order. One prefill program: every prompt is padded to the longest one's bucket."""
    longest = max((np.size(r["prompt_ids"]) for r in requests), default=1)
    engine = PagedEngine(model, params, max_batch=max_batch, page_size=page_size, num_pages=num_pages,
                         memory_bytes=memory_bytes, cache_dtype=cache_dtype, max_len=max_len,
                         share_prompts=share_prompts, prompt_len=_bucket(max(longest, 1)))
    ids = [engine.add_request(**request) for request in requests]
    out = engine.run()
    return [out[i] for i in ids]
