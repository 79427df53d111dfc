"""Never wrong an honest learner, and never let the syntax check's blind spots through.

A learner's own method named like a forbidden one keeps its points; a part whose check could not run
the learner's code here scores 0 with the reason; code on a ``%time`` line, private and operator-registry
spellings of a forbidden function, the references named by file path and a relabelled answer cell are
all read by the syntax check."""

from pathlib import Path

import nbformat
import pytest
import torch

from attnlab.grading import core, shortcuts
from attnlab.grading.checks import run_check
from attnlab.grading.layout import learner_cell
from attnlab.grading.parts import forbidden

ROOT = Path(__file__).resolve().parents[1]

OWN_SOFTMAX = '''import math
import torch

class Attention:
    def softmax(self, s):
        e = (s - s.amax(-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)

    def __call__(self, q, k, v, scale=None):
        scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        return self.softmax(q @ k.transpose(-2, -1) * scale) @ v

def scaled_dot_product_attention(q, k, v, scale=None):
    return Attention()(q, k, v, scale)
'''


def test_a_learner_s_own_softmax_method_keeps_a_passing_part():
    assert "torch.Tensor.softmax" in forbidden("scaled-attention")
    assert shortcuts.uses([OWN_SOFTMAX], forbidden("scaled-attention")) == []
    ns = {}
    exec(OWN_SOFTMAX, ns)
    result = run_check("scaled-attention", ns)
    assert result.passed, result.message


def test_a_tensor_s_softmax_is_still_caught_without_a_method_of_that_name():
    source = "def scaled_dot_product_attention(q, k, v, scale=None):\n    return (q @ k.mT).softmax(-1) @ v\n"
    assert shortcuts.uses([source], forbidden("scaled-attention")) == [("torch.Tensor.softmax", 2)]


def test_a_part_that_cannot_be_checked_here_scores_nothing():
    def body(learner):
        return "not checked on a GPU: grade this part on a CPU-only machine"

    result = core.run_part("some-part", body, {})
    assert not result.passed and "not checked here, so no points" in result.message


def test_a_part_whose_check_ran_the_learner_s_code_passes():
    def body(learner):
        core.check_function(learner, "double", lambda x: 2 * x, [("x", (torch.ones(3),), {})])
        return "1 case"

    assert core.run_part("some-part", body, {"double": lambda x: x + x}).passed


def test_code_on_a_magic_line_is_checked():
    cell = "import torch\n%time out = torch.softmax(x, -1)\n%%timeit -n 2\n"
    assert ("torch.softmax", 2) in shortcuts.uses([cell], ["torch.softmax"])
    cell = "%%time\nimport torch\ny = torch.softmax(x, -1)\n"
    assert shortcuts.uses([cell], ["torch.softmax"])


def test_private_and_registry_spellings_and_the_references_by_path_are_caught():
    patterns = ["torch.softmax"]
    found = shortcuts.uses(["import torch\ny = torch._softmax(x, -1, False)\n"], patterns)
    assert [n for n, _ in found] == ["torch._softmax"]
    found = shortcuts.uses(["import torch\ny = torch.ops.aten._softmax.default(x, -1, False)\n"], patterns)
    assert found and found[0][0].startswith("torch.ops.aten")
    by_path = ("import importlib.util as u\n"
               "s = u.spec_from_file_location('m', '/c/attnlab/grading/exercises/e03/spec.py')\n")
    assert any("grading.exercises" in n for n, _ in shortcuts.uses([by_path], patterns))


def test_an_answer_cell_with_an_unknown_grade_id_is_the_learner_s():
    given = {"03-cell-02": "import torch\n"}
    relabelled = nbformat.v4.new_code_cell("def softmax(x, dim=-1):\n    return torch.softmax(x, dim)\n")
    relabelled.metadata["nbgrader"] = {"grade_id": "made-up-id"}
    assert learner_cell(relabelled, "stable-softmax", given)
    untouched = nbformat.v4.new_code_cell("import torch\n")
    untouched.metadata["nbgrader"] = {"grade_id": "03-cell-02"}
    assert not learner_cell(untouched, "stable-softmax", given)
    untouched.source = "import torch\n_sm = torch.softmax\n"  # a given cell edited: the learner's now
    assert learner_cell(untouched, "stable-softmax", given)


def test_exactly_one_gradient_per_input_is_required():
    class NoGradients:
        def call(self, name, cases, grad=None):  # a kernel that answers with an empty list of gradients
            return {"results": [{"ok": {"out": 2 * a[0], "grads": []}} for a, _k, _g in cases]}

        def launch(self, request):
            raise AssertionError("not a kernel part")

    x = torch.randn(3)
    cases = [("x", (x,), {}, torch.ones(3))]
    result = core.run_part("p", lambda learner: core.check_with_gradients(learner, "f", lambda t: 2 * t, cases, [0]),
                           NoGradients())
    assert not result.passed and "one gradient per input" in result.message


def test_a_scratch_comparison_with_the_forbidden_function_is_not_the_answer():
    """What the syntax check reads of other cells: the statements that define what the answer uses (its helpers,
    their helpers), never a scratch cell's comparison with torch.softmax nor a cell that only shares a parameter's
    name with the answer (``x = ...`` for ``def softmax(x, ...)``)."""
    answer = "def softmax(x, dim=-1):\n    e = (x - x.amax(dim, keepdim=True)).exp()\n    return _norm(e, dim)\n"
    helper = "def _norm(e, dim):\n    return e / _total(e, dim)\n"
    helpers_helper = "def _total(e, dim):\n    return torch.softmax(e, dim)\n"
    scratch = "x = torch.randn(4, 5)\nprint((softmax(x) - torch.softmax(x, -1)).abs().max())\n"
    loop = "for x in [torch.ones(3)]:\n    print(torch.softmax(x, -1))\n"
    patterns = forbidden("stable-softmax")
    code = ["import torch", answer, helper, scratch, loop]
    assert shortcuts.uses(shortcuts.part_cells([helper, scratch, loop], ["softmax"], [answer]), patterns, code) == []
    read = shortcuts.part_code([helper, helpers_helper, scratch, loop], ["softmax"], [answer])
    assert [own for _text, own in read] == [True, False, False]
    assert shortcuts.uses([read[2][0]], patterns, code) == [("torch.softmax", 2)]


def test_a_solution_with_scratch_cells_and_an_edited_demo_keeps_its_points(tmp_path):
    from attnlab.grading.scoring import grade_notebook

    nb = nbformat.read(str(ROOT / "solutions" / "03_scaled_dot_product.ipynb"), as_version=4)
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == "03-cell-11":  # a given demo, edited
            cell.source = cell.source.replace("manual_seed(0)", "manual_seed(7)")
            assert "manual_seed(7)" in cell.source
    nb.cells.append(nbformat.v4.new_code_cell("x = torch.randn(4, 5)\n"
                                              "print((softmax(x) - torch.softmax(x, -1)).abs().max())\n"
                                              "q = k = v = torch.randn(1, 1, 3, 8)\n"
                                              "print(torch.nn.functional.scaled_dot_product_attention(q, k, v))\n"))
    path = tmp_path / "03_scaled_dot_product.ipynb"
    nbformat.write(nb, str(path))
    report = grade_notebook(path)
    assert report["score"] == report["max_score"], [(p["name"], p["feedback"]) for p in report["parts"]]


@pytest.mark.parametrize("cells, answer, part", [
    ([], "def softmax(x, dim=-1):\n    return x.softmax(dim)\n", "stable-softmax"),  # the learner's def is not a method
    (["_ops = []\n", "_ops.append(torch.softmax)\n"], "def softmax(x, dim=-1):\n    return _ops[0](x, dim)\n",
     "stable-softmax"),
    (["def _init():\n    global _bw\n    _bw = torch._softmax_backward_data\n", "_init()\n"],
     "def softmax_backward(p, dp, dim=-1):\n    return _bw(dp, p, dim, p.dtype)\n", "softmax-backward"),
    (["match torch._softmax_backward_data:\n    case _bw:\n        pass\n"],
     "def softmax_backward(p, dp, dim=-1):\n    return _bw(dp, p, dim, p.dtype)\n", "softmax-backward"),
    (["from torch.nn.functional import *\n_sdpa = scaled_dot_product_attention\n"],
     "def scaled_dot_product_attention(q, k, v, scale=None):\n    return _sdpa(q, k, v, scale=scale)\n",
     "scaled-attention"),
], ids=["tensor-method", "list-append", "global-in-a-function", "match-capture", "star-import"])
def test_plain_python_routes_to_a_forbidden_function_are_read(cells, answer, part):
    """Found by a red team: each of these reached a forbidden function past the syntax check."""
    function = answer.split("(")[0][4:]
    code = ["import torch\nimport torch.nn.functional as F\n", *cells, answer]
    assert shortcuts.uses(shortcuts.part_cells(cells, [function], [answer]), forbidden(part), code) != []


def test_a_scratch_cell_reading_what_a_demo_printed_keeps_the_part_s_points(tmp_path):
    """The grader does not run the given demos (they call the learner's functions for show); a learner's cell after
    one that reads its result (``o_parts``) ran in Jupyter, and is not run here instead of failing the part."""
    from attnlab.grading.scoring import grade_notebook

    nb = nbformat.read(str(ROOT / "solutions" / "10_inference.ipynb"), as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade_id", "").startswith(
        "10-cell-") and "o_parts, lse = split_partials(" in c.source)   # the given demo that defines o_parts
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell("print(o_parts.shape, lse.shape)\nmine = o_parts.sum()\n"
                                                      "print(mine)\nkept = 1\n"))
    path = tmp_path / "10_inference.ipynb"
    nbformat.write(nb, str(path))
    report = grade_notebook(path)
    assert report["score"] == report["max_score"], [(p["name"], p["feedback"]) for p in report["parts"]]


def test_a_forbidden_object_is_read_under_any_name_and_an_allowed_one_is_not():
    """Red team, round three: re-exports and what a library module imported are the forbidden object itself."""
    code = ["import torch\nimport torch.nn.functional as F\nfrom attnlab.models import gpt as _model\n"
            "import torch.distributed as dist\n"]
    sdpa = "def f(q, k, v):\n    return _model.F.scaled_dot_product_attention(q, k, v)\n"
    assert shortcuts.uses([sdpa], forbidden("capstone-local-global"), code + [sdpa]) == [
        ("attnlab.models.gpt.F.scaled_dot_product_attention (which is "
         "torch.nn.functional.scaled_dot_product_attention)", 2)]
    reexport = "from attnlab.models.gpt import scaled_dot_product_attention as attend\n"
    assert "attnlab.attention" in shortcuts.uses([reexport], forbidden("capstone-local-global"))[0][0]
    gather = "from torch.distributed.distributed_c10d import all_gather_object\n"
    assert shortcuts.uses([gather], forbidden("ring-group")) != []
    objects = "def f(k, v):\n    every = [None, None]\n    dist.all_gather_object(every, (k, v))\n"
    assert shortcuts.uses([objects], forbidden("ring-group"), code + [objects])[0][0] == \
        "torch.distributed.all_gather_object"
    honest = ("def ring_forward(q, k, v):\n    r, p = dist.get_rank(), dist.get_world_size()\n"
              "    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, k, (r + 1) % p)])\n"
              "    x = torch.exp(q) + F.relu(q) + torch.matmul(q, k.transpose(-1, -2)).amax(-1)\n"
              "    heads = torch.arange(4).repeat_interleave(2)\n    return x, heads\n")
    assert shortcuts.uses([honest], forbidden("ring-group"), code + [honest]) == []
    assert shortcuts.uses([honest], forbidden("decode-attention"), code + [honest]) == []
    backend = "def train(seed):\n    return GPT(attention='sdpa', seed=seed)\n"
    assert shortcuts.uses([backend], forbidden("capstone-train"))[0][0] == \
        "'sdpa' (the name of one of the library's backends)"


def test_the_warm_up_call_s_values_say_nothing_of_the_measured_call_s():
    from attnlab.grading.sandbox.footprint import _other_values

    case = [(torch.randn(64, 64) * 3 + 1, torch.arange(5), torch.randn(8, dtype=torch.float16)), {"x": torch.ones(3)}]
    other = _other_values(case)
    (a, ints, half), kw = other
    assert a.shape == case[0][0].shape and a.dtype == torch.float32 and half.dtype == torch.float16
    assert torch.equal(ints, case[0][1])  # lengths and indices stay what they were
    assert abs(torch.corrcoef(torch.stack([a.flatten(), case[0][0].flatten()]))[0, 1]) < 0.1
    assert not torch.equal(_other_values(case)[0][0], a)  # drawn afresh each time
    assert kw["x"].shape == (3,) and torch.isfinite(kw["x"]).all()


def test_a_part_that_asks_for_a_technique_needs_the_answer_to_use_it():
    """Red team, round three: exercise 09's training run through my_sdpa instead of the kernel, and an experiment's
    numbers written as the formula, had the right outputs; the answer's code must read what the part is about."""
    from attnlab.grading.parts import required

    nb = nbformat.read(str(ROOT / "solutions" / "09_capstone.ipynb"), as_version=4)
    train = next(c.source for c in nb.cells
                 if c.metadata.get("nbgrader", {}).get("grade_id") == "capstone-train-answer")
    skipped = train.replace("attention=kernel_attention if attention is None else attention",
                            "attention=attention or my_sdpa")
    assert skipped != train
    needs = required("capstone-train")
    assert shortcuts.missing(shortcuts.part_cells([], ["train_gpt"], [train]), needs) == []
    assert shortcuts.missing(shortcuts.part_cells([], ["train_gpt"], [skipped]), needs) == list(needs)
    # the given name bound to something else is not the given one; the given class itself is
    assert shortcuts.missing(shortcuts.part_cells([], ["train_gpt"], [train]), needs, rebound={"kernel_attention"}) \
        == list(needs)
    given = "def kernel_attention(q, k, v, **kw):\n    return KernelAttention.apply(q, k, v)\n"
    assert shortcuts.rebound(["kernel_attention = my_sdpa\n"], [given]) == {"kernel_attention"}
    assert shortcuts.rebound([given + "# my note\n"], [given]) == set()
    apply = train.replace("attention=kernel_attention if attention is None else attention",
                          "attention=attention or (lambda q, k, v, **kw: KernelAttention.apply(q, k, v))")
    assert shortcuts.missing(shortcuts.part_cells([], ["train_gpt"], [apply]), needs) == []
    # through a helper of the learner's own, it is still used
    helper = "def _attend(a):\n    return kernel_attention if a is None else a\n"
    via = train.replace("attention=kernel_attention if attention is None else attention",
                        "attention=_attend(attention)")
    assert shortcuts.missing(shortcuts.part_cells([helper], ["train_gpt"], [via]), needs) == []


@pytest.mark.parametrize("imports, call", [
    ("from attnlab.memory import trace\n", "trace(f, x)"),
    ("from attnlab.memory import trace as tr\n", "tr(f, x)"),
    ("import attnlab.memory\n", "attnlab.memory.trace(f, x)"),
    ("from attnlab import memory as mem\n", "mem.trace(f, x)"),
], ids=["as-given", "alias", "module", "module-alias"])
def test_a_required_library_function_is_found_under_any_name(imports, call):
    answer = f"def decode_bytes(contexts, kv_heads_list, heads=8, d=16):\n    return {call}\n"
    needs = {"attnlab.memory.trace": "why"}
    assert shortcuts.missing(shortcuts.part_cells([], ["decode_bytes"], [answer]), needs, [imports, answer]) == []
    formula = "def decode_bytes(contexts, kv_heads_list, heads=8, d=16):\n    return 2 * heads * d\n"
    assert shortcuts.missing([formula], needs, [imports, formula]) == ["attnlab.memory.trace"]


def test_a_learner_s_own_assignment_of_a_name_a_demo_also_sets_runs(tmp_path):
    """Round three, second pass: ``layout = "contiguous"`` in the learner's cell reads nothing, so it runs even
    though a skipped demo also assigns ``layout``."""
    import nbformat as nbf

    from attnlab.grading.layout import to_run

    nb = nbf.v4.new_notebook()
    demo = "P, layout = 4, my_fn(2)\nprint(layout)\n"
    mine = "layout = 'contiguous'\nprint(layout)\nx = layout + '!'\n"
    reads = "print(P)\ny = 1\n"
    nb.cells = [nbf.v4.new_code_cell(demo, metadata={"nbgrader": {"grade_id": "demo"}}),
                nbf.v4.new_code_cell(mine), nbf.v4.new_code_cell(reads)]
    ran = dict(to_run(nb, [None, None, None], {"demo": demo}, {"demo": [0, 1]}, [], {"my_fn"}))  # both its statements
    assert 0 not in ran                     # the demo calls the learner's function: not run
    assert ran[1] == mine                   # the learner's assignment and what reads it run, whole
    assert "print(P)" not in ran[2] and "y = 1" in ran[2]   # P only the demo made


@pytest.mark.parametrize("answer, part", [
    ('def f(q, k, v):\n    return F.__dict__["scaled_dot_product_attention"](q, k, v)\n', "capstone-sdpa"),
    ('def f(q, k, v):\n    return vars(F)["scaled_dot_product_attention"](q, k, v)\n', "capstone-sdpa"),
    ('def f(q, k, v):\n    return F.__getattribute__("scaled_dot_product_attention")(q, k, v)\n', "capstone-sdpa"),
    ("def f(q, k, v):\n    return torch._scaled_dot_product_attention_math(q, k, v)[0]\n", "capstone-sdpa"),
    ("def f(s):\n    return F.softmin(-s, -1)\n", "capstone-sdpa"),
    ("def f(k):\n    dist.group.WORLD.allgather([[k]], [k]).wait()\n", "ring-group"),
    ("def f(k):\n    dist.new_group().allgather([[k]], [k]).wait()\n", "ring-group"),
    ("def f(fn, x, g):\n    return torch.func.vjp(fn, x)[1](g)\n", "tiled-backward"),
    ("def f(seed):\n    mode = 'sdpa'\n    return GPT(attention=mode, seed=seed)\n", "capstone-train"),
], ids=["dict", "vars", "getattribute", "private-math", "softmin", "group-world", "new-group", "func-vjp",
        "backend-assigned"])
def test_round_three_routes_to_a_forbidden_function_are_read(answer, part):
    code = ["import torch\nimport torch.nn.functional as F\nimport torch.distributed as dist\n", answer]
    assert shortcuts.uses([answer], forbidden(part), code) != []


def test_a_backend_s_name_as_a_label_is_not_a_backend():
    answer = ("def local_vs_dense(seed, steps, window, n_global):\n    runs = {}\n"
              "    for name, fn in [('standard', dense), ('flash', local)]:\n"
              "        runs[name] = train_gpt(seed, steps, fn)\n        print('reference', name == 'sdpa')\n"
              "    return runs['standard'], runs['flash']\n")
    assert shortcuts.uses([answer], forbidden("capstone-local-global"), [answer]) == []
