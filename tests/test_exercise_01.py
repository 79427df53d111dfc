"""Exercise 01 (soft alignment): wrong implementations fail their check with the matching diagnosis."""


import torch

from attnlab.grading.exercises.e01 import spec as specs
from mistakes import Wrong

WRONG = Wrong()


WRONG.add("additive-score", "no-tanh", additive_scores=lambda s, h, w, u, v: ((s @ w.T).unsqueeze(1) + h @ u.T) @ v)
WRONG.add("additive-score", "swapped-projections",
      additive_scores=lambda s, h, w, u, v: torch.tanh((s @ u.T).unsqueeze(1) + h @ w.T) @ v)
WRONG.add("additive-score", "softmax-applied",
      additive_scores=lambda s, h, w, u, v: torch.softmax(torch.tanh((s @ w.T)[:, None] + h @ u.T) @ v, dim=1))


def _ctx_wrong_axis(scores, h, mask=None):
    if mask is not None:
        scores = scores.masked_fill(~mask, -1e30)
    w = torch.softmax(scores, dim=0)
    return torch.einsum("bn,bnd->bd", w, h), w


def _ctx_mask_after(scores, h, mask=None):
    w = torch.softmax(scores, dim=-1)
    if mask is not None:
        w = w * mask
    return torch.einsum("bn,bnd->bd", w, h), w


def _ctx_no_max(scores, h, mask=None):
    e = torch.exp(scores)
    if mask is not None:
        e = e * mask
    w = e / e.sum(-1, keepdim=True).clamp_min(1e-30)
    return torch.einsum("bn,bnd->bd", w, h), w


def _ctx_nan_rows(scores, h, mask=None):
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    w = torch.softmax(scores, dim=-1)
    return torch.einsum("bn,bnd->bd", w, h), w


WRONG.add("context-vector", "wrong-axis", context_vector=_ctx_wrong_axis)
WRONG.add("context-vector", "mask-after-softmax", context_vector=_ctx_mask_after)
WRONG.add("context-vector", "no-max-subtraction", context_vector=_ctx_no_max)
WRONG.add("context-vector", "fully-masked-row", context_vector=_ctx_nan_rows)


def _decoder(update, weights_axis=-1, use_mask=True):
    def decode_step(s, h, w, u, v, w_s, w_c, mask=None):
        scores = specs.additive_scores(s, h, w, u, v)
        if mask is not None and use_mask:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=weights_axis)
        c = (weights.unsqueeze(-1) * h).sum(1)
        return update(s, c, w_s, w_c), weights
    return decode_step


WRONG.add("decode-step", "no-tanh", decode_step=_decoder(lambda s, c, ws, wc: s @ ws.T + c @ wc.T))
WRONG.add("decode-step", "mask-ignored", decode_step=_decoder(lambda s, c, ws, wc: torch.tanh(s @ ws.T + c @ wc.T),
                                                           use_mask=False))
WRONG.add("decode-step", "wrong-axis", decode_step=_decoder(lambda s, c, ws, wc: torch.tanh(s @ ws.T + c @ wc.T),
                                                         weights_axis=0))
WRONG.add("decode-step", "swapped-update-weights",
      decode_step=_decoder(lambda s, c, ws, wc: torch.tanh(s @ wc.T + c @ ws.T)))


test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()
