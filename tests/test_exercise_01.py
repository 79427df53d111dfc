"""Exercise 01 (soft alignment): shortcuts are refused, a right decode step over a wrong part 2 says so, and the
experiment's recipe, tolerance and plug-in hook hold. The known mistakes: tests/test_every_mistake.py."""

import contextlib
import io
from functools import lru_cache
from pathlib import Path

import nbformat
import pytest
import torch

from attnlab.grading.checks import run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.exercises.e01 import checks as e01_checks
from attnlab.grading.exercises.e01 import spec as specs
from attnlab.grading.parts import forbidden

ROOT = Path(__file__).resolve().parents[1]


# Every known mistake of the four parts is proven by its check's own emulation (tests/test_every_mistake.py).
# What follows is the learner's side of the tests below.

def learner_scores(s, h, w, u, v):
    """A right additive_scores, written as a learner would."""
    return torch.einsum("bna,a->bn", torch.tanh(torch.einsum("bd,ad->ba", s, w)[:, None, :]
                                                + torch.einsum("bnd,ad->bna", h, u)), v)


def specs_free_context(scores, h, mask=None):
    """A right context_vector, written as a learner would."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m)
    s = e.sum(-1, keepdim=True)
    w = torch.where(s > 0, e / s.clamp_min(1e-30), torch.zeros_like(e))
    return torch.einsum("bn,bnd->bd", w, h), w


def _ctx_zero_fill(scores, h, mask=None):
    """A wrong context_vector: padding scores set to 0, not -inf (masked-to-zero)."""
    if mask is not None:
        scores = scores * mask
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    w = e / e.sum(-1, keepdim=True)
    return (w[:, :, None] * h).sum(1), w


# ----------------------------------------------------------------------------- alignment-crossing
# the learner's side, written as the notebook's answer would be (its data built by the notebook's setup cell)

def _setup_namespace():
    """Run the notebook's data cell (the one that defines SWAPS) and return its globals."""
    nb = nbformat.read(str(ROOT / "solutions" / "01_soft_alignment.ipynb"), as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "SWAPS = " in c.source)
    ns = {"torch": torch}
    with contextlib.redirect_stdout(io.StringIO()):  # it prints what it built
        exec(compile(cell.source, "setup-cell", "exec"), ns)
    return ns


NB = _setup_namespace()


@lru_cache(maxsize=8)
def _learner_train(seed, steps, context_fn=specs_free_context):
    with NB["deterministic"](seed, threads=1):
        model = NB["RNNsearch"](len(NB["SRC_VOCAB"]), len(NB["TGT_VOCAB"]), emb_dim=16, hidden_dim=32, maxout_dim=32,
                                score_fn=learner_scores, context_fn=context_fn)
        g = torch.Generator().manual_seed(seed)

        def stream():
            while True:
                yield from NB["batches"](NB["TRAIN_SRC"], NB["TRAIN_TGT"], 32, generator=g)

        NB["fit"](model, stream(), lambda b: model.loss(b[0], b[1], b[2]), steps, lr=1e-2, progress=False)
    rows = []

    def recording(scores, h, mask=None):
        context, weights = context_fn(scores, h, mask)
        rows.append(weights)
        return context, weights

    model.context_fn = recording
    with torch.no_grad():
        model(NB["PROBE_SRC"], NB["PROBE_LEN"], NB["PROBE_TGT"])
    return torch.stack(rows, dim=1)  # (P, T, S)


def _learner_masses(A):
    crossed, straight = [], []
    for a, pairs in zip(A, NB["SWAPS"]):
        for i, j in pairs:
            crossed.append(0.5 * (a[i, j] + a[i + 1, j - 1]))
            straight.append(0.5 * (a[i, j - 1] + a[i + 1, j]))
    return torch.stack(crossed).mean().item(), torch.stack(straight).mean().item()


def crossing_right(seed, steps=250):
    """A right alignment_crossing through the notebook's own RNNsearch (its numbers differ from the grader's run by
    round-off; its known mistakes are proven by the check's emulations, tests/test_every_mistake.py)."""
    return _learner_masses(_learner_train(seed, steps))




# ----------------------------------------------------------------------------- shortcuts

def _softmax_context(scores, h, mask=None):
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    w = torch.nan_to_num(torch.softmax(scores, dim=-1))
    return (w[:, :, None] * h).sum(1), w


def _library_scores(s, h, w, u, v):
    from attnlab.attention import AdditiveAttention

    module = AdditiveAttention(s.shape[-1], h.shape[-1], w.shape[0])
    with torch.no_grad():
        module.W.weight.copy_(w)
        module.U.weight.copy_(u)
        module.v.weight.copy_(v[None])
    return module.score(s, h)


def _softmax_decode(s, h, w, u, v, w_s, w_c, mask=None):
    c, weights = _softmax_context(learner_scores(s, h, w, u, v), h, mask)
    return torch.tanh(s @ w_s.T + c @ w_c.T), weights


def _library_crossing(seed, steps=250):
    # the library's masked_softmax as the model's attention, which the part refuses
    from attnlab.attention import masked_softmax  # noqa: F401
    with NB["deterministic"](seed, threads=1):
        model = NB["RNNsearch"](len(NB["SRC_VOCAB"]), len(NB["TGT_VOCAB"]), emb_dim=16, hidden_dim=32, maxout_dim=32)
        return float(model.loss(NB["PROBE_SRC"], NB["PROBE_LEN"], NB["PROBE_TGT"])), 0.0


@pytest.mark.parametrize("part, names, tripped", [
    ("additive-score", {"additive_scores": _library_scores}, "attnlab.attention"),
    ("context-vector", {"context_vector": _softmax_context}, "torch.softmax"),
    ("decode-step", {"decode_step": _softmax_decode}, "torch.softmax"),
    ("alignment-crossing", {"alignment_crossing": _library_crossing}, "attnlab.attention.masked_softmax"),
], ids=["additive-score", "context-vector", "decode-step", "alignment-crossing"])
def test_a_forbidden_call_is_refused_as_a_shortcut(part, names, tripped):
    result = run_check(part, names)  # the part's own forbidden list, read from the functions' code
    assert not result.passed and "shortcut" in result.diagnosis, result.message
    assert tripped in result.message, result.message


# ----------------------------------------------------------------------------- the experiment

def test_the_experiment_may_train_the_course_model_but_not_use_its_attention():
    assert "attnlab.models.*" not in forbidden("alignment-crossing")
    assert "attnlab.attention.*" in forbidden("alignment-crossing")
    assert "attnlab.models.*" in forbidden("decode-step")


def test_the_notebook_builds_the_data_and_recipe_the_grader_reruns():
    src_ids, tgt_ids, (src, src_len, tgt), swaps, sizes = specs._data()
    assert NB["TRAIN_SRC"] == src_ids and NB["TRAIN_TGT"] == tgt_ids
    assert torch.equal(NB["PROBE_SRC"], src) and torch.equal(NB["PROBE_LEN"], src_len)
    assert torch.equal(NB["PROBE_TGT"], tgt) and NB["SWAPS"] == swaps
    assert sizes == (len(NB["SRC_VOCAB"]), len(NB["TGT_VOCAB"]))
    assert len(swaps) == specs.RECIPE["n_probe"] and all(swaps)
    # the recipe the markdown states is the spec's
    nb = nbformat.read(str(ROOT / "solutions" / "01_soft_alignment.ipynb"), as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    r = specs.RECIPE
    for stated in (f"emb_dim={r['emb_dim']}", f"hidden_dim={r['hidden_dim']}", f"lr={r['lr']:.0e}".replace("e-0", "e-"),
                   f"TRAIN_TGT, {r['batch_size']}", f"steps={e01_checks.CHECK_STEPS}", f"{e01_checks.TOLERANCE}"):
        assert stated in text, stated


def test_a_right_answer_written_differently_passes_within_the_tolerance():
    # einsum scores and a where-based softmax round differently from the reference: the run drifts a little
    result = run_check("alignment-crossing", LocalLearner({"alignment_crossing": crossing_right}, forbidden=[]))
    assert result.passed, result.message
    assert "the alignment crosses" in result.message


def test_the_plugged_in_reference_is_the_model_s_own_attention():
    src, src_len, tgt = specs._data()[2]
    with torch.no_grad():
        torch.manual_seed(0)
        model = NB["RNNsearch"](len(NB["SRC_VOCAB"]), len(NB["TGT_VOCAB"]), emb_dim=16, hidden_dim=32, maxout_dim=32)
        plain = model(src, src_len, tgt)
        model.score_fn, model.context_fn = specs.additive_scores, specs.context_vector
        plugged = model(src, src_len, tgt)
    assert torch.allclose(plain, plugged, atol=1e-5)
    with pytest.raises(TypeError, match="score_fn"):
        NB["RNNsearch"](67, 95, score_fn="additive")


def test_the_crossing_appears_from_other_seeds_too():
    for seed in (1, 2):
        crossed, straight = specs.alignment_crossing(seed, steps=250)
        assert crossed > straight + 0.4, (seed, crossed, straight)


def test_adjective_noun_swaps_reads_the_grammar_s_alignment():
    from attnlab.data.translation import adjective_noun_swaps

    assert adjective_noun_swaps("these green trees sleep .") == [(1, 2)]
    assert adjective_noun_swaps("the dog often sees a red car .") == [(5, 6)]   # the adverb swap is left out
    assert adjective_noun_swaps("the bird sleeps .") == []


def test_a_right_decode_step_over_a_wrong_part_2_says_so():
    def decode_step(s, h, w, u, v, w_s, w_c, mask=None):
        c, weights = _ctx_zero_fill(learner_scores(s, h, w, u, v), h, mask)
        return torch.tanh(s @ w_s.T + c @ w_c.T), weights

    result = run_check("decode-step", LocalLearner({"decode_step": decode_step}, forbidden=[]))
    assert not result.passed and "context-vector-wrong" in result.diagnosis, result.message
