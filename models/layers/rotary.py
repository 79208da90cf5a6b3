"""Positions: each token's position within its sequence, rotary position embeddings (with the rope-scaling variants)
and their Hugging Face config fields."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def segment_positions(segment_ids):
    """Position of each token within its run of equal segment ids, 0 on padding (id 0): [0,0,1,1,2] -> [0,0,0,1,0].
    Left padding therefore does not shift the positions of the real tokens (as in transformers' generate), and
    packed sequences restart at 0."""
    T = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], dtype=bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return jnp.where(segment_ids > 0, idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1), 0)


@dataclasses.dataclass(frozen=True)
class Rotary:
    """Rotary position embedding of the first `dim` features of each head.

    interleaved=False rotates the two halves (LLaMA, rotate_half); True rotates adjacent pairs (GPT-J,
    rotate_every_two). scaling: sorted (key, value) pairs of a Hugging Face `rope_parameters` / `rope_scaling` dict;
    rope_type 'default', 'linear', 'dynamic' (NTK, recomputed from the current length), 'llama3' and 'yarn'.
    """
    dim: int
    theta: float = 10000.0
    interleaved: bool = False
    scaling: tuple = ()
    max_position_embeddings: int = 2048

    def _static_inv_freq(self):
        """(inverse frequencies [dim/2] float32, cos/sin multiplier), following the published formulas."""
        s = dict(self.scaling)
        kind = s.get("rope_type", s.get("type", "default"))
        d = self.dim
        inv = 1.0 / (np.float32(self.theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))
        if kind in ("default", "dynamic"):  # dynamic is applied at call time
            return inv, 1.0
        if kind == "linear":
            return inv / np.float32(s["factor"]), 1.0
        if kind == "llama3":
            factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
            old_len = s.get("original_max_position_embeddings", self.max_position_embeddings)
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > old_len / low, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
            return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
        if kind == "yarn":
            old_len = s.get("original_max_position_embeddings", self.max_position_embeddings)
            factor = s.get("factor") or self.max_position_embeddings / old_len

            def mscale(scale, m=1.0):
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            att = s.get("attention_factor")
            if att is None:
                m, m_all = s.get("mscale"), s.get("mscale_all_dim")
                att = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
            beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

            def correction_dim(rotations):
                return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

            lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
            if s.get("truncate", True):
                lo, hi = math.floor(lo), math.ceil(hi)
            lo, hi = max(lo, 0), min(hi, d - 1)
            hi = hi + 0.001 if lo == hi else hi
            ramp = np.clip((np.arange(d // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1)
            extrapolate = 1 - ramp
            return (inv / factor * (1 - extrapolate) + inv * extrapolate).astype(np.float32), float(att)
        raise ValueError(f"rope scaling type {kind!r} is not supported; expected default, linear, dynamic, llama3 "
                         "or yarn")

    def __call__(self, x, positions):
        """x [batch, len, heads, head_dim], positions int [batch, len] -> x with its first `dim` features rotated."""
        return self.rotate(x, positions, *self.frequencies(positions))

    def frequencies(self, positions):
        """(inverse frequencies [dim/2] float32, cos/sin multiplier) for a call at `positions` (dynamic NTK grows its
        base from them)."""
        inv, att = self._static_inv_freq()
        inv = jnp.asarray(inv)
        s = dict(self.scaling)
        if s.get("rope_type", s.get("type")) == "dynamic":
            # NTK-aware base, grown from the longest position in this call (as transformers does per forward).
            seq_len = jnp.maximum(jnp.max(positions) + 1, self.max_position_embeddings).astype(jnp.float32)
            factor, d = s["factor"], self.dim
            base = self.theta * ((factor * seq_len / self.max_position_embeddings) - (factor - 1)) ** (d / (d - 2))
            inv = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
        return inv, att

    def rotate(self, x, positions, inv, att):
        """x rotated by the angles positions * inv, cos and sin times att (`frequencies`' pair, which may be traced:
        a layer scan picks one of two ropes per layer)."""
        angles = positions[..., None].astype(jnp.float32) * inv  # [B, T, dim/2]
        cos = (jnp.cos(angles) * att)[:, :, None, :]
        sin = (jnp.sin(angles) * att)[:, :, None, :]
        rot, rest = x[..., :self.dim].astype(jnp.float32), x[..., self.dim:]
        if self.interleaved:
            x1, x2 = rot[..., ::2], rot[..., 1::2]
            out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(rot.shape)
        else:
            x1, x2 = jnp.split(rot, 2, axis=-1)
            out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return jnp.concatenate([out.astype(x.dtype), rest], axis=-1)


def rope_from_hf(hf):
    """(rope_theta, scaling pairs) from a transformers config dict: v5 `rope_parameters` or v4 `rope_theta` +
    `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    if params.get("rope_type", "default") == "default":
        params.pop("rope_type", None)
    if params.get("rope_type") in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return float(theta), tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))


def rope_to_hf(theta, scaling):
    return {"rope_type": "default", "rope_theta": theta, **{k: list(v) if isinstance(v, tuple) else v
                                                           for k, v in scaling}}
