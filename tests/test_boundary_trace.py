"""scripts/boundary_trace.py: the minimum traffic it holds each event to, and a run on a small model."""

import pytest

from co2_hf import CO2Config
from co2_hf.core.schedule import Event, Plan
from scripts import boundary_trace

pytestmark = [pytest.mark.research, pytest.mark.timeout(60)]


def test_the_minimum_words_per_element_follow_docs_algorithm():
    streaming = CO2Config(co2_local_steps=12)  # lookahead, no clip: B reads x a o m, writes d x o
    plan = Plan.resolve(streaming)
    assert boundary_trace.minimum_words(plan, streaming, Event.BOUNDARY, applies=False) == 7
    # the apply: R D, m; W m, a; R a; the shift R x, W x; R o, W o
    assert boundary_trace.minimum_words(plan, streaming, Event.APPLY_IN_ROUND, applies=True) == 9
    paper = CO2Config(co2_fragments=1, co2_start_rule="anchor", co2_gap_penalty=1.0, co2_clip_threshold=1.0)
    # R x, a; W d, x; then R D, m, W m, one more R D (mean |D|), R m', W m' (clip), W a
    assert boundary_trace.minimum_words(Plan.resolve(paper), paper, Event.BOUNDARY, applies=True) == 11


def test_a_traced_round_has_no_host_read_and_no_less_traffic_than_the_minimum(capsys):
    rows = boundary_trace.main(["--settings", "streaming", "paper", "--width", "64", "--depth", "2"])
    assert {r["setting"] for r in rows} == {"streaming", "paper"}
    assert len([r for r in rows if r["setting"] == "streaming"]) == 12  # every step of the round ran events
    assert all(r["host_reads"] == 0 and r["words_per_element"] >= r["minimum_words"] > 0 for r in rows)
    assert "# paper: a round: " in capsys.readouterr().out
