"""Exercise 03 (scaled dot-product attention): wrong implementations fail their check with the matching diagnosis."""


import torch

from attnlab.grading.checks import run_check
from mistakes import Wrong

WRONG = Wrong()


WRONG.add("stable-softmax", "no-max-subtraction", softmax=lambda x, dim=-1: x.exp() / x.exp().sum(dim, keepdim=True))
WRONG.add("stable-softmax", "wrong-axis",
      softmax=lambda x, dim=-1: (x - x.amax(-1, keepdim=True)).exp() / (x - x.amax(-1, keepdim=True)).exp().sum(
          -1, keepdim=True))
WRONG.add("stable-softmax", "global-max",
      softmax=lambda x, dim=-1: (x - x.max()).exp() / (x - x.max()).exp().sum(dim, keepdim=True))


def _sdpa(scale_of_d, dim=-1, honour=True):
    def scaled_dot_product_attention(q, k, v, scale=None):
        sc = scale if (scale is not None and honour) else scale_of_d(q.shape[-1])
        return torch.softmax(q @ k.transpose(-2, -1) * sc, dim=dim) @ v
    return scaled_dot_product_attention


WRONG.add("scaled-attention", "scale-forgotten", scaled_dot_product_attention=_sdpa(lambda d: 1))
WRONG.add("scaled-attention", "scale-one-over-d", scaled_dot_product_attention=_sdpa(lambda d: 1 / d))
WRONG.add("scaled-attention", "wrong-axis", scaled_dot_product_attention=_sdpa(lambda d: d ** -0.5, dim=-2))
WRONG.add("scaled-attention", "scale-ignored", scaled_dot_product_attention=_sdpa(lambda d: d ** -0.5, honour=False))

WRONG.add("variance-experiment", "divided-by-d",
      score_variance=lambda q, k: torch.stack([(q * k).sum(1).var(), ((q * k).sum(1) / q.shape[1]).var()]))
WRONG.add("variance-experiment", "std-not-var",
      score_variance=lambda q, k: torch.stack([(q * k).sum(1).std(), ((q * k).sum(1) / q.shape[1] ** 0.5).std()]))
WRONG.add("variance-experiment", "all-pairs",
      score_variance=lambda q, k: torch.stack([(q @ k.T).var(), (q @ k.T / q.shape[1] ** 0.5).var()]))


test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


def test_a_list_instead_of_a_tensor_passes():
    def score_variance(q, k):  # a list instead of a stacked tensor
        raw = (q * k).sum(-1)
        return [raw.var().item(), (raw / q.shape[-1] ** 0.5).var().item()]

    assert run_check("variance-experiment", {"score_variance": score_variance}).passed
