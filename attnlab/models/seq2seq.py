"""Encoder-decoder RNNs for translation, with and without attention (lesson 01).

Two models, after Bahdanau, Cho & Bengio (2014), "Neural machine translation by
jointly learning to align and translate", appendix A, scaled down to a laptop:

* ``RNNencdec`` (Cho et al. 2014): a GRU reads the source and its last state
  becomes one fixed vector ``c``; the decoder sees only ``c``. Everything the
  sentence says has to squeeze through ``hidden_dim`` numbers.
* ``RNNsearch``: a bidirectional GRU keeps one annotation ``h_j = [fwd_j; bwd_j]``
  per source position; at each output step the decoder scores every annotation
  against its state with the additive alignment model
  ``e_ij = v^T tanh(W s_{i-1} + U h_j)`` (``attnlab.attention.AdditiveAttention``),
  turns the scores into weights ``alpha_ij`` with a softmax over the real (not
  padded) positions, and reads the context ``c_i = sum_j alpha_ij h_j``.

Both decoders emit word ``y_i`` from a maxout layer over the decoder state, the
previous word's embedding and the context (appendix A.2.2). Two departures from
the paper, both common in later implementations: the output layer reads the new
state ``s_i`` rather than ``s_{i-1}``, and RNNsearch's decoder reads the previous
word before it attends (see ``RNNsearch``), so its query ``s_{i-1}`` is, more
exactly, ``s'_i = GRU(E y_{i-1}, s_{i-1})``.

Shapes: ``src (B, S)`` and ``tgt (B, T)`` are padded id tensors (pad id 0) whose
rows end with ``<eos>``; ``src_len (B,)`` counts the real tokens.

Example::

    model = RNNsearch(src_vocab_size=67, tgt_vocab_size=95)
    logits = model(src, src_len, tgt)            # (B, T, V), teacher forcing
    ids, weights = model.greedy_decode(src, src_len)  # (B, T'), (B, T', S)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from attnlab.attention import AdditiveAttention, masked_softmax

__all__ = ["RNNencdec", "RNNsearch", "Maxout", "translate", "MODELS"]

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


class Maxout(nn.Module):
    """``t = max(t~_{2j-1}, t~_{2j})`` over pairs of a linear layer's outputs: ``(..., in) -> (..., out)``."""

    def __init__(self, in_dim: int, out_dim: int, pool: int = 2):
        super().__init__()
        self.pool = pool
        self.linear = nn.Linear(in_dim, out_dim * pool)

    def forward(self, x):
        t = self.linear(x)  # (..., out * pool)
        return t.view(*t.shape[:-1], -1, self.pool).max(dim=-1).values  # (..., out)


def _check_batch(src, src_len, tgt=None):
    if not torch.is_tensor(src) or src.dtype != torch.long or src.dim() != 2:
        raise TypeError(f"src: expected a (B, S) long tensor of token ids, got {getattr(src, 'shape', type(src))}")
    if not torch.is_tensor(src_len) or src_len.shape != (src.shape[0],):
        raise ValueError(f"src_len: expected a ({src.shape[0]},) tensor of lengths, got {getattr(src_len, 'shape', src_len)}")
    if int(src_len.min()) < 1 or int(src_len.max()) > src.shape[1]:
        raise ValueError(f"src_len: lengths must lie in [1, {src.shape[1]}]")
    if tgt is not None and (not torch.is_tensor(tgt) or tgt.dim() != 2 or tgt.shape[0] != src.shape[0]):
        raise ValueError(f"tgt: expected a ({src.shape[0]}, T) long tensor, got {getattr(tgt, 'shape', type(tgt))}")


def _shift_right(tgt):
    """Decoder inputs for teacher forcing: ``<bos> y_1 ... y_{T-1}``. ``(B, T) -> (B, T)``."""
    bos = torch.full_like(tgt[:, :1], BOS_ID)
    return torch.cat([bos, tgt[:, :-1]], dim=1)


class _Seq2Seq(nn.Module):
    """What both models share: embeddings, the maxout output layer, the loss and greedy decoding."""

    def __init__(self, src_vocab_size, tgt_vocab_size, emb_dim, hidden_dim, context_dim, maxout_dim):
        super().__init__()
        self.config = dict(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, emb_dim=emb_dim,
                           hidden_dim=hidden_dim, maxout_dim=maxout_dim)
        self.src_embed = nn.Embedding(src_vocab_size, emb_dim, padding_idx=PAD_ID)
        self.tgt_embed = nn.Embedding(tgt_vocab_size, emb_dim, padding_idx=PAD_ID)
        # t~_i = U_o s_i + V_o E y_{i-1} + C_o c_i, then maxout, then W_o
        self.maxout = Maxout(hidden_dim + emb_dim + context_dim, maxout_dim)
        self.out = nn.Linear(maxout_dim, tgt_vocab_size)

    def _logits(self, s, y_prev_emb, c):
        return self.out(self.maxout(torch.cat([s, y_prev_emb, c], dim=-1)))

    def loss(self, src, src_len, tgt):
        """Mean cross-entropy per real target token (padding ignored)."""
        logits = self(src, src_len, tgt)  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=PAD_ID)

    def num_parameters(self):
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def greedy_decode(self, src, src_len, max_len: int | None = None):
        """Translate greedily (the most likely word at each step).

        Returns ``(ids (B, T'), weights)``: ``ids`` end with ``<eos>`` then padding; ``weights`` is
        the alignment ``(B, T', S)`` (row i: how much output word i drew on each source position)
        for ``RNNsearch`` and ``None`` for ``RNNencdec``, which has no alignment to show.
        """
        _check_batch(src, src_len)
        if max_len is None:
            max_len = 2 * int(src_len.max()) + 10
        state = self._start(src, src_len)
        B = src.shape[0]
        y_prev = torch.full((B,), BOS_ID, dtype=torch.long, device=src.device)
        done = torch.zeros(B, dtype=torch.bool, device=src.device)
        ids, weights = [], []
        for _ in range(max_len):
            logits, state, w = self._step(y_prev, state)
            y = logits.argmax(dim=-1).masked_fill(done, PAD_ID)  # (B,)
            ids.append(y)
            if w is not None:
                weights.append(w.masked_fill(done[:, None], 0.0))
            done = done | (y == EOS_ID)
            y_prev = y
            if bool(done.all()):
                break
        ids = torch.stack(ids, dim=1)
        return ids, (torch.stack(weights, dim=1) if weights else None)


class RNNencdec(_Seq2Seq):
    """Encoder-decoder with a fixed-length vector between them (Cho et al. 2014; "RNNencdec" in Bahdanau et al. 2014).

    Encoder: GRU over the source; ``c = tanh(V h_S)`` from its last real state ``(B, hidden_dim)``.
    Decoder: ``s_0 = tanh(W_s c)``; ``s_i = GRU([E y_{i-1}; c], s_{i-1})``; ``y_i`` from maxout(s_i, E y_{i-1}, c).

    Example: ``RNNencdec(67, 95)(src, src_len, tgt).shape == (B, T, 95)``
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, emb_dim: int = 48, hidden_dim: int = 96,
                 maxout_dim: int = 64):
        super().__init__(src_vocab_size, tgt_vocab_size, emb_dim, hidden_dim, hidden_dim, maxout_dim)
        self.encoder = nn.GRU(emb_dim, hidden_dim, batch_first=True)
        self.to_context = nn.Linear(hidden_dim, hidden_dim)  # V
        self.init_state = nn.Linear(hidden_dim, hidden_dim)  # W_s
        self.decoder = nn.GRU(emb_dim + hidden_dim, hidden_dim, batch_first=True)

    def encode(self, src, src_len):
        """The fixed vector: ``(B, S) -> c (B, hidden_dim)``."""
        packed = pack_padded_sequence(self.src_embed(src), src_len.cpu(), batch_first=True, enforce_sorted=False)
        _, h_last = self.encoder(packed)  # (1, B, H): the state after the last real token
        return torch.tanh(self.to_context(h_last[0]))

    def forward(self, src, src_len, tgt):
        """Teacher-forced logits ``(B, T, V)`` for targets ``tgt (B, T)``."""
        _check_batch(src, src_len, tgt)
        c = self.encode(src, src_len)  # (B, H)
        y_prev = self.tgt_embed(_shift_right(tgt))  # (B, T, E)
        c_rep = c[:, None, :].expand(-1, tgt.shape[1], -1)  # (B, T, H): the same c at every step
        s0 = torch.tanh(self.init_state(c))[None]  # (1, B, H)
        s, _ = self.decoder(torch.cat([y_prev, c_rep], dim=-1), s0)  # (B, T, H): s_1 .. s_T
        return self._logits(s, y_prev, c_rep)

    def _start(self, src, src_len):
        c = self.encode(src, src_len)
        return c, torch.tanh(self.init_state(c))

    def _step(self, y_prev, state):
        c, s = state
        e = self.tgt_embed(y_prev)  # (B, E)
        _, s = self.decoder(torch.cat([e, c], dim=-1)[:, None, :], s[None])
        s = s[0]
        return self._logits(s, e, c), (c, s), None


class RNNsearch(_Seq2Seq):
    """Encoder-decoder that learns to align (Bahdanau, Cho & Bengio 2014, appendix A).

    Encoder: bidirectional GRU, annotations ``h_j = [fwd_j; bwd_j]`` ``(B, S, 2 * hidden_dim)``.
    Decoder: ``s_0 = tanh(W_s bwd_1)``; at step i it first reads the previous word,
    ``s'_i = GRUCell(E y_{i-1}, s_{i-1})``, then searches the source with that state,
    ``(c_i, alpha_i) = AdditiveAttention(s'_i, h, mask)``, then reads the context,
    ``s_i = GRUCell(c_i, s'_i)``; ``y_i`` comes from maxout(s_i, E y_{i-1}, c_i).

    The paper scores with ``s_{i-1}``, a state that has not yet seen ``y_{i-1}``; reading the word
    first (the "conditional GRU" of Sennrich et al. 2017, Nematus) lets the query know which word was
    just written. On this small task that gives alignments that sit on the right word instead of
    lagging one word behind; the alignment model itself is the paper's.

    Your own alignment model can replace the library's (exercise 01): ``score_fn(s, h, w, u, v) -> (B, S)``
    computes the raw scores from the query ``s (B, H)``, the annotations ``h (B, S, 2H)`` and the model's
    own parameters ``w (A, H)``, ``u (A, 2H)``, ``v (A,)`` (the weights of ``attention.W``, ``U``, ``v``,
    so they train); ``context_fn(scores, h, mask) -> (context (B, 2H), weights (B, S))`` turns them into
    weights and the context. Either may be given alone; None (the default) keeps the library's.

    Example: ``ids, alpha = RNNsearch(67, 95).greedy_decode(src, src_len)``  # alpha (B, T', S)
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, emb_dim: int = 48, hidden_dim: int = 96,
                 maxout_dim: int = 64, align_dim: int | None = None, score_fn=None, context_fn=None):
        super().__init__(src_vocab_size, tgt_vocab_size, emb_dim, hidden_dim, 2 * hidden_dim, maxout_dim)
        for name, fn in (("score_fn", score_fn), ("context_fn", context_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name}: expected a function or None, got {type(fn).__name__}")
        self.score_fn, self.context_fn = score_fn, context_fn  # plain attributes: not in config, not saved
        align_dim = align_dim or hidden_dim
        self.config["align_dim"] = align_dim
        self.encoder = nn.GRU(emb_dim, hidden_dim, batch_first=True, bidirectional=True)
        self.init_state = nn.Linear(hidden_dim, hidden_dim)  # W_s
        # the alignment model: a one-hidden-layer feedforward net, v^T tanh(W s_{i-1} + U h_j)
        self.attention = AdditiveAttention(query_dim=hidden_dim, key_dim=2 * hidden_dim, hidden_dim=align_dim)
        self.read_word = nn.GRUCell(emb_dim, hidden_dim)  # s'_i from s_{i-1} and E y_{i-1}
        self.decoder = nn.GRUCell(2 * hidden_dim, hidden_dim)  # s_i from s'_i and c_i

    def encode(self, src, src_len):
        """Annotations ``(B, S, 2H)`` (zeros at padding), the padding mask ``(B, S)`` and ``s_0 (B, H)``."""
        H = self.config["hidden_dim"]
        packed = pack_padded_sequence(self.src_embed(src), src_len.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.encoder(packed)
        h, _ = pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])  # (B, S, 2H)
        mask = torch.arange(src.shape[1], device=src.device)[None, :] < src_len[:, None]  # (B, S) True = real
        s0 = torch.tanh(self.init_state(h[:, 0, H:]))  # backward state at the first word has read it all
        return h, mask, s0

    def search(self, q, h, uh, mask):
        """The alignment model at one step, with ``U h_j`` computed once per sentence and passed as ``uh``.

        The same function as ``self.attention(q, h, mask)`` (``AdditiveAttention``; a test checks
        they agree), minus the ``U h_j`` products, which do not depend on the step (lesson 01,
        question 2): training runs about 1.7 times faster. ``q (B, H)``, ``h (B, S, 2H)``,
        ``uh = self.attention.U(h) (B, S, A)`` -> ``(context (B, 2H), weights (B, S))``.
        """
        a = self.attention
        if self.score_fn is None:
            scores = a.v(torch.tanh(a.W(q)[:, None, :] + uh))[..., 0]  # (B, S): v^T tanh(W s + U h_j)
        else:  # a plugged-in alignment model, on the same parameters (it recomputes U h_j itself)
            scores = self.score_fn(q, h, a.W.weight, a.U.weight, a.v.weight[0])  # (B, S)
        if self.context_fn is not None:
            return self.context_fn(scores, h, mask)  # (B, 2H), (B, S)
        weights = masked_softmax(scores, mask, dim=-1)  # (B, S), zero at padding
        return torch.einsum("bs,bsd->bd", weights, h), weights  # (B, 2H)

    def forward(self, src, src_len, tgt):
        """Teacher-forced logits ``(B, T, V)`` for targets ``tgt (B, T)``."""
        _check_batch(src, src_len, tgt)
        h, mask, s = self.encode(src, src_len)
        uh = self.attention.U(h)  # (B, S, A): the key half of every score, once per sentence
        y_prev = self.tgt_embed(_shift_right(tgt))  # (B, T, E)
        states, contexts = [], []
        for i in range(tgt.shape[1]):  # the decoder is sequential: s_i needs s_{i-1}
            q = self.read_word(y_prev[:, i], s)  # (B, H): s'_i, the state after reading y_{i-1}
            c, _ = self.search(q, h, uh, mask)  # (B, 2H): weighted sum of annotations
            s = self.decoder(c, q)  # (B, H): s_i
            states.append(s)
            contexts.append(c)
        return self._logits(torch.stack(states, 1), y_prev, torch.stack(contexts, 1))  # (B, T, V)

    def _start(self, src, src_len):
        h, mask, s = self.encode(src, src_len)
        return h, self.attention.U(h), mask, s

    def _step(self, y_prev, state):
        h, uh, mask, s = state
        e = self.tgt_embed(y_prev)
        q = self.read_word(e, s)
        c, w = self.search(q, h, uh, mask)  # w: (B, S) alignment weights of this output word
        s = self.decoder(c, q)
        return self._logits(s, e, c), (h, uh, mask, s), w


MODELS = {"RNNencdec": RNNencdec, "RNNsearch": RNNsearch}


def translate(model, sentences, src_vocab, tgt_vocab, batch_size: int = 256, max_len: int | None = None):
    """Translate English strings greedily; returns ``(french strings, alignments)``.

    ``alignments[k]`` is a ``(len(output words) + 1, len(source words) + 1)`` tensor of weights
    (rows and columns include ``<eos>``) or ``None`` for a model without attention.

    Example: ``translate(model, ["the red car sleeps ."], data.src_vocab, data.tgt_vocab)``
    """
    if isinstance(sentences, str):
        raise TypeError("sentences: expected a list of strings, got one string (wrap it in a list)")
    model.eval()
    outputs, aligns = [], []
    for start in range(0, len(sentences), batch_size):
        chunk = [src_vocab.encode(s) for s in sentences[start:start + batch_size]]
        lengths = torch.tensor([len(x) for x in chunk])
        src = torch.zeros(len(chunk), int(lengths.max()), dtype=torch.long)
        for i, x in enumerate(chunk):
            src[i, : len(x)] = torch.tensor(x)
        ids, weights = model.greedy_decode(src, lengths, max_len=max_len)
        for i in range(len(chunk)):
            row = ids[i].tolist()
            n_out = row.index(EOS_ID) + 1 if EOS_ID in row else len(row)
            outputs.append(tgt_vocab.decode(row))
            aligns.append(None if weights is None else weights[i, :n_out, : len(chunk[i])].clone())
    return outputs, aligns
