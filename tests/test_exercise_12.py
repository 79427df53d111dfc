"""Exercise 12 (past dense softmax attention): wrong kernels and wrong measurements, written the way a learner
would, fail their check with the matching diagnosis (the emulated mistakes: tests/test_every_mistake.py); right
answers written another way pass; the library's answers are refused; the chunked part's memory check catches an
N x N matrix and a state per token; the experiment is a measurement."""

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from attnlab.grading.checks import run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.exercises.e12 import checks as e12, spec
from mistakes import Wrong, variant as _variant

WRONG = Wrong()


# ---------------------------------------------------------------------------------------------
# causal-topk, delta-recurrence and delta-chunked: every known mistake the checks emulate is proven by
# tests/test_every_mistake.py. Here: right answers as a learner would write them, the kernel's wrong versions and
# the mistakes only a measurement shows.
# ---------------------------------------------------------------------------------------------
# causal-topk
# ---------------------------------------------------------------------------------------------

def _select():
    def select_blocks(block_scores, topk):
        s = block_scores.clone().float()
        nqb, nkb = s.shape[-2], s.shape[-1]
        for i in range(nqb):
            for j in range(i + 1, nkb):
                s[..., i, j] = -math.inf                                    # the future: never selected
            if i < nkb:
                s[..., i, i] = math.inf                                     # the diagonal: always selected
        k = min(topk, nkb)
        vals, ids = torch.topk(s, k, dim=-1)
        out = torch.where(vals == -math.inf, nkb, ids).sort(dim=-1).values
        out = torch.where(out == nkb, -1, out)                              # unselectable slots last, as -1
        return F.pad(out, (0, topk - k), value=-1).int()
    return select_blocks


# ---------------------------------------------------------------------------------------------
# selected-kernel: one kernel source, its mistake switches are globals of its code
# ---------------------------------------------------------------------------------------------

@triton.jit
def _kernel_body(Q, K, V, O, block_indices, stride_h, stride_n, n_ctx, n_qb, topk, scale,
                 HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    base = pid_h * stride_h
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + offs_m[:, None] * stride_n + offs_d[None, :], mask=offs_m[:, None] < n_ctx, other=0.0)
    m_i = tl.full((BLOCK,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK,), tl.float32)
    acc = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    row = pid_m if HEAD_ZERO else pid_h * n_qb + pid_m
    stop = topk - 1 if DROP_LAST else topk
    if LOAD_ALL:
        stop = n_qb
    for i in range(0, stop):
        if COUNTER_AS_INDEX or LOAD_ALL:
            j = i
        else:
            j = tl.load(block_indices + row * topk + i)
        if PAD == 1:
            j = tl.maximum(j, 0)
        if PAD == 2:
            selected = j > -1000000   # every slot, -1 too
        else:
            selected = j >= 0
        if selected:
            offs_n = j * BLOCK + tl.arange(0, BLOCK)
            k = tl.load(K + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx,
                        other=0.0)
            if LOAD_TWICE:
                k = tl.load(K + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx,
                            other=0.0)
            v = tl.load(V + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx,
                        other=0.0)
            if SCALE_ARG:
                s = tl.dot(q, tl.trans(k)) * scale
            else:
                s = tl.dot(q, tl.trans(k)) * (1.0 / HEAD_DIM ** 0.5)
            s = tl.where(offs_n[None, :] < n_ctx, s, float("-inf"))
            if CAUSAL == 0:
                s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
            if CAUSAL == 2:
                s = tl.where(offs_n[None, :] < offs_m[:, None], s, float("-inf"))
            if LOAD_ALL:   # every block loaded, the unselected ones masked afterwards
                chosen = 0
                for t in range(0, topk):
                    chosen = chosen | (tl.load(block_indices + row * topk + t) == j).to(tl.int32)
                s = tl.where(chosen != 0, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if RESCALE:
                acc = acc * alpha[:, None] + tl.dot(p, v)
            else:
                acc = acc + tl.dot(p, v)
            m_i = m_new
    tl.store(O + base + offs_m[:, None] * stride_n + offs_d[None, :], acc / l_i[:, None], mask=offs_m[:, None] < n_ctx)


_KERNEL_OK = dict(HEAD_ZERO=False, DROP_LAST=False, LOAD_ALL=False, COUNTER_AS_INDEX=False, PAD=0, LOAD_TWICE=False,
                  SCALE_ARG=True, CAUSAL=0, RESCALE=True)


def _kernel(**flags):
    return _variant(_kernel_body, **{**_KERNEL_OK, **flags})


for _key, _flags in [("padding-slot-read", {"PAD": 2}), ("padding-as-block-zero", {"PAD": 1}),
                     ("causal-mask-missing", {"CAUSAL": 1}), ("causal-diagonal-excluded", {"CAUSAL": 2}),
                     ("acc-not-rescaled", {"RESCALE": False}), ("counter-as-block-index", {"COUNTER_AS_INDEX": True}),
                     ("head-offset-forgotten", {"HEAD_ZERO": True}), ("last-slot-skipped", {"DROP_LAST": True}),
                     ("scale-argument-ignored", {"SCALE_ARG": False}),
                     ("unselected-blocks-loaded", {"LOAD_ALL": True}), ("extra-traffic", {"LOAD_TWICE": True})]:
    WRONG.add("selected-kernel", _key, selected_attn_kernel=_kernel(**_flags))


# ---------------------------------------------------------------------------------------------
# delta-recurrence: a learner's loop, with einsum
# ---------------------------------------------------------------------------------------------

def _recurrence():
    def delta_recurrence(q, k, v, beta, g=None, scale=None, initial_state=None):
        B, H, N, dk = q.shape
        scale = 1 / math.sqrt(dk) if scale is None else scale
        S = torch.zeros(B, H, dk, v.shape[-1]) if initial_state is None else initial_state.clone()
        o = torch.zeros(B, H, N, v.shape[-1])
        for t in range(N):
            if g is not None:
                S = S * torch.exp(g[:, :, t])[:, :, None, None]
            u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k[:, :, t], S))
            S = S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], u)
            o[:, :, t] = torch.einsum("bhk,bhkv->bhv", scale * q[:, :, t], S)
        return o, S
    return delta_recurrence


# ---------------------------------------------------------------------------------------------
# delta-chunked: a learner's chunk loop, forward substitution by hand
# ---------------------------------------------------------------------------------------------

def _forward_substitution(L, R):
    """X with (I + L) X = R, L strictly lower (or with a diagonal: then divided by it): row by row."""
    X = torch.zeros_like(R)
    C = L.shape[-1]
    for i in range(C):
        X[..., i, :] = (R[..., i, :] - (L[..., i, :i, None] * X[..., :i, :]).sum(-2)) / (1 + L[..., i, i, None])
    return X


def _solve_triangular(L, R):
    return torch.linalg.solve_triangular(L + torch.eye(L.shape[-1]), R, upper=False)


def _chunked(solve=_forward_substitution):
    def delta_chunkwise(q, k, v, beta, g, chunk_size, scale=None, initial_state=None):
        B, H, N, dk = q.shape
        scale = dk ** -0.5 if scale is None else scale
        g = torch.zeros_like(beta) if g is None else g
        S = torch.zeros(B, H, dk, v.shape[-1]) if initial_state is None else initial_state.clone()
        o = torch.zeros(B, H, N, v.shape[-1])
        for c in range(math.ceil(N / chunk_size)):
            sl = slice(c * chunk_size, min(N, (c + 1) * chunk_size))
            qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]
            G = torch.cumsum(g[:, :, sl], dim=-1)
            C = G.shape[-1]
            causal = torch.tril(torch.ones(C, C, dtype=torch.bool))
            D = torch.exp(torch.where(causal, G[..., :, None] - G[..., None, :], -math.inf))      # (B, H, C, C)
            A = torch.tril(bc[..., None] * (kc @ kc.transpose(-1, -2)) * D, -1)
            W = solve(A, (bc * torch.exp(G))[..., None] * kc)
            U = solve(A, bc[..., None] * vc) - W @ S
            P = (qc @ kc.transpose(-1, -2)) * D
            o[:, :, sl] = scale * (torch.exp(G)[..., None] * qc @ S + P @ U)
            last = G[..., -1]
            S = torch.exp(last)[..., None, None] * S + (torch.exp(last[..., None] - G)[..., None] * kc).transpose(
                -1, -2) @ U
        return o, S
    return delta_chunkwise


def _whole_sequence(q, k, v, beta, g, chunk_size, scale=None, initial_state=None):
    """Right numbers, chunk_size ignored: the whole sequence is one chunk, its matrices N x N."""
    return _chunked(solve=_solve_triangular)(q, k, v, beta, g, q.shape[2], scale=scale, initial_state=initial_state)


def _states_per_token(q, k, v, beta, g, chunk_size, scale=None, initial_state=None):
    """Right numbers, token by token, keeping every state (N x d_k x d_v) to read the outputs from afterwards."""
    B, H, N, dk = q.shape
    scale = dk ** -0.5 if scale is None else scale
    S = torch.zeros(B, H, dk, v.shape[-1]) if initial_state is None else initial_state.clone()
    states = []
    for t in range(N):
        if g is not None:
            S = S * torch.exp(g[:, :, t])[..., None, None]
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k[:, :, t], S))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], u)
        states.append(S)
    all_states = torch.stack(states, dim=2)                                 # (B, H, N, d_k, d_v)
    return torch.einsum("bhnk,bhnkv->bhnv", scale * q, all_states), S


# these two compute the right numbers: only the check's memory measurement shows them
WRONG.add("delta-chunked", "whole-sequence-one-chunk", delta_chunkwise=_whole_sequence)
WRONG.add("delta-chunked", "state-kept-per-token", delta_chunkwise=_states_per_token)


# ---------------------------------------------------------------------------------------------
# state-vs-cache: the experiment, measured on real tensors and the learner's own delta rule
# ---------------------------------------------------------------------------------------------

def _measured(flaw=None):
    def state_vs_cache(contexts, heads, kv_heads, d):
        cache, state = [], []
        for L in contexts:
            h = heads if flaw == "cache-query-heads" else kv_heads
            dtype = torch.float32 if flaw == "cache-float32" else torch.float16
            tokens = 1 if flaw == "cache-one-token" else L
            kc, vc = torch.zeros(1, h, tokens, d, dtype=dtype), torch.zeros(1, h, tokens, d, dtype=dtype)
            cache.append(kc.nbytes + (0 if flaw == "cache-k-only" else vc.nbytes))
            q, v = torch.randn(1, heads, L, d), torch.randn(1, heads, L, d)
            k = F.normalize(torch.randn(1, heads, L, d), dim=-1)
            beta, g = torch.rand(1, heads, L), -torch.rand(1, heads, L)
            o, S = delta_chunkwise(q, k, v, beta, g, 16)
            if flaw == "state-float16":
                S = S.half()
            state.append(S.nbytes * (L if flaw == "state-per-token" else 1))
        out = torch.tensor(cache), torch.tensor(state)
        return out[::-1] if flaw == "swapped" else out
    delta_chunkwise = _chunked()
    return state_vs_cache


# kept beside the emulations (formulas): each measures real tensors the wrong way, so it proves that the
# emulation's formula is what such a learner measures
for _key in ("cache-k-only", "cache-float32", "cache-query-heads", "cache-one-token", "state-float16",
             "state-per-token", "swapped"):
    WRONG.add("state-vs-cache", _key, state_vs_cache=_measured(_key))

test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


# ---------------------------------------------------------------------------------------------
# right answers written another way, shortcuts, and the checks' own claims
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("part, names", [
    pytest.param("causal-topk", {"select_blocks": _select()}, id="causal-topk"),
    pytest.param("selected-kernel", {"selected_attn_kernel": _kernel()}, id="selected-kernel"),
    pytest.param("delta-recurrence", {"delta_recurrence": _recurrence()}, id="delta-recurrence"),
    pytest.param("delta-chunked", {"delta_chunkwise": _chunked()}, id="delta-chunked"),
    pytest.param("state-vs-cache", {"state_vs_cache": _measured()}, id="state-vs-cache")])
def test_right_answers_written_another_way_pass(part, names):
    result = run_check(part, LocalLearner(names, forbidden=[]))
    assert result.passed, result.message


def _refused(part, ns, name):
    result = run_check(part, ns)
    assert not result.passed and "shortcut" in result.diagnosis, result.message
    assert name in result.message, result.message


def test_the_library_s_answers_are_refused():
    from attnlab import linear_attention, sparse

    _refused("causal-topk", {"select_blocks": lambda block_scores, topk: sparse.select_blocks(block_scores, topk)},
             "attnlab.sparse.select_blocks")
    _refused("delta-recurrence", {"delta_recurrence": lambda q, k, v, beta, g=None, scale=None, initial_state=None:
                                  linear_attention.delta_rule_recurrent(q, k, v, beta, g, scale=scale,
                                                                        initial_state=initial_state,
                                                                        output_final_state=True)},
             "attnlab.linear_attention.delta_rule_recurrent")
    _refused("delta-chunked", {"delta_chunkwise": lambda q, k, v, beta, g, chunk_size, scale=None, initial_state=None:
                               linear_attention.delta_rule_chunked(q, k, v, beta, g, scale=scale,
                                                                   initial_state=initial_state,
                                                                   output_final_state=True, chunk_size=chunk_size)},
             "attnlab.linear_attention.delta_rule_chunked")
    _refused("delta-chunked", {"delta_chunkwise": spec.delta_chunkwise_fast},
             "attnlab.grading.exercises.e12.spec")


def test_the_formula_is_not_the_experiment():
    def state_vs_cache(contexts, heads, kv_heads, d):
        return (torch.tensor([2 * kv_heads * d * 2 * L for L in contexts]),
                torch.tensor([heads * d * d * 4 for _ in contexts]))

    result = run_check("state-vs-cache", LocalLearner({"state_vs_cache": state_vs_cache}))
    assert not result.passed and "technique-skipped" in result.diagnosis, result.message
    assert "delta_chunkwise" in result.message, result.message


def test_a_token_loop_that_keeps_one_state_passes_the_chunked_part_as_its_docstring_says():
    """What the grader cannot see (checks.py's docstring): the recurrence with one state has the chunked form's
    numbers and memory. Said, and tested, so that the claim stays true."""
    def delta_chunkwise(q, k, v, beta, g, chunk_size, scale=None, initial_state=None):
        return _recurrence()(q, k, v, beta, g, scale=scale, initial_state=initial_state)

    assert run_check("delta-chunked", LocalLearner({"delta_chunkwise": delta_chunkwise}, forbidden=[])).passed
    assert "neither is used, so such a loop passes" in e12.__doc__


def test_the_selections_of_the_kernel_cases_have_padding_and_ragged_blocks():
    cases = [launch.inputs for launch in e12._launches()]                # (q, k, v, scale, block_indices, BLOCK)
    assert not any((bi < 0).any() for *_, bi, _bs in cases[:1])           # the first: no -1 slot, even N
    assert all((bi < 0).any() for *_, bi, _bs in cases[1:])
    assert any(q.shape[1] % bs for q, *_, bs in cases)
    assert {scale for _q, _k, _v, scale, _bi, _bs in cases}.isdisjoint({d ** -0.5 for d in (16, 32)})


def test_the_chunked_reference_at_the_peak_case_equals_the_recurrence():
    """The peak check compares the measured call with the library's chunked form (the recurrence is slow at N =
    4096 in the grader): the two agree within the check's tolerance on a shorter sequence of the same kind."""
    q, k, v, beta, g, _ = e12._delta_inputs(torch.Generator().manual_seed(3), 1, 1, 300, 64, 64, "mild")
    o1, s1 = spec.delta_chunkwise_fast(q, k, v, beta, g, 64)
    o2, s2 = spec.delta_recurrence(q, k, v, beta, g)
    torch.testing.assert_close(o1, o2, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(s1, s2, rtol=1e-3, atol=1e-4)
