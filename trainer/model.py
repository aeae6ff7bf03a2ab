"""A qwen3moe-shaped transformer in JAX, computed as llama.cpp computes that architecture.

Per layer: RMSNorm, grouped-query attention with per-head RMSNorm on queries and keys and NEOX
rotary embeddings, then RMSNorm and a mixture of SwiGLU experts: a softmax router over every
expert, the top k chosen, their weights renormalized to sum to one. The export (export.py) writes
these weights under llama.cpp's tensor names, so the pinned llama.cpp runs the model unchanged.

Training dispatches tokens to experts with a capacity (each expert computes at most `capacity`
tokens of a batch; the rest of its tokens skip it), which is what makes a 2-core trainer fast;
`capacity_factor=None` computes every chosen expert for every token, as inference does.
"""

from dataclasses import dataclass
import math

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Config:
    """The model's shape."""
    vocab: int
    embd: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_ff: int
    ctx: int
    rope_base: float = 10000.0
    eps: float = 1e-6


def init(cfg, key):
    """Initial parameters: normal(0, 0.02) matrices, residual outputs scaled by depth, ones norms."""
    std = 0.02
    out_std = std / math.sqrt(2 * cfg.layers)
    keys = iter(jax.random.split(key, 3 + 8 * cfg.layers))

    def normal(shape, s=std):
        return s * jax.random.normal(next(keys), shape, jnp.float32)

    layers = []
    for _ in range(cfg.layers):
        layers.append({
            "attn_norm": jnp.ones(cfg.embd),
            "wq": normal((cfg.embd, cfg.heads * cfg.head_dim)),
            "wk": normal((cfg.embd, cfg.kv_heads * cfg.head_dim)),
            "wv": normal((cfg.embd, cfg.kv_heads * cfg.head_dim)),
            "wo": normal((cfg.heads * cfg.head_dim, cfg.embd), out_std),
            "q_norm": jnp.ones(cfg.head_dim),
            "k_norm": jnp.ones(cfg.head_dim),
            "ffn_norm": jnp.ones(cfg.embd),
            "router": normal((cfg.embd, cfg.experts)),
            "gate": normal((cfg.experts, cfg.embd, cfg.expert_ff)),
            "up": normal((cfg.experts, cfg.embd, cfg.expert_ff)),
            "down": normal((cfg.experts, cfg.expert_ff, cfg.embd), out_std),
        })
    return {
        "embed": normal((cfg.vocab, cfg.embd)),
        "layers": layers,
        "out_norm": jnp.ones(cfg.embd),
        "output": normal((cfg.embd, cfg.vocab)),
    }


def rms_norm(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, base):
    """NEOX rotary embedding of x: (batch, seq, heads, dim), dims i and i + dim/2 paired."""
    t, d = x.shape[1], x.shape[-1]
    half = d // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / d)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(cfg, p, x):
    b, t, _ = x.shape
    h = rms_norm(x, p["attn_norm"], cfg.eps)
    q = (h @ p["wq"]).reshape(b, t, cfg.heads, cfg.head_dim)
    k = (h @ p["wk"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    v = (h @ p["wv"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    q = rope(rms_norm(q, p["q_norm"], cfg.eps), cfg.rope_base)
    k = rope(rms_norm(k, p["k_norm"], cfg.eps), cfg.rope_base)
    group = cfg.heads // cfg.kv_heads
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal[None, None], scores, -1e30)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(b, t, cfg.heads * cfg.head_dim) @ p["wo"]


def route(cfg, p, h):
    """Router logits, the chosen experts (n, k) and their renormalized weights (n, k)."""
    logits = h @ p["router"]
    probs = jax.nn.softmax(logits, axis=-1)
    weights, chosen = jax.lax.top_k(probs, cfg.experts_used)
    return logits, probs, chosen, weights / jnp.sum(weights, axis=-1, keepdims=True)


def experts_dense(p, h, chosen, weights):
    """Every chosen expert for every token (inference's computation)."""
    g = jnp.einsum("nd,edf->nef", h, p["gate"])
    u = jnp.einsum("nd,edf->nef", h, p["up"])
    y = jnp.einsum("nef,efd->ned", jax.nn.silu(g) * u, p["down"])
    picked = jnp.take_along_axis(y, chosen[:, :, None], axis=1)
    return jnp.sum(picked * weights[:, :, None], axis=1)


def experts_capacity(cfg, p, h, chosen, weights, capacity):
    """Each expert computes at most `capacity` of its tokens (earlier tokens first); returns the
    output and the share of (token, expert) choices dropped."""
    n, k = chosen.shape
    flat = chosen.reshape(-1)
    onehot = jax.nn.one_hot(flat, cfg.experts, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
    kept = position < capacity
    slot = jnp.where(kept, flat * capacity + position, cfg.experts * capacity)
    token = jnp.repeat(jnp.arange(n), k)
    index = jnp.full(cfg.experts * capacity + 1, n, jnp.int32).at[slot].set(token)[:-1]
    padded = jnp.concatenate([h, jnp.zeros((1, h.shape[1]), h.dtype)], axis=0)
    xe = padded[index].reshape(cfg.experts, capacity, -1)
    g = jnp.einsum("ecd,edf->ecf", xe, p["gate"])
    u = jnp.einsum("ecd,edf->ecf", xe, p["up"])
    ye = jnp.einsum("ecf,efd->ecd", jax.nn.silu(g) * u, p["down"]).reshape(cfg.experts * capacity, -1)
    ye = jnp.concatenate([ye, jnp.zeros((1, ye.shape[1]), ye.dtype)], axis=0)
    contrib = ye[slot] * (weights.reshape(-1) * kept)[:, None]
    out = jnp.zeros_like(h).at[token].add(contrib)
    return out, 1.0 - jnp.mean(kept)


def forward(cfg, params, ids, capacity_factor=None):
    """Logits (batch, seq, vocab) and the auxiliary terms: load-balancing loss, router z-loss,
    dropped share, and each layer's chosen experts (batch*seq, k)."""
    b, t = ids.shape
    x = params["embed"][ids]
    balance, zloss, dropped, routes = 0.0, 0.0, 0.0, []
    for p in params["layers"]:
        x = x + attention(cfg, p, x)
        h = rms_norm(x, p["ffn_norm"], cfg.eps).reshape(b * t, cfg.embd)
        logits, probs, chosen, weights = route(cfg, p, h)
        share = jnp.mean(jax.nn.one_hot(chosen, cfg.experts).sum(axis=1), axis=0) / cfg.experts_used
        balance += cfg.experts * jnp.sum(share * jnp.mean(probs, axis=0))
        zloss += jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        if capacity_factor is None:
            y = experts_dense(p, h, chosen, weights)
        else:
            capacity = int(math.ceil(b * t * cfg.experts_used / cfg.experts * capacity_factor))
            y, drop = experts_capacity(cfg, p, h, chosen, weights, capacity)
            dropped += drop
        x = x + y.reshape(b, t, cfg.embd)
        routes.append(chosen)
    x = rms_norm(x, params["out_norm"], cfg.eps)
    n = len(params["layers"])
    return x @ params["output"], (balance / n, zloss / n, dropped / n, routes)
