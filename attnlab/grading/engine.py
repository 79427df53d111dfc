"""Exercise parts as data, and the one engine that runs them.

Each exercise's ``checks.py`` holds one table per graded part, ``TABLES = {part id: table}``; :func:`run` is all that
reads them. A table says which of the learner's functions it calls, on which cases, against which reference, within
which tolerance, with which known mistakes (:class:`attnlab.grading.core.Mistake`: a name, a message and an
emulation with the signature of the function it stands for), and for a kernel the budget of its launches. The kinds:
:class:`Function` (:class:`InTurn`: several in one part), :class:`Gradients` (backpropagated too), :class:`Kernel`
(launched by the grader under guard, :mod:`attnlab.grading.kernel_check`) and :class:`Measured` (what only the
grader's own measurement shows: an experiment on salted parameters, peak memory, a process group's traffic).

What the framework guarantees, whatever a table's author writes (docs/grading.md): inputs from the salted
:func:`attnlab.grading.core.gen` (tests/test_grading_salt.py); one comparison, :func:`attnlab.grading.core.mismatch`
on ``torch.testing`` (non-finite values fail where the reference is finite, shapes before arithmetic); replies
decoded on the trusted side (:mod:`attnlab.grading.sandbox.frames`); a pass only when the learner's code ran
(:func:`attnlab.grading.core.run_part`). tests/test_every_mistake.py runs every emulated mistake of every table.
"""

from dataclasses import dataclass, field
from typing import Callable, Sequence

from attnlab.grading import core


@dataclass(frozen=True)
class Function:
    """The learner's ``name`` against ``reference`` on ``cases()`` [(label, args, kwargs)].

    ``ordered``: a known mistake that a case before the failing one would already have failed (and the learner's
    code passed) is not the learner's. ``says``: the message of a pass, ``{n}`` the number of cases."""

    name: str
    reference: Callable
    cases: Callable
    mistakes: Sequence = ()
    says: str = "{n} randomized cases match the spec"
    rtol: float = 1e-4
    atol: float = 1e-5
    ordered: bool = False
    kind = "function"


@dataclass(frozen=True)
class Gradients:
    """:class:`Function`, and backpropagation: ``cases()`` [(label, args, kwargs, grad_output)]; the arguments at
    positions ``inputs`` require grad, ``grad_output`` flows back from the output (``output``: an index into a
    returned tuple, or None); ``labels`` name the gradients in messages. The reference's gradients are autograd's
    through ``reference``; a mistake's are autograd's through its emulation."""

    name: str
    reference: Callable
    cases: Callable
    inputs: tuple
    output: object = None
    mistakes: Sequence = ()
    labels: Sequence = None
    says: str = "{n} cases match the spec, forward and backward"
    rtol: float = 1e-4
    atol: float = 1e-5
    kind = "gradients"


@dataclass(frozen=True)
class Launch:
    """One launch of a kernel part, as the grader makes it.

    ``buffers``/``args``/``grid``/``constexprs``: see :func:`attnlab.grading.kernel_check.run_guarded`;
    ``want``: {output buffer: the reference's tensor}; ``inputs``: what the part's mistakes take, named ``names``
    in a counterexample; ``budget``: {buffer: (max load bytes, max store bytes)}, held in the interpreter;
    ``allowed``: {buffer: allowed(program) -> bool tensor of the buffer's shape}, what each program (its program
    ids) may load, held in the interpreter to the loads it traced (a stray load is the table's ``stray_loads``)."""

    label: str
    buffers: dict
    grid: tuple
    args: list
    constexprs: dict
    want: dict
    inputs: tuple = ()
    names: tuple = ()
    budget: dict = field(default_factory=dict)
    allowed: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Kernel:
    """The learner's kernel ``name`` launched on ``launches()`` [:class:`Launch`].

    ``budget_says``/``loads_says``: the budget and what each program may load, in the part's words;
    ``traffic_mistakes`` (and ``traffic_diagnosis(case, traffic) -> [Mistake]``): what traffic over budget suggests;
    ``stray_loads``: {buffer: the mistake a load outside ``allowed`` is}; ``uses_dot``: TF32's tolerance on a GPU;
    ``tf32``: the mistake a GPU failure is when TF32's tolerance passes it; ``stride_mistake``: a kernel right only on
    contiguous rows (:data:`STRIDE_IGNORED`); ``failure_diagnosis(learner, case, exc)``: a further diagnosis;
    ``undefined_other``: masked lanes of a load without ``other=`` read NaN, as undefined as on a GPU."""

    name: str
    launches: Callable
    mistakes: Sequence = ()
    says: str = "{n} launches match the spec, with no access outside the tensors"
    budget_says: str = None
    traffic_mistakes: Sequence = ()
    traffic_diagnosis: Callable = None
    stray_loads: dict = field(default_factory=dict)
    loads_says: str = None
    uses_dot: bool = False
    tf32: core.Mistake = None
    stride_mistake: core.Mistake = None
    failure_diagnosis: Callable = None
    undefined_other: bool = False
    kind = "kernel"


@dataclass(frozen=True)
class Measured:
    """A part whose technique or result only a measurement of the grader's own shows: ``measure(learner) ->
    message`` raises :class:`attnlab.grading.core.Fail`. ``kind``: "experiment", "peak-memory", "process-group" or
    "function" (a function part that feeds the learner's outputs back in, or says what its results mean);
    ``mistakes``: {the learner's function a list stands for, or "(why no function)": [Mistake]}."""

    kind: str
    measure: Callable
    mistakes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class InTurn:
    """A part that checks several of the learner's functions, one :class:`Function` or :class:`Gradients` table
    each, in turn: it passes when all do. ``says``: the pass message, ``{n}`` the cases of all of them."""

    says: str
    tables: tuple
    kind = "function"


KINDS = ("function", "gradients", "kernel", "experiment", "peak-memory", "process-group")


def mistakes(table):
    """{the learner's function (or a label in parentheses): [Mistake]} that ``table`` names."""
    if isinstance(table, Measured):
        return {k: list(v) for k, v in table.mistakes.items()}
    if isinstance(table, InTurn):
        return {k: v for t in table.tables for k, v in mistakes(t).items()}
    return {table.name: list(table.mistakes)} if table.mistakes else {}


def _cases_passed(table, learner):
    if isinstance(table, Gradients):
        return core.check_with_gradients(learner, table.name, table.reference, table.cases(), table.inputs,
                                         table.output, table.mistakes, rtol=table.rtol, atol=table.atol,
                                         labels=table.labels)
    check = core.check_in_order if table.ordered else core.check_function
    return check(learner, table.name, table.reference, table.cases(), table.mistakes, rtol=table.rtol,
                 atol=table.atol)


def run(table, learner):
    """Run one part's table on ``learner`` (:func:`attnlab.grading.core.learner_of`); returns the pass message,
    raises :class:`attnlab.grading.core.Fail`."""
    if isinstance(table, (Function, Gradients)):
        return table.says.format(n=_cases_passed(table, learner))
    if isinstance(table, InTurn):
        return table.says.format(n=sum(_cases_passed(t, learner) for t in table.tables))
    if isinstance(table, Kernel):
        return _run_kernel(table, learner)
    if isinstance(table, Measured):
        if table.kind not in KINDS:
            raise ValueError(f"table: kind {table.kind!r} is not one of {KINDS}")
        return table.measure(learner)
    raise TypeError(f"table: expected a Function, Gradients, InTurn, Kernel or Measured, got {type(table).__name__}")


def body(table):
    """``table`` as a check body, ``body(learner) -> message``."""
    return lambda learner: run(table, learner)


# ----------------------------------------------------------------------------- kernels

NEVER_WRITTEN = core.Mistake("never-written", "part of the output was never stored: the grid has one program per "
                             "block (axis 0 of the grid walks the first dimension, axis 1 the second); each program "
                             "must store its own whole block, offset by its program id times the block size", None)
STRIDE_IGNORED = core.Mistake("stride-ignored", "the kernel is right when the rows are contiguous and wrong when "
                              "they are not: address row i as ptr + i * stride (the stride argument), not "
                              "i * n_cols", None)


def _as_1d(x):
    import torch

    return x.reshape(-1) if torch.is_tensor(x) and x.dim() == 2 and x.shape[0] == 1 else x


def launch(learner, table, case, traffic=None, loads=None):
    """Launch ``table``'s kernel on one :class:`Launch` and compare its outputs with ``case.want``; a failure on
    padded rows that a contiguous launch passes is named ``table.stride_mistake`` (``stride-ignored``), one that
    TF32's tolerance passes on a GPU ``table.tf32``, then ``table.failure_diagnosis`` has its say. Fills
    ``traffic`` (and ``loads``) as :func:`attnlab.grading.kernel_check.run_guarded` does; returns the outputs."""
    from attnlab.grading.sandbox.agent import device
    from attnlab.grading.sandbox.footprint import undefined_other
    from attnlab.grading.kernel_check import kernel_failure, labelled, run_guarded

    who = undefined_other(learner) if table.undefined_other else learner
    named, named_mistakes = labelled(case.names or [f"argument {i + 1}" for i in range(len(case.inputs))],
                                     case.inputs, table.mistakes)

    def flat(impl):  # a (1, n) result compared as the (n,) output it is
        return None if impl is None else (lambda **kw: _as_1d(impl(**kw)))

    def go(buffers, tr=None, ld=None, uses_dot=table.uses_dot, mistakes=named_mistakes):
        got = run_guarded(who, table.name, case.label, buffers, case.grid, case.args, case.constexprs,
                          list(case.want), loads=ld, traffic=tr)
        for k, w in case.want.items():
            g, ms = got[k], mistakes
            if w.dim() == 2 and w.shape[0] == 1:
                g, w = g.reshape(-1), w.reshape(-1)
                ms = [core.Mistake(m.key, m.message, flat(m.impl)) for m in ms]
            kernel_failure(case.label, table.name, g, w, ms, (), named, uses_dot=uses_dot)
        return got

    def passes(*args, **kwargs):
        try:
            go(*args, **kwargs)
        except core.Fail:
            return False
        return True

    try:
        return go(case.buffers, traffic, loads)
    except (core.NotDone, core.NotAccepted):
        raise
    except core.Fail as exc:
        if "never written" in exc.message:
            exc.mistakes.append(NEVER_WRITTEN)
        padded = any(b.get("pad_rows") or b.get("pad_cols") for b in case.buffers.values())
        if padded and " raised " not in exc.message and passes(
                {k: {kk: vv for kk, vv in b.items() if kk not in ("pad_rows", "pad_cols")}
                 for k, b in case.buffers.items()}, mistakes=()):
            exc.mistakes.insert(0, table.stride_mistake or STRIDE_IGNORED)
        if table.tf32 and device() == "cuda" and " raised " not in exc.message and passes(
                case.buffers, uses_dot=True, mistakes=()):
            exc.mistakes.append(table.tf32)
        if table.failure_diagnosis:
            table.failure_diagnosis(learner, case, exc)
        raise


def _stray_loads(table, case, loads):
    """Fail at the first program that loaded an element of a buffer its ``case.allowed`` leaves out."""
    for k, allowed in case.allowed.items():
        for program, seen in sorted((loads[k] or {}).items()):
            extra = seen & ~allowed(program)
            if extra.any():
                raise core.Fail(f"`{table.name}` on {case.label}: program {program[:len(case.grid)]} loaded "
                                f"{int(extra.sum())} element(s) of `{k}` outside what it may load "
                                f"({table.loads_says})", [table.stray_loads[k]])


def _run_kernel(table, learner):
    from attnlab.grading.kernel_check import check_traffic

    cases = table.launches()
    traced = False
    for case in cases:
        traffic, loads = {}, {k: None for k in case.allowed}
        launch(learner, table, case, traffic, loads if case.allowed else None)
        _stray_loads(table, case, loads)
        if case.budget:
            found = table.traffic_diagnosis(case, traffic) if table.traffic_diagnosis and traffic else []
            traced = check_traffic(table.name, case.label, traffic, case.budget, [*found, *table.traffic_mistakes],
                                   says=table.budget_says)
    message = table.says.format(n=len(cases))
    loaded = any(case.allowed for case in cases)
    if traced:
        message += (f"; each program loads {table.loads_says}" if loaded else "") + "; traffic within budget" + (
            f" ({table.budget_says})" if table.budget_says else "")
    elif any(case.budget for case in cases):
        message += ("; loads and traffic" if loaded else "; traffic") + " not checked: on a GPU there is no trace " \
            "(the tracer watches Triton's interpreter only)"
    return message
