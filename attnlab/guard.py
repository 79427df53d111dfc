"""A guarded launch for the demo cells of the exercise notebooks: ``guarded(kernel)[grid](*args, **meta)``.

A demo cell that launches a learner's kernel plainly (``scale_kernel[grid](x, y, ...)``) runs it in the
learner's own Python process: in Triton's interpreter a load or store past the end of a tensor reads or
writes whatever memory lies there, which can hang the kernel, corrupt it or kill it (a missing mask is the
most natural first mistake). ``guarded`` launches the same kernel with every access bounds-checked
*before* it happens:

- each ``tl.load`` and ``tl.store`` is checked against the tensors the kernel was given (the span of each
  tensor's elements); the first access outside all of them stops the launch, nothing outside is touched;
- the launch then prints what happened in one sentence that names the mistake (an out-of-bounds load or
  store, with the program and the tensor it ran past) and returns; so do a kernel that is not written yet
  and a kernel that raises (:func:`attnlab.grading.feedback.describe_exception`: the learner's line first);
- nothing is printed when the kernel is right, and the launch is the kernel's own (``attnlab.memory.trace``
  around it sees the same loads and stores).

On a GPU the accesses cannot be checked before they happen; the kernel is launched as it is, and only
its exceptions are caught. Example::

    guarded(scale_kernel)[(triton.cdiv(1000, 128),)](x, y, 1000, 3.0, BLOCK_SIZE=128)
"""

import inspect


class OutOfBounds(Exception):
    """A load or store outside every tensor of the launch (raised before the access)."""

    def __init__(self, op, count, program, tensor, where):
        self.op, self.count, self.program, self.tensor, self.where = op, count, program, tensor, where
        super().__init__(self.sentence())

    def sentence(self):
        prog = ", ".join(str(i) for i in self.program)
        if self.op == "load":
            fix = ("mask the load: tl.load(ptr + offs, mask=offs < n, other=...); the masked lanes are not read")
            kind = "an out-of-bounds load"
        else:
            fix = "mask the store: tl.store(ptr + offs, value, mask=offs < n)"
            kind = "an out-of-bounds store"
        return (f"{kind}: program ({prog}) {'read' if self.op == 'load' else 'wrote'} {self.count} element(s) "
                f"{self.where} `{self.tensor}`; the launch was stopped before the access. {fix}")


def _span(t):
    """[first byte, end byte) of tensor ``t``'s elements in memory."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _spans(fn, args, meta):
    """(name, first byte, end byte) of every tensor argument of a launch of the Python kernel ``fn``."""
    params = inspect.signature(fn).parameters
    try:  # launch options (num_warps, ...) are not the kernel's parameters
        bound = inspect.getcallargs(fn, *args, **{k: v for k, v in meta.items() if k in params})
    except TypeError:
        bound = {f"argument {i + 1}": a for i, a in enumerate(args)}
    return [(name, *_span(val)) for name, val in bound.items()
            if hasattr(val, "data_ptr") and hasattr(val, "untyped_storage")]


def _bounds_check(spans):
    """The check run before each load and store (:func:`attnlab._interp_hooks.before_each_access`): an access
    outside every tensor of the launch raises OutOfBounds, naming the tensor it ran past."""
    import numpy as np

    def check(op, addr, grid):
        inside = np.zeros(addr.shape, dtype=bool)
        for _name, start, end in spans:
            inside |= (addr >= start) & (addr < end)
        if inside.all():
            return
        bad = addr[~inside]
        first = int(bad.min())
        below = [(first - end, name) for name, _s, end in spans if end <= first]
        above = [(start - first, name) for name, start, _e in spans if start > first]
        if below:
            where, name = "past the end of", min(below)[1]
        else:
            where, name = "before the start of", min(above)[1] if above else "any tensor"
        program = grid
        while len(program) > 1 and program[-1] == 0:
            program = program[:-1]
        raise OutOfBounds(op, int(bad.size), program, name, where)
    return check


def _name_of(kernel):
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", "the kernel")


class _Guarded:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **meta):
            return _launch(self.kernel, grid, args, meta)
        return launch


def guarded(kernel):
    """``kernel`` (a ``@triton.jit`` function), launched as ``guarded(kernel)[grid](*args, **meta)`` with every
    access bounds-checked first; a mistake is printed (named), never raised. Returns True when the launch ran
    clean, False otherwise."""
    return _Guarded(kernel)


def _interpreted(kernel):
    """Whether ``kernel`` runs in Triton's interpreter: no GPU, or defined under TRITON_INTERPRET=1."""
    import torch

    from attnlab._interp_hooks import is_interpreted

    return not torch.cuda.is_available() or is_interpreted(kernel)


def _launch(kernel, grid, args, meta):
    from attnlab.grading.feedback import _root_cause, describe_exception, wrap

    name = _name_of(kernel)
    try:
        if _interpreted(kernel):  # in Triton's interpreter, whatever TRITON_INTERPRET was when the kernel was defined
            from attnlab._interp_hooks import before_each_access, interpreted, interpreter_session, \
                jit_helpers_interpreted, kernel_function

            fn = kernel_function(kernel)
            if fn is None:
                print(f"`{name}` is not a Triton kernel (a function decorated with @triton.jit)")
                return False
            check = _bounds_check(_spans(fn, args, meta))
            with interpreter_session(), jit_helpers_interpreted(), before_each_access(check):
                interpreted(fn)[grid](*args, **meta)
        else:
            kernel[grid](*args, **meta)
        return True
    except Exception as exc:  # the learner's bug: told plainly, the notebook goes on
        root = _root_cause(exc)  # the interpreter re-raises everything as an InterpreterError
        if isinstance(root, OutOfBounds):
            print(wrap(f"`{name}`: {root.sentence()}"))
        elif isinstance(root, NotImplementedError):
            print(f"`{name}` is not written yet: replace `raise NotImplementedError()` with your code")
        else:
            print(wrap(f"`{name}` raised {describe_exception(exc)}"))
    return False
