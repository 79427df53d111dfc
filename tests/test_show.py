"""show_source shows the library's own code, kernels included, with the file it comes from."""

import pytest

from attnlab import scaled_dot_product_attention
from attnlab.kernels.flash_attention import _attn_fwd_kernel
from attnlab.show import _repo_relative, show_source


def test_prints_the_source_outside_a_notebook(capsys):
    show_source(scaled_dot_product_attention)
    assert "def scaled_dot_product_attention(" in capsys.readouterr().out


def test_unwraps_a_triton_kernel(capsys):
    show_source(_attn_fwd_kernel, lines=(0, 3))
    out = capsys.readouterr().out
    assert "def _attn_fwd_kernel(" in out and len(out.splitlines()) == 3


def test_names_the_file_from_the_top_of_the_course():
    assert _repo_relative("/home/me/attnlab/attnlab/attention.py") == "attnlab/attention.py"
    assert _repo_relative("/home/me/attnlab/kernels/softmax.py") == "kernels/softmax.py"
    assert _repo_relative("/venv/site-packages/attnlab/kernels/softmax.py") == "kernels/softmax.py"


def test_rejects_what_has_no_source():
    with pytest.raises(TypeError, match="obj"):
        show_source(42)


def test_notebook_listing_scrolls_instead_of_wrapping_mid_word():
    from attnlab.show import _Listing

    bundle = _Listing("attnlab/attention.py", "def f(x):\n    return x  # a long comment that must not wrap\n")._repr_mimebundle_()
    html = bundle["text/html"]
    assert "white-space:pre;" in html and "word-break:normal" in html and "overflow-x:auto" in html
    assert "attnlab/attention.py" in html and "return" in html
    assert bundle["text/markdown"].startswith("`attnlab/attention.py`\n```python\ndef f(x):")


def test_folds_the_input_checks_a_learner_skips(capsys):
    show_source(scaled_dot_product_attention)
    folded = capsys.readouterr().out
    assert "validate.qkv(" not in folded and "raise ValueError" not in folded
    assert folded.count("checks=True") == 1                      # one comment says where they went
    assert "scores = (q @ k.transpose(-2, -1)) * scale" in folded and "masked_softmax(" in folded
    show_source(scaled_dot_product_attention, checks=True)
    full = capsys.readouterr().out
    assert "validate.qkv(q, k, v)" in full and "raise ValueError" in full and "checks=True" not in full


def test_fold_checks_keeps_what_computes():
    from attnlab.show import CHECKS_FOLDED, fold_checks

    source = ("def f(x, n):\n    validate.tensor(x, 'x')\n    if n < 0:\n        raise ValueError('n')\n"
              "    y = x * n\n    if y.sum() > 0:\n        return y\n    _check_out(y)\n    return -y")
    assert fold_checks(source).splitlines() == [
        "def f(x, n):", "    " + CHECKS_FOLDED, "    y = x * n", "    if y.sum() > 0:", "        return y",
        "    return -y"]
    assert fold_checks("def g(x):\n    return x") == "def g(x):\n    return x"
