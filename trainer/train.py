"""Trains the small qwen3moe model on the KJV and writes it as an f32 GGUF.

    python train.py --preset full|small|board|board-small --seed N --out DIR

DIR receives: model-f32.gguf, held-out.txt (the held-out chapters, for `sluice perplexity`),
baselines.json (unigram and add-k bigram perplexity of the same held-out tokens) and
training.log.tsv (step, loss, balance loss, dropped share, held-out loss). Deterministic for a
seed on one machine: a fixed number of steps, batches drawn from a seeded generator, and XLA's CPU
kernels, which give the same bits for the same program and thread count.
"""

import argparse
import json
import math
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

import corpus
import tokenizer
from model import Config

# Each preset: the model, the tokenizer's size, and the schedule. "full" is the model the benches
# and the demo use (about 40 minutes here); "small" is the same recipe at CI's size (about 3).
PRESETS = {
    "full": dict(
        cfg=Config(vocab=4096, embd=256, layers=8, heads=4, kv_heads=2, head_dim=64,
                   experts=32, experts_used=4, expert_ff=128, ctx=256),
        batch=16, steps=640, lr=3e-3,
    ),
    "small": dict(
        cfg=Config(vocab=1024, embd=128, layers=4, heads=4, kv_heads=2, head_dim=32,
                   experts=16, experts_used=4, expert_ff=64, ctx=256),
        batch=8, steps=400, lr=4e-3,
    ),
    # Qwen3-30B-A3B's routing fan-out (128 experts a layer, 8 routed) with narrow experts, which
    # two cores can train; pad.py exports them `pad_ff` units wide (zero units: the same
    # function) so that each expert is as many bytes as a board model's (2.0 MiB in Q8_0, where
    # Qwen3-30B-A3B's Q4_K_M experts are 2.5-2.9 MiB). "board-small" is its size for the gates.
    "board": dict(
        cfg=Config(vocab=4096, embd=256, layers=8, heads=4, kv_heads=2, head_dim=64,
                   experts=128, experts_used=8, expert_ff=32, ctx=256),
        batch=16, steps=600, lr=3e-3, pad_ff=2560,
    ),
    "board-small": dict(
        cfg=Config(vocab=1024, embd=128, layers=4, heads=4, kv_heads=2, head_dim=32,
                   experts=128, experts_used=8, expert_ff=32, ctx=256),
        batch=8, steps=240, lr=4e-3, pad_ff=256,
    ),
}
# Tokens an expert computes per batch, as a multiple of its even share. The routers start
# crowded (most tokens pick the same few experts until the balancing loss spreads them), so the
# warm-up steps get room for four times the share, and the rest 1.5 times.
CAPACITY_FACTOR = 1.5
WARMUP_CAPACITY_FACTOR = 4.0
BALANCE_WEIGHT = 0.01
Z_WEIGHT = 0.001
WARMUP = 0.06


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def baselines(train_ids, held_ids, vocab):
    """Unigram and add-k bigram perplexity of held_ids (k tuned on the last 5% of train_ids)."""
    train_ids, held_ids = np.asarray(train_ids), np.asarray(held_ids)
    uni = np.bincount(train_ids, minlength=vocab) + 1.0
    uni /= uni.sum()
    unigram = math.exp(-np.mean(np.log(uni[held_ids])))

    def bigram_nll(fit, score, k):
        counts = np.zeros((vocab, vocab))
        np.add.at(counts, (fit[:-1], fit[1:]), 1.0)
        probs = (counts + k) / (counts.sum(axis=1, keepdims=True) + k * vocab)
        return -np.mean(np.log(probs[score[:-1], score[1:]]))

    cut = int(len(train_ids) * 0.95)
    k = min((0.001, 0.003, 0.01, 0.03, 0.1, 0.3), key=lambda k: bigram_nll(train_ids[:cut], train_ids[cut:], k))
    return {"unigram": unigram, "bigram": math.exp(bigram_nll(train_ids, held_ids, k)), "bigram_k": k,
            "held_out_tokens": int(len(held_ids)), "train_tokens": int(len(train_ids))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, help="override the preset's step count (tests)")
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import optax

    import export
    import model

    preset = PRESETS[a.preset]
    cfg, batch = preset["cfg"], preset["batch"]
    steps = a.steps or preset["steps"]
    a.out.mkdir(parents=True, exist_ok=True)

    chapters = corpus.read_chapters()
    train_text, held_text = corpus.split(chapters)
    tok = tokenizer.train(train_text, cfg.vocab)
    train_ids = np.concatenate([tok.encode(c).ids for c in train_text]).astype(np.int32)
    held_ids = np.asarray(tok.encode("".join(held_text)).ids, np.int32)
    (a.out / "held-out.txt").write_text("".join(held_text))
    base = baselines(train_ids, held_ids, cfg.vocab)
    (a.out / "baselines.json").write_text(json.dumps(base, indent=2) + "\n")
    log(f"train: {len(train_ids)} tokens, held out: {len(held_ids)}; unigram {base['unigram']:.1f}, "
        f"bigram {base['bigram']:.1f}")

    rng = np.random.default_rng(a.seed)
    params = model.init(cfg, jax.random.PRNGKey(a.seed))
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    log(f"model: {n_params / 1e6:.1f}M parameters, {steps} steps of {batch}x{cfg.ctx} tokens")

    warmup = max(1, int(steps * WARMUP))
    schedule = optax.warmup_cosine_decay_schedule(0.0, preset["lr"], warmup, steps, preset["lr"] * 0.1)
    decay = jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay))
    state = opt.init(params)

    def loss_fn(p, ids, capacity_factor):
        logits, (balance, z, dropped, _) = model.forward(cfg, p, ids[:, :-1], capacity_factor)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
        return nll + BALANCE_WEIGHT * balance + Z_WEIGHT * z, (nll, balance, dropped)

    @partial(jax.jit, static_argnums=3)
    def step(p, s, ids, capacity_factor):
        (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, ids, capacity_factor)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, aux

    @jax.jit
    def held_loss(p, ids):
        logits, _ = model.forward(cfg, p, ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    n_eval = min(8, len(held_ids) // (cfg.ctx + 1))
    eval_ids = jnp.asarray(held_ids[: n_eval * (cfg.ctx + 1)].reshape(n_eval, cfg.ctx + 1))
    started = time.monotonic()
    with open(a.out / "training.log.tsv", "w") as tsv:
        tsv.write("step\tloss\tbalance\tdropped\theld_out_loss\n")
        for i in range(1, steps + 1):
            starts = rng.integers(0, len(train_ids) - cfg.ctx - 1, batch)
            ids = np.stack([train_ids[s:s + cfg.ctx + 1] for s in starts])
            factor = WARMUP_CAPACITY_FACTOR if i <= warmup else CAPACITY_FACTOR
            params, state, (nll, balance, dropped) = step(params, state, jnp.asarray(ids), factor)
            held = ""
            if i % 50 == 0 or i == steps or i == warmup:
                held = f"{float(held_loss(params, eval_ids)):.4f}"
                rate = i * batch * cfg.ctx / (time.monotonic() - started)
                log(f"step {i}/{steps}: loss {float(nll):.3f}, held-out {held} "
                    f"(perplexity {math.exp(float(held)):.1f}), dropped {float(dropped):.1%}, {rate:.0f} tok/s")
            tsv.write(f"{i}\t{float(nll):.4f}\t{float(balance):.4f}\t{float(dropped):.4f}\t{held}\n")

    flat, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(params))
    np.savez(a.out / "params.npz", **{jax.tree_util.keystr(k): v for k, v in flat})
    # Written under a temporary name, then renamed: a model-f32.gguf is always a whole one.
    path = a.out / "model-f32.gguf"
    unfinished = a.out / "model-f32.gguf.partial"
    export.write(unfinished, cfg, jax.device_get(params), tokenizer.vocabulary(tok),
                 f"sluice KJV MoE ({a.preset}, seed {a.seed})")
    unfinished.rename(path)
    log(f"trained in {time.monotonic() - started:.0f} s")
    print(path)


if __name__ == "__main__":
    main()
