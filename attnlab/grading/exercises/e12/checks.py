"""The checks of exercise 12_beyond_dense: one table per graded part (:mod:`attnlab.grading.engine`).

``selected-kernel``: the interpreter records every load, so loading a key block not selected fails. ``delta-chunked``:
the numbers, then the peak memory at N = 4096 (under 24 MiB; an N x N matrix or a state per token is 64 MiB).

**What "chunkwise" cannot mean to this grader.** A loop over the tokens keeping one state gives the same numbers at
about the same memory; it differs only in time and operation counts. An operation count taken inside the learner's
process is the learner's word, and CPU time on a shared machine is noise within a factor of a few:
neither is used, so such a loop passes the check (the written part asks why it would be slow on a GPU).
"""

import math

import torch
import torch.nn.functional as F

from attnlab.grading.core import Fail, Mistake, check_function, gen as _gen, mistakes, randn as _randn, table
from attnlab.grading.engine import Function, Kernel, Launch, Measured, run
from attnlab.grading.exercises.e12 import spec as specs
from attnlab.grading.kernel_check import attention_budget, attention_launch, block_rows, blocks_allowed, cdiv
from attnlab.grading.sandbox.footprint import peak_growth

NEG_INF = float("-inf")


# (label, shape, topk, what the scores are): "negative" all below 0, "holes" a third of them -inf
_TOPK_CASES = [("B=1, 4 x 4 blocks, topk=2", (1, 4, 4), 2, ""),
               ("B=2, H=2, 5 x 5 blocks, topk=3 (4-D: one selection per head)", (2, 2, 5, 5), 3, ""),
               ("B=1, 6 x 6 blocks, topk=1: the diagonal only", (1, 6, 6), 1, ""),
               ("B=2, 5 x 5 blocks, topk=3, every score negative", (2, 5, 5), 3, "negative"),
               ("B=1, 6 x 6 blocks, topk=3, a third of the past blocks scored -inf", (1, 6, 6), 3, "holes"),
               ("B=1, 3 x 3 blocks, topk=5 (more slots than key blocks)", (1, 3, 3), 5, ""),
               ("B=1, 4 query blocks, 6 key blocks, topk=2", (1, 4, 6), 2, ""),
               ("B=1, 6 query blocks, 4 key blocks, topk=2 (no diagonal block for query blocks 4 and 5)", (1, 6, 4),
                2, "")]


def _topk_case(g, label, shape, topk, how):
    s = _randn(g, *shape) - (4.0 if how == "negative" else 0.0)
    if how == "holes":
        s = s.masked_fill(torch.rand(*shape, generator=g) < 0.33, NEG_INF)
    return label, (s, topk), {}


def _select_with(future="-inf", diagonal="forced", free="-1", order="ascending", widen=True):
    """A wrong select_blocks: future "-inf" | "zero" | "none"; diagonal "forced" | "free" | "masked";
    free slots "-1" | "kept" | "zero"; order "ascending" | "rank" | "pad-first"; widen: pad to topk columns."""
    def impl(block_scores, topk):
        s = block_scores.float().clone()
        nqb, nkb = s.shape[-2:]
        i, j = torch.arange(nqb)[:, None], torch.arange(nkb)[None, :]
        if future != "none":
            s = s.masked_fill((j >= i) if diagonal == "masked" else (j > i), NEG_INF if future == "-inf" else 0.0)
        if diagonal == "forced":
            s = s.masked_fill(j == i, float("inf"))
        kk = min(topk, nkb)
        values, ids = s.topk(kk, dim=-1)
        fill = 0 if free == "zero" else -1
        # ascending: the free slots last, as a stand-in larger than any id, sorted, then the fill
        ids = torch.where((values == NEG_INF) & (free != "kept"), nkb if order == "ascending" else -1, ids)
        ids = ids if order == "rank" else ids.sort(dim=-1).values
        ids = torch.where(ids == nkb, fill, ids)
        if widen and kk < topk:
            ids = torch.cat([ids, ids.new_full((*ids.shape[:-1], topk - kk), fill)], -1)
        return ids.to(torch.int32)
    return impl


_TOPK_MISTAKES = mistakes(_select_with, [
    ("future-selected", "query block i may never select a block j > i: give those -inf first", {"future": "none"}),
    ("future-masked-with-zero", "mask the future with -inf, not 0, which outranks negative scores", {"future": "zero"}),
    ("diagonal-not-kept", "always keep the diagonal block j == i: give it +inf before ranking", {"diagonal": "free"}),
    ("diagonal-masked-as-future", "only j > i is the future; the diagonal j == i is kept", {"diagonal": "masked"}),
    ("unselectable-slots-kept", "a slot whose block scored -inf is -1, not a real id", {"free": "kept"}),
    ("ids-not-sorted", "list the ids in ascending order, -1s last", {"order": "rank"}),
    ("padding-first", "put the -1s last: sort with n_k_blocks standing in for them, then make it -1",
     {"order": "pad-first"}),
    ("padding-zero", "0 is a real block id: mark free slots -1", {"free": "zero"}),
    ("not-padded-to-topk", "always return topk columns, the extra ones -1", {"widen": False}),
])


_BUDGET = "Q read once, K and V of each selected block once per query block that selected it, O written once"

# (BH, N, D, BLOCK, topk, amplitude of q and k, scale, what the case shows): the first two have no ragged block, so
# an out-of-bounds load there comes from a -1 slot read as a block, not from the end of the sequence
_KERNEL_CASES = [(2, 64, 16, 16, 1, 1.0, 0.3, " (the diagonal block only)"),
                 (2, 64, 16, 16, 2, 1.0, 0.55, " (query block 0 has a -1 slot)"),
                 (2, 50, 16, 16, 3, 1.0, 0.2, ", ragged N"),
                 (1, 80, 16, 16, 5, 1.0, 0.4, " (every past block: causal attention)"),
                 (3, 72, 32, 16, 2, 5.0, 0.12, ", large scores"),
                 (2, 70, 16, 32, 2, 1.0, 0.35, ", ragged N")]


def _launch(g, bh, n, d, bs, topk, amp, scale, what):
    """q, k, v and o each inside sentinel memory with 16 extra rows per head, one program per (query block, head),
    the selection of each head made by the library's ``select_blocks``; each program may load K and V of its
    selected blocks only."""
    q, k, v = _randn(g, bh, n, d, scale=amp), _randn(g, bh, n, d, scale=amp), _randn(g, bh, n, d)
    nqb = cdiv(n, bs)
    block_indices = specs.select_blocks(_randn(g, bh, nqb, nqb), topk)     # (BH, nqb, topk), per head
    buffers, args = attention_launch({"q": q, "k": k, "v": v, "o": q.shape}, 16, ["o"], [n, nqb, topk, scale],
                                     [block_indices.contiguous()])
    kv = sum(block_rows(j, bs, n) for j in block_indices.flatten().tolist() if j >= 0)
    visit = torch.zeros(bh, nqb, nqb + 1, dtype=torch.bool).scatter_(
        -1, torch.where(block_indices < 0, nqb, block_indices).long(), True)[..., :nqb]
    return Launch(f"BH={bh}, N={n}, D={d}, BLOCK={bs}, topk={topk}{what}, scale={scale}", buffers, (nqb, bh), args,
                  {"HEAD_DIM": d, "BLOCK": bs}, {"o": specs.selected_attention(q, k, v, block_indices, bs, scale)},
                  (q, k, v, scale, block_indices, bs), ("Q", "K", "V", "scale", "block_indices", "BLOCK"),
                  attention_budget(q.shape, kv), dict.fromkeys("kv", blocks_allowed(visit, bs, q.shape)))


def _launches():
    return table(12_100, _KERNEL_CASES, _launch)


def _selected_with(pad="skip", causal="le", rescale=True, counter=False, head_zero=False, drop_last=False,
                   scale_arg=True):
    """A wrong kernel, as the kernel computes it: every (head, query block) at once, lesson 07's online softmax
    over the slots of its list, in slot order. q, k, v (BH, N, D); block_indices (BH, n_qb, topk)."""
    def impl(q, k, v, scale, block_indices, block):
        bh, n, d = q.shape
        nqb, topk = cdiv(n, block), block_indices.shape[-1]
        scale = scale if scale_arg else d ** -0.5
        qb, kb, vb = (F.pad(x, (0, 0, 0, nqb * block - n)).view(bh, nqb, block, d) for x in (q, k, v))
        ids = block_indices[:1].expand(bh, -1, -1) if head_zero else block_indices
        ids = torch.arange(topk).expand(bh, nqb, topk) if counter else ids.long()
        rows = torch.arange(nqb * block).view(nqb, block, 1)
        m_i, l_i = torch.full((bh, nqb, block), NEG_INF), torch.zeros(bh, nqb, block)
        acc = torch.zeros(bh, nqb, block, d)
        for slot in range(topk - 1 if drop_last else topk):
            j = ids[..., slot].clamp(min=0) if pad == "zero" else ids[..., slot]      # (BH, nqb)
            live = (j >= 0) & (j < nqb)          # a skipped slot, or one past the keys (every score -inf)
            jj = j.clamp(0, nqb - 1)
            kj, vj = (x[torch.arange(bh)[:, None], jj] for x in (kb, vb))             # (BH, nqb, BLOCK, D)
            cols = (jj[..., None] * block + torch.arange(block))[..., None, :]         # (BH, nqb, 1, BLOCK)
            s = (qb @ kj.transpose(-1, -2) * scale).masked_fill((cols >= n) | ~live[..., None, None], NEG_INF)
            if causal != "none":   # "le": a query sees keys j <= i; "lt": j < i
                s = s.masked_fill(cols > rows - int(causal == "lt"), NEG_INF)
            m_new = torch.maximum(m_i, s.amax(-1))
            m_safe = m_new.masked_fill(m_new == NEG_INF, 0.0)
            alpha, p = torch.exp(m_i - m_safe), torch.exp(s - m_safe[..., None])
            l_i, m_i = l_i * alpha + p.sum(-1), m_new
            acc = (acc * alpha[..., None] if rescale else acc) + p @ vj
        return (acc / l_i[..., None]).view(bh, nqb * block, d)[:, :n]
    return impl


_KERNEL_MISTAKES = mistakes(_selected_with, [
    ("padding-as-block-zero", "a -1 slot is read as block 0 (tl.maximum(j, 0)?): skip slots j < 0", {"pad": "zero"}),
    ("causal-mask-missing", "mask scores with offs_n[None, :] > offs_m[:, None] to -inf", {"causal": "none"}),
    ("causal-diagonal-excluded", "a query sees its own key: mask offs_n > offs_m, not >=", {"causal": "lt"}),
    ("acc-not-rescaled", "rescale as the max grows: acc = acc * alpha[:, None] + tl.dot(p, v)", {"rescale": False}),
    ("counter-as-block-index", "use j = tl.load(block_indices + row * topk + i) as slot i's block", {"counter": True}),
    ("head-offset-forgotten", "each head has its own lists: they start at block_indices + (pid_h * n_qb + pid_m) * "
     "topk", {"head_zero": True}),
    ("last-slot-skipped", "visit all topk slots: range(0, topk)", {"drop_last": True}),
    ("scale-argument-ignored", "multiply the scores by `scale`, not 1/sqrt(HEAD_DIM)", {"scale_arg": False}),
])
PADDING_READ = Mistake("padding-slot-read", "a -1 slot is loaded as a block, outside K and V: do the loads and the "
                       "update under `if j >= 0:`", None)
UNSELECTED_LOADED = Mistake("unselected-blocks-loaded", "blocks not selected are loaded (dense attention's bytes): "
                            "load only block j = block_indices[..., i] for each slot with j >= 0", None)


def _padding_read(learner, case, exc):
    """An out-of-bounds load where no block is ragged: the stray rows are a -1 slot's."""
    q, _k, _v, _scale, block_indices, bs = case.inputs
    if any(m.key == "out-of-bounds-load" for m in exc.mistakes) and not q.shape[1] % bs and (block_indices < 0).any():
        exc.mistakes.insert(0, PADDING_READ)


def _padding_as_block_zero(case, traffic):
    """Block 0 loaded once more for every -1 slot: the signature of a -1 read as block 0."""
    q, _k, _v, _scale, block_indices, bs = case.inputs
    pads, (n, d) = int((block_indices < 0).sum()), q.shape[1:]
    extra = traffic["k"]["load_bytes"] - case.budget["k"][0]
    return [_KERNEL_MISTAKES[0]] if pads and extra == pads * block_rows(0, bs, n) * d * 4 else []


def _delta_inputs(g, B, H, N, dk, dv, gate="mild", init=False):
    """q, k (unit-norm keys, as Gated DeltaNet normalises them), v, beta in (0, 1), g <= 0 (or None), state."""
    q, k, v = _randn(g, B, H, N, dk), F.normalize(_randn(g, B, H, N, dk), dim=-1), _randn(g, B, H, N, dv)
    beta = torch.sigmoid(_randn(g, B, H, N))
    gates = None if gate is None else F.logsigmoid(_randn(g, B, H, N) + (3.0 if gate == "mild" else -2.0))
    state = _randn(g, B, H, dk, dv, scale=0.5) if init else None
    return q, k, v, beta, gates, state


def _delta_case(g, label, dims, gate, init, scale):
    """A case of both forms from a row (label, (B, H, N, d_k, d_v[, chunk_size]), gate, initial state?, scale): the
    recurrence takes g as a keyword, the chunked form g and the chunk size after beta."""
    B, H, N, dk, dv, *chunk = dims
    q, k, v, beta, gates, state = _delta_inputs(g, B, H, N, dk, dv, gate, init)
    kwargs = {**({} if scale is None else {"scale": scale}), **({} if state is None else {"initial_state": state})}
    return (label, (q, k, v, beta, gates, *chunk), kwargs) if chunk else (label, (q, k, v, beta),
                                                                         {"g": gates, **kwargs})


_RECURRENCE_CASES = [
    ("B=1, H=1, N=6, d_k=d_v=4, no gate (g=None)", (1, 1, 6, 4, 4), None, False, None),
    ("B=2, H=2, N=9, d_k=d_v=8, gated", (2, 2, 9, 8, 8), "mild", False, None),
    ("B=1, H=2, N=7, d_k=4, d_v=6, gated, scale=0.3", (1, 2, 7, 4, 6), "mild", False, 0.3),
    ("B=2, H=1, N=8, d_k=d_v=4, gated, an initial state", (2, 1, 8, 4, 4), "mild", True, None),
    ("B=1, H=2, N=10, d_k=6, d_v=4, strong gates (g ~ -2), an initial state", (1, 2, 10, 6, 4), "strong", True, None)]


def _read(S, x, transposed=False):
    """S^T x for S (B, H, d_k, d_v) and x (B, H, d_k): (B, H, d_v); S x (sum over d_v) when ``transposed``."""
    return (S * x[..., None, :]).sum(-1) if transposed else (x[..., None] * S).sum(-2)


def _recurrence_with(gate="before", read_from="decayed", correct=True, out="after", exp_gate=True,
                     read_transposed=False, state_transposed=False, scale_rule="arg", init=True):
    """A wrong delta_recurrence, token by token."""
    def impl(q, k, v, beta, g=None, scale=None, initial_state=None):
        B, H, N, dk = q.shape
        sc = 1.0 if scale_rule == "none" else dk ** -0.5 if (scale is None or scale_rule == "ignored") else scale
        S = initial_state.clone() if (initial_state is not None and init) else q.new_zeros(B, H, dk, v.shape[-1])
        outs = []
        for t in range(N):
            a = 1.0 if g is None else (g[:, :, t].exp() if exp_gate else g[:, :, t])[:, :, None, None]
            old, S = S, S * a if gate == "before" else S
            r = _read(S if read_from == "decayed" else old, k[:, :, t], read_transposed)
            u = beta[:, :, t, None] * (v[:, :, t] - (r if correct else 0.0))
            if out == "before":
                outs.append(_read(old, sc * q[:, :, t], read_transposed))
            S = S + k[:, :, t, :, None] * u[:, :, None, :]
            S = S * a if gate == "after" else S
            if out == "after":
                outs.append(_read(S, sc * q[:, :, t], read_transposed))
        return torch.stack(outs, 2), (S.transpose(-1, -2) if state_transposed else S)
    return impl


_RECURRENCE_MISTAKES = mistakes(_recurrence_with, [
    ("gate-after-write", "decay first, S = S * exp(g_t), then read and write", {"gate": "after"}),
    ("read-before-decay", "read the decayed state: u_t = beta_t (v_t - (exp(g_t) S)^T k_t)", {"read_from": "old"}),
    ("no-delta-correction", "write only the correction u_t = beta_t (v_t - S^T k_t)", {"correct": False}),
    ("output-before-write", "read o_t = S_t^T (scale q_t) after this token's decay and write", {"out": "before"}),
    ("gate-not-exponentiated", "g is the log of the decay: multiply S by exp(g_t)", {"exp_gate": False}),
    ("read-transposed", "sum over d_k, not d_v: S^T k = (k[..., None] * S).sum(-2)", {"read_transposed": True}),
    ("state-transposed", "return the final state (B, H, d_k, d_v), as k u^T writes it", {"state_transposed": True}),
    ("scale-missing", "o_t = S^T (scale q_t), scale = 1/sqrt(d_k) by default", {"scale_rule": "none"}),
    ("scale-ignored", "a given `scale` replaces 1/sqrt(d_k)", {"scale_rule": "ignored"}),
    ("initial-state-ignored", "start from a copy of initial_state when one is given", {"init": False}),
])


_CHUNKED_CASES = [
    ("B=1, H=1, N=10, d_k=d_v=4, chunks of 4 (4, 4, 2), gated", (1, 1, 10, 4, 4, 4), "mild", False, None),
    ("B=2, H=2, N=37, d_k=d_v=8, chunks of 8, gated, an initial state", (2, 2, 37, 8, 8, 8), "mild", True, None),
    ("B=1, H=2, N=16, d_k=d_v=8, one chunk of 16, no gate", (1, 2, 16, 8, 8, 16), None, False, None),
    ("B=1, H=1, N=5, d_k=d_v=4, chunk_size=8 > N, gated", (1, 1, 5, 4, 4, 8), "mild", False, None),
    ("B=1, H=1, N=12, d_k=d_v=4, chunk_size=1", (1, 1, 12, 4, 4, 1), "mild", True, None),
    ("B=1, H=2, N=23, d_k=4, d_v=6, chunks of 5, scale=0.7", (1, 2, 23, 4, 6, 5), "mild", False, 0.7),
    ("B=1, H=1, N=64, d_k=d_v=8, chunks of 16, strong gates (g ~ -2), an initial state", (1, 1, 64, 8, 8, 16),
     "strong", True, None)]


def _chunked_with(cumulative=True, carry=True, inter=True, intra_diagonal=True, a_strict=True, ws0=True,
                  tail=True, state_decay=True, key_decay=True, a_beta=True, q_decay=True):
    """A wrong delta_chunkwise: the library's WY / UT form with one switch off."""
    def impl(q, k, v, beta, g, chunk_size, scale=None, initial_state=None):
        B, H, N, dk = q.shape
        sc = dk ** -0.5 if scale is None else scale
        gg = g if g is not None else torch.zeros_like(beta)
        S = initial_state.clone() if initial_state is not None else q.new_zeros(B, H, dk, v.shape[-1])
        stop = N if tail else N - N % chunk_size
        outs = []
        for c0 in range(0, stop, chunk_size):
            qc, kc, vc, bc, gc = (x[:, :, c0:c0 + chunk_size] for x in (q, k, v, beta, gg))
            C, G = qc.shape[2], gc.cumsum(-1) if cumulative else gc
            lower = torch.ones(C, C, dtype=torch.bool).tril()
            decay = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, NEG_INF).exp()
            A = (kc @ kc.transpose(-2, -1)) * decay * (bc[..., None] if a_beta else 1.0)
            I_A = A.tril(-1 if a_strict else 0) + torch.eye(C)
            W = torch.linalg.solve_triangular(I_A, (bc * G.exp())[..., None] * kc, upper=False)
            U = torch.linalg.solve_triangular(I_A, bc[..., None] * vc, upper=False) - (W @ S if ws0 else 0.0)
            inter_o = ((G.exp()[..., None] * qc) if q_decay else qc) @ S
            scores = ((qc @ kc.transpose(-2, -1)) * decay).tril(0 if intra_diagonal else -1)
            outs.append(sc * ((inter_o if inter else 0.0) + scores @ U))
            if carry:
                G_last = G[..., -1]
                keys = ((G_last[..., None] - G).exp()[..., None] * kc) if key_decay else kc
                S = (G_last.exp()[..., None, None] * S if state_decay else S) + keys.transpose(-2, -1) @ U
        return torch.cat(outs, dim=2), S
    return impl


_CHUNKED_MISTAKES = mistakes(_chunked_with, [
    ("gate-not-cumulative", "decay j -> i is exp(G_i - G_j), G = g.cumsum(-1) within the chunk", {"cumulative": False}),
    ("state-not-carried", "carry the state: after each chunk S = exp(G_C) S + (K exp(G_C - G))^T U", {"carry": False}),
    ("inter-chunk-term-missing", "o = scale (exp(G) Q S + ((Q K^T) * decay) U): add exp(G) Q S", {"inter": False}),
    ("intra-diagonal-excluded", "token i reads its own write: (Q K^T) * decay keeps j <= i", {"intra_diagonal": False}),
    ("A-diagonal-included", "A is strictly lower triangular (j < i); I + A has the ones", {"a_strict": False}),
    ("ws0-term-missing", "U = T diag(beta) V - W S: subtract what S already returns", {"ws0": False}),
    ("ragged-tail-dropped", "chunk starts run range(0, N, C); the last chunk is N - c0 tokens", {"tail": False}),
    ("state-decay-missing", "decay the carried state over the chunk: S_new = exp(G_C) S + ...", {"state_decay": False}),
    ("key-decay-missing", "S_new = exp(G_C) S + (K * exp(G_C - G_j))^T U: decay the writes too", {"key_decay": False}),
    ("beta-missing-in-A", "A[i, j] = beta_i exp(G_i - G_j) (k_i . k_j) for j < i", {"a_beta": False}),
    ("query-decay-missing", "decay the queries' read of the starting state: exp(G_i) q_i^T S", {"q_decay": False}),
])
# the technique, measured from outside the learner's code (attnlab/grading/sandbox/footprint.py): at N = 4096,
# d_k = d_v = 64, an N x N float32 matrix and a state per token are 64 MiB each; the inputs and the output 1 MiB each
PEAK_CASE = (1, 1, 4096, 64, 64, 64)   # B, H, N, d_k, d_v, chunk_size
PEAK_LIMIT = 24 * 2**20
NOT_CHUNKED = [
    Mistake("whole-sequence-one-chunk", "an N x N matrix is held: use chunk_size, C x C matrices per chunk", None),
    Mistake("state-kept-per-token", "keep only the state at the chunk's start, not one per token", None),
]


_CHUNKED = Function("delta_chunkwise", specs.delta_chunkwise, lambda: table(12_300, _CHUNKED_CASES, _delta_case),
                    _CHUNKED_MISTAKES, rtol=1e-4, atol=1e-4,
                    says="{n} cases equal the recurrence (ragged N, chunk sizes 1 to > N, gates, initial states, "
                         "d_k != d_v)")


def _measure_chunked(learner):
    """The numbers (:data:`_CHUNKED`), then the peak memory of one long call."""
    numbers = run(_CHUNKED, learner)
    B, H, N, dk, dv, C = PEAK_CASE
    first, second = (_delta_inputs(_gen(seed), B, H, N, dk, dv, "mild")[:5] for seed in (12_390, 12_391))
    label = f"B={B}, H={H}, N={N}, d_k=d_v={dk}, chunk_size={C}"
    peak = peak_growth(learner, "delta_chunkwise", [(*first, C), {}], label,
                       "that no N x N matrix and no state per token is held", spec=specs.delta_chunkwise_fast,
                       second=[(*second, C), {}], limit=PEAK_LIMIT)
    if peak > PEAK_LIMIT:
        raise Fail(f"`delta_chunkwise` on {label}: the process's peak memory grew by {peak / 2**20:.1f} MiB during the "
                   f"call, where an N x N matrix is {4 * N * N / 2**20:.0f} MiB, a state per token "
                   f"{4 * N * dk * dv / 2**20:.0f} MiB, and a chunkwise function holds C x C matrices and one state",
                   NOT_CHUNKED)
    return (f"{numbers}; no N x N matrix and no state per token held at N={N} (peak memory growth under "
            f"{PEAK_LIMIT // 2**20} MiB)")


def _bytes_with(cache="kv", cache_e=2, cache_heads="kv", state_e=4, state="one", swapped=False):
    def impl(contexts, heads, kv_heads, d):
        per_token = (1 if cache == "k" else 2) * (kv_heads if cache_heads == "kv" else heads) * d * cache_e
        c = torch.tensor([per_token * (1 if cache == "one-token" else L) for L in contexts], dtype=torch.int64)
        s = torch.tensor([heads * d * d * state_e * (L if state == "per-token" else 1) for L in contexts])
        return (s, c) if swapped else (c, s)
    return impl


_BYTES_MISTAKES = mistakes(_bytes_with, [
    ("cache-k-only", "the cache holds K and V", {"cache": "k"}),
    ("cache-float32", "the cache is float16 here (2 bytes per element)", {"cache_e": 4}),
    ("cache-query-heads", "one K and V head per KV head (kv_heads): grouped-query attention", {"cache_heads": "q"}),
    ("cache-one-token", "a decoding step at context L reads the cache of all L tokens", {"cache": "one-token"}),
    ("state-float16", "the delta rule keeps its state in float32 (4 bytes per element)", {"state_e": 2}),
    ("state-per-token", "the state is one (d, d) matrix per head whatever L is", {"state": "per-token"}),
    ("swapped", "return (cache_bytes, state_bytes)", {"swapped": True}),
])


def _measure_bytes(learner):
    """The learner's measured bytes against the grader's count, at parameters drawn from the grader's seed."""
    g = _gen(12_400)
    heads = [2, 4, 6][int(torch.randint(0, 3, (1,), generator=g))]
    kv_heads = [h for h in range(1, heads) if heads % h == 0][-1]           # grouped-query: fewer KV heads
    d = [8, 16, 32][int(torch.randint(0, 3, (1,), generator=g))]
    contexts = sorted(int(x) + 1 for x in torch.randperm(400, generator=g)[:3])
    label = f"contexts {contexts}, heads={heads}, kv_heads={kv_heads}, d={d}"
    check_function(learner, "state_vs_cache", specs.state_vs_cache, [(label, (contexts, heads, kv_heads, d), {})],
                   _BYTES_MISTAKES, rtol=0, atol=0)
    cache, state = specs.state_vs_cache(contexts, heads, kv_heads, d)
    cross = math.ceil(int(state[0]) / (int(cache[0]) // contexts[0]))
    return (f"your measured bytes equal the grader's count exactly ({label}): the cache passes the state at "
            f"L = {cross} tokens")


TABLES = {
    "causal-topk": Function("select_blocks", specs.select_blocks, lambda: table(12_000, _TOPK_CASES, _topk_case),
                            _TOPK_MISTAKES, rtol=0, atol=0,
                            says="{n} selections equal the indexer's causal top-k (3-D and 4-D scores, -inf blocks, "
                                 "negative scores, topk above the number of blocks, n_q_blocks != n_k_blocks)"),
    "selected-kernel": Kernel("selected_attn_kernel", _launches, _KERNEL_MISTAKES, uses_dot=True,
                              says="{n} launches match selected attention (causal, -1 slots, ragged N, topk up to "
                                   "every past block, a scale)", budget_says=_BUDGET,
                              traffic_diagnosis=_padding_as_block_zero, failure_diagnosis=_padding_read,
                              stray_loads=dict.fromkeys("kv", UNSELECTED_LOADED),
                              loads_says="K and V of the key blocks it selected only"),
    "delta-recurrence": Function("delta_recurrence", specs.delta_recurrence,
                                 lambda: table(12_200, _RECURRENCE_CASES, _delta_case), _RECURRENCE_MISTAKES,
                                 says="{n} cases match the gated delta rule, output and final state (gates, "
                                      "d_k != d_v, initial states, a scale)"),
    "delta-chunked": Measured("peak-memory", _measure_chunked, {"delta_chunkwise": _CHUNKED_MISTAKES}),
    "state-vs-cache": Measured("experiment", _measure_bytes, {"state_vs_cache": _BYTES_MISTAKES}),
}
