"""BLEU (Papineni et al. 2002), corpus-level, and exact match: how lesson 01 scores translations.

Corpus BLEU-4 with one reference per sentence, as the WMT'14 numbers of Bahdanau et al. (2014)
were computed (``multi-bleu.perl``): clipped n-gram counts are summed over the whole corpus,
then ``BLEU = BP * exp(mean_n log p_n)`` for n = 1..4, with the brevity penalty
``BP = min(1, exp(1 - r / c))`` (``r`` reference words, ``c`` hypothesis words). Scores are on
the papers' 0-100 scale. No smoothing: a corpus with no matching 4-gram scores 0.

Example::

    >>> corpus_bleu(["le chat dort ."], ["le chat dort ."])
    100.0
"""

from __future__ import annotations

import math
from collections import Counter

__all__ = ["corpus_bleu", "ngram_matches", "exact_match", "bleu_by_length", "alignment_accuracy"]


def _tokens(sentence):
    if isinstance(sentence, str):
        return sentence.split()
    if isinstance(sentence, (list, tuple)) and all(isinstance(w, str) for w in sentence):
        return list(sentence)
    raise TypeError(f"sentence: expected a string or a list of words, got {type(sentence).__name__}")


def ngram_matches(hypothesis, reference, n: int):
    """``(clipped matches, hypothesis n-grams)`` for one sentence pair and one order ``n``.

    Each hypothesis n-gram counts at most as often as it occurs in the reference.

    Example: ``ngram_matches("the the the", "the cat", 1) == (1, 3)``
    """
    hyp, ref = _tokens(hypothesis), _tokens(reference)
    h = Counter(tuple(hyp[i:i + n]) for i in range(len(hyp) - n + 1))
    r = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
    return sum(min(c, r[g]) for g, c in h.items()), max(len(hyp) - n + 1, 0)


def _check_pair(hypotheses, references):
    if isinstance(hypotheses, str) or isinstance(references, str):
        raise TypeError("hypotheses, references: expected lists of sentences, got a single string")
    if len(hypotheses) != len(references):
        raise ValueError(f"hypotheses, references: expected equal lengths, got {len(hypotheses)} and {len(references)}")
    if len(hypotheses) == 0:
        raise ValueError("hypotheses: expected at least one sentence")


def corpus_bleu(hypotheses, references, max_n: int = 4) -> float:
    """Corpus-level BLEU-``max_n`` (0 to 100) of hypotheses against one reference each.

    Example: ``corpus_bleu(["la voiture rouge ."], ["la voiture rouge dort ."])`` (short: penalised)
    """
    _check_pair(hypotheses, references)
    if not isinstance(max_n, int) or max_n < 1:
        raise ValueError(f"max_n: expected a positive int, got {max_n!r}")
    matches, totals = [0] * max_n, [0] * max_n
    hyp_len = ref_len = 0
    for hyp, ref in zip(hypotheses, references):
        hyp_len += len(_tokens(hyp))
        ref_len += len(_tokens(ref))
        for n in range(1, max_n + 1):
            m, t = ngram_matches(hyp, ref, n)
            matches[n - 1] += m
            totals[n - 1] += t
    if hyp_len == 0 or min(matches) == 0:
        return 0.0
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / max_n
    brevity = min(0.0, 1.0 - ref_len / hyp_len)  # log of the brevity penalty
    return 100.0 * math.exp(log_precision + brevity)


def exact_match(hypotheses, references) -> float:
    """Percentage of hypotheses identical to their reference, word for word (0 to 100)."""
    _check_pair(hypotheses, references)
    same = sum(_tokens(h) == _tokens(r) for h, r in zip(hypotheses, references))
    return 100.0 * same / len(hypotheses)


def bleu_by_length(hypotheses, references, lengths, bins):
    """BLEU and exact match per bin of source length: the shape of Bahdanau et al. (2014), Fig. 2.

    ``bins`` are edges ``[b0, b1, ..., bk]``; bin j holds sentences with ``b_j <= length < b_{j+1}``.
    Returns a list of dicts ``{"lo", "hi", "count", "bleu", "exact"}`` (empty bins are skipped).

    Example: ``bleu_by_length(hyps, refs, [len(s.split()) for s in sources], range(5, 56, 5))``
    """
    _check_pair(hypotheses, references)
    if len(lengths) != len(hypotheses):
        raise ValueError(f"lengths: expected {len(hypotheses)} lengths, got {len(lengths)}")
    bins = list(bins)
    if len(bins) < 2 or any(a >= b for a, b in zip(bins, bins[1:])):
        raise ValueError(f"bins: expected at least two increasing edges, got {bins}")
    rows = []
    for lo, hi in zip(bins, bins[1:]):
        idx = [i for i, n in enumerate(lengths) if lo <= n < hi]
        if not idx:
            continue
        h = [hypotheses[i] for i in idx]
        r = [references[i] for i in idx]
        rows.append({"lo": lo, "hi": hi, "count": len(idx), "bleu": corpus_bleu(h, r), "exact": exact_match(h, r)})
    return rows


def alignment_accuracy(alignments, gold) -> float:
    """Percentage of output words whose largest attention weight falls on their gold source word.

    ``alignments``: list of ``(T_k, S_k)`` weight arrays (rows: output words, columns: source words;
    extra rows or columns, e.g. for ``<eos>``, are ignored beyond ``len(gold[k])``); ``gold``: list of
    lists, ``gold[k][i]`` the source index that output word ``i`` translates.

    Example: ``alignment_accuracy([torch.eye(3)], [[0, 1, 2]]) == 100.0``
    """
    if len(alignments) != len(gold):
        raise ValueError(f"alignments, gold: expected equal lengths, got {len(alignments)} and {len(gold)}")
    hits = total = 0
    for weights, g in zip(alignments, gold):
        if len(weights) < len(g):
            raise ValueError(f"alignments: expected at least {len(g)} rows for a gold alignment of {len(g)} words, "
                             f"got {len(weights)}")
        for i, j in enumerate(g):
            row = list(weights[i])
            hits += max(range(len(row)), key=row.__getitem__) == j
            total += 1
    if total == 0:
        raise ValueError("gold: expected at least one aligned word")
    return 100.0 * hits / total
