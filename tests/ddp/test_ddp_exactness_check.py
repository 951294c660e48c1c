"""The exactness check on sparse_ddp's ranks (2 gloo processes, float64): what it says on rank 0 matches how far the
training is from one device's with the whole global batch (tests/support/step_forms.py's step code), and it says it
for the scenarios of tests/ddp/test_ddp.py too."""

from __future__ import annotations

import sys

import pytest

from tests.ddp.test_ddp import RTOL, _load, _reference, _run
from tests.support.ddp_helpers import FORM_SCENARIOS, WARMUP_SCENARIO
from tests.support.exact import relative_difference

EQUAL = "exactness check of training step 0 on 2 ranks: equals one device's"
DIFFERS = "exactness check of training step 0 on 2 ranks: differs from one device's"


@pytest.fixture(scope="module")
def ddp_form_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sparse_ddp_forms")
    names = ",".join([*FORM_SCENARIOS, WARMUP_SCENARIO.name])
    _run([[sys.executable, "-m", "tests.support.ddp_script", str(out), names]], timeout=400)
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


def test_a_loss_coupling_the_samples_after_a_warm_up_is_checked_where_it_starts(ddp_form_runs):
    """The term starts at the second step: the check at step 0 said 'equals' and nothing looked again (the ranks then
    trained unlike one device, silently). A step that calls a loss call site no checked step called is checked too."""
    ranks = [_load(ddp_form_runs, WARMUP_SCENARIO.name, r) for r in range(2)]
    said = [m for m in ranks[0]["messages"] if "exactness check" in m]
    assert len(said) == 2 and EQUAL in said[0], said
    assert "exactness check of training step 1 on 2 ranks: differs from one device's" in said[1], said
    assert not [m for m in ranks[1]["messages"] if "exactness check" in m]
