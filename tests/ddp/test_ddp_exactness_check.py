"""The exactness check on sparse_ddp's ranks (2 gloo processes, float64): what it says on rank 0 matches how far the
training is from one device's with the whole global batch (tests/support/step_forms.py's step code), and it says it
for the scenarios of tests/ddp/test_ddp.py too."""

from __future__ import annotations

import sys

import pytest

from tests.ddp.test_ddp import RTOL, _load, _reference, _run
from tests.support.ddp_helpers import FORM_SCENARIOS
from tests.support.exact import relative_difference

EQUAL = "exactness check of training step 0 on 2 ranks: equals one device's"
DIFFERS = "exactness check of training step 0 on 2 ranks: differs from one device's"


@pytest.fixture(scope="module")
def ddp_form_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sparse_ddp_forms")
    _run([[sys.executable, "-m", "tests.support.ddp_script", str(out), ",".join(FORM_SCENARIOS)]], timeout=400)
    return out


@pytest.mark.parametrize("name", list(FORM_SCENARIOS))
def test_the_check_on_ranks_says_a_difference_exactly_when_training_differs(ddp_form_runs, name):
    ranks = [_load(ddp_form_runs, name, r) for r in range(2)]
    ref = _reference(name)
    worst = max(
        relative_difference(v, ref["state"][k]) for k, v in ranks[0]["state"].items() if v.is_floating_point()
    )
    said = [m for m in ranks[0]["messages"] if "exactness check" in m]
    assert len(said) == 1, ranks[0]["messages"]
    if worst <= RTOL:
        assert EQUAL in said[0], (name, worst, said)
    else:
        assert DIFFERS in said[0] and "Fixes:" in said[0], (name, worst, said)
    assert not [m for m in ranks[1]["messages"] if "exactness check" in m]  # rank 0 says it
