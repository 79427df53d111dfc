"""Exercise 10 (attention at inference): wrong implementations fail their check with the matching diagnosis,
shortcuts are refused, a right answer written another way passes, and the experiment is measured, not computed."""

import math

import torch

from attnlab.grading.checks import run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.exercises.e10 import spec
from mistakes import Wrong

WRONG = Wrong()


def _softmax_rows(s):
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


# ---------------------------------------------------------------------------------------------
# decode-cost: a learner's cost model, with one flaw each
# ---------------------------------------------------------------------------------------------

def _cost(flaw=None):
    def decode_step_bytes(batch, context, params, layers, kv_heads, d, bytes_per_element=2):
        e = {"element-size-ignored": 1, "bits-not-bytes": 8 * bytes_per_element}.get(flaw, bytes_per_element)
        per_layer = kv_heads * d * e if flaw == "k-only" else 2 * kv_heads * d * e      # K and V of one token
        per_token = per_layer if flaw == "cache-layers-missing" else per_layer * layers
        tokens = context + 1 if flaw == "new-token-counted" else context
        sequences = 1 if flaw == "cache-not-per-sequence" else batch
        weights = 0 if flaw == "weights-forgotten" else params * e
        if flaw == "weights-per-sequence":
            weights *= batch
        return weights + sequences * tokens * per_token
    return decode_step_bytes


def _crossover(flaw=None):
    def crossover_tokens(params, layers, kv_heads, d, bytes_per_element=2):
        weight_bytes = params if flaw == "crossover-weights-in-parameters" else params * bytes_per_element
        kv = 1 if flaw == "crossover-k-only" else 2
        cache_per_token = kv * kv_heads * d * (1 if flaw == "crossover-cache-in-elements" else bytes_per_element)
        if flaw != "crossover-layers-missing":
            cache_per_token *= layers
        return cache_per_token / weight_bytes if flaw == "crossover-inverted" else weight_bytes / cache_per_token
    return crossover_tokens


for _key in ("weights-per-sequence", "k-only", "cache-layers-missing", "element-size-ignored", "bits-not-bytes",
             "weights-forgotten", "cache-not-per-sequence", "new-token-counted"):
    WRONG.add("decode-cost", _key, decode_step_bytes=_cost(_key))
for _key in ("crossover-inverted", "crossover-k-only", "crossover-layers-missing", "crossover-weights-in-parameters",
             "crossover-cache-in-elements"):
    WRONG.add("decode-cost", _key, crossover_tokens=_crossover(_key))


# ---------------------------------------------------------------------------------------------
# decode-attention: a learner's loop, with one flaw each
# ---------------------------------------------------------------------------------------------

def _decode(flaw=None):
    def decode_attention(q, k_cache, v_cache, cache_seqlens, scale=None):
        B, hq, nq, D = q.shape
        G = hq // k_cache.shape[1]
        if scale is None or flaw == "scale-ignored":
            scale = 1 / D if flaw == "scale-1-over-d" else 1 / math.sqrt(D)
        if flaw == "scale-missing":
            scale = 1.0
        out = torch.zeros_like(q)
        for b in range(B):
            L = k_cache.shape[2] if flaw == "lengths-ignored" else int(cache_seqlens[b])
            for h in range(hq):
                kv = h % k_cache.shape[1] if flaw == "kv-head-modulo" else h // G
                s = q[b, h] @ k_cache[b, kv, :L].T * scale
                for i in range(nq):
                    last = {"new-queries-see-the-future": L - 1, "causal-top-left": i,
                            "causal-diagonal-excluded": L - nq + i - 1,
                            "causal-off-by-one": L - nq + i + 1}.get(flaw, L - nq + i)
                    s[i, last + 1:] = float("-inf")
                out[b, h] = _softmax_rows(s) @ v_cache[b, kv, :L]
        return out
    return decode_attention


for _key in ("lengths-ignored", "new-queries-see-the-future", "causal-top-left", "causal-diagonal-excluded",
             "kv-head-modulo", "scale-1-over-d", "scale-ignored", "causal-off-by-one", "scale-missing"):
    WRONG.add("decode-attention", _key, decode_attention=_decode(_key))


def _copying(q, k_cache, v_cache, cache_seqlens, scale=None):
    """Right numbers, the cache repeated for every query head: only the measured peak memory shows it."""
    B, hq, nq, D = q.shape
    heads = torch.arange(hq) // (hq // k_cache.shape[1])
    k_all, v_all = k_cache[:, heads], v_cache[:, heads]     # (B, H_q, S, D): the cache once per query head
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.zeros_like(q)
    for b in range(B):
        L = int(cache_seqlens[b])
        s = q[b] @ k_all[b, :, :L].transpose(-1, -2) * scale
        s = s.masked_fill(torch.arange(L)[None, :] > (L - nq + torch.arange(nq))[:, None], float("-inf"))
        out[b] = _softmax_rows(s) @ v_all[b, :, :L]
    return out


WRONG.add("decode-attention", "cache-copied-per-head", decode_attention=_copying)


# ---------------------------------------------------------------------------------------------
# split-partials
# ---------------------------------------------------------------------------------------------

def _partials(flaw=None):
    def split_partials(q, k, v, num_splits, scale=None):
        B, H, nq, D = q.shape
        N = k.shape[2]
        scale = D ** -0.5 if scale is None else scale
        chunk = N // num_splits if flaw == "chunk-rounded-down" else math.ceil(N / num_splits)
        outs, lses = [], []
        for s in range(num_splits):
            keys = list(range(s, N, num_splits)) if flaw == "splits-strided" else \
                list(range(s * chunk, min((s + 1) * chunk, N)))
            if not keys:
                outs.append(q.new_zeros(B, H, nq, D))
                lses.append(q.new_zeros(B, H, nq) if flaw == "empty-split-lse-zero" else
                            q.new_full((B, H, nq), -math.inf))
                continue
            raw = q @ k[:, :, keys].transpose(-1, -2)
            sc = raw * (1.0 if flaw == "scale-missing" else scale)
            if flaw == "lse-overflows":
                lse = torch.log(torch.exp(sc).sum(-1))
            else:
                base = raw if flaw == "lse-unscaled" else sc
                m = base.max(-1).values
                lse = (0 if flaw == "lse-max-not-added-back" else m) + torch.log(torch.exp(base - m[..., None]).sum(-1))
                if flaw == "lse-base-2":
                    lse = lse * math.log2(math.e)
            p = torch.exp(sc - sc.max(-1, keepdim=True).values)
            o = p @ v[:, :, keys]
            outs.append(o if flaw == "partial-not-normalised" else o / p.sum(-1, keepdim=True))
            lses.append(lse)
        return torch.stack(outs, 2), torch.stack(lses, 2)
    return split_partials


for _key in ("lse-overflows", "partial-not-normalised", "chunk-rounded-down", "lse-base-2", "lse-unscaled",
             "empty-split-lse-zero", "splits-strided", "scale-missing", "lse-max-not-added-back"):
    WRONG.add("split-partials", _key, split_partials=_partials(_key))


# ---------------------------------------------------------------------------------------------
# split-merge
# ---------------------------------------------------------------------------------------------

def _merge(flaw=None):
    def merge_splits(o_parts, lse):
        if flaw == "mean-of-partials":
            return o_parts.sum(2) / o_parts.shape[2]
        if flaw == "max-only":
            best = lse.argmax(2)                                          # (B, H, Nq)
            out = torch.empty_like(o_parts[:, :, 0])
            for b in range(o_parts.shape[0]):
                for h in range(o_parts.shape[1]):
                    for i in range(o_parts.shape[3]):
                        out[b, h, i] = o_parts[b, h, best[b, h, i], i]
            return out
        if flaw == "linear-weights":
            w = lse / lse.sum(2, keepdim=True)
        else:
            dim = -1 if flaw == "wrong-axis" else 2
            if flaw == "exp-overflows-float64":             # float64 only moves the overflow from ~88 to ~709
                w = torch.exp(lse.double())
                return torch.einsum("bhsq,bhsqd->bhqd", w / w.sum(2, keepdim=True), o_parts.double()).to(o_parts.dtype)
            w = torch.exp(lse) if flaw == "exp-overflows" else torch.exp(lse - lse.max(dim, keepdim=True).values)
            if flaw != "not-normalised":
                w = w / w.sum(dim, keepdim=True)
        return torch.einsum("bhsq,bhsqd->bhqd", w, o_parts)
    return merge_splits


for _key in ("mean-of-partials", "exp-overflows", "exp-overflows-float64", "not-normalised", "linear-weights",
             "max-only", "wrong-axis"):
    WRONG.add("split-merge", _key, merge_splits=_merge(_key))


def _running_merge(flaw):
    """Lesson 07's running merge, one split at a time, with its rescaling left out."""
    def merge_splits(o_parts, lse):
        acc = torch.zeros_like(o_parts[:, :, 0])
        total = torch.zeros_like(lse[:, :, 0])
        m = torch.full_like(lse[:, :, 0], -math.inf)
        for s in range(o_parts.shape[2]):
            m_new = torch.maximum(m, lse[:, :, s])
            alpha = torch.where(torch.isneginf(m_new), torch.zeros_like(m), torch.exp(m - m_new))
            w = torch.where(torch.isneginf(m_new), torch.zeros_like(m), torch.exp(lse[:, :, s] - m_new))
            if flaw != "running-not-rescaled":
                acc = acc * alpha[..., None] if flaw != "running-output-not-rescaled" else acc
                total = total * alpha if flaw != "running-sum-not-rescaled" else total
            acc, total, m = acc + w[..., None] * o_parts[:, :, s], total + w, m_new
        return acc / total[..., None]
    return merge_splits


for _key in ("running-not-rescaled", "running-sum-not-rescaled", "running-output-not-rescaled"):
    WRONG.add("split-merge", _key, merge_splits=_running_merge(_key))


# ---------------------------------------------------------------------------------------------
# paged-gather
# ---------------------------------------------------------------------------------------------

def _gather(flaw=None):
    def gather_sequence(pool, block_table, b, length):
        ps = pool.shape[2]
        n = length // ps if flaw == "pages-rounded-down" else -(-length // ps)
        n = max(n, 1)
        row = block_table[0] if flaw == "wrong-row" else block_table[b]
        pieces = []
        for p in range(n):
            page = p if flaw == "table-ignored" else int(row[p])
            pieces.append(pool[page])                                     # (H_kv, ps, D)
        if flaw == "heads-not-first":
            kv = torch.stack(pieces).reshape(pool.shape[1], n * ps, pool.shape[3])
        else:
            kv = torch.cat(pieces, dim=1)                                 # (H_kv, n * ps, D)
        return kv if flaw == "not-trimmed" else kv[:, :length]
    return gather_sequence


for _key in ("table-ignored", "wrong-row", "heads-not-first", "pages-rounded-down", "not-trimmed"):
    WRONG.add("paged-gather", _key, gather_sequence=_gather(_key))


# ---------------------------------------------------------------------------------------------
# latent-decode: a learner's absorbed MLA decode, head by head, with one flaw each
# ---------------------------------------------------------------------------------------------

def _latent(flaw=None):
    def latent_decode(q_nope, q_rope, w_uk, w_uv, c, k_rope, scale=None):
        B, H, d_h = q_nope.shape
        width = {"scale-head-only": d_h, "scale-latent-width": c.shape[-1] + q_rope.shape[-1]}.get(
            flaw, d_h + q_rope.shape[-1])
        if scale is None or flaw == "scale-ignored":
            scale = 1 / math.sqrt(width)
        if flaw == "scale-missing":
            scale = 1.0
        if flaw == "up-projections-swapped":
            w_uk, w_uv = w_uv, w_uk
        scores = torch.empty(B, H, c.shape[1])
        for h in range(H):
            q_lat = q_nope[:, h] @ w_uk[h]                                  # (B, d_latent): W_UK_h^T q
            s = torch.bmm(c, q_lat[:, :, None])[..., 0]                     # (B, L)
            if flaw != "rope-forgotten":
                s = s + torch.bmm(k_rope, q_rope[:, h, :, None])[..., 0]
            scores[:, h] = s * scale
        dim = 1 if flaw == "softmax-wrong-axis" else -1
        e = torch.exp(scores - scores.max(dim, keepdim=True).values)
        p = e if flaw == "not-normalised" else e / e.sum(dim, keepdim=True)
        out = torch.empty_like(q_nope)
        for h in range(H):
            o_lat = torch.bmm(p[:, h, None], c)[:, 0]                       # (B, d_latent)
            out[:, h] = o_lat @ w_uv[h].T                                   # (B, d_h)
        return out
    return latent_decode


for _key in ("up-projections-swapped", "rope-forgotten", "scale-missing", "scale-head-only", "scale-latent-width",
             "scale-ignored", "softmax-wrong-axis", "not-normalised"):
    WRONG.add("latent-decode", _key, latent_decode=_latent(_key))


def _expanded(q_nope, q_rope, w_uk, w_uv, c, k_rope, scale=None):
    """Right numbers, the unabsorbed decode: per-head K and V made from the latents; only the peak memory shows it."""
    H, d_h = q_nope.shape[1], q_nope.shape[2]
    scale = 1 / math.sqrt(d_h + q_rope.shape[-1]) if scale is None else scale
    k = torch.cat([torch.einsum("hdc,blc->bhld", w_uk, c), k_rope[:, None].expand(-1, H, -1, -1)], -1)
    v = torch.einsum("hdc,blc->bhld", w_uv, c)                             # (B, H, L, d_h)
    s = torch.einsum("bhd,bhld->bhl", torch.cat([q_nope, q_rope], -1), k) * scale
    return torch.einsum("bhl,bhld->bhd", _softmax_rows(s), v)


WRONG.add("latent-decode", "expanded-kv", latent_decode=_expanded)


# ---------------------------------------------------------------------------------------------
# decode-bytes: the experiment, traced, with one flaw each
# ---------------------------------------------------------------------------------------------

def _measured(flaw=None):
    def decode_bytes(contexts, kv_heads_list, heads=8, d=16):
        from attnlab.kernels import flash_decode
        from attnlab.memory import trace

        dtype = torch.float32 if flaw == "float32-cache" else torch.float16
        table = torch.zeros(len(kv_heads_list), len(contexts), dtype=torch.int64)
        for r, h in enumerate(kv_heads_list):
            for c, L in enumerate(contexts):
                q = torch.ones(1, heads, 1, d, dtype=dtype)
                k = torch.ones(1, h, L, d, dtype=dtype)
                if flaw == "cache-size-not-traffic":
                    table[r, c] = 2 * k.numel() * k.element_size()
                    continue
                t = trace(flash_decode, q, k, k.clone(), torch.tensor([L], dtype=torch.int32), num_splits=1)
                table[r, c] = {"reads-only": t.bytes_read,
                               "values-not-counted": t.total_bytes - t.by_tensor["V"]["read"]}.get(flaw, t.total_bytes)
        return table.T if flaw == "transposed" else table
    return decode_bytes


for _key in ("reads-only", "values-not-counted", "float32-cache", "cache-size-not-traffic", "transposed"):
    WRONG.add("decode-bytes", _key, decode_bytes=_measured(_key))

test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


# ---------------------------------------------------------------------------------------------
# right answers written another way, and shortcuts
# ---------------------------------------------------------------------------------------------

def test_right_answers_written_another_way_pass():
    for part, names in (("decode-cost", {"decode_step_bytes": _cost(), "crossover_tokens": _crossover()}),
                        ("decode-attention", {"decode_attention": _decode()}),
                        ("split-partials", {"split_partials": _partials()}),
                        ("split-merge", {"merge_splits": _merge()}),
                        ("paged-gather", {"gather_sequence": _gather()}),
                        ("latent-decode", {"latent_decode": _latent()}),
                        ("decode-bytes", {"decode_bytes": _measured()})):
        result = run_check(part, LocalLearner(names, forbidden=[]))
        assert result.passed, result.message


def _refused(part, ns, name):
    result = run_check(part, ns)
    assert not result.passed and "shortcut" in result.diagnosis, result.message
    assert name in result.message, result.message


def test_the_library_s_reference_and_torch_s_softmax_are_refused():
    from attnlab import kvcache   # through the module, as a notebook's imports see it once the grader is wired up

    _refused("decode-attention", {"decode_attention": lambda q, k, v, lens, scale=None:
                                  kvcache.decode_reference(q, k, v, lens, scale=scale)}, "attnlab.kvcache.")
    _refused("paged-gather", {"gather_sequence": lambda pool, table, b, n: kvcache.gather_cache(pool, b, n, table)},
             "attnlab.kvcache.gather_cache")
    _refused("latent-decode", {"latent_decode": lambda qn, qr, wk, wv, c, kr, scale=None: spec.latent_decode(
        qn, qr, wk, wv, c, kr, scale=scale)}, "attnlab.grading.exercises.e10.spec.latent_decode")
    _refused("split-merge", {"merge_splits": lambda o, lse: (torch.softmax(lse, 2)[..., None] * o).sum(2)},
             "torch.softmax")


def test_the_io_model_is_refused_as_the_cost_model():
    from attnlab import iomodel

    def by_library(batch, context, params, layers, kv_heads, d, bytes_per_element=2):
        return params * bytes_per_element + batch * iomodel.kv_cache_bytes(context, layers, kv_heads, d,
                                                                           bytes_per_element)

    _refused("decode-cost", {"decode_step_bytes": by_library, "crossover_tokens": _crossover()},
             "attnlab.iomodel.kv_cache_bytes")


def test_the_io_model_is_refused_as_the_experiment():
    from attnlab import iomodel

    def by_formula(contexts, kv_heads_list, heads=8, d=16):
        return torch.tensor([[iomodel.decode_io(1, heads, L, d, 2, kv_heads=h).total_bytes for L in contexts]
                             for h in kv_heads_list])

    _refused("decode-bytes", {"decode_bytes": by_formula}, "attnlab.iomodel.decode_io")


def test_the_grader_s_own_answers_are_refused():
    _refused("split-partials", {"split_partials": spec.split_partials},
             "attnlab.grading.exercises.e10.spec.split_partials")


def test_the_latent_decode_reference_equals_the_unabsorbed_definition():
    # the spec computes the decode absorbed (so it passes its own memory check); its definition is the unabsorbed form
    from attnlab.attention import scaled_dot_product_attention
    from attnlab.grading.exercises.e10 import spec

    g = torch.Generator().manual_seed(5)
    B, H, L, dh, dc, dr = 2, 3, 11, 8, 6, 4
    q_nope, q_rope = torch.randn(B, H, dh, generator=g, dtype=torch.float64), torch.randn(B, H, dr, generator=g,
                                                                                          dtype=torch.float64)
    w_uk, w_uv = (torch.randn(H, dh, dc, generator=g, dtype=torch.float64) for _ in range(2))
    c, k_rope = torch.randn(B, L, dc, generator=g, dtype=torch.float64), torch.randn(B, L, dr, generator=g,
                                                                                     dtype=torch.float64)
    k = torch.cat([torch.einsum("hdc,blc->bhld", w_uk, c), k_rope[:, None].expand(-1, H, -1, -1)], dim=-1)
    v = torch.einsum("hdc,blc->bhld", w_uv, c)
    for scale in (None, 0.3):
        want = scaled_dot_product_attention(torch.cat([q_nope, q_rope], -1)[:, :, None], k, v, scale=scale)[:, :, 0]
        torch.testing.assert_close(spec.latent_decode(q_nope, q_rope, w_uk, w_uv, c, k_rope, scale=scale), want)
