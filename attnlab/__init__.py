"""attnlab: the library behind the attention course.

Everything a lesson uses is importable from here, for example::

    from attnlab import scaled_dot_product_attention, MultiHeadAttention, tiled_attention

The names are imported on first use (see ``_EXPORTS``): ``import attnlab`` stays
cheap and works even where torch is broken, so that ``attnlab doctor`` can say
what is wrong. The Triton kernels live in the top-level ``kernels/`` folder and
are imported as ``attnlab.kernels`` (see ``_kernels_path``).
"""

from importlib import import_module

from attnlab import _kernels_path  # makes `attnlab.kernels` importable from a source checkout

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # reference attention in plain PyTorch (attnlab/attention.py)
    "softmax": "attnlab.attention",
    "masked_softmax": "attnlab.attention",
    "padding_mask": "attnlab.attention",
    "causal_mask": "attnlab.attention",
    "AdditiveAttention": "attnlab.attention",
    "scaled_dot_product_attention": "attnlab.attention",
    "MultiHeadAttention": "attnlab.attention",
    "naive_attention": "attnlab.attention",
    "block_sparse_reference": "attnlab.attention",
    # the FlashAttention algorithm in PyTorch (attnlab/tiled.py)
    "tiled_attention": "attnlab.tiled",
    # every load and store of a kernel, counted in Triton's interpreter (attnlab/memory.py)
    "trace": "attnlab.memory",
    "MemoryTrace": "attnlab.memory",
    # widgets (attnlab/widgets/)
    "AttentionMap": "attnlab.widgets",
    "ScalingExplorer": "attnlab.widgets",
    "MemoryTraffic": "attnlab.widgets",
    "BlockMaskEditor": "attnlab.widgets",
    # models and toy data the lessons train on the CPU
    "TinyTransformer": "attnlab.models.transformer",
    "SelfAttention": "attnlab.models.transformer",
    "KeyValueLookup": "attnlab.data.toy",
    "PreviousTwo": "attnlab.data.toy",
    "InductionCopy": "attnlab.data.toy",
    # lesson 01: Bahdanau et al. 2014, scaled down, on a synthetic translation task
    "RNNencdec": "attnlab.models.seq2seq",
    "RNNsearch": "attnlab.models.seq2seq",
    "translate": "attnlab.models.seq2seq",
    "load_pretrained": "attnlab.pretrained",
    "load_task": "attnlab.data.translation",
    "corpus_bleu": "attnlab.bleu",
    # approximate attention (lesson 08)
    "local_window_attention": "attnlab.approx",
    "linformer_attention": "attnlab.approx",
    "performer_attention": "attnlab.approx",
    # measuring on the learner's machine (lessons 05, 07, 08)
    "peak_memory": "attnlab.measure",
    "time_call": "attnlab.measure",
    # inline checks of the exercises
    "check": "attnlab.grading.checks",
    # showing the library's own code in a lesson
    "show_source": "attnlab.show",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
