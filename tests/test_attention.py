"""The reference attention library (attnlab/attention.py) against torch and against hand computations."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from attnlab.attention import (
    AdditiveAttention,
    MultiHeadAttention,
    block_sparse_reference,
    causal_mask,
    masked_softmax,
    naive_attention,
    padding_mask,
    scaled_dot_product_attention,
    softmax,
)


def _randn(*shape, seed=0, dtype=torch.float64, mult=1.0, grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=dtype) * mult
    return x.requires_grad_() if grad else x


# ---------------------------------------------------------------------------------------------
# softmax and masks
# ---------------------------------------------------------------------------------------------

@given(st.integers(1, 5), st.integers(1, 30), st.integers(0, 2**16), st.sampled_from([1.0, 1e4]))
def test_softmax_matches_torch_even_for_huge_scores(rows, cols, seed, mult):
    x = _randn(rows, cols, seed=seed, dtype=torch.float32, mult=mult)
    y = softmax(x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, torch.softmax(x, dim=-1))
    torch.testing.assert_close(softmax(x, dim=0), torch.softmax(x, dim=0))


@given(st.integers(1, 4), st.integers(1, 12), st.integers(0, 2**16))
def test_masked_softmax_matches_torch_and_zeros_fully_masked_rows(rows, cols, seed):
    x = _randn(rows, cols, seed=seed, grad=True)
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(rows, cols, generator=g) > 0.4
    mask[0] = False                                      # always one fully masked row
    y = masked_softmax(x, mask)
    want = torch.softmax(x.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    torch.testing.assert_close(y, want)
    assert (y[0] == 0).all() and (y[~mask] == 0).all()
    (dx,) = torch.autograd.grad((y * torch.arange(cols, dtype=y.dtype)).sum(), (x,))
    assert torch.isfinite(dx).all() and (dx[~mask] == 0).all()


def test_masked_softmax_broadcasts_a_row_mask():
    y = masked_softmax(torch.zeros(2, 3), torch.tensor([True, True, False]))
    torch.testing.assert_close(y, torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]))


def test_padding_mask():
    m = padding_mask(torch.tensor([2, 3, 0]), 4)
    assert m.dtype == torch.bool
    assert m.tolist() == [[True, True, False, False], [True, True, True, False], [False] * 4]
    assert padding_mask([1, 2]).shape == (2, 2)


@given(st.integers(1, 12), st.integers(1, 12))
def test_causal_mask_is_torch_is_causal(n_q, n_k):
    """Top-left alignment: causal_mask as an explicit mask gives exactly SDPA(is_causal=True)."""
    m = causal_mask(n_q, n_k)
    assert m.shape == (n_q, n_k)
    assert m.tolist() == [[j <= i for j in range(n_k)] for i in range(n_q)]
    q, k, v = _randn(1, 1, n_q, 4, seed=n_q), _randn(1, 1, n_k, 4, seed=n_k + 50), _randn(1, 1, n_k, 4, seed=9)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))


# ---------------------------------------------------------------------------------------------
# scaled dot-product attention and naive attention against torch SDPA
# ---------------------------------------------------------------------------------------------

cases = st.fixed_dictionaries({
    "B": st.integers(1, 2), "H": st.integers(1, 3), "Nq": st.integers(1, 20), "Nk": st.integers(1, 20),
    "D": st.integers(1, 10), "Dv": st.integers(1, 10), "causal": st.booleans(), "seed": st.integers(0, 2**16),
    # which dims of (B, H, Nq, Nk) the mask has (others broadcast); None = no mask
    "mask_dims": st.one_of(st.none(), st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans())),
    "scale": st.one_of(st.none(), st.floats(0.1, 2.0)),
})


@given(cases)
def test_sdpa_matches_torch_outputs_weights_and_gradients(c):
    q = _randn(c["B"], c["H"], c["Nq"], c["D"], seed=c["seed"], grad=True)
    k = _randn(c["B"], c["H"], c["Nk"], c["D"], seed=c["seed"] + 1, grad=True)
    v = _randn(c["B"], c["H"], c["Nk"], c["Dv"], seed=c["seed"] + 2, grad=True)
    full = (c["B"], c["H"], c["Nq"], c["Nk"])
    mask = None
    if c["mask_dims"] is not None:
        shape = tuple(n if keep else 1 for n, keep in zip(full, c["mask_dims"]))
        mask = torch.rand(shape, generator=torch.Generator().manual_seed(c["seed"])) > 0.3
        if c["mask_dims"][2]:
            mask[..., 0, :] = False                       # a fully masked query row -> zeros
    out, w = scaled_dot_product_attention(q, k, v, mask=mask, causal=c["causal"], scale=c["scale"],
                                          return_weights=True)
    both = mask
    if c["causal"]:
        tri = torch.ones(c["Nq"], c["Nk"], dtype=torch.bool).tril()
        both = tri if mask is None else mask & tri
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=both, scale=c["scale"])
    torch.testing.assert_close(out, ref)
    assert w.shape == full
    sums = w.sum(-1)
    assert torch.all(((sums - 1).abs() < 1e-9) | (sums == 0))
    if both is not None:
        dead = ~both.expand(full).any(-1)                  # (B, H, Nq) rows with no visible key
        assert (out[dead] == 0).all()
    dout = _randn(*out.shape, seed=c["seed"] + 3)
    got = torch.autograd.grad((out * dout).sum(), (q, k, v))
    want = torch.autograd.grad((ref * dout).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@given(st.integers(1, 20), st.integers(1, 20), st.booleans(), st.integers(0, 2**16))
def test_naive_attention_matches_torch_and_counts_its_matrices(Nq, Nk, causal, seed):
    q = _randn(2, 3, Nq, 8, seed=seed, dtype=torch.float32, grad=True)
    k = _randn(2, 3, Nk, 8, seed=seed + 1, dtype=torch.float32, grad=True)
    v = _randn(2, 3, Nk, 5, seed=seed + 2, dtype=torch.float32, grad=True)
    out, nbytes = naive_attention(q, k, v, causal=causal)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert nbytes == 2 * (2 * 3 * Nq * Nk) * 4              # S and P, fp32
    got = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fn", ["sdpa", "naive"])
@pytest.mark.parametrize("causal", [False, True])
def test_logits_of_magnitude_1e4_stay_finite(fn, causal):
    q = _randn(1, 2, 9, 8, seed=1, dtype=torch.float32, mult=60.0, grad=True)
    k = _randn(1, 2, 11, 8, seed=2, dtype=torch.float32, mult=60.0, grad=True)
    v = _randn(1, 2, 11, 8, seed=3, dtype=torch.float32, grad=True)
    assert ((q @ k.transpose(-2, -1)) / math.sqrt(8)).abs().max() > 1e4
    if fn == "sdpa":
        out = scaled_dot_product_attention(q, k, v, causal=causal)
    else:
        out, _ = naive_attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    ref = F.scaled_dot_product_attention(*(x.detach().double() for x in (q, k, v)), is_causal=causal)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# multi-head attention against torch.nn.MultiheadAttention
# ---------------------------------------------------------------------------------------------

def _torch_mha_like(mha):
    t = torch.nn.MultiheadAttention(mha.d_model, mha.num_heads, bias=mha.q_proj.bias is not None,
                                    batch_first=True, dtype=mha.q_proj.weight.dtype)
    with torch.no_grad():
        t.in_proj_weight.copy_(torch.cat([mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight]))
        t.out_proj.weight.copy_(mha.out_proj.weight)
        if t.in_proj_bias is not None:
            t.in_proj_bias.copy_(torch.cat([mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias]))
            t.out_proj.bias.copy_(mha.out_proj.bias)
    return t.eval()


@given(st.integers(1, 2), st.sampled_from([(8, 1), (8, 2), (12, 3), (16, 4)]), st.integers(1, 9),
       st.integers(1, 9), st.booleans(), st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_multihead_matches_torch(B, dims, Nq, Nk, self_attn, causal, bias, seed):
    d_model, h = dims
    torch.manual_seed(seed)
    mha = MultiHeadAttention(d_model, h, bias=bias).double()
    ref = _torch_mha_like(mha)
    x = _randn(B, Nq, d_model, seed=seed, grad=True)
    mem = x if self_attn else _randn(B, Nk, d_model, seed=seed + 1, grad=True)
    Nk = mem.shape[1]
    keep = torch.ones(Nq, Nk, dtype=torch.bool).tril() if causal else None
    out, w = mha(x, mem, mem, causal=causal, return_weights=True)
    want, want_w = ref(x, mem, mem, attn_mask=None if keep is None else ~keep,   # torch: True = blocked
                       need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(w, want_w)
    got = torch.autograd.grad(out.sum(), (x, mha.q_proj.weight))
    exp = torch.autograd.grad(want.sum(), (x, ref.in_proj_weight))
    torch.testing.assert_close(got[0], exp[0])
    torch.testing.assert_close(got[1], exp[1][:d_model])


def test_multihead_key_padding_mask_and_defaults():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).double()
    ref = _torch_mha_like(mha)
    x = _randn(2, 5, 8, seed=4)
    lengths = torch.tensor([5, 3])
    out = mha(x, mask=padding_mask(lengths, 5)[:, None, None, :])
    want, _ = ref(x, x, x, key_padding_mask=~padding_mask(lengths, 5))
    torch.testing.assert_close(out, want)


def test_split_and_merge_heads_are_inverse():
    mha = MultiHeadAttention(12, 3)
    x = torch.arange(2 * 5 * 12, dtype=torch.float32).reshape(2, 5, 12)
    heads = mha.split_heads(x)
    assert heads.shape == (2, 3, 5, 4)
    torch.testing.assert_close(heads[:, 1], x[:, :, 4:8])        # head 1 owns features 4..7
    torch.testing.assert_close(mha.merge_heads(heads), x)


# ---------------------------------------------------------------------------------------------
# additive (Bahdanau) attention against a hand computation
# ---------------------------------------------------------------------------------------------

def test_additive_attention_by_hand():
    torch.manual_seed(0)
    att = AdditiveAttention(query_dim=3, key_dim=4, hidden_dim=5).double()
    W, U, v = att.W.weight.detach(), att.U.weight.detach(), att.v.weight[0].detach()            # (5, 3), (5, 4), (5,)
    s = _randn(2, 3, seed=1)
    h = _randn(2, 6, 4, seed=2)
    mask = torch.tensor([[True] * 6, [True, True, True, False, False, False]])
    ctx, w = att(s, h, mask)
    for b in range(2):
        scores = []
        for j in range(6):
            e = 0.0
            for a in range(5):                                          # e_j = sum_a v_a tanh((W s)_a + (U h_j)_a)
                ws = sum(W[a, i] * s[b, i] for i in range(3))
                uh = sum(U[a, i] * h[b, j, i] for i in range(4))
                e += v[a] * math.tanh(ws + uh)
            scores.append(float(e))
        torch.testing.assert_close(att.score(s, h)[b], torch.tensor(scores, dtype=torch.float64))
        n = int(mask[b].sum())
        exps = [math.exp(e) for e in scores[:n]]
        weights = [x / sum(exps) for x in exps] + [0.0] * (6 - n)
        torch.testing.assert_close(w[b], torch.tensor(weights, dtype=torch.float64))
        context = [sum(weights[j] * float(h[b, j, i]) for j in range(6)) for i in range(4)]
        torch.testing.assert_close(ctx[b], torch.tensor(context, dtype=torch.float64))


def test_additive_attention_fully_masked_row_is_zero():
    att = AdditiveAttention(3, 4, 5)
    ctx, w = att(torch.randn(2, 3), torch.randn(2, 6, 4), padding_mask([0, 6], 6))
    assert (ctx[0] == 0).all() and (w[0] == 0).all()
    torch.testing.assert_close(w[1].sum(), torch.tensor(1.0))


# ---------------------------------------------------------------------------------------------
# block-sparse reference against SDPA with the equivalent element mask
# ---------------------------------------------------------------------------------------------

@given(st.integers(1, 2), st.integers(1, 2), st.integers(1, 25), st.integers(1, 25), st.integers(1, 8),
       st.integers(1, 8), st.booleans(), st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_block_sparse_reference_matches_element_mask(B, H, Nq, Nk, BQ, BK, causal, per_head, as_object, seed):
    q = _randn(B, H, Nq, 4, seed=seed, grad=True)
    k = _randn(B, H, Nk, 4, seed=seed + 1, grad=True)
    v = _randn(B, H, Nk, 3, seed=seed + 2, grad=True)
    nqb, nkb = -(-Nq // BQ), -(-Nk // BK)
    bm = torch.rand(B if per_head else 1, H if per_head else 1, nqb, nkb,
                    generator=torch.Generator().manual_seed(seed)) > 0.5
    elem = torch.zeros(bm.shape[0], bm.shape[1], Nq, Nk, dtype=torch.bool)  # element mask by hand
    for i in range(Nq):
        for j in range(Nk):
            elem[:, :, i, j] = bm[:, :, i // BQ, j // BK]
    if causal:
        elem &= torch.ones(Nq, Nk, dtype=torch.bool).tril()
    if as_object:
        out = block_sparse_reference(q, k, v, SimpleNamespace(mask=bm, block_size=(BQ, BK)), causal=causal)
    else:
        out = block_sparse_reference(q, k, v, bm, (BQ, BK), causal=causal)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=elem)
    torch.testing.assert_close(out, ref)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------
# bad input: ValueError / TypeError naming the argument
# ---------------------------------------------------------------------------------------------

Q, K, V = torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 3)


def _sdpa(**over):
    args = dict(q=Q, k=K, v=V)
    args.update(over)
    return lambda: scaled_dot_product_attention(**args)


BAD = [
    (_sdpa(q=torch.zeros(2, 5, 4)), ValueError, "q"),
    (_sdpa(k=torch.zeros(1, 2, 6)), ValueError, "k"),
    (_sdpa(v="v"), TypeError, "v"),
    (_sdpa(k=torch.zeros(2, 2, 6, 4)), ValueError, "k"),
    (_sdpa(k=torch.zeros(1, 2, 6, 3)), ValueError, "k"),
    (_sdpa(v=torch.zeros(1, 2, 5, 3)), ValueError, "v"),
    (_sdpa(v=torch.zeros(1, 2, 6, 3, dtype=torch.float64)), TypeError, "v"),
    (_sdpa(k=torch.zeros(1, 2, 6, 4, device="meta")), ValueError, "k"),
    (_sdpa(q=torch.zeros(1, 2, 5, 4, dtype=torch.int32)), TypeError, "q"),
    (_sdpa(mask=torch.ones(5, 7, dtype=torch.bool)), ValueError, "mask"),
    (_sdpa(mask=torch.ones(3, 1, 5, 6, dtype=torch.bool)), ValueError, "mask"),
    (_sdpa(mask=torch.ones(1, 1, 1, 5, 6, dtype=torch.bool)), ValueError, "mask"),
    (_sdpa(mask=torch.ones(5, 6)), TypeError, "mask"),
    (_sdpa(mask=torch.ones(5, 6, dtype=torch.bool, device="meta")), ValueError, "mask"),
    (_sdpa(scale="x"), TypeError, "scale"),
    (lambda: naive_attention(Q, K.double(), V), TypeError, "k"),
    (lambda: naive_attention(Q[0], K, V), ValueError, "q"),
    (lambda: softmax([1.0, 2.0]), TypeError, "x"),
    (lambda: softmax(torch.tensor([1, 2])), TypeError, "x"),
    (lambda: masked_softmax(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool)), ValueError, "mask"),
    (lambda: masked_softmax(torch.zeros(2, 3), torch.ones(2, 3)), TypeError, "mask"),
    (lambda: padding_mask(torch.tensor([[1, 2]]), 3), ValueError, "lengths"),
    (lambda: padding_mask(torch.tensor([1.5]), 3), TypeError, "lengths"),
    (lambda: padding_mask([1, -1], 3), ValueError, "lengths"),
    (lambda: padding_mask([1], -1), ValueError, "max_len"),
    (lambda: padding_mask([4, 2], 3), ValueError, "max_len"),
    (lambda: causal_mask(-1, 3), ValueError, "n_q"),
    (lambda: causal_mask(2, 2.0), TypeError, "n_k"),
    (lambda: AdditiveAttention(0, 4, 5), ValueError, "query_dim"),
    (lambda: AdditiveAttention(3, 4, 5)(torch.zeros(2, 3), torch.zeros(2, 6)), ValueError, "keys"),
    (lambda: AdditiveAttention(3, 4, 5)(torch.zeros(2, 2), torch.zeros(2, 6, 4)), ValueError, "query"),
    (lambda: AdditiveAttention(3, 4, 5)(torch.zeros(2, 3), torch.zeros(3, 6, 4)), ValueError, "keys"),
    (lambda: AdditiveAttention(3, 4, 5)(torch.zeros(2, 3), torch.zeros(2, 6, 4), torch.ones(2, 5, dtype=torch.bool)),
     ValueError, "mask"),
    (lambda: MultiHeadAttention(10, 3), ValueError, "num_heads"),
    (lambda: MultiHeadAttention(8, 0), ValueError, "num_heads"),
    (lambda: MultiHeadAttention(8, 2)(torch.zeros(2, 5, 7)), ValueError, "query"),
    (lambda: MultiHeadAttention(8, 2)(torch.zeros(2, 5, 8), torch.zeros(3, 4, 8)), ValueError, "key"),
    (lambda: MultiHeadAttention(8, 2)(torch.zeros(2, 5, 8), torch.zeros(2, 4, 8), torch.zeros(2, 3, 8)),
     ValueError, "value"),
    (lambda: MultiHeadAttention(8, 2)(torch.zeros(2, 5, 8), mask=torch.ones(2, 5, 6, 5, dtype=torch.bool)),
     ValueError, "mask"),
    (lambda: MultiHeadAttention(8, 2).merge_heads(torch.zeros(2, 3, 5, 4)), ValueError, "x"),
    (lambda: block_sparse_reference(Q, K, V, torch.ones(1, 1, 3, 2, dtype=torch.bool), 4), ValueError, "block_mask"),
    (lambda: block_sparse_reference(Q, K, V, torch.ones(2, 1, 2, 2, dtype=torch.bool), 4), ValueError, "block_mask"),
    (lambda: block_sparse_reference(Q, K, V, torch.ones(1, 1, 2, 3, dtype=torch.bool), (4, 0)), ValueError,
     "block_size"),
    (lambda: block_sparse_reference(Q, K, V, torch.ones(1, 1, 2, 3, dtype=torch.bool), -1), ValueError, "block_size"),
    (lambda: block_sparse_reference(Q, K, V, torch.ones(1, 1, 2, 3), (4, 2)), TypeError, "block_mask"),
    (lambda: block_sparse_reference(Q, K, V, torch.ones(2, 3, dtype=torch.bool), (4, 2)), ValueError, "block_mask"),
    (lambda: block_sparse_reference(Q, K, V, torch.ones(1, 1, 2, 3, dtype=torch.bool)), TypeError, "block_size"),
    (lambda: block_sparse_reference(Q, K, V, SimpleNamespace(mask=torch.ones(1, 1, 2, 3, dtype=torch.bool),
                                                             block_size=(4, 2)), (2, 2)), ValueError, "block_size"),
    (lambda: block_sparse_reference(Q, K, V, torch.ones(1, 1, 2, 3, dtype=torch.bool, device="meta"), (4, 2)),
     ValueError, "block_mask"),
]


@pytest.mark.parametrize("call,exc,name", BAD)
def test_bad_input_names_the_argument(call, exc, name):
    with pytest.raises(exc, match=rf"^{name}:"):
        call()
