"""Exercise 10 (attention at inference): wrong implementations that a measurement shows fail their check with the
matching diagnosis (the emulated mistakes: tests/test_every_mistake.py), shortcuts are refused, a right answer
written another way passes, and the experiment is measured, not computed."""

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
# decode-cost, decode-attention, split-partials, split-merge, paged-gather and latent-decode: every known mistake
# the checks emulate is proven by tests/test_every_mistake.py. Here: right answers as a learner would write them,
# and the mistakes only a measurement shows.
# ---------------------------------------------------------------------------------------------

def _cost():
    def decode_step_bytes(batch, context, params, layers, kv_heads, d, bytes_per_element=2):
        per_token = 2 * kv_heads * d * bytes_per_element * layers                 # K and V of one token, every layer
        return params * bytes_per_element + batch * context * per_token
    return decode_step_bytes


def _crossover():
    def crossover_tokens(params, layers, kv_heads, d, bytes_per_element=2):
        return params * bytes_per_element / (2 * kv_heads * d * bytes_per_element * layers)
    return crossover_tokens


# ---------------------------------------------------------------------------------------------
# decode-attention: a learner's loop, with one flaw each
# ---------------------------------------------------------------------------------------------

def _decode():
    def decode_attention(q, k_cache, v_cache, cache_seqlens, scale=None):
        B, hq, nq, D = q.shape
        G = hq // k_cache.shape[1]
        scale = 1 / math.sqrt(D) if scale is None else scale
        out = torch.zeros_like(q)
        for b in range(B):
            L = int(cache_seqlens[b])
            for h in range(hq):
                s = q[b, h] @ k_cache[b, h // G, :L].T * scale
                for i in range(nq):
                    s[i, L - nq + i + 1:] = float("-inf")
                out[b, h] = _softmax_rows(s) @ v_cache[b, h // G, :L]
        return out
    return decode_attention


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

def _partials():
    def split_partials(q, k, v, num_splits, scale=None):
        B, H, nq, D = q.shape
        N = k.shape[2]
        scale = D ** -0.5 if scale is None else scale
        chunk = math.ceil(N / num_splits)
        outs, lses = [], []
        for s in range(num_splits):
            keys = list(range(s * chunk, min((s + 1) * chunk, N)))
            if not keys:
                outs.append(q.new_zeros(B, H, nq, D))
                lses.append(q.new_full((B, H, nq), -math.inf))
                continue
            sc = q @ k[:, :, keys].transpose(-1, -2) * scale
            m = sc.max(-1).values
            p = torch.exp(sc - m[..., None])
            outs.append(p @ v[:, :, keys] / p.sum(-1, keepdim=True))
            lses.append(m + torch.log(p.sum(-1)))
        return torch.stack(outs, 2), torch.stack(lses, 2)
    return split_partials


# ---------------------------------------------------------------------------------------------
# split-merge
# ---------------------------------------------------------------------------------------------

def _merge():
    def merge_splits(o_parts, lse):
        w = torch.exp(lse - lse.max(2, keepdim=True).values)
        return torch.einsum("bhsq,bhsqd->bhqd", w / w.sum(2, keepdim=True), o_parts)
    return merge_splits


# ---------------------------------------------------------------------------------------------
# paged-gather
# ---------------------------------------------------------------------------------------------

def _gather():
    def gather_sequence(pool, block_table, b, length):
        n = max(-(-length // pool.shape[2]), 1)
        kv = torch.cat([pool[int(block_table[b, p])] for p in range(n)], dim=1)      # (H_kv, n * ps, D)
        return kv[:, :length]
    return gather_sequence


# ---------------------------------------------------------------------------------------------
# latent-decode: a learner's absorbed MLA decode, head by head, with one flaw each
# ---------------------------------------------------------------------------------------------

def _latent():
    def latent_decode(q_nope, q_rope, w_uk, w_uv, c, k_rope, scale=None):
        B, H, d_h = q_nope.shape
        scale = 1 / math.sqrt(d_h + q_rope.shape[-1]) if scale is None else scale
        scores = torch.empty(B, H, c.shape[1])
        for h in range(H):
            q_lat = q_nope[:, h] @ w_uk[h]                                  # (B, d_latent): W_UK_h^T q
            s = torch.bmm(c, q_lat[:, :, None])[..., 0]                     # (B, L)
            scores[:, h] = (s + torch.bmm(k_rope, q_rope[:, h, :, None])[..., 0]) * scale
        p = _softmax_rows(scores)
        out = torch.empty_like(q_nope)
        for h in range(H):
            out[:, h] = torch.bmm(p[:, h, None], c)[:, 0] @ w_uv[h].T      # (B, d_h)
        return out
    return latent_decode


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


# kept beside the emulations: each traces a real kernel, read the wrong way, so it proves that the emulation's
# formula is what such a learner measures
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
