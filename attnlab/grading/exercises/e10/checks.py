"""The checks of exercise 10_inference, in TABLES. decode-attention and latent-decode also measure one large call's
peak memory; decode-bytes' traced bytes are reproduced to the byte by ``attnlab.iomodel.decode_io``."""

import math

import torch

from attnlab import iomodel
from attnlab.grading.core import Fail, Mistake, gen as _gen, randn as _randn, salted_ints, table as _table
from attnlab.grading.engine import Function, InTurn, Measured, run
from attnlab.grading.exercises.e10 import spec as specs
from attnlab.grading.sandbox.footprint import peak_growth
from attnlab.kvcache import to_paged


# ----------------------------------------------------------------------------- decode-cost

LLAMA = (6.7e9, 32, 32, 128)                              # params, layers, kv_heads, d (Touvron et al. 2023)
GQA8 = (6.7e9 - 32 * 2 * 4096 * (32 - 8) * 128, 32, 8, 128)  # lesson 10's what-if: K, V projections 4x narrower


def _models(seed):
    """(label, (params, layers, kv_heads, d), kwargs): the course's models, and one drawn from the salt."""
    millions, layers, kv_heads, d, e = salted_ints(seed, (50, 9000), (2, 48), (1, 16), (0, 2), (0, 2))
    d, e = (64, 96, 128)[d], (1, 2, 4)[e]
    return [("Llama-2-7B-like (6.7e9 params, 32 layers, 32 KV heads, d=128, fp16)", LLAMA, {}),
            (f"grouped-query ({GQA8[0]:,} params, 32 layers, 8 KV heads, d=128)", GQA8, {}),
            ("GPT-2-small-like in fp32 (124M params, 12 layers, 12 KV heads, d=64)", (124_000_000, 12, 12, 64),
             {"bytes_per_element": 4}),
            (f"{millions}M params, {layers} layers, {kv_heads} KV heads, d={d}, bytes_per_element={e}",
             (millions * 10**6, layers, kv_heads, d), {"bytes_per_element": e})]


def _cost_cases():
    batch, context = salted_ints(10_010, (2, 64), (1, 8192))
    llama, gqa, gpt2, salted = _models(10_011)
    return [(f"{label}, batch {b}, context {n}", (b, n, *model), kwargs) for (label, model, kwargs), b, n in
            [(llama, 1, 4096), (llama, 32, 512), (llama, 32, 4096), (gqa, 16, 2048), (gpt2, 4, 1024),
             (salted, batch, context)]]


def _cost_with(weights="once", kv=2, with_layers=True, unit="bytes", cache_unit=None, cache="per-sequence",
               new_token=False):
    """A wrong decode_step_bytes: ``unit`` what an element counts as, ``cache_unit`` the cache's when it differs."""
    def impl(batch, context, params, layers, kv_heads, d, bytes_per_element=2):
        e = {"bytes": bytes_per_element, "elements": 1, "bits": 8 * bytes_per_element}
        per_token = kv * (layers if with_layers else 1) * kv_heads * d * e[cache_unit or unit]
        w = {"once": 1, "per-sequence": batch, "none": 0}[weights] * params * e[unit]
        return w + (batch if cache == "per-sequence" else 1) * (context + new_token) * per_token
    return impl


def _crossover_of(cost):
    """The crossover a wrong decode_step_bytes gives: its weights' bytes over its cache's bytes per token."""
    def impl(params, layers, kv_heads, d, bytes_per_element=2):
        weights = cost(1, 0, params, layers, kv_heads, d, bytes_per_element)
        return weights / (cost(1, 1, params, layers, kv_heads, d, bytes_per_element) - weights)
    return impl


_COST_MISTAKES = [Mistake(*row) for row in [
    ("weights-per-sequence", "the sequences of a batch share the weights: a step reads them once, not once per "
     "sequence", _cost_with("per-sequence")),
    ("k-only", "the cache holds K and V: 2 x layers x kv_heads x d x e bytes per token", _cost_with(kv=1)),
    ("cache-layers-missing", "every layer has its own K and V: 2 x layers x kv_heads x d x e bytes per token",
     _cost_with(with_layers=False)),
    ("element-size-ignored", "count bytes, not elements: multiply by bytes_per_element", _cost_with(unit="elements")),
    ("bits-not-bytes", "bytes_per_element is already in bytes, not bits", _cost_with(unit="bits")),
    ("weights-forgotten", "a step also reads every weight once, params x bytes_per_element bytes", _cost_with("none")),
    ("cache-not-per-sequence", "each sequence reads its own cache of `context` tokens", _cost_with(cache="shared")),
    ("new-token-counted", "count the `context` cached tokens: the new token's K and V are written, not read",
     _cost_with(new_token=True))]]

_CROSSOVER_MISTAKES = [Mistake(*row) for row in [
    ("crossover-inverted", "inverted: the crossover is the weights' bytes over the cache's bytes per token, params x "
     "e / (cache bytes per token)",
     lambda *args, **kwargs: 1 / specs.crossover_tokens(*args, **kwargs)),
    *[(f"crossover-{key}", m.message, _crossover_of(m.impl))      # the step's k-only and cache-layers-missing
      for key, m in zip(("k-only", "layers-missing"), _COST_MISTAKES[1:3])],
    ("crossover-weights-in-parameters", "the weights are in parameters, the cache in bytes: count both in bytes "
     "(params x e)", _crossover_of(_cost_with(unit="elements", cache_unit="bytes"))),
    ("crossover-cache-in-elements", "the weights are in bytes, the cache in elements: count both in bytes (2 x layers "
     "x kv_heads x d x e per token)", _crossover_of(_cost_with(cache_unit="elements")))]]

_STEP = specs.decode_step_bytes(1, 4096, *LLAMA)   # a 7B model's step at batch 1 and 4,096 tokens
_COST = InTurn(f"{{n}} cases match (steps and crossovers): at batch 1 and 4,096 tokens the weights are "
               f"{LLAMA[0] * 2 / _STEP:.0%} of a 7B step; the caches' read passes the weights' past "
               f"{specs.crossover_tokens(*LLAMA):,.0f} tokens (MHA), {specs.crossover_tokens(*GQA8):,.0f} (8 KV heads)",
               (Function("decode_step_bytes", specs.decode_step_bytes, _cost_cases, _COST_MISTAKES),
                Function("crossover_tokens", specs.crossover_tokens, lambda: _models(10_012), _CROSSOVER_MISTAKES)))


# ----------------------------------------------------------------------------- decode-attention

def _decode_inputs(g, B, hq, hkv, nq, D, lens):
    """q, the caches with garbage past each length (a query that sees it is clearly wrong), and the lengths."""
    q, k, v = _randn(g, B, hq, nq, D), _randn(g, B, hkv, max(lens), D), _randn(g, B, hkv, max(lens), D)
    for b, L in enumerate(lens):
        k[b, :, L:], v[b, :, L:] = 50.0, 100.0
    return q, k, v, torch.tensor(lens, dtype=torch.int32)


def _decode_cases():
    return _table(10_000, [
        ("one sequence, 2 heads, one new query, L = 7 (a full cache)", (1, 2, 2, 1, 8, [7]), {}),
        ("ragged lengths [9, 4, 1] in a cache of 9 (positions past L hold garbage)", (3, 2, 2, 1, 8, [9, 4, 1]), {}),
        ("3 new queries, lengths [10, 5]: query i at position L - 3 + i", (2, 1, 1, 3, 8, [10, 5]), {}),
        ("grouped-query: 4 query heads, 2 KV heads, lengths [6, 8]", (2, 4, 2, 1, 16, [6, 8]), {}),
        ("multi-query: 4 query heads, 1 KV head, 2 new queries, lengths [7, 3]", (2, 4, 1, 2, 8, [7, 3]), {}),
        ("grouped-query, 2 new queries, scale=0.3 (not 1/sqrt(D))", (1, 6, 3, 2, 4, [5]), {"scale": 0.3})],
        lambda g, label, sizes, kwargs: (label, _decode_inputs(g, *sizes), kwargs))


def _decode_with(lengths=True, seen=lambda i, L, nq: L - nq + i, head=lambda h, G, hkv: h // G,
                 default=lambda D: D ** -0.5, scale_used=True):
    """A wrong decode_attention: query i sees keys 0 .. ``seen``, head h reads KV head ``head``, scale ``default``."""
    def impl(q, k_cache, v_cache, cache_seqlens, scale=None):
        B, hq, nq, D = q.shape
        sc = default(D) if scale is None or not scale_used else scale
        heads = head(torch.arange(hq), hq // k_cache.shape[1], k_cache.shape[1])
        out = torch.empty_like(q)
        for b in range(B):
            L = int(cache_seqlens[b]) if lengths else k_cache.shape[2]
            s = q[b] @ k_cache[b, heads, :L].transpose(-1, -2) * sc                   # (H_q, Nq, L)
            s = s.masked_fill(torch.arange(L) > seen(torch.arange(nq)[:, None], L, nq), float("-inf"))
            w = torch.exp(s - s.amax(-1, keepdim=True))
            out[b] = (w / w.sum(-1, keepdim=True)) @ v_cache[b, heads, :L]
        return out
    return impl


_DECODE_MISTAKES = [Mistake(*row) for row in [
    ("lengths-ignored", "attend to k_cache[b, :, :cache_seqlens[b]] only", _decode_with(lengths=False)),
    ("new-queries-see-the-future", "query i sits at position L - Nq + i: it must not see the new keys after it",
     _decode_with(seen=lambda i, L, nq: L)),
    ("causal-top-left", "the queries are the last Nq positions: query i sees keys 0..L - Nq + i, not 0..i",
     _decode_with(seen=lambda i, L, nq: i)),
    ("causal-diagonal-excluded", "a query sees its own key: keep keys j <= L - Nq + i",
     _decode_with(seen=lambda i, L, nq: L - nq + i - 1)),
    ("causal-off-by-one", "query i sees keys j <= L - Nq + i, not L - Nq + i + 1",
     _decode_with(seen=lambda i, L, nq: L - nq + i + 1)),
    ("scale-missing", "scale the scores: q @ k^T x scale (1/sqrt(D) unless given)",
     _decode_with(default=lambda D: 1.0, scale_used=False)),
    ("kv-head-modulo", "query head h reads KV head h // (H_q // H_kv), not h % H_kv",
     _decode_with(head=lambda h, G, hkv: h % hkv)),
    ("scale-1-over-d", "the default scale is 1/sqrt(D), not 1/D", _decode_with(default=lambda D: 1.0 / D)),
    ("scale-ignored", "a given `scale` replaces 1/sqrt(D)", _decode_with(scale_used=False))]]


PEAK_LIMIT = 48 * 2**20   # the inputs, the scores (1 MiB) and softmax: far below what either part below rules out


def _peak_part(part, inputs, seed, label, what, where, mistake, held):
    """(check, part then check): the peak memory of one call on ``inputs(gen(seed))``, measured outside the learner's
    code (sandbox/footprint.py); over PEAK_LIMIT, or not measured, fails naming ``mistake``."""
    def check(learner):
        peak = peak_growth(learner, part.name, [inputs(_gen(seed)), {}], label, what, spec=part.reference,
                           limit=PEAK_LIMIT)
        if peak > PEAK_LIMIT:
            raise Fail(f"`{part.name}` on {label}: the process's peak memory grew by {peak / 2**20:.1f} MiB during "
                       f"the call, where {where}", [mistake])
        return f"{held} (peak memory growth under {PEAK_LIMIT // 2**20} MiB at {label})"
    return check, Measured("peak-memory", lambda learner: f"{run(part, learner)}; {check(learner)}",
                           {part.name: [*part.mistakes, mistake]})


# the technique: query heads read their KV head in place
COPY_CASE = (1, 32, 2, 1, 64, [8192])   # B, H_q, H_kv, Nq, D, lengths: K and V are 8 MiB, a copy per query head 128
CACHE_COPIED = Mistake("cache-copied-per-head", "the cache is copied per query head (an index of heads, "
                       "repeat_interleave, torch.cat, .expand().reshape or .contiguous(), or q.view(B, H_kv, G, Nq, D) "
                       "@ k_cache.unsqueeze(2).mT): read each KV head in place, k_cache[b, h // G] (a view), or "
                       "reshape q to (B, H_kv, G * Nq, D) and multiply by each KV head once", None)


_check_no_copy, _DECODE = _peak_part(
    Function("decode_attention", specs.decode_attention, _decode_cases, _DECODE_MISTAKES, says="{n} cases match the "
             "reference over the cache (ragged lengths, new queries, GQA and MQA, a scale)"),
    lambda g: _decode_inputs(g, *COPY_CASE), 10_090, "B=1, H_q=32, H_kv=2, one new query, D=64, L=8192", "that the "
    "cache is not copied per query head", "the whole K and V cache is 8 MiB and a copy of it per query head 128 MiB",
    CACHE_COPIED, "the cache is read in place")


# ----------------------------------------------------------------------------- split-partials

def _split_case(g, label, B, H, nq, D, N, S, amp, kwargs):
    q, k, v = _randn(g, B, H, nq, D, scale=amp), _randn(g, B, H, N, D, scale=amp), _randn(g, B, H, N, D)
    return label, (q, k, v, S), kwargs


def _split_cases():
    return _table(10_100, [
        ("B=1, H=2, one query, D=8, N=12 keys, 3 splits of 4", 1, 2, 1, 8, 12, 3, 1.0, {}),
        ("B=2, H=1, one query, N=10, 3 splits: chunks of 4, 4 and 2", 2, 1, 1, 8, 10, 3, 1.0, {}),
        ("B=1, H=1, 2 queries, D=4, N=5, 4 splits: chunks of 2, 2, 1 and an empty one", 1, 1, 2, 4, 5, 4, 1.0, {}),
        ("large logits (q, k x 12: scores in the hundreds), N=9, 2 splits", 1, 2, 1, 16, 9, 2, 12.0, {}),
        ("N=7, 2 splits, scale=0.3", 2, 2, 1, 4, 7, 2, 1.0, {"scale": 0.3})], _split_case)


def _partials_with(stable=True, stable_o=True, normalise=True, floor=False, log2=False, lse_scaled=True,
                   empty_lse=float("-inf"), strided=False, scaled=True, max_added=True):
    """A wrong split_partials."""
    def impl(q, k, v, num_splits, scale=None):
        (B, H, nq, D), N = q.shape, k.shape[2]
        sc = 1.0 if not scaled else D ** -0.5 if scale is None else scale
        chunk = max(1, N // num_splits) if floor else -(-N // num_splits)
        o, lse = q.new_zeros(B, H, num_splits, nq, D), q.new_full((B, H, num_splits, nq), empty_lse)
        for s in range(num_splits):
            lo = s * chunk
            idx = torch.arange(s, N, num_splits) if strided else torch.arange(lo, max(lo, min(lo + chunk, N)))
            if idx.numel():
                raw = q @ k[:, :, idx].transpose(-1, -2)
                p = torch.exp(raw * sc - (raw * sc).amax(-1, keepdim=True)) if stable_o else torch.exp(raw * sc)
                o[:, :, s] = (p @ v[:, :, idx]) / (p.sum(-1, keepdim=True) if normalise else 1.0)
                base = raw * sc if lse_scaled else raw
                m = base.amax(-1, keepdim=True) if stable else torch.zeros_like(base[..., :1])
                lse[:, :, s] = ((m[..., 0] if max_added else 0) + torch.log(torch.exp(base - m).sum(-1))) / \
                    (math.log(2) if log2 else 1)
        return o, lse
    return impl


_PARTIAL_MISTAKES = [Mistake(*row) for row in [
    *[("lse-overflows", "exp overflows on scores in the hundreds: subtract each row's max m (in the output too), lse "
       "= m + log(sum(exp(s - m)))", _partials_with(stable=False, stable_o=stable_o)) for stable_o in (True, False)],
    ("scale-missing", "scale the scores (1/sqrt(D) unless given) in the output and lse", _partials_with(scaled=False)),
    ("lse-max-not-added-back", "add back the max: lse = m + log(sum(exp(s - m)))", _partials_with(max_added=False)),
    ("partial-not-normalised", "normalise each split's output over its own keys: (p @ v_s) / p.sum(-1, keepdim=True)",
     _partials_with(normalise=False)),
    ("chunk-rounded-down", "chunks hold ceil(N / num_splits) keys, covering every key", _partials_with(floor=True)),
    ("lse-base-2", "use the natural log (torch.log) in the log-sum-exp, not base 2", _partials_with(log2=True)),
    ("lse-unscaled", "take the log-sum-exp of the scaled scores", _partials_with(lse_scaled=False)),
    ("empty-split-lse-zero", "an empty split's log-sum-exp is -inf, not 0", _partials_with(empty_lse=0.0)),
    ("splits-strided", "split s is one contiguous chunk [s * chunk, (s + 1) * chunk), not every S-th key",
     _partials_with(strided=True))]]


# ----------------------------------------------------------------------------- split-merge

def _merge_cases():
    split, g = _split_cases(), _gen(10_200)
    return [(label, (o, lse + shift), {}) for label, i, shift in [
        ("partials of 3 splits of N=12 keys (B=1, H=2, one query)", 0, 0.0),
        ("partials with an empty split (lse = -inf) and 2 queries", 2, 0.0),
        ("partials from scores in the hundreds (lse ~ 300)", 3, 0.0),
        ("3 splits, every lse shifted by +800 (exp(lse) overflows float32, and float64 past ~709)", 1, 800.0)]
        for o, lse in [specs.split_partials(*split[i][1], **split[i][2])]] + [
        ("one split only (S = 1): the merge returns it", (_randn(g, 2, 2, 1, 2, 8), _randn(g, 2, 2, 1, 2)), {})]


def _merge_by(weights, dtype=None):
    """A wrong merge_splits: the partials weighed by ``weights(lse)`` and summed over the splits, in ``dtype``."""
    wide = (lambda x: x) if dtype is None else (lambda x: x.to(dtype))
    return lambda o, lse: (weights(wide(lse))[..., None] * wide(o)).sum(dim=2).to(o.dtype)


def _normalised(w, dim=2):
    return w / w.sum(dim, keepdim=True)


def _merge_running(rescale_acc=True, rescale_total=True):
    """Lesson 07's running merge over the splits, its rescaling by exp(m - m_new) left out where asked."""
    def impl(o, lse):
        acc, total = torch.zeros_like(o[:, :, 0]), torch.zeros_like(lse[:, :, 0])
        m = torch.full_like(lse[:, :, 0], float("-inf"))
        for s in range(o.shape[2]):
            m_new = torch.maximum(m, lse[:, :, s])
            alpha, w = torch.nan_to_num(torch.exp(m - m_new)), torch.nan_to_num(torch.exp(lse[:, :, s] - m_new))
            acc = (acc * alpha[..., None] if rescale_acc else acc) + w[..., None] * o[:, :, s]
            total, m = (total * alpha if rescale_total else total) + w, m_new
        return acc / total[..., None]
    return impl


_MERGE_MISTAKES = [Mistake(*row) for row in [
    *[("running-not-rescaled", "when the max grows, multiply the running output and sum alike by exp(m_old - m_new)",
       _merge_running(acc, total)) for acc, total in ((False, False), (True, False), (False, True))],
    ("mean-of-partials", "weigh each partial by its split's mass exp(lse_s), normalised", lambda o, lse: o.mean(dim=2)),
    *[("exp-overflows", "subtract the max lse before exp: large lse overflow (float64 too, past ~709) into NaN weights",
       _merge_by(lambda lse: _normalised(torch.exp(lse)), dtype)) for dtype in (None, torch.float64)],
    ("not-normalised", "divide the weights exp(lse_s - M) by their sum",
     _merge_by(lambda lse: torch.exp(lse - lse.amax(2, keepdim=True)))),
    ("linear-weights", "the weights are lse_s / sum(lse): the mass of a split is exp(lse_s)", _merge_by(_normalised)),
    ("max-only", "every split contributes its share, not only the largest lse's",
     _merge_by(lambda lse: torch.nn.functional.one_hot(lse.argmax(2), lse.shape[2]).movedim(-1, 2).to(lse.dtype))),
    ("wrong-axis", "normalise the weights over the splits (dim 2), not the queries (dim -1)",
     _merge_by(lambda lse: _normalised(torch.exp(lse - lse.amax(-1, keepdim=True)), -1)))]]


# ----------------------------------------------------------------------------- paged-gather

def _paged_cases():
    g = _gen(10_300)
    k = _randn(g, 3, 2, 12, 3)                                              # (B, H_kv, 12, D)
    pool, _, table = to_paged(k, k, torch.tensor([12, 6, 3], dtype=torch.int32), 4, generator=g)  # shuffled pages
    table = torch.cat([table, torch.zeros(3, 1, dtype=torch.int32)], dim=1)  # an unused column
    return [(f"sequence {b}, length {L} (pages of 4 in a shuffled pool of {pool.shape[0]})", (pool, table, b, L), {})
            for b, L in ((0, 12), (1, 6), (2, 3), (0, 9), (1, 1))]


def _gather_with(pages="table", heads_first=True, floor=False, trim=True):
    def impl(pool, block_table, b, length):
        ps = pool.shape[2]
        n = max(1, length // ps) if floor else -(-length // ps)
        idx = {"table": block_table[b, :n].long(), "first-row": block_table[0, :n].long(), "order": torch.arange(n)}
        kv = pool[idx[pages]]
        kv = (kv.transpose(0, 1) if heads_first else kv).reshape(pool.shape[1], n * ps, pool.shape[3])
        return kv[:, :length] if trim else kv
    return impl


_GATHER_MISTAKES = [Mistake(*row) for row in [
    ("table-ignored", "take each page where the block table says, block_table[b, n // page_size]",
     _gather_with(pages="order")),
    ("wrong-row", "sequence b reads row b of the block table, not row 0", _gather_with(pages="first-row")),
    ("heads-not-first", "the pages were reshaped with the heads still inside them: transpose to (H_kv, n_pages, "
     "page_size, D) before flattening the pages", _gather_with(heads_first=False)),
    ("pages-rounded-down", "use ceil(length / page_size) pages: the last may be part full", _gather_with(floor=True)),
    ("not-trimmed", "keep only the first `length` positions of the last page", _gather_with(trim=False))]]


# ----------------------------------------------------------------------------- latent-decode

def _latent_inputs(g, B, H, d_h, d_lat, d_rope, L):
    """q_nope, q_rope, w_uk, w_uv, c, k_rope with attnlab.mla's shapes; weights N(0, 1/d_lat) as MLA's."""
    return (_randn(g, B, H, d_h), _randn(g, B, H, d_rope), _randn(g, H, d_h, d_lat, scale=d_lat ** -0.5),
            _randn(g, H, d_h, d_lat, scale=d_lat ** -0.5), _randn(g, B, L, d_lat), _randn(g, B, L, d_rope))


def _latent_cases():
    B, H, L, d_lat = salted_ints(10_350, (1, 3), (2, 6), (3, 21), (4, 24))
    return [(label, _latent_inputs(_gen(10_360 + seed), *sizes), kwargs) for seed, (label, sizes, kwargs) in enumerate([
        ("B=1, H=2, d_h=4, d_latent=6, d_rope=2, L=5", (1, 2, 4, 6, 2, 5), {}),
        ("B=2, H=4, d_h=8, d_latent=12, d_rope=4, L=9", (2, 4, 8, 12, 4, 9), {}),
        ("B=1, H=3, d_latent=4 below d_h=8, d_rope=6, L=7", (1, 3, 8, 4, 6, 7), {}),
        (f"B={B}, H={H}, d_h=8, d_latent={d_lat}, d_rope=4, L={L}", (B, H, 8, d_lat, 4, L), {}),
        ("B=2, H=2, d_h=4, d_latent=8, d_rope=2, L=6, scale=0.3 (not 1/sqrt(d_h + d_rope))", (2, 2, 4, 8, 2, 6),
         {"scale": 0.3})])]


def _latent_with(swap=False, rope=True, scale_rule="sum", ignore_scale=False, axis=-1, normalise=True):
    """A wrong latent_decode, absorbed as asked, with one flaw."""
    def impl(q_nope, q_rope, w_uk, w_uv, c, k_rope, scale=None):
        d_h, d_lat, d_rope = q_nope.shape[-1], c.shape[-1], q_rope.shape[-1]
        w_uk, w_uv = (w_uv, w_uk) if swap else (w_uk, w_uv)
        width = {"sum": d_h + d_rope, "head": d_h, "latent": d_lat + d_rope}.get(scale_rule, 1)
        sc = 1.0 if scale_rule == "none" else width ** -0.5 if (scale is None or ignore_scale) else scale
        s = torch.einsum("bhc,blc->bhl", torch.einsum("bhd,hdc->bhc", q_nope, w_uk), c)   # W_UK absorbed: (B, H, L)
        s = (s + torch.einsum("bhr,blr->bhl", q_rope, k_rope) if rope else s) * sc
        p = torch.exp(s - s.amax(axis, keepdim=True))
        p = p / p.sum(axis, keepdim=True) if normalise else p
        return torch.einsum("hdc,bhc->bhd", w_uv, torch.einsum("bhl,blc->bhc", p, c))      # (B, H, d_h)
    return impl


_LATENT_MISTAKES = [Mistake(*row) for row in [
    ("up-projections-swapped", "W_UK and W_UV are swapped: W_UK goes into the query (q_lat = W_UK_i^T q_nope_i), "
     "W_UV onto the weighted latent", _latent_with(swap=True)),
    ("rope-forgotten", "the score also adds q_rope_i . k_rope_j to q_lat_i . c_j", _latent_with(rope=False)),
    ("scale-missing", "scale the scores (1/sqrt(d_h + d_rope) unless given)", _latent_with(scale_rule="none")),
    ("scale-head-only", "head i's key [W_UK_i c ; k_rope] is d_h + d_rope wide: the default scale is 1/sqrt(d_h + "
     "d_rope)", _latent_with(scale_rule="head")),
    ("scale-latent-width", "absorbing W_UK does not change the scores: the default scale is 1/sqrt(d_h + d_rope), not "
     "1/sqrt(d_latent + d_rope)", _latent_with(scale_rule="latent")),
    ("scale-ignored", "a given `scale` replaces 1/sqrt(d_h + d_rope)", _latent_with(ignore_scale=True)),
    ("softmax-wrong-axis", "take the softmax over the L positions (last dim), not the heads", _latent_with(axis=1)),
    ("not-normalised", "divide the weights exp(s - max) by their sum over positions", _latent_with(normalise=False))]]

# the latent cache is 2.5 MiB; the per-head K (d_h + d_rope wide) and V of the unabsorbed form 144 MiB; the scores 1 MiB
LATENT_CASE = (1, 32, 64, 64, 16, 8192)   # B, H, d_h, d_latent, d_rope, L
EXPANDED_KV = Mistake("expanded-kv", "the per-head keys or values were made (W_UK_i c_j, W_UV_i c_j, or k_rope per "
                      "head): absorb W_UK into the query, attend over c and k_rope as they are, and apply W_UV to "
                      "each head's weighted latent", None)


_check_latent_memory, _LATENT = _peak_part(
    Function("latent_decode", specs.latent_decode, _latent_cases, _LATENT_MISTAKES, says="{n} cases equal the "
             "unabsorbed decode (per-head K and V up-projected), with a scale and d_h other than d_latent"),
    lambda g: _latent_inputs(g, *LATENT_CASE), 10_390, "B=1, H=32, d_h=64, d_latent=64, d_rope=16, L=8192", "that "
    "only the latent cache is read", "the latent cache is 2.5 MiB and the per-head K and V 144 MiB", EXPANDED_KV,
    "only the latent cache is read, where per-head K and V would be 144 MiB")


# ----------------------------------------------------------------------------- decode-bytes

CONTEXTS, KV_HEADS, HEADS, D = [48, 130], [8, 2, 1], 8, 16


def _bytes_cases():
    first, second, kv = salted_ints(10_400, (3, 40), (41, 90), (0, 2))
    return [(f"contexts {c}, kv_heads {h}, {HEADS} query heads, d={D}", (c, h), {"heads": HEADS, "d": D})
            for c, h in ((CONTEXTS, KV_HEADS), ([first, second], [(4, 2, 1)[kv]]))]


def _bytes_with(what="total", e=2, transposed=False):
    """A wrong decode_bytes: ``what`` of each step's IO, with elements of ``e`` bytes."""
    def impl(contexts, kv_heads_list, heads=8, d=16):
        def cell(h, L):
            io = iomodel.decode_io(1, heads, L, d, e, kv_heads=h, num_splits=1)
            return {"total": io.total_bytes, "read": io.bytes_read, "k-only": io.total_bytes - L * h * d * e,
                    "cache": iomodel.kv_cache_bytes(L, 1, h, d, e)}[what]
        table = torch.tensor([[cell(h, L) for L in contexts] for h in kv_heads_list], dtype=torch.int64)
        return table.T if transposed else table
    return impl


_BYTES_MISTAKES = [Mistake(*row) for row in [
    ("reads-only", "count the bytes written too: t.bytes_read + t.bytes_written", _bytes_with("read")),
    ("values-not-counted", "the values' reads are missing: the kernel reads K and V", _bytes_with("k-only")),
    ("float32-cache", "the caches are float32: the experiment's are float16 (2 bytes per element)", _bytes_with(e=4)),
    ("cache-size-not-traffic", "this is the cache's size: a step also reads Q and writes and re-reads the partial "
     "results", _bytes_with("cache")),
    ("transposed", "one row per kv_heads, one column per context length", _bytes_with(transposed=True))]]

_BYTES = specs.decode_bytes(CONTEXTS, KV_HEADS, HEADS, D)   # what the notebook's run gives


TABLES = {
    "decode-cost": _COST,
    "decode-attention": _DECODE,
    "split-partials": Function("split_partials", specs.split_partials, _split_cases, _PARTIAL_MISTAKES,
                               says="{n} cases match: uneven and empty chunks, scores in the hundreds, a scale"),
    "split-merge": Function("merge_splits", specs.merge_splits, _merge_cases, _MERGE_MISTAKES,
                            says="{n} cases match: empty splits, lse in the hundreds, one split"),
    "paged-gather": Function("gather_sequence", specs.gather_sequence, _paged_cases, _GATHER_MISTAKES,
                             says="{n} sequences gathered exactly through a shuffled block table"),
    "latent-decode": _LATENT,
    "decode-bytes": Function("decode_bytes", specs.decode_bytes, _bytes_cases, _BYTES_MISTAKES,
                             says=f"your traced bytes equal the IO model's to the byte; at L={CONTEXTS[-1]} MQA "
                                  f"moves {_BYTES[0, -1] / _BYTES[-1, -1]:.1f}x fewer bytes than MHA"),
}
