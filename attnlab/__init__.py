"""attnlab: the library behind the attention course.

Everything a lesson uses is importable from here, for example::

    from attnlab import scaled_dot_product_attention, MultiHeadAttention, tiled_attention

The names are imported on first use (see ``_EXPORTS``): ``import attnlab`` stays
cheap and works even where torch is broken, so that ``attnlab doctor`` can say
what is wrong. The Triton kernels live in the top-level ``kernels/`` folder and
are imported as ``attnlab.kernels`` (see ``_kernels_path``).
"""

import sys
from importlib import import_module
from importlib.machinery import PathFinder

from attnlab import _kernels_path  # makes `attnlab.kernels` importable from a source checkout


class _OnceTritonInterprets:
    """Loads :mod:`attnlab._interp_hooks` right after Triton's interpreter module (which ``@triton.jit`` imports under
    ``TRITON_INTERPRET=1``), so that a learner's own first launch already patches ``triton.language`` per thread and
    undoes what each ``@triton.jit`` helper call patches. Without it, a kernel launched before any attnlab call (a
    notebook's demo cell) left ``triton.language`` patched for the whole process, and the inline check's compile of a
    correct kernel that used ``tl.max`` failed."""

    name = "triton.runtime.interpreter"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                import_module("attnlab._interp_hooks")   # installs its patches on import (a supported Triton)

            spec.loader.exec_module = exec_module
        return spec


if "triton.runtime.interpreter" in sys.modules:
    if "triton.language" in sys.modules:
        import_module("attnlab._interp_hooks")
elif not any(isinstance(f, _OnceTritonInterprets) for f in sys.meta_path):
    sys.meta_path.insert(0, _OnceTritonInterprets())

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
