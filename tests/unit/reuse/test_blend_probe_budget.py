"""blend's probe within a scratch budget (``--pcr-blend-probe-mb``): a selection whose
estimated scratch exceeds it is refused before anything runs (the request is recomputed by
the caller), one within it runs as before; the estimate grows with the tokens and the
prefix and counts one bounded block of attention scores."""

from __future__ import annotations

import pytest
import torch

from pcr_sglang.reuse import blend_select
from pcr_sglang.reuse.blend_select import BlendProbe, ProbeBudgetError
from tests.unit.reuse.test_doc_reuse_setup import CANDIDATES, PROBE_ARGS, _stand_in_model


def test_the_estimate_grows_with_the_work_and_bounds_the_score_block():
    model, pools = _stand_in_model(5)
    probe = BlendProbe(model, pools)
    small = probe.scratch_estimate(6, 5)
    assert probe.scratch_estimate(600, 5) > small and probe.scratch_estimate(6, 5000) > small
    assert probe.scratch_estimate(6, 5, question=3) > small
    huge = probe.scratch_estimate(100_000, 100_000)
    assert huge < (100_000 + 200_000) * 10_000 + blend_select.SCORE_ELEMENTS * 9  # scores: one block at most


def test_a_selection_over_the_budget_is_refused_before_it_runs(monkeypatch):
    model, pools = _stand_in_model(5)
    need = BlendProbe(model, pools).scratch_estimate(6, 5)
    tight = BlendProbe(model, pools, scratch_bytes=need - 1)
    ran = []
    monkeypatch.setattr(tight, "layer1", lambda *a: ran.append(1))
    with pytest.raises(ProbeBudgetError, match="--pcr-blend-probe-mb"):
        tight.select(*PROBE_ARGS, CANDIDATES, 2, torch.zeros(5, dtype=torch.bool), "deviation")
    assert ran == []
    roomy = BlendProbe(model, pools, scratch_bytes=need)
    selection = roomy.select(*PROBE_ARGS, CANDIDATES, 2, torch.zeros(5, dtype=torch.bool), "deviation")
    assert selection.chosen.numel() == 2
