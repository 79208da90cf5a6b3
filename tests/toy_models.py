"""Small Flax models shaped like the real families (parameter names and dataflow), for sharding and engine tests.

They are deliberately not the native models in `models/`: their names follow each family's Hugging Face layout so
that the name-based fallback of `auto_shard` is exercised on the trees users bring.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def _attend(q, k, v, causal=True):
    """[b, t, h, d] attention with grouped kv heads, plain jnp."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        t = q.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


class LlamaAttention(nn.Module):
    d: int
    heads: int
    kv_heads: int

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        hd = self.d // self.heads
        q = nn.Dense(self.heads * hd, use_bias=False, name="q_proj")(x).reshape(b, t, self.heads, hd)
        k = nn.Dense(self.kv_heads * hd, use_bias=False, name="k_proj")(x).reshape(b, t, self.kv_heads, hd)
        v = nn.Dense(self.kv_heads * hd, use_bias=False, name="v_proj")(x).reshape(b, t, self.kv_heads, hd)
        return nn.Dense(self.d, use_bias=False, name="o_proj")(_attend(q, k, v).reshape(b, t, -1))


class LlamaBlock(nn.Module):
    d: int = 32
    heads: int = 4
    kv_heads: int = 2
    ff: int = 64

    @nn.compact
    def __call__(self, x):
        x = x + LlamaAttention(self.d, self.heads, self.kv_heads, name="self_attn")(nn.RMSNorm(name="input_layernorm")(x))
        h = nn.RMSNorm(name="post_attention_layernorm")(x)
        g = nn.Dense(self.ff, use_bias=False, name="gate_proj")(h)
        u = nn.Dense(self.ff, use_bias=False, name="up_proj")(h)
        return x + nn.Dense(self.d, use_bias=False, name="down_proj")(nn.silu(g) * u)


class LlamaLike(nn.Module):
    vocab: int = 64
    d: int = 32
    n_layers: int = 2

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.d, name="embed_tokens")(ids)
        for i in range(self.n_layers):
            x = LlamaBlock(self.d, name=f"layers_{i}")(x)
        return nn.Dense(self.vocab, use_bias=False, name="lm_head")(nn.RMSNorm(name="norm")(x))


class _ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return LlamaBlock(name="block")(x), None


class LlamaScanned(nn.Module):
    """Stacked layer weights [n_layers, ...] through nn.scan."""
    vocab: int = 64
    d: int = 32

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.d, name="embed_tokens")(ids)
        scan = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = scan(name="layers")(x, None)
        return nn.Dense(self.vocab, use_bias=False, name="lm_head")(x)


class GPTJLike(nn.Module):
    """Parallel attention + MLP, GPT-J's nesting: h_i/attn/{q,k,v,out}_proj, h_i/mlp/{fc_in,fc_out}."""
    vocab: int = 64
    d: int = 32

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.d, name="wte")(ids)
        for i in range(2):
            x = x + _GPTJLayer(self.d, name=f"h_{i}")(x)
        return nn.Dense(self.vocab, name="lm_head")(x)


class _GPTJLayer(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="ln_1")(x)
        attn = _Proj4(self.d, ("q_proj", "k_proj", "v_proj", "out_proj"), False, name="attn")(h)
        mlp = _MLP(self.d, ("fc_in", "fc_out"), name="mlp")(h)
        return attn + mlp


class _Proj4(nn.Module):
    d: int
    names: tuple
    bias: bool

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = [nn.Dense(self.d, use_bias=self.bias, name=n)(x).reshape(b, t, 4, -1) for n in self.names[:3]]
        return nn.Dense(self.d, use_bias=self.bias, name=self.names[3])(_attend(q, k, v).reshape(b, t, -1))


class _MLP(nn.Module):
    d: int
    names: tuple

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.d, name=self.names[1])(nn.relu(nn.Dense(4 * self.d, name=self.names[0])(x)))


class OPTLike(nn.Module):
    """Learned positions, biased q/k/v/out_proj, fc1/fc2 at layer scope, tied head."""
    vocab: int = 64
    d: int = 32

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(self.vocab, self.d, name="embed_tokens")
        pos = nn.Embed(66, self.d, name="embed_positions")
        x = emb(ids) + pos(jnp.arange(ids.shape[1])[None] + 2)
        for i in range(2):
            x = x + _OPTLayer(self.d, name=f"layers_{i}")(x)
        return emb.attend(nn.LayerNorm(name="final_layer_norm")(x))


class _OPTLayer(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x):
        x = x + _Proj4(self.d, ("q_proj", "k_proj", "v_proj", "out_proj"), True, name="self_attn")(x)
        return nn.Dense(self.d, name="fc2")(nn.relu(nn.Dense(4 * self.d, name="fc1")(x)))


class _T5Attention(nn.Module):
    d: int
    relative: bool = False

    @nn.compact
    def __call__(self, x, kv=None):
        kv = x if kv is None else kv
        b, t, _ = x.shape
        q = nn.Dense(self.d, use_bias=False, name="q")(x).reshape(b, t, 4, -1)
        k = nn.Dense(self.d, use_bias=False, name="k")(kv).reshape(b, kv.shape[1], 4, -1)
        v = nn.Dense(self.d, use_bias=False, name="v")(kv).reshape(b, kv.shape[1], 4, -1)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if self.relative:
            bias = nn.Embed(32, 4, name="relative_attention_bias")
            rel = jnp.clip(jnp.arange(kv.shape[1])[None] - jnp.arange(t)[:, None] + 16, 0, 31)
            s = s + bias(rel).transpose(2, 0, 1)[None]
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, -1)
        return nn.Dense(self.d, use_bias=False, name="o")(out)


class _T5FF(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.d, use_bias=False, name="wo")(nn.relu(nn.Dense(2 * self.d, use_bias=False, name="wi")(x)))


class T5Like(nn.Module):
    vocab: int = 64
    d: int = 32

    @nn.compact
    def __call__(self, ids, dec_ids):
        shared = nn.Embed(self.vocab, self.d, name="shared")
        x = shared(ids)
        x = x + _T5Attention(self.d, True, name="encoder_block_0_SelfAttention")(x)
        x = x + _T5FF(self.d, name="encoder_block_0_DenseReluDense")(x)
        y = shared(dec_ids)
        y = y + _T5Attention(self.d, True, name="decoder_block_0_SelfAttention")(y)
        y = y + _T5Attention(self.d, name="decoder_block_0_EncDecAttention")(y, x)
        y = y + _T5FF(self.d, name="decoder_block_0_DenseReluDense")(y)
        return nn.Dense(self.vocab, use_bias=False, name="lm_head")(y)


class GPT2Like(nn.Module):
    """Fused c_attn, c_proj in both attention and MLP, tied head: the tree RedCoast's alphabetical rule gets wrong."""
    vocab: int = 64
    d: int = 32

    @nn.compact
    def __call__(self, ids):
        wte = nn.Embed(self.vocab, self.d, name="wte")
        x = wte(ids) + nn.Embed(64, self.d, name="wpe")(jnp.arange(ids.shape[1]))[None]
        for i in range(2):
            x = x + _GPT2Layer(self.d, name=f"h_{i}")(x)
        return wte.attend(nn.LayerNorm(name="ln_f")(x))


class _GPT2Layer(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x):
        x = x + _GPT2Attn(self.d, name="attn")(nn.LayerNorm(name="ln_1")(x))
        return _MLP(self.d, ("c_fc", "c_proj"), name="mlp")(nn.LayerNorm(name="ln_2")(x))


class _GPT2Attn(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        qkv = nn.Dense(3 * self.d, name="c_attn")(x)
        q, k, v = [a.reshape(b, t, 4, -1) for a in jnp.split(qkv, 3, axis=-1)]
        return nn.Dense(self.d, name="c_proj")(_attend(q, k, v).reshape(b, t, -1))


class MLPStack(nn.Module):
    """Generic names Dense_0 ... Dense_{n-1}; widths may be odd."""
    widths: tuple = (32, 64, 32, 64, 32, 64, 32, 64, 32)

    @nn.compact
    def __call__(self, x):
        for w in self.widths[1:-1]:
            x = nn.relu(nn.Dense(w)(x))
        return nn.Dense(self.widths[-1])(x)


class GenericFusedQKV(nn.Module):
    """Fused qkv attention + MLP where every layer is an anonymous Dense_i."""
    d: int = 32

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        qkv = nn.Dense(3 * self.d)(x).reshape(b, t, 3, 4, -1)
        a = _attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(b, t, -1)
        x = x + nn.Dense(self.d)(a)
        return x + nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(x)))


class MisnamedMLP(nn.Module):
    """`fc2` runs first and `fc1` second: only the dataflow, not the names, tells the order."""
    d: int = 32

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.d, name="fc1")(nn.relu(nn.Dense(4 * self.d, name="fc2")(x)))
