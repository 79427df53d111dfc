"""The references of exercise 04_multi_head (never shown; an empty file in the sandbox where ``attnlab grade`` runs):
the library's ``MultiHeadAttention``, its costs measured on the meta device, and its ``TinyTransformer`` trained."""

import functools
from types import SimpleNamespace

import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlab.attention import MultiHeadAttention
from attnlab.data.toy import PreviousTwo
from attnlab.models.transformer import TinyTransformer, train
from attnlab.train import deterministic


def _layout(d_model, num_heads):
    """What MultiHeadAttention.split_heads/merge_heads read from their module."""
    return SimpleNamespace(d_model=d_model, num_heads=num_heads, d_head=d_model // num_heads)


def split_heads(x, num_heads):
    """(B, N, d_model) -> (B, h, N, d_model / h): head i holds features [i*dh, (i+1)*dh)."""
    return MultiHeadAttention.split_heads(_layout(x.shape[-1], num_heads), x)


def merge_heads(x):
    """(B, h, N, dh) -> (B, N, h*dh), the inverse of ``split_heads``."""
    return MultiHeadAttention.merge_heads(_layout(x.shape[1] * x.shape[3], x.shape[1]), x)


def mha_forward(state_dict, num_heads, query, key=None, value=None, mask=None, causal=False):
    """The library's MultiHeadAttention with the weights ``state_dict`` (biases if it has them) -> (B, Nq, d_model)."""
    module = MultiHeadAttention(state_dict["q_proj.weight"].shape[1], num_heads, bias="q_proj.bias" in state_dict)
    module.load_state_dict(state_dict)
    return module(query, key, value, mask=mask, causal=causal)


def mha_parameters(d_model, num_heads, bias=True):
    with torch.device("meta"):
        return sum(p.numel() for p in MultiHeadAttention(d_model, num_heads, bias=bias).parameters())


def mha_flops(batch, n_q, n_k, d_model, num_heads):
    """Matmul FLOPs of one forward (key = value) as FlopCounterMode counts them (2 per multiply-add)."""
    with torch.device("meta"):
        module = MultiHeadAttention(d_model, num_heads)
        query, key = torch.empty(batch, n_q, d_model), torch.empty(batch, n_k, d_model)
    with FlopCounterMode(display=False) as counter:
        module(query, key)
    return counter.get_total_flops()


TASK, MODEL = dict(vocab=8, seq_len=12), dict(d_model=32, d_mlp=0)   # PreviousTwo, a one-layer attention-only model
TRAIN, TEST_SEQUENCES = dict(batch_size=32, lr=6e-3, schedule="cosine"), 500


def trained_model(seed, num_heads=2, steps=200):
    """(TinyTransformer trained on PreviousTwo from ``seed``, the test tokens (500, 12) of seed + 1)."""
    task = PreviousTwo(**TASK)
    with deterministic(seed), torch.enable_grad():   # checks call the spec under no_grad
        model = TinyTransformer(task.vocab_size, task.n_classes, num_heads=num_heads, max_len=task.seq_len, seed=seed,
                                **MODEL)
        if steps:
            train(model, task, steps=steps, seed=seed, **TRAIN)
    return model, task.sample(TEST_SEQUENCES, torch.Generator().manual_seed(seed + 1))[0]


def attention_weights(model, tokens):
    """(n, h, N, N): layer 0's attention weights of the trained model on ``tokens``."""
    with torch.no_grad():
        return model(tokens, return_weights=True)[1][0]


def profile(weights, ahead=False, summed=False):
    """(h, 3): per head, the mean weight of the queries i >= 2 on key i-1, on key i-2 and on all others, rows sorted by
    the first; the checks' mistakes: ``ahead`` (keys i+1, i+2), ``summed`` (not averaged)."""
    reduce, sign = functools.partial(torch.sum if summed else torch.mean, dim=(0, 2)), 1 if ahead else -1
    prev1 = reduce(weights.diagonal(sign, dim1=-2, dim2=-1)[..., 0 if ahead else 1:])   # (h,)  queries 2..N-1
    prev2 = reduce(weights.diagonal(2 * sign, dim1=-2, dim2=-1))                         # (h,)
    rest = (weights.shape[0] * (weights.shape[-1] - 2) if summed else 1) - prev1 - prev2
    rows = torch.stack([prev1, prev2, rest], dim=1)                                     # (h, 3)
    return rows[rows[:, 0].argsort(descending=True)]


def head_specialisation(seed, num_heads=2, steps=200):
    """Each head's profile (h, 3) of the one-layer attention-only model trained on PreviousTwo from ``seed``."""
    return profile(attention_weights(*trained_model(seed, num_heads, steps)))
