"""What a failed check tells the learner: the failing case's inputs (:func:`case_line`) and where the output first
differs (:func:`first_mismatch`), the learner's own error with the library's frames folded and a common one in one
plain sentence (:func:`describe_exception`), all wrapped at word boundaries (:func:`wrap`). It imports no other module
of the grader, so that every one of them can import it.
"""

import inspect
import os
import re
import sys
import textwrap
import traceback

WIDTH = 100  # check output is wrapped at this many characters, at word boundaries


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


def _scalar(x):
    import torch

    x = x.item() if torch.is_tensor(x) else x
    return f"{x:.6g}" if isinstance(x, float) else repr(x)


def describe_inputs(args, kwargs, names=None, small=12):
    """The inputs of a case, for a counterexample: ``name: value`` for each, shapes and dtypes for tensors
    and the values of small ones. ``names``: the parameter names of the positional arguments."""
    import torch

    def rounded(values):
        return [rounded(v) for v in values] if isinstance(values, list) else \
            round(values, 4) if isinstance(values, float) else values

    def one(x):
        if torch.is_tensor(x):
            text = f"tensor of shape {tuple(x.shape)}, {str(x.dtype).replace('torch.', '')}"
            if 0 < x.numel() <= small:
                values = x.detach().cpu().tolist()
                text += f" = {values if x.dtype == torch.bool else rounded(values)}"
            return text
        if isinstance(x, (tuple, list)) and len(x) <= 8:
            return "(" + ", ".join(one(v) for v in x) + ")"
        return repr(x) if len(repr(x)) <= 60 else type(x).__name__

    names = list(names or [])
    parts = [f"{names[i] if i < len(names) else f'argument {i + 1}'}: {one(a)}" for i, a in enumerate(args)]
    return "; ".join(parts + [f"{k}: {one(v)}" for k, v in kwargs.items()])


def parameter_names(fn):
    """The names of ``fn``'s parameters ([] when it has no signature)."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def case_line(label, args, kwargs, spec=None, names=None):
    """The counterexample's inputs, labelled by ``spec``'s parameter names (or ``names``)."""
    labels = names if names is not None else (parameter_names(spec) if spec else None)
    return f"counterexample ({label}): {describe_inputs(args, kwargs, labels)}"


_LIBRARY_ROOTS = tuple({os.path.dirname(os.path.dirname(os.__file__)), sys.prefix, sys.base_prefix,
                        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})


def _is_learners(filename):
    """A frame of the learner's code: a notebook cell or a file outside Python, its packages and attnlab."""
    if not filename or filename.startswith("<frozen") or "site-packages" in filename or "dist-packages" in filename:
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


# (the key a check reports, the plain sentence, whether an error's (text, learner's line) is this one); the
# sentence of ctx-attribute-not-saved is a template for the attribute's name
PLAIN = [
    ("pointer-indexed", "a pointer is not an array: `x_ptr[offs]` indexes the pointer itself; add the offsets to it "
     "instead, tl.load(x_ptr + offs, mask=offs < n, other=0.0)",
     lambda text, line: re.search(r"\btl\.(load|store)\(\s*\w+\s*\[", line) or re.search(r"\w*_ptr\s*\[", line)
     or "'int' object is not iterable" in text),
    ("torch-op-in-kernel", "a torch function was called inside the kernel: a @triton.jit kernel computes on Triton "
     "blocks with tl.* (tl.exp, tl.sum, tl.maximum, tl.where, ...); torch.* runs only outside the kernel",
     lambda text, line: "must be Tensor, not tensor" in text),
    ("arange-not-constexpr", "tl.arange needs bounds known when the kernel is compiled: use a tl.constexpr (declare "
     "BLOCK_SIZE: tl.constexpr in the signature and pass it as a keyword), not a runtime value such as n_elements; "
     "mask the lanes past n instead",
     lambda text, line: "arange's arguments must be of type tl.constexpr" in text),
    ("not-differentiable", "the output is not differentiable: autograd cannot reach q, k, v through it; compute it "
     "with torch operations on the inputs themselves, not under torch.no_grad(), not through .detach(), .item(), "
     ".numpy() or a new torch.tensor(...)",
     lambda text, line: "does not require grad and does not have a grad_fn" in text
     or "does not depend on the inputs through autograd" in text),
    ("ctx-attribute-not-saved", "the backward reads ctx.{0}, which your forward never set: in the Function's "
     "forward keep it on ctx (ctx.{0} = {0}) beside ctx.save_for_backward(...)",
     lambda text, line: re.search(r"'\w*Backward\w*' object has no attribute '(\w+)'", text)),
]


def plain_sentence(text, line=""):
    """The translation of a common error (from its text and the learner's line), or ""."""
    for _key, sentence, test in PLAIN:
        found = test(text, line)
        if found:
            return sentence.format(*found.groups()) if "{0}" in sentence else sentence
    return ""


def plain_mistake(text):
    """(the error's text without its plain sentence, key, sentence) for an error ``describe_exception`` wrote;
    key and sentence are None when it is not a common one."""
    head, _, sentence = text.partition("\n    in plain words: ")
    if not sentence:
        return text, None, None
    key = next((key for key, template, _test in PLAIN if sentence == template or "{0}" in template and
                sentence.startswith(template.split("{0}")[0])), "error")
    return head, key, sentence


def describe_exception(exc):
    """An exception from the learner's code: "TypeError at line 6 of `k1` (your code): `x = tl.load(x_ptr[offs])`:
    'int' object is not iterable (4 frames of Triton/PyTorch below it folded)", then a common error's sentence."""
    cause = _root_cause(exc)
    message = str(cause).strip().splitlines()
    message = message[-1][:300] if message else ""
    frames = traceback.extract_tb(cause.__traceback__) if cause.__traceback__ else []
    mine = [f for f in frames if _is_learners(f.filename)]
    head, line = f"{type(cause).__name__}: {message}".rstrip(": "), ""
    if mine:
        last = mine[-1]
        line = (last.line or "").strip()
        folded = len(frames) - frames.index(last) - 1
        where = f"line {last.lineno} of `{last.name}` (your code)" + (f": `{line}`" if line else "")
        head = f"{type(cause).__name__} at {where}: {message}" + (
            f" ({folded} frame{'s' if folded != 1 else ''} of Triton/PyTorch below it folded)" if folded else "")
    sentence = plain_sentence(message, line)
    return head + (f"\n    in plain words: {sentence}" if sentence else "")


def wrap(text, width=WIDTH):
    """``text`` with each line longer than ``width`` wrapped at word boundaries (never inside a word), continuation
    lines indented two spaces more."""
    out = []
    for line in text.splitlines():
        indent = line[:len(line) - len(line.lstrip())]
        out.extend([line] if len(line) <= width else textwrap.wrap(
            line.strip(), width=width, initial_indent=indent, subsequent_indent=indent + "  ",
            break_long_words=False, break_on_hyphens=False))
    return "\n".join(out)
