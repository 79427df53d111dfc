"""A forbidden call is read by what the names hold, not by how it is spelled (docs/grading.md): an alias made by
assignment, a parameter's default or the walrus is followed, a name the syntax cannot follow (getattr with a
computed name, vars(), sys.modules, operator's getters, a dunder) is refused outright, and an unused class with a
``softmax`` method no longer turns the ``x.softmax(...)`` rule off. Honest answers keep their points."""

import pytest

from attnlab.grading.shortcuts import uses

PATTERNS = ["torch.softmax", "torch.Tensor.softmax", "torch.nn.functional.softmax"]

FORGED = {
    "assignment": "import torch\n_t = torch\ndef f(x):\n    return _t.softmax(x, -1)\n",
    "a chain of assignments": "import torch\na = torch\nb = a.softmax\ndef f(x):\n    return b(x, -1)\n",
    "a default argument": "import torch\ndef f(x, sm=torch.softmax):\n    return sm(x, -1)\n",
    "a keyword-only default": "import torch.nn.functional as F\ndef f(x, *, sm=F.softmax):\n    return sm(x, -1)\n",
    "the walrus": "import torch\ndef f(x):\n    return (t := torch).softmax(x, -1)\n",
    "sys.modules": "import sys\ndef f(x):\n    return sys.modules['tor' + 'ch'].special.softmax(x, -1)\n",
    "vars": "import torch\ndef f(x):\n    return vars(torch).get('soft' + 'max')(x, -1)\n",
    "globals": "def f(x):\n    return globals()['tor' + 'ch'].softmax(x, -1)\n",
    "operator.attrgetter": "import operator, torch\ndef f(x):\n    return operator.attrgetter('softmax')(torch)(x, -1)\n",
    "operator.methodcaller": "import operator\ndef f(x):\n    return operator.methodcaller('softmax', -1)(x)\n",
    "getattr with a computed name": "import torch\ndef f(x):\n    return getattr(torch, 'soft' + 'max')(x, -1)\n",
    "__dict__": "import torch\ndef f(x):\n    return torch.__dict__['soft' + 'max'](x, -1)\n",
    "an unused class with a softmax method": "class A:\n    def softmax(self):\n        pass\n\n"
                                             "def f(x):\n    return x.softmax(-1)\n",
}

HONEST = {
    "the max subtracted by hand": "import torch\ndef f(x):\n    m = x.amax(-1, keepdim=True)\n    e = torch.exp(x - m)\n"
                                  "    return e / e.sum(-1, keepdim=True)\n",
    "a method of the learner's own class": "class A:\n    def softmax(self, x):\n        e = x.exp()\n"
                                           "        return e / e.sum(-1, keepdim=True)\n\n"
                                           "    def __call__(self, x):\n        return self.softmax(x)\n",
    "getattr with a literal name": "def f(x):\n    return getattr(x, 'shape')[0]\n",
    "an alias of an allowed function": "import torch\nexp = torch.exp\ndef f(x):\n    e = exp(x - x.max())\n"
                                       "    return e / e.sum()\n",
}


@pytest.mark.parametrize("how", sorted(FORGED))
def test_a_forbidden_call_by_another_spelling_is_found(how):
    assert uses([FORGED[how]], PATTERNS), how


@pytest.mark.parametrize("how", sorted(HONEST))
def test_honest_code_is_not_charged(how):
    assert uses([HONEST[how]], PATTERNS) == [], how


_DEAD = {
    "if-false": "def loop_attention(q, k, v):\n    if False:\n        attention_row(q[0], k, v)\n    return q\n",
    "if-not-true": "def loop_attention(q, k, v):\n    if not 1:\n        attention_row(q[0], k, v)\n    return q\n",
    "while-0": "def loop_attention(q, k, v):\n    while 0:\n        attention_row(q[0], k, v)\n    return q\n",
    "after-return": "def loop_attention(q, k, v):\n    return q\n    attention_row(q[0], k, v)\n",
    "false-and": "def loop_attention(q, k, v):\n    _ = False and attention_row(q[0], k, v)\n    return q\n",
    "ifexp": "def loop_attention(q, k, v):\n    f = attention_row if 0 else None\n    return q\n",
    "type-checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    attention_row(1, 2, 3)\n"
                     "def loop_attention(q, k, v):\n    return q\n",
}
_LIVE = {
    "a-loop": "def loop_attention(q, k, v):\n    return torch.stack([attention_row(r, k, v) for r in q])\n",
    "a-branch": "def loop_attention(q, k, v):\n    if q.shape[0] > 0:\n        return attention_row(q[0], k, v)\n"
                "    return q\n",
    "else-of-false": "def loop_attention(q, k, v):\n    if False:\n        pass\n    else:\n        q = attention_row(q, k, v)\n"
                     "    return q\n",
    "true-or-not": "def loop_attention(q, k, v):\n    f = None or attention_row\n    return f(q, k, v)\n",
    # a function whose whole body never runs, in the same cell: the cell must still be read
    "beside-a-dead-body": "def unused(q):\n    if False:\n        attention_row(q)\n\n"
                          "def loop_attention(q, k, v):\n    return attention_row(q, k, v)\n",
}


@pytest.mark.parametrize("name", sorted(_DEAD))
def test_a_required_call_in_code_that_never_runs_is_not_a_call(name):
    from attnlab.grading.shortcuts import missing

    assert missing([_DEAD[name]], {"attention_row": "why"}) == ["attention_row"]


@pytest.mark.parametrize("name", sorted(_LIVE))
def test_a_required_call_that_can_run_counts(name):
    from attnlab.grading.shortcuts import missing

    assert missing([_LIVE[name]], {"attention_row": "why"}) == []
