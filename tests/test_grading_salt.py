"""Every graded part's inputs come from the trusted side's secret salt: graded under two salts, the first inputs a
part sends to the learner's code differ. A part whose cases were all written out (sizes, world sizes, contexts)
showed the grader's inputs in the inline check, and a table of answers scored (ten parts, 17 points)."""

import hashlib
import io

import pytest
import torch

from attnlab.grading.checks import PARTS, run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.parts import MANUAL


class Recording(LocalLearner):
    """A learner that records what each request sends and answers nothing (the check stops there)."""

    def __init__(self):
        super().__init__({}, forbidden=[])
        self.sent = []

    def _record(self, obj):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        self.sent.append(hashlib.sha1(buffer.getvalue()).hexdigest())

    def call(self, name, cases, grad=None, ranks=None):
        if not cases:                       # "is the function there?": yes, go on to the first real request
            return {"results": []}
        self._record(cases)
        return {"missing": True}

    def launch(self, request):
        self._record({k: v for k, v in request.items() if k != "name"})
        return {"missing": True}


@pytest.mark.parametrize("part", [p for p in PARTS if p not in MANUAL])
def test_a_part_s_inputs_depend_on_the_secret_salt(part):
    first, second = Recording(), Recording()
    run_check(part, first, salt=1)
    run_check(part, second, salt=2)
    assert first.sent, f"{part} sent nothing to the learner's code"
    assert first.sent[0] != second.sent[0], f"{part}: the same inputs under two salts"
