"""The references of exercise 01_soft_alignment (never shown in the exercise): the softmax and its mask are the
library's; specific are the decomposition (score, weights and context, one decoder step) and the experiment, the
course's RNNsearch trained with an alignment model plugged in and how much of swapped pairs' weight crosses."""

import itertools
from functools import lru_cache

import torch

from attnlab.attention import masked_softmax, softmax


def additive_scores(s, h, w, u, v):
    """Alignment scores e_j = v^T tanh(W s + U h_j): s (B, Dq) decoder state, h (B, N, Dk) encoder states,
    w (A, Dq), u (A, Dk), v (A,) -> (B, N)."""
    return torch.tanh((s @ w.T)[:, None, :] + h @ u.T) @ v  # (B, 1, A) + (B, N, A) -> (B, N)


def context_vector(scores, h, mask=None):
    """(context (B, Dk), weights (B, N)): scores (B, N) softmaxed over the N source positions (mask: bool (B, N),
    True = real token, or None; a row with none gets zero weights), and the encoder states h (B, N, Dk) averaged."""
    weights = softmax(scores, dim=-1) if mask is None else masked_softmax(scores, mask, dim=-1)  # (B, N)
    return torch.einsum("bn,bnd->bd", weights, h), weights  # (B, Dk), (B, N)


def decode_step(s, h, w, u, v, w_s, w_c, mask=None):
    """One step of an attention decoder, (new state tanh(s W_s^T + c W_c^T) (B, Dq), weights (B, N)): s (B, Dq);
    h, w, u, v as in ``additive_scores``; w_s (Dq, Dq), w_c (Dq, Dk); mask as in ``context_vector``."""
    c, weights = context_vector(additive_scores(s, h, w, u, v), h, mask)  # (B, Dk), (B, N)
    return torch.tanh(s @ w_s.T + c @ w_c.T), weights


# the recipe the notebook's setup cell states (a test checks the two agree)
RECIPE = dict(n_train=3000, train_seed=1, min_len=5, max_len=8, n_probe=64, probe_seed=2,
              emb_dim=16, hidden_dim=32, batch_size=32, lr=1e-2, steps=250)


@lru_cache(maxsize=1)
def _data():
    """The training ids, the probe batch (src, src_len, tgt) and its swaps, as the notebook builds them."""
    from attnlab.data.translation import adjective_noun_swaps, encode, generate_pairs, source_vocab, target_vocab

    r = RECIPE
    sv, tv = source_vocab(), target_vocab()
    train = generate_pairs(r["n_train"], seed=r["train_seed"], min_len=r["min_len"], max_len=r["max_len"])
    candidates = generate_pairs(400, seed=r["probe_seed"], min_len=5, max_len=9)
    probe = [(en, fr) for en, fr in candidates if adjective_noun_swaps(en)][: r["n_probe"]]
    src, src_len = encode([en for en, _ in probe], sv)  # (P, S), (P,)
    tgt, _ = encode([fr for _, fr in probe], tv)  # (P, T)
    return ([sv.encode(en) for en, _ in train], [tv.encode(fr) for _, fr in train],
            (src, src_len, tgt), [adjective_noun_swaps(en) for en, _ in probe], (len(sv), len(tv)))


def train_rnnsearch(seed, steps, score_fn=additive_scores, context_fn=context_vector):
    """RNNsearch with ``score_fn`` and ``context_fn`` plugged in, trained ``steps`` Adam steps from ``seed``."""
    from attnlab.data.translation import batches
    from attnlab.models.seq2seq import RNNsearch
    from attnlab.train import deterministic, fit

    r = RECIPE
    src_ids, tgt_ids, _, _, (n_src, n_tgt) = _data()
    with deterministic(seed, threads=1), torch.enable_grad():  # also when a caller runs under no_grad
        model = RNNsearch(n_src, n_tgt, emb_dim=r["emb_dim"], hidden_dim=r["hidden_dim"], maxout_dim=r["hidden_dim"],
                          score_fn=score_fn, context_fn=context_fn)
        generator = torch.Generator().manual_seed(seed)
        stream = itertools.chain.from_iterable(batches(src_ids, tgt_ids, r["batch_size"], generator=generator)
                                               for _ in itertools.count())
        fit(model, stream, lambda b: model.loss(b[0], b[1], b[2]), steps, lr=r["lr"], progress=False)
    return model


@torch.no_grad()
def probe_alignments(model):
    """The teacher-forced alignment of every probe sentence: (P, T, S), row i = French word i."""
    _, _, (src, src_len, tgt), _, _ = _data()
    rows, plugged = [], model.context_fn

    def recording(scores, h, mask=None):
        context, weights = (plugged or context_vector)(scores, h, mask)
        rows.append(weights)
        return context, weights

    model.eval()
    model.context_fn = recording
    try:
        model(src, src_len, tgt)
    finally:
        model.context_fn = plugged
    return torch.stack(rows, dim=1)  # (P, T, S)


def swap_masses(alignments):
    """(crossed, straight): the mean weight of a swapped pair's rows on the crossed source positions
    (noun -> noun, adjective -> adjective) and on the straight ones (noun -> adjective, adjective -> noun)."""
    _, _, _, swaps, _ = _data()
    at = [(a, i, j) for a, pairs in zip(alignments, swaps) for i, j in pairs]  # a: (T, S)
    crossed = torch.stack([(a[i, j] + a[i + 1, j - 1]) / 2 for a, i, j in at]).mean()
    straight = torch.stack([(a[i, j - 1] + a[i + 1, j]) / 2 for a, i, j in at]).mean()
    return float(crossed), float(straight)


def alignment_crossing(seed, steps=250):
    """``(crossed, straight)`` (see ``swap_masses``) of RNNsearch trained ``steps`` steps from ``seed``."""
    return swap_masses(probe_alignments(train_rnnsearch(seed, steps)))
