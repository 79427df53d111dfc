"""The machinery every check shares: finding the learner's function, calling it, comparing with the spec and naming the
likely mistake.

A check runs the learner's function and the spec on the same randomized inputs (several shapes and seeds, then edge
cases). When they disagree it runs each known *mistake* (a deliberately wrong version of the spec, e.g. the softmax
over the wrong axis) on the failing input; a mistake whose output equals the learner's is the diagnosis. Inputs are
cloned for every call, so a function that writes into its arguments cannot change what the spec sees.
"""

import math
import numbers
import re
from dataclasses import dataclass, field

import torch

from attnlab.grading.sandbox.agent import backward
from attnlab.grading.feedback import case_line, first_mismatch, parameter_names, wrap


@dataclass
class Mistake:
    """A known wrong version of a spec: ``impl`` takes the spec's arguments."""

    key: str
    message: str
    impl: object


@dataclass
class CheckResult:
    """What a check found. ``passed`` is all-or-nothing; ``diagnosis`` lists mistake keys."""

    part: str
    passed: bool
    message: str
    diagnosis: list = field(default_factory=list)

    def __bool__(self):
        return self.passed

    def report(self):
        mark = "PASS" if self.passed else "FAIL"
        return wrap(f"[{mark}] {self.part}: {self.message}")


class Fail(Exception):
    """Raised inside a check to stop at the first failure, with diagnosis keys and their messages."""

    def __init__(self, message, mistakes=()):
        super().__init__(message)
        self.message = message
        self.mistakes = list(mistakes)


class NotDone(Fail):
    """The learner has not written this part yet."""


class Raised(Fail):
    """The learner's code raised: the error (in plain words where it is a common one) is the diagnosis."""


class NotAccepted(Fail):
    """The answer is not the kind the part asks for (a shortcut, an object that is not a kernel)."""


class LocalLearner:
    """The learner's functions in a namespace of this process (the inline ``check()``).

    ``attnlab grade`` uses :class:`attnlab.grading.sandbox.runner.RemoteLearner` instead, with the same two methods,
    whose calls run in a fresh sandboxed process (docs/grading.md). Both answer in the agent's format
    (:func:`attnlab.grading.sandbox.agent.handle`). ``forbidden``: the patterns the inline check reads the learner's
    code for (:func:`attnlab.grading.shortcuts.in_namespace`; None: the part's own, and what it must read; [] none).
    """

    def __init__(self, ns, forbidden=None):
        self.ns = ns
        self.forbidden = forbidden

    def call(self, name, cases, grad=None, ranks=None, tap=None):
        from attnlab.grading.sandbox import agent

        return agent.handle({"op": "call", "name": name, "cases": cases, "ranks": ranks,
                             **({"grad": grad} if grad else {}), **({"tap": tap} if tap else {})}, self.ns)

    def launch(self, request):
        from attnlab.grading.sandbox import agent

        return agent.handle({**request, "op": "launch", "verify": True}, self.ns)


def learner_of(ns):
    """A learner (LocalLearner for a plain namespace dict)."""
    return ns if hasattr(ns, "call") and hasattr(ns, "launch") else LocalLearner(ns)


SHORTCUT = Mistake("shortcut", "this part asks you to write the computation yourself: a library function that "
                   "already does it (or the grader's own reference) scores no points", None)


def present(reply, name):
    """Raise NotDone/Fail when the agent's reply says ``name`` is missing or not callable."""
    if "agent_error" in reply:
        raise Fail(f"the grader could not call `{name}`: {reply['agent_error']}")
    if reply.get("missing"):
        raise NotDone(f"`{name}` is not defined: run the cell where you define it")
    if "not_callable" in reply:
        raise Fail(f"`{name}` should be a function, got {reply['not_callable']}")


def value_of(outcome, name, label):
    """The learner's result from one outcome, or NotDone/Fail naming the input."""
    if "refused" in outcome:
        raise NotAccepted(outcome["refused"])
    if outcome.get("not_implemented"):
        raise NotDone(f"`{name}` is not implemented yet: replace `raise NotImplementedError()` with your code")
    if "raised" in outcome:
        from attnlab.grading.feedback import plain_mistake

        text, key, sentence = plain_mistake(outcome["raised"])
        raise Raised(f"`{name}` raised {text} (input: {label})", [Mistake(key, sentence, None)] if key else [])
    return outcome["ok"]


def clone(x):
    if torch.is_tensor(x):
        return x.clone()
    if isinstance(x, tuple):
        return tuple(clone(v) for v in x)
    if isinstance(x, list):
        return [clone(v) for v in x]
    if isinstance(x, dict):
        return {k: clone(v) for k, v in x.items()}
    return x


def mismatch(got, want, rtol=1e-4, atol=1e-5, equal_nan=False):
    """None when ``got`` matches ``want``; otherwise a short reason. Tensors are compared by
    ``torch.testing.assert_close`` (in float64 unless one side is bool or complex), whose reason it gives (shape,
    dtype, how many entries differ, the greatest differences), with the first mismatch in the output's own
    shape, expected and got, added."""
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"expected a tuple of {len(want)} values, got {_kind(got)}"
        for i, (g, w) in enumerate(zip(got, want)):
            why = mismatch(g, w, rtol, atol, equal_nan)
            if why:
                return f"output {i + 1} of {len(want)}: {why}"
        return None
    if torch.is_tensor(want):
        if isinstance(got, (tuple, list)) and want.dim() == 1 and len(got) == want.numel():
            try:  # [a, b] for a tensor [a, b] is fine
                got = torch.tensor([float(g) for g in got], dtype=want.dtype)
            except (TypeError, ValueError):
                pass
        if not torch.is_tensor(got):
            return f"expected a tensor, got {_kind(got)}"
        strict = want.dtype == torch.bool or got.dtype == torch.bool or got.is_complex()  # else any real dtype
        try:
            torch.testing.assert_close(got if strict else got.detach().double(), want if strict else
                                       want.detach().double(), rtol=rtol, atol=atol, equal_nan=equal_nan,
                                       check_dtype=strict, check_device=False)
        except AssertionError as exc:
            return _in_words(str(exc), got, want, rtol, atol)
        return None
    if isinstance(want, bool):
        is_bool = isinstance(got, bool) or type(got).__name__ in ("bool_", "bool") or (
            torch.is_tensor(got) and got.numel() == 1 and got.dtype == torch.bool)
        if not is_bool or bool(got) != want:
            return f"returned {got!r}, expected {want!r}"
        return None
    if isinstance(want, numbers.Real):
        if torch.is_tensor(got) and got.numel() == 1:
            got = got.item()
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            return f"expected a number, got {_kind(got)}"
        if not math.isclose(float(got), float(want), rel_tol=1e-9, abs_tol=1e-12):
            return f"returned {got:.6g}, expected {want:.6g}"
        return None
    raise TypeError(f"spec returned an unsupported type {type(want).__name__}")


def _in_words(text, got, want, rtol, atol):
    """assert_close's reason on one line, in the learner's words, then where the output first differs."""
    head, *lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:  # shape or dtype: one sentence, actual != expected
        return f"{head[0].lower()}{head[1:].rstrip('.')} (yours != the spec's)"
    if want.dtype == torch.bool:  # differences of booleans say nothing the count does not
        lines = [line for line in lines if not line.startswith("Greatest")]
    lines = [re.sub(r"\d+\.\d{5,}(e[-+]?\d+)?", lambda m: f"{float(m.group()):.4g}",
                    re.sub(r"^Mismatched elements: (.*?) \((.*)\)$", r"\1 entries differ (\2)", line)).rstrip(".")
             for line in lines]
    found = first_mismatch(got, want, rtol, atol) if want.dim() else None  # a scalar's are in assert_close's text
    if found is not None:
        lines.append(f"first mismatch at index {found[0]}: expected {found[1]}, got {found[2]}")
    return "values differ from the spec: " + "; ".join(line[0].lower() + line[1:] for line in lines)


def _kind(x):
    if hasattr(x, "type_name"):  # frames.Unsupported: a value the process could not send
        return x.type_name
    if torch.is_tensor(x):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} values"
    return type(x).__name__


def diagnose(got, mistakes, args, kwargs, rtol=1e-4, atol=1e-5):
    """The mistakes whose output on this input equals the learner's."""
    found = []
    for m in mistakes:
        try:
            with torch.no_grad():
                out = m.impl(*clone(args), **clone(kwargs))
        except Exception:
            continue
        try:
            if mismatch(got, out, rtol, atol, equal_nan=True) is None:
                found.append(m)
        except TypeError:
            continue
    return found


_SALT = [0]  # set by run_check for the grader (a secret), 0 for the inline check


def gen(seed):
    """A torch Generator for the case ``seed``, shifted by the grader's secret salt."""
    return torch.Generator().manual_seed((seed + _SALT[0] * 7919) % (2**63))


def salted_ints(seed, *ranges):
    """One int per inclusive ``(low, high)`` range, drawn from :func:`gen` ``(seed)``: sizes a notebook cannot know
    before it is graded (the grader's salt is secret; the inline check's is 0). A part whose cases are all written
    out could be answered by a table of them."""
    g = gen(seed)
    return tuple(int(torch.randint(low, high + 1, (1,), generator=g)) for low, high in ranges)


def randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def table(seed0, rows, build):
    """A case table: ``build(generator, *row)`` for each row, row i's inputs drawn from :func:`gen` ``(seed0 + i)``."""
    return [build(gen(seed0 + i), *row) for i, row in enumerate(rows)]


def mistakes(make, rows):
    """Known mistakes from a table: ``Mistake(key, message, make(**change))`` for each row (key, message, change)."""
    return [Mistake(key, message, make(**change)) for key, message, change in rows]


def each_result(learner, name, cases, copy=False, tap=None, grad=None):
    """``(*case, the learner's value)`` for each case [(label, args, kwargs, ...)], all sent in one request (copies
    of the inputs with ``copy``; ``tap``: see :func:`attnlab.grading.sandbox.agent._tapped`; ``grad``: see
    :func:`check_with_gradients`); raises NotDone/Fail as :func:`present` and :func:`value_of` do."""
    learner = learner_of(learner)
    reply = learner.call(name, [[clone(x) if copy else x for x in case[1:]] for case in cases],
                         **({"tap": tap} if tap else {}), **({"grad": grad} if grad else {}))
    present(reply, name)
    results = reply.get("results", [])
    for i, case in enumerate(cases):
        if i >= len(results):
            raise Fail(f"`{name}`: the grader got no result for {case[0]}")
        yield (*case, value_of(results[i], name, case[0]))


def check_function(learner, name, spec, cases, mistakes=(), rtol=1e-4, atol=1e-5):
    """Run the learner's ``name`` against ``spec`` on ``cases`` [(label, args, kwargs)].

    ``learner``: a LocalLearner, the grader's RemoteLearner, or a namespace dict. All cases go
    in one request; the spec and the mistakes run here. Raises Fail at the first disagreement,
    naming the matching mistakes. Returns the number of cases passed.
    """
    for label, args, kwargs, got in each_result(learner, name, cases, copy=True):
        with torch.no_grad():
            want = spec(*clone(args), **clone(kwargs))
        why = mismatch(got, want, rtol, atol)
        if why:
            found = diagnose(got, mistakes, args, kwargs, rtol, atol)
            raise Fail("\n    ".join([f"`{name}` on {label}: {why}",
                                      case_line(label, args, kwargs, spec)]), found)
    return len(cases)


def check_in_order(ns, name, spec, cases, mistakes, **tolerance):
    """``check_function``, with a sharper diagnosis: the cases run in order, so a known mistake that would already
    have failed a case before the one that failed (which the learner's code passed) is not the learner's."""
    try:
        return check_function(ns, name, spec, cases, mistakes, **tolerance)
    except Fail as exc:
        failed = next((i for i, (label, _, _) in enumerate(cases) if exc.message.startswith(f"`{name}` on {label}:")),
                      None)
        if failed:
            exc.mistakes = [m for m in exc.mistakes if m.impl is None or all(
                _agrees_with_spec(m.impl, spec, args, kwargs, tolerance) for _, args, kwargs in cases[:failed])]
        raise


def _agrees_with_spec(impl, spec, args, kwargs, tolerance):
    try:
        return mismatch(impl(*clone(args), **clone(kwargs)), spec(*clone(args), **clone(kwargs)), **tolerance) is None
    except Exception:
        return False


def check_with_gradients(learner, name, spec, cases, inputs, output=None, mistakes=(), rtol=1e-4, atol=1e-5,
                         labels=None):
    """Like :func:`check_function`, and also backpropagate: the learner's ``name`` is called (in its
    kernel) with the arguments at positions ``inputs`` requiring grad, and ``grad_output`` is
    backpropagated from its output (``output``: an index into a returned tuple, or None).

    cases: [(label, args, kwargs, grad_output)]; ``spec(*args, **kwargs)`` returns the expected
    output and ``spec_grads`` is computed here by autograd through the spec. labels: names of the
    gradients in messages (default dArg0...). Returns the number of cases passed.
    """
    params = parameter_names(spec)
    names = labels or [f"the gradient of `{params[i]}`" if i < len(params) else f"the gradient of argument {i + 1}"
                       for i in inputs]
    grad = {"inputs": list(inputs), "output": output}
    for label, args, kwargs, grad_output, got in each_result(learner, name, cases, copy=True, grad=grad):
        if not isinstance(got, dict) or "out" not in got:
            raise Fail(f"`{name}` on {label}: the grader could not read the result")
        want_out, want_grads = backward(spec, clone(args), clone(kwargs), inputs, output, grad_output)
        why = mismatch(got["out"], want_out, rtol, atol)
        if why:
            raise Fail("\n    ".join([f"`{name}` on {label} (forward): {why}",
                                      case_line(label, args, kwargs, spec)]),
                       diagnose(got["out"], mistakes, args, kwargs, rtol, atol))
        grads = got.get("grads")
        if not isinstance(grads, (list, tuple)) or len(grads) != len(inputs):
            raise Fail(f"`{name}` on {label}: expected one gradient per input ("
                       f"{', '.join(n.split()[-1] for n in names)}), the grader got "
                       f"{len(grads) if isinstance(grads, (list, tuple)) else 'none'}")
        for k, (gname, g, want) in enumerate(zip(names, grads, want_grads)):
            if g is None:
                raise Fail(f"`{name}` on {label}: {gname} is None: the backward returned no gradient for it")
            why = mismatch(g, want, rtol, atol)
            if why:
                raise Fail("\n    ".join([f"`{name}` on {label}: {gname}: {why}",
                                          case_line(label, args, kwargs, spec)]),
                           _diagnose_gradient(g, k, mistakes, args, kwargs, inputs, output, grad_output, rtol, atol))
    return len(cases)


def _diagnose_gradient(got, k, mistakes, args, kwargs, inputs, output, grad_output, rtol, atol):
    """The mistakes (differentiable wrong versions of the spec) whose gradient of the ``k``-th input equals ``got``."""
    found = []
    for m in mistakes:
        if m.impl is None:
            continue
        try:
            want = backward(m.impl, clone(args), clone(kwargs), inputs, output, grad_output)[1][k]
            if want is not None and mismatch(got, want, rtol, atol, equal_nan=True) is None:
                found.append(m)
        except Exception:
            continue
    return found


class _Counted:
    """A learner that counts the calls and launches a check made: a part passes only when it ran the learner's code."""

    def __init__(self, learner):
        self.learner, self.calls = learner, 0

    def call(self, *args, **kwargs):
        self.calls += 1
        return self.learner.call(*args, **kwargs)

    def launch(self, *args, **kwargs):
        self.calls += 1
        return self.learner.launch(*args, **kwargs)


def run_part(part_id, body, learner):
    """Run a check body (``body(learner) -> message``) and package the outcome.

    A body that returns without having called or launched the learner's code at all (a part that cannot
    be checked on this device says why and returns) is not a pass: the part scores 0 with that reason."""
    counted = _Counted(learner_of(learner))
    try:
        message = body(counted)
        if not counted.calls:
            return CheckResult(part_id, False, f"not checked here, so no points: {message}")
        return CheckResult(part_id, True, message)
    except Fail as exc:
        lines = [exc.message]
        unique = {}
        for m in exc.mistakes:
            unique.setdefault(m.key, m)
        exc.mistakes = list(unique.values())
        for m in exc.mistakes:
            lines.append(f"likely mistake ({m.key}): {m.message}")
        if exc.mistakes == [] and not isinstance(exc, (NotDone, NotAccepted, Raised)):
            lines.append("no common mistake matches this output; compare your code with the spec line by line")
        return CheckResult(part_id, False, "\n    ".join(lines), [m.key for m in exc.mistakes])
