"""Hybrids, measured: the capstone GPT with a layer layout, trained over seeds, and what each layout keeps per token.

2025-26 models mix layer kinds instead of running dense attention in every layer (claim C43):
Gemma 3 interleaves 5 local (sliding-window) layers per global one (arXiv:2503.19786), Qwen3-Next
3 Gated DeltaNet layers per attention layer, DeepSeek-V3.2 keeps every layer but lets a lightning
indexer pick the keys each query reads (DSA, arXiv:2512.02556). ``attnlab.models.gpt.GPT`` takes
such a layout (``layout=[...]``, one kind per layer); this module measures what it buys.

Read top to bottom:

1. :func:`layer_bytes` and :func:`layout_bytes`: the bytes a layout keeps for one sequence at a
   given context (KV cache or state) and the bytes one decoding step reads from them, per
   layer kind, from :func:`attnlab.iomodel.kv_cache_bytes`,
   :func:`attnlab.iomodel.mla_cache_bytes` and :func:`attnlab.linear_attention.recurrent_state_bytes`.
2. :data:`RECIPE` and :data:`LAYOUTS`: the tiny model (exercise 09's tiny GPT, longer sequences
   so that windows and blocks mean something) and the four layouts lesson 12 compares.
3. :func:`train_layout`: one (layout, seed) run on the stdlib character corpus
   (``attnlab.train.train_lm``, then ``evaluate_lm``).
4. :func:`compare_layouts`: every layout over every seed, on the same batches, one row per layout;
   :func:`format_rows` prints them.

At 150 steps the tiny model is early in training; ``benchmarks/hybrids.py`` runs the same
comparison at 600 and 1500 steps (``benchmarks/hybrids_results.md``: the ranking holds).

Example::

    rows = compare_layouts()                  # 4 layouts x 3 seeds: about 35 s on one CPU core
    print(format_rows(rows))
"""

from __future__ import annotations

import statistics
import time

from attnlab import validate
from attnlab.iomodel import kv_cache_bytes, mla_cache_bytes
from attnlab.linear_attention import recurrent_state_bytes
from attnlab.models.gpt import GPT, LAYER_KINDS, layout_from_ratio

__all__ = ["layer_bytes", "layout_bytes", "model_bytes", "RECIPE", "LAYOUTS", "train_layout", "compare_layouts",
           "format_rows", "layout_from_ratio"]


# ---------------------------------------------------------------------------------------------
# 1. bytes kept and read per layout
# ---------------------------------------------------------------------------------------------

def layer_bytes(kind, context, *, d_model, n_heads, n_kv_heads=None, window=32, sinks=4, topk=2, select_block=16,
                index_dim=16, bytes_per_element=2, state_bytes_per_element=4, d_latent=None, d_rope=None):
    """(held, read): one layer's bytes kept for one sequence of ``context`` tokens, and read by one decoding step.

    With hs = d_model // n_heads and kv = n_kv_heads (default n_heads), ``c(n) = kv_cache_bytes(n,
    1, kv, hs, bytes_per_element)``:

    * ``"dense"``: the KV cache grows with the context: held = read = c(context);
    * ``"local"``: only the sinks and the window are kept: held = read = c(min(context, sinks + window));
    * ``"selected"`` (DSA): the whole cache is kept, plus the indexer's key per token
      (``index_dim`` elements); a step reads every indexer key (to score them) but only the
      ``topk`` selected blocks of ``select_block`` keys: held = c(context) + context x index_dim x e,
      read = c(min(context, topk x select_block)) + context x index_dim x e;
    * ``"delta"``: a d_k x d_v state per head, whatever the context: held = read =
      ``recurrent_state_bytes(1, n_heads, hs, hs, state_bytes_per_element)`` (float32 by default);
    * ``"mla"`` (multi-head latent attention): one latent of ``d_latent`` and one rotary key of
      ``d_rope`` per token, shared by the heads, all read by a step (the absorbed decode): held =
      read = ``mla_cache_bytes(context, 1, d_latent, d_rope, bytes_per_element)``; ``d_latent`` and
      ``d_rope`` are required for it (a ``GPT``'s are in its config: :func:`model_bytes`).

    Example: ``layer_bytes("local", 4096, d_model=32, n_heads=2, window=16, sinks=4)  # (2560, 2560)``
    """
    if kind not in LAYER_KINDS:
        raise ValueError(f"kind: expected one of {LAYER_KINDS}, got {kind!r}")
    validate.integer(context, "context", minimum=0)
    for name, val in (("d_model", d_model), ("n_heads", n_heads), ("window", window), ("topk", topk),
                      ("select_block", select_block), ("index_dim", index_dim),
                      ("bytes_per_element", bytes_per_element), ("state_bytes_per_element", state_bytes_per_element)):
        validate.integer(val, name)
    validate.integer(sinks, "sinks", minimum=0)
    kv = n_heads if n_kv_heads is None else validate.integer(n_kv_heads, "n_kv_heads")
    if d_model % n_heads:
        raise ValueError(f"n_heads: expected a divisor of d_model={d_model}, got {n_heads}")
    hs, e = d_model // n_heads, bytes_per_element
    if kind == "mla":
        if d_latent is None or d_rope is None:
            raise ValueError(f"d_latent: an 'mla' layer's bytes need d_latent and d_rope, got {d_latent} and {d_rope}")
        held = mla_cache_bytes(context, 1, d_latent, d_rope, e)
        return held, held

    def cache(n):
        return kv_cache_bytes(n, 1, kv, hs, e)

    if kind == "dense":
        return cache(context), cache(context)
    if kind == "local":
        kept = cache(min(context, sinks + window))
        return kept, kept
    if kind == "selected":
        index_keys = context * index_dim * e
        return cache(context) + index_keys, cache(min(context, topk * select_block)) + index_keys
    state = recurrent_state_bytes(1, n_heads, hs, hs, state_bytes_per_element)
    return state, state


def layout_bytes(layout, context, **kwargs):
    """A layout's bytes for one sequence at ``context`` tokens: a dict with ``"held"`` (cache and
    state kept, summed over layers), ``"read"`` (bytes one decoding step reads from them, i.e. per
    generated token at batch 1), ``"held_per_token"`` (held / context) and ``"per_layer"`` (a list
    of (kind, held, read)). ``kwargs``: :func:`layer_bytes`' (d_model and n_heads required).

    Example: ``layout_bytes(["delta"] * 3 + ["dense"], 4096, d_model=32, n_heads=2)["held"]``
    """
    if isinstance(layout, str) or not isinstance(layout, (list, tuple)) or not layout:
        raise TypeError(f"layout: expected a non-empty list of layer kinds from {LAYER_KINDS}, got {layout!r}")
    per_layer = [(kind, *layer_bytes(kind, context, **kwargs)) for kind in layout]
    held = sum(h for _, h, _ in per_layer)
    read = sum(r for _, _, r in per_layer)
    return {"held": held, "read": read, "held_per_token": held / context if context else float("nan"),
            "per_layer": per_layer}


def model_bytes(model, context, *, bytes_per_element=2, state_bytes_per_element=4):
    """:func:`layout_bytes` of a ``GPT`` (its layout, or every layer dense; its window, sinks, ...).

    Example: ``model_bytes(GPT(96, 64, 32, 2, 4, layout=["local"] * 3 + ["dense"]), 4096)["read"]``
    """
    if not isinstance(model, GPT):
        raise TypeError(f"model: expected an attnlab.models.gpt.GPT, got {type(model).__name__}")
    c = model.config
    layout = c.get("layout") or ["dense"] * c["n_layers"]
    options = {k: c[k] for k in ("window", "sinks", "topk", "select_block", "index_dim", "d_latent", "d_rope")
               if k in c}
    return layout_bytes(layout, context, d_model=c["d_model"], n_heads=c["n_heads"],
                        n_kv_heads=c.get("n_kv_heads"), bytes_per_element=bytes_per_element,
                        state_bytes_per_element=state_bytes_per_element, **options)


# ---------------------------------------------------------------------------------------------
# 2. the recipe and the layouts
# ---------------------------------------------------------------------------------------------

# Exercise 09's tiny GPT (d_model 32, 2 heads of 16, learned positions, Adam at 3e-3, clip 1) with
# 4 layers and 64 positions: a window of 16 plus 4 sinks, blocks of 16 with the top 2 selected.
RECIPE = dict(
    model=dict(vocab_size=96, block_size=64, d_model=32, n_heads=2, n_layers=4, window=16, sinks=4, topk=2,
               select_block=16),
    steps=150, batch_size=8, lr=3e-3, clip=1.0, eval_batches=4, eval_batch_size=16, eval_seed=1234,
    context=4096,
)

# Gemma 3's 5:1 local:global is 3:1 here (4 layers); Qwen3-Next's delta:attention is 3:1.
LAYOUTS = {
    "dense": ["dense"] * 4,
    "local 3:1 + sinks": ["local", "local", "local", "dense"],
    "selected top-k": ["selected"] * 4,
    "delta 3:1": ["delta", "delta", "delta", "dense"],
}


# ---------------------------------------------------------------------------------------------
# 3. one run
# ---------------------------------------------------------------------------------------------

def train_layout(layout, seed=0, steps=None, *, corpus=None, **overrides):
    """Train the tiny GPT of :data:`RECIPE` with ``layout`` from ``seed``; returns (model, validation loss, history).

    Initial weights ``GPT(..., layout=layout, seed=seed)``; batches ``corpus.batch("train",
    batch_size, block_size, g)`` from ``g`` seeded with ``seed`` (so every layout of a seed sees the
    same batches); ``attnlab.train.train_lm`` (Adam, clipped), one thread and deterministic
    algorithms; validation: ``evaluate_lm`` on the same ``eval_batches`` windows for every run.
    ``overrides``: model arguments (d_model=..., window=...) or the recipe's (batch_size=, lr=, ...).

    Example: ``model, valid, history = train_layout(["delta"] * 3 + ["dense"], seed=0, steps=20)``
    """
    from attnlab.train import deterministic, evaluate_lm, train_lm

    recipe = {k: v for k, v in RECIPE.items() if k != "model"}
    model_kwargs = dict(RECIPE["model"])
    for key, value in overrides.items():
        (recipe if key in recipe else model_kwargs)[key] = value
    steps = recipe["steps"] if steps is None else validate.integer(steps, "steps", minimum=0)
    validate.integer(seed, "seed", minimum=0)
    if corpus is None:
        from attnlab.data.stdlib_text import load_corpus

        corpus = load_corpus()
    with deterministic(seed, threads=1):   # tiny matrices: one thread is faster, and rounds the same every run
        model = GPT(**model_kwargs, layout=list(layout), seed=seed)
        history = train_lm(model, corpus, steps, batch_size=recipe["batch_size"], lr=recipe["lr"], seed=seed,
                           clip=recipe["clip"], progress=False)
        valid = evaluate_lm(model, corpus, batches=recipe["eval_batches"], batch_size=recipe["eval_batch_size"],
                            seed=recipe["eval_seed"])
    return model, valid, history


# ---------------------------------------------------------------------------------------------
# 4. every layout, every seed
# ---------------------------------------------------------------------------------------------

def compare_layouts(layouts=None, seeds=(0, 1, 2), steps=None, *, context=None, corpus=None, verbose=False,
                    **model_kwargs):
    """Train the tiny GPT on each layout for each seed; one row (a dict) per layout.

    layouts: {name: [kind per layer]} (default :data:`LAYOUTS`); seeds: the runs per layout (each
    seed: its own initial weights and batches, shared by every layout); steps: default the
    recipe's; context: the context at which bytes are counted (default 4096); ``model_kwargs``:
    overrides of :data:`RECIPE` (``d_model=``, ``window=``, ``batch_size=``, ...). ``verbose``
    prints each run as it ends.

    Each row: ``name``, ``layout``, ``val_loss`` (one per seed), ``mean``, ``spread`` (max - min
    over seeds), ``std``, ``train_loss`` (each seed's loss at every step), ``params``, ``seconds``
    (training and evaluation, all seeds), ``context``,
    ``held_bytes`` (cache and state for one sequence at ``context``, :func:`model_bytes`),
    ``held_bytes_per_token`` (held / context) and ``decode_bytes_per_token`` (read by one decoding step).

    Example: ``rows = compare_layouts({"dense": ["dense"] * 4, "delta": ["delta"] * 3 + ["dense"]}, seeds=(0,))``
    """
    layouts = LAYOUTS if layouts is None else layouts
    if not isinstance(layouts, dict) or not layouts:
        raise TypeError(f"layouts: expected a non-empty dict {{name: [layer kinds]}}, got {type(layouts).__name__}")
    seeds = tuple(seeds)
    if not seeds:
        raise ValueError("seeds: expected at least one seed, got none")
    context = RECIPE["context"] if context is None else validate.integer(context, "context")
    if corpus is None:
        from attnlab.data.stdlib_text import load_corpus

        corpus = load_corpus()
    rows = []
    for name, layout in layouts.items():
        losses, curves, seconds, model = [], [], 0.0, None
        for seed in seeds:
            t0 = time.perf_counter()
            model, valid, history = train_layout(layout, seed, steps, corpus=corpus, **model_kwargs)
            seconds += time.perf_counter() - t0
            losses.append(valid)
            curves.append(history["loss"])
            if verbose:
                print(f"{name:>20}  seed {seed}: validation loss {valid:.4f}  ({time.perf_counter() - t0:.1f} s)")
        nbytes = model_bytes(model, context)
        rows.append({
            "name": name, "layout": list(layout), "val_loss": losses, "mean": statistics.fmean(losses),
            "spread": max(losses) - min(losses), "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "train_loss": curves, "params": model.num_parameters(), "seconds": seconds, "context": context,
            "held_bytes": nbytes["held"], "held_bytes_per_token": nbytes["held_per_token"],
            "decode_bytes_per_token": nbytes["read"],
        })
    return rows


def format_rows(rows):
    """The rows of :func:`compare_layouts` as a text table (loss mean +- std, per-seed losses, bytes).

    Example: ``print(format_rows(compare_layouts()))``
    """
    context = rows[0]["context"] if rows else 0
    lines = [f"{'layout':<20} {'valid loss':>16} {'per seed':>24} {'kept @' + str(context):>12} "
             f"{'kept/token':>11} {'read/step':>10}"]
    for r in rows:
        seeds = " ".join(f"{v:.3f}" for v in r["val_loss"])
        lines.append(f"{r['name']:<20} {r['mean']:>8.3f} +- {r['std']:.3f} {seeds:>24} {r['held_bytes']:>10,} B "
                     f"{r['held_bytes_per_token']:>9.1f} B {r['decode_bytes_per_token']:>8,} B")
    return "\n".join(lines)
