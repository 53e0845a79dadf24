"""The admission verdict (core/admission.py): a pure function of the request's phase and facts."""

from __future__ import annotations

import pytest

from pcr_sglang.core.admission import AdmissionPhase, Decision, Verdict, after_reads, at_gate, read_or_recompute

P = AdmissionPhase


def _never() -> bool:
    raise AssertionError("asked although the verdict does not depend on it")


@pytest.mark.parametrize("phase", list(P))
def test_without_the_ssd_tier_every_request_goes_and_keeps_its_phase(phase):
    assert at_gate(phase, tier_on=False, still_reading=_never) == Decision(Verdict.ADMIT, phase)


@pytest.mark.parametrize("phase", [P.NEW, P.PROBING, P.PROBED])
def test_a_request_never_held_is_considered(phase):
    assert at_gate(phase, tier_on=True, still_reading=_never) == Decision(Verdict.CONSIDER, phase)


def test_a_held_request_waits_while_its_reads_are_in_flight_and_goes_once_they_land():
    assert at_gate(P.HOLDING, tier_on=True, still_reading=lambda: True) == Decision(Verdict.HOLD, P.HOLDING)
    assert at_gate(P.HOLDING, tier_on=True, still_reading=lambda: False) == Decision(Verdict.ADMIT, P.WAITED)


def test_an_expired_wait_admits_without_asking_about_reads_and_a_request_is_never_held_twice():
    assert at_gate(P.EXPIRED, tier_on=True, still_reading=_never) == Decision(Verdict.ADMIT, P.WAITED)
    assert at_gate(P.WAITED, tier_on=True, still_reading=_never) == Decision(Verdict.ADMIT, P.WAITED)


def test_only_holding_and_expired_count_as_held():
    assert {p for p in P if p.held} == {P.HOLDING, P.EXPIRED}


def test_the_cost_model_is_asked_only_when_there_is_something_to_read():
    assert read_or_recompute(ssd_chunks=0, io_healthy=True, choose_load=_never) is Verdict.ADMIT
    assert read_or_recompute(ssd_chunks=3, io_healthy=False, choose_load=_never) is Verdict.ADMIT
    assert read_or_recompute(ssd_chunks=3, io_healthy=True, choose_load=lambda: True) is Verdict.READ
    assert read_or_recompute(ssd_chunks=3, io_healthy=True, choose_load=lambda: False) is Verdict.RECOMPUTE


def test_reads_in_flight_hold_a_request_once_and_none_ordered_admit_it_unchanged():
    assert after_reads(P.PROBED, reading=True) == Decision(Verdict.HOLD, P.HOLDING)
    assert after_reads(P.NEW, reading=False) == Decision(Verdict.ADMIT, P.NEW)
