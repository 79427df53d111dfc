"""What a failed check tells the learner: the counterexample, the learner's own error, in words.

- :func:`counterexample`: the inputs of the failing case, each labelled by its parameter name, and where the
  output first differs, as an index in the output's own shape; a tuple's outputs are counted as the learner
  counts them ("output 2 of 2", or by name);
- :func:`describe_exception`: an exception raised by the learner's code, the learner's own line first, the
  frames of Triton, PyTorch and attnlab folded into a count, and the common interpreter errors (indexing a
  pointer, a torch function inside a kernel, a ``tl.arange`` with bounds that are not ``tl.constexpr``)
  translated into one plain sentence with the fix;
- :func:`wrap`: check output wrapped at word boundaries, so that a notebook never breaks a word in two.

:mod:`attnlab.grading.core` imports the counterexample functions from here; nothing here imports another
module of the grader (agent.py imports :func:`describe_exception` from here), so no import goes round in a
circle.
"""

import inspect
import os
import re
import sys
import textwrap
import traceback

WIDTH = 100  # check output is wrapped at this many characters, at word boundaries


# ---------------------------------------------------------------------------------------
# counterexamples
# ---------------------------------------------------------------------------------------

def first_mismatch(got, want, rtol=1e-4, atol=1e-5):
    """(index in the output's own shape, expected, got, mismatched count, count) of the first entry where two
    tensors of one shape differ (NaN equals NaN), or None when they agree or cannot be compared."""
    import torch

    if not (torch.is_tensor(want) and torch.is_tensor(got)) or tuple(got.shape) != tuple(want.shape):
        return None
    if want.dtype == torch.bool or got.dtype == torch.bool:
        bad = got.cpu() != want.cpu()
    else:
        g, w = got.detach().double().cpu(), want.detach().double().cpu()
        bad = ~(torch.isclose(g, w, rtol=rtol, atol=atol) | (torch.isnan(g) & torch.isnan(w)))
    if not bad.any():
        return None
    index = tuple(int(i) for i in torch.nonzero(bad)[0]) if bad.dim() else ()
    shown = index[0] if len(index) == 1 else index  # a 1-D output's index is a number, not (i,)
    return shown, _scalar(want[index]), _scalar(got[index]), int(bad.sum()), bad.numel()


def first_difference(got, want, rtol=1e-4, atol=1e-5, names=None):
    """Where two results first differ: "first mismatch at index (i, j): expected x, got y (k of n entries
    differ)", or "" when it cannot tell.

    For tuples: "output 2 of 2 (L), first mismatch ..." (1-based, as the learner counts; ``names`` label them)."""
    if isinstance(want, (tuple, list)) and isinstance(got, (tuple, list)) and len(got) == len(want):
        for i, (g, w) in enumerate(zip(got, want)):
            where = first_difference(g, w, rtol, atol)
            if where:
                return f"{output_name(i, len(want), names)}, {where}"
        return ""
    found = first_mismatch(got, want, rtol, atol)
    if found is None:
        return ""
    index, expected, value, wrong, count = found
    return f"first mismatch at index {index}: expected {expected}, got {value} ({wrong} of {count} entries differ)"


def output_name(i, n, names=None):
    """Output ``i`` (0-based) of ``n``, as the learner counts: "output 2 of 2 (L)"."""
    label = f" ({names[i]})" if names and i < len(names) else ""
    return f"output {i + 1} of {n}{label}"


def _scalar(x):
    import torch

    x = x.item() if torch.is_tensor(x) else x
    return f"{x:.6g}" if isinstance(x, float) else repr(x)


def describe_inputs(args, kwargs, names=None, small=12):
    """The inputs of a case, for a counterexample: ``name: value`` for each, shapes and dtypes for tensors
    and the values of small ones. ``names``: the parameter names of the positional arguments."""
    import torch

    def one(x):
        if torch.is_tensor(x):
            text = f"tensor of shape {tuple(x.shape)}, {str(x.dtype).replace('torch.', '')}"
            if 0 < x.numel() <= small:
                values = x.detach().cpu().tolist()
                text += f" = {values}" if x.dtype == torch.bool else f" = {_rounded(values)}"
            return text
        if isinstance(x, (tuple, list)) and len(x) <= 8:
            return "(" + ", ".join(one(v) for v in x) + ")"
        return repr(x) if len(repr(x)) <= 60 else type(x).__name__

    names = list(names or [])
    parts = [f"{names[i] if i < len(names) else f'argument {i + 1}'}: {one(a)}" for i, a in enumerate(args)]
    parts += [f"{k}: {one(v)}" for k, v in kwargs.items()]
    return "; ".join(parts)


def _rounded(values):
    if isinstance(values, list):
        return [_rounded(v) for v in values]
    return round(values, 4) if isinstance(values, float) else values


def parameter_names(fn):
    """The names of ``fn``'s parameters ([] when it has no signature)."""
    try:
        return [p for p in inspect.signature(fn).parameters]
    except (TypeError, ValueError):
        return []


def case_line(label, args, kwargs, spec=None, names=None):
    """The counterexample's inputs, labelled by ``spec``'s parameter names (or ``names``): what a failure whose
    reason came from :func:`attnlab.grading.core.mismatch` (which says where the output differs) shows."""
    labels = names if names is not None else (parameter_names(spec) if spec else None)
    return f"counterexample ({label}): {describe_inputs(args, kwargs, labels)}"


def counterexample(label, got, want, args, kwargs, spec=None, rtol=1e-4, atol=1e-5, names=None):
    """The lines a failure whose reason does not say where the output differs shows: the inputs
    (:func:`case_line`) and where expected and got first differ."""
    where = first_difference(got, want, rtol, atol)
    return [case_line(label, args, kwargs, spec, names), *([where] if where else [])]


def named(impl, args):
    """``args`` as {parameter name of ``impl``: value}: a mistake's inputs, labelled in a counterexample."""
    names = parameter_names(impl)
    if len(names) < len(args):
        return None
    return dict(zip(names, args))


# ---------------------------------------------------------------------------------------
# the learner's errors
# ---------------------------------------------------------------------------------------

_LIBRARY_ROOTS = tuple({os.path.dirname(os.path.dirname(os.__file__)), sys.prefix, sys.base_prefix,
                        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})


def _is_learners(filename):
    """A frame of the learner's code: a notebook cell or a file outside Python, its packages and attnlab."""
    if not filename or filename.startswith("<frozen"):
        return False
    if "site-packages" in filename or "dist-packages" in filename:
        return False
    path = os.path.abspath(filename)
    return not any(path.startswith(root + os.sep) for root in _LIBRARY_ROOTS if root)


def _root_cause(exc):
    """The innermost cause (Triton's interpreter re-raises every error as an InterpreterError from it)."""
    seen = set()
    while exc.__cause__ is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    return exc


POINTER_INDEXED = ("a pointer is not an array: `x_ptr[offs]` indexes the pointer itself; add the offsets to it "
                   "instead, tl.load(x_ptr + offs, mask=offs < n, other=0.0)")
TORCH_IN_KERNEL = ("a torch function was called inside the kernel: a @triton.jit kernel computes on Triton blocks "
                   "with tl.* (tl.exp, tl.sum, tl.maximum, tl.where, ...); torch.* runs only outside the kernel")
ARANGE_NOT_CONSTEXPR = ("tl.arange needs bounds known when the kernel is compiled: use a tl.constexpr (declare "
                        "BLOCK_SIZE: tl.constexpr in the signature and pass it as a keyword), not a runtime value "
                        "such as n_elements; mask the lanes past n instead")


NOT_DIFFERENTIABLE = ("the output is not differentiable: autograd cannot reach q, k, v through it; compute it with "
                      "torch operations on the inputs themselves, not under torch.no_grad(), not through .detach(), "
                      ".item(), .numpy() or a new torch.tensor(...)")
CTX_NOT_SET = ("the backward reads ctx.{0}, which your forward never set: in the Function's forward keep it on "
               "ctx (ctx.{0} = {0}) beside ctx.save_for_backward(...)")

# the key a check reports for each plain sentence (its diagnosis)
PLAIN_KEYS = {POINTER_INDEXED: "pointer-indexed", TORCH_IN_KERNEL: "torch-op-in-kernel",
              ARANGE_NOT_CONSTEXPR: "arange-not-constexpr", CTX_NOT_SET: "ctx-attribute-not-saved",
              NOT_DIFFERENTIABLE: "not-differentiable"}


def plain_sentence(text, line=""):
    """The translation of a common error (from its text and the learner's line), or ""."""
    if re.search(r"\btl\.(load|store)\(\s*\w+\s*\[", line) or re.search(r"\w*_ptr\s*\[", line) or \
            "'int' object is not iterable" in text:
        return POINTER_INDEXED
    if "must be Tensor, not tensor" in text:
        return TORCH_IN_KERNEL
    if "arange's arguments must be of type tl.constexpr" in text:
        return ARANGE_NOT_CONSTEXPR
    if "does not require grad and does not have a grad_fn" in text or \
            "does not depend on the inputs through autograd" in text:
        return NOT_DIFFERENTIABLE
    found = re.search(r"'\w*Backward\w*' object has no attribute '(\w+)'", text)
    if found:
        return CTX_NOT_SET.format(found.group(1))
    return ""


def plain_mistake(text):
    """(the error's text without its plain sentence, key, sentence) for an error ``describe_exception`` wrote;
    key and sentence are None when it is not a common one."""
    head, _, sentence = text.partition("\n    in plain words: ")
    if not sentence:
        return text, None, None
    for template, key in PLAIN_KEYS.items():
        if sentence == template or ("{0}" in template and sentence.startswith(template.split("{0}")[0])):
            return head, key, sentence
    return head, "error", sentence


def describe_exception(exc):
    """An exception from the learner's code in a few lines: "TypeError at line 6 of `k1` (your code):
    `x = tl.load(x_ptr[offs])`: 'int' object is not iterable (4 frames of Triton folded)", then the plain
    sentence for a common error."""
    cause = _root_cause(exc)
    message = str(cause).strip().splitlines()
    message = message[-1][:300] if message else ""
    frames = traceback.extract_tb(cause.__traceback__) if cause.__traceback__ else []
    mine = [f for f in frames if _is_learners(f.filename)]
    head = f"{type(cause).__name__}: {message}".rstrip(": ")
    line = ""
    if mine:
        last = mine[-1]
        line = (last.line or "").strip()
        folded = len(frames) - frames.index(last) - 1
        where = f"line {last.lineno} of `{last.name}` (your code)" + (f": `{line}`" if line else "")
        head = f"{type(cause).__name__} at {where}: {message}" + (
            f" ({folded} frame{'s' if folded != 1 else ''} of Triton/PyTorch below it folded)" if folded else "")
    sentence = plain_sentence(message, line)
    return head + (f"\n    in plain words: {sentence}" if sentence else "")


# ---------------------------------------------------------------------------------------
# wrapping
# ---------------------------------------------------------------------------------------

def wrap(text, width=WIDTH):
    """``text`` with each line longer than ``width`` wrapped at word boundaries; continuation lines are
    indented two spaces more than the line they continue. Words longer than a line stay whole."""
    out = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        out.extend(textwrap.wrap(line.strip(), width=width, initial_indent=indent, subsequent_indent=indent + "  ",
                                 break_long_words=False, break_on_hyphens=False))
    return "\n".join(out)
