"""The step planner: expected tokens per second of step time, from measured cost curves and each
request's decayed acceptance; probes, the draft's catch-up, and the cost curves themselves."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.model.runner import ForwardInput
from engine.outputs import RequestTimes
from engine.sample.sampling_params import SamplingParams
from engine.sequence import ScheduledSeq, Sequence
from engine.spec_decode import step_cost
from engine.spec_decode.acceptance import (
    MAX_PROBE_EVERY,
    PROBE_EVERY,
    AcceptanceEstimate,
    ProposerTrack,
    RequestSpecState,
    reach,
)
from engine.spec_decode.planner import (
    EVIDENCE_MULTIPLE,
    EXPLORE_DRAFTS,
    DraftOption,
    OutputLengths,
    SpecPlanner,
    plan_step,
)
from engine.spec_decode.step_cost import CostCurve, StepCosts, calibration_rows


def tiled(tile: int = 4, per_tile: float = 1.0, max_rows: int = 64) -> CostCurve:
    """A kernel that computes rows in tiles: 1..4 rows cost one tile, 5..8 two, ..."""
    curve = CostCurve()
    for m in range(1, max_rows + 1):
        curve.observe(m, per_tile * -(-m // tile))
    return curve


def costs(draft_per_row: float = 0.0) -> StepCosts:
    c = StepCosts()
    c.target = tiled()
    if draft_per_row:
        for m in range(1, 65):
            c.draft.observe(m, draft_per_row * m)
    return c


def _with_target(curve: CostCurve) -> StepCosts:
    c = StepCosts()
    c.target = curve
    return c


def ngram(index: int, *gains: float) -> DraftOption:
    return DraftOption(index, "ngram", list(gains))


def test_reach_is_the_product_of_the_rates_so_far() -> None:
    assert reach([0.5, 0.5, 1.0]) == pytest.approx([0.5, 0.25, 0.25])


def test_free_drafts_fill_the_tile_of_a_single_request() -> None:
    assert plan_step([ngram(0, 0.9, 0.8, 0.7, 0.6)], 1, 1, costs()) == {0: 3}  # 4 rows, one tile


def test_no_drafts_when_the_batch_fills_the_tile_and_drafts_would_start_another() -> None:
    options = [ngram(i, 0.9, 0.8, 0.7) for i in range(4)]
    assert plan_step(options, 4, 4, costs()) == {}


def test_free_rows_of_a_partly_filled_tile_go_to_the_best_drafts() -> None:
    options = [ngram(0, 0.2), ngram(1, 0.9, 0.8), ngram(2, 0.5), ngram(3, 0.1), ngram(4, 0.3)]
    assert plan_step(options, 5, 5, costs()) == {1: 2, 2: 1}  # rows 6, 7, 8: the three best


def test_a_draft_model_drafts_only_where_its_forwards_pay() -> None:
    paid = DraftOption(0, "draft", [0.9, 0.8, 0.7], draft_rows=2)
    assert plan_step([paid], 1, 1, costs(draft_per_row=0.1)) == {0: 3}
    assert plan_step([paid], 1, 1, costs(draft_per_row=1.0)) == {}  # a draft as dear as the target
    poor = DraftOption(0, "draft", [0.2, 0.04], draft_rows=2)
    assert plan_step([poor], 1, 1, costs(draft_per_row=0.1)) == {}


def test_a_tree_prices_each_later_draft_forward_at_its_width() -> None:
    """A tree of width 4 runs four draft rows a level after the first: where a chain's depth
    pays, the tree stops at its first level."""
    chain = DraftOption(0, "draft", [0.9, 0.8, 0.7], draft_rows=2)
    tree = DraftOption(0, "draft", [0.9, 0.8, 0.7], draft_rows=2, level_rows=4)
    assert plan_step([chain], 1, 1, costs(draft_per_row=0.3)) == {0: 3}
    assert plan_step([tree], 1, 1, costs(draft_per_row=0.3)) == {0: 1}


def test_cheap_matches_are_weighed_without_the_draft_models_forwards() -> None:
    options = [ngram(0, 0.6, 0.4), DraftOption(1, "draft", [0.7], draft_rows=2)]
    assert plan_step(options, 2, 2, costs(draft_per_row=1.0)) == {0: 2}


def test_a_step_with_a_long_prompt_chunk_takes_drafts_almost_for_free() -> None:
    assert plan_step([ngram(0, 0.5, 0.25)], 500, 1, costs()) == {0: 2}


def test_a_step_that_gives_first_tokens_takes_only_drafts_that_fit_its_tiles() -> None:
    options = [ngram(0, 0.9, 0.8, 0.7, 0.6)]
    assert plan_step(options, 3, 1, costs()) == {0: 4}  # 7 rows: worth a second tile
    assert plan_step(options, 3, 1, costs(), max_slowdown=1.05) == {0: 1}  # TTFT first


def test_estimate_follows_recent_behaviour() -> None:
    est = AcceptanceEstimate()
    for _ in range(20):
        est.observe(3, 3)
    assert est.rates(3, base=0.5) == pytest.approx([1.0] * 3, abs=0.3)
    for _ in range(20):
        est.observe(3, 0)
    rates = est.rates(3, base=0.5)
    assert rates[0] < 0.25  # the request's text changed: its own record takes over quickly


def test_unreached_positions_borrow_from_the_one_before() -> None:
    est = AcceptanceEstimate()
    for _ in range(10):
        est.observe(1, 1)
    rates = est.rates(4, base=0.5)
    assert rates[0] > 0.8 and rates[3] > 0.8  # never drafted there, but its neighbour accepts


def test_probes_back_off_while_they_keep_failing() -> None:
    track = ProposerTrack()
    probes = []
    for step in range(300):
        due = track.probe_due
        track.planned(2 if due else 0, probe=due)
        if due:
            probes.append(step)
    assert probes[0] == PROBE_EVERY
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[0] == 2 * PROBE_EVERY + 1 and gaps[-1] == MAX_PROBE_EVERY + 1
    track.planned(3, probe=False)  # its own record pays again: probes start over
    assert track.probe_every == PROBE_EVERY


def test_cost_curve_interpolates_and_extends() -> None:
    curve = CostCurve()
    assert curve.seconds(3) == 3.0 and not curve.known  # unmeasured: every row a full unit
    curve.observe(1, 0.1)
    curve.observe(5, 0.3)
    assert curve.seconds(3) == pytest.approx(0.2)
    assert curve.seconds(10) == pytest.approx(0.6)  # past the last point: proportional
    curve.observe(5, 0.8)
    assert curve.seconds(5) == pytest.approx(0.3 + 0.2 * 0.5)  # a running mean
    curve.observe(2, 0.9)  # a noisy spike: never dearer than a forward of more rows
    assert curve.seconds(2) == pytest.approx(0.4)
    assert calibration_rows(20)[:16] == list(range(1, 17)) and calibration_rows(20)[-1] == 16


def test_real_forwards_move_the_level_so_the_rows_they_skip_do_not_look_free() -> None:
    """Steps of many requests with long contexts cost more than calibration's short ones: they
    scale the whole curve, so the rows next to the one they hit do not start to look free."""
    curve = tiled(max_rows=32)  # 1..4 rows 1 s, 5..8 rows 2 s, ...
    for _ in range(30):
        curve.track(16, 6.0)  # 16 rows calibrated at 4 s run at 6 s
    assert curve.seconds(16) == pytest.approx(6.0, rel=1e-2)
    assert curve.seconds(20) - curve.seconds(16) == pytest.approx(1.5, rel=1e-2)  # one more tile
    assert curve.seconds(4) == pytest.approx(1.5, rel=1e-2)
    curve.track(500, 1000.0)  # a long prompt chunk, beyond the measured rows: another shape
    assert curve.seconds(16) == pytest.approx(6.0, rel=1e-2)
    curve.prompt_rows_from = 24  # from 24 rows on, prompt forwards: measured as they are
    curve.track(28, 100.0)
    assert curve.seconds(28) == pytest.approx(7.0) and curve.seconds(16) == pytest.approx(
        6.0, rel=1e-2
    )


def _drafting_steps(calibrated: Callable[[int], float], real: Callable[[int], float]) -> str:
    """300 steps of 4 requests, one with an n-gram match of 4 drafts, priced by a curve
    calibrated as `calibrated` while forwards really cost `real`: how many drafts each step took."""
    curve = CostCurve()
    for m in range(1, 17):
        curve.observe(m, calibrated(m))
    option = [ngram(0, 0.9, 0.8, 0.7, 0.6)]
    taken = ""
    for _ in range(300):
        drafts = plan_step(option, base_rows=4, base_tokens=4, costs=_with_target(curve)).get(0, 0)
        curve.track(4 + drafts, real(4 + drafts), sets_level=drafts == 0)
        taken += str(drafts)
    return taken


def test_a_row_count_calibrated_too_cheap_is_corrected_by_its_own_forwards() -> None:
    """X8's calibration put 4 and 8 target rows at the same cost on a noisy host, so at 4 requests
    every n-gram draft looked free. The forwards of each wrongly cheap size correct it within a
    few steps; its record then fades, and it is measured again now and then."""
    flat = lambda m: 1.0 if m <= 8 else 2.0  # noqa: E731
    tiles = lambda m: float(-(-m // 4))  # noqa: E731
    taken = _drafting_steps(calibrated=flat, real=tiles)
    assert taken[:10].count("0") >= 4 and set(taken[10:50]) == {"0"}
    assert taken.count("0") >= 290 and set(taken[50:]) != {"0"}
    assert _drafting_steps(calibrated=flat, real=flat) == "4" * 300  # where they are free: kept
    # the level of every plain step doubles: the tiles stay what calibration said
    assert _drafting_steps(calibrated=tiles, real=lambda m: 2 * tiles(m)).count("0") >= 299


def test_calibration_takes_the_median_of_its_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of load during one forward moves that round, not the point."""
    clock = [0.0]
    monkeypatch.setattr(step_cost.time, "perf_counter", lambda: clock[0])

    class Runner:
        block_size, vocab_size, calls = 16, 100, 0
        loaded = type("Loaded", (), {"name": "fake"})
        device = "cpu"

        def forward(self, inputs: list[ForwardInput]) -> None:
            self.calls += 1
            rows = len(inputs[0].token_ids)
            clock[0] += (10.0 if self.calls == 6 else 1.0) * -(-rows // 4)  # one spike

    curve = CostCurve()
    step_cost.calibrate(curve, Runner(), calibration_rows(24), num_blocks=64)  # type: ignore[arg-type]
    assert [curve.points[m] for m in (1, 4, 5, 8, 16, 24)] == [1, 1, 2, 2, 4, 6]


def _planner() -> SpecPlanner:
    planner = SpecPlanner(("ngram", "draft"), costs(draft_per_row=0.1))
    return planner


def test_draft_catches_up_only_where_the_rest_of_the_request_pays_for_it() -> None:
    planner = _planner()
    gains = [0.9, 0.8, 0.7]
    state = RequestSpecState()
    for _ in range(EXPLORE_DRAFTS):
        planner.observe(state, "draft", 3, 3)
    # A step saves (1 - 1.6 / 3.4) of a 1 s step per token; catching up on 300 tokens costs 30 s.
    assert not planner._catch_up_pays(gains, lag=300, remaining=40, batch_rows=1, batch_size=1)
    assert planner._catch_up_pays(gains, lag=300, remaining=100, batch_rows=1, batch_size=1)
    # In a batch of four every request waits for the catch-up, and a drafting step gives this
    # request 2.4 tokens worth a quarter of a step each (0.6 s) for 1.4 s more a step (a second
    # tile and the draft's forwards): no length of request pays for it.
    assert not planner._catch_up_pays(gains, lag=300, remaining=100, batch_rows=4, batch_size=4)
    assert not planner._catch_up_pays(gains, lag=300, remaining=10**6, batch_rows=4, batch_size=4)
    # Two requests, two drafts that fill their tile: 1.7 tokens worth half a step each for 0.3 s
    # of draft forwards; 200 tokens left save 200 / 2.7 * 0.55 = 41 s, more than the 30 s.
    assert planner._catch_up_pays([0.9, 0.8], lag=300, remaining=200, batch_rows=2, batch_size=2)
    assert not planner._catch_up_pays(
        [0.9, 0.8], lag=300, remaining=100, batch_rows=2, batch_size=2
    )
    assert planner._catch_up_pays(gains, lag=2, remaining=4, batch_rows=1, batch_size=1)


def test_remaining_length_follows_finished_answers_and_grows_with_a_long_one() -> None:
    lengths = OutputLengths()
    assert lengths.remaining(produced=20, max_tokens=64) == 44  # nothing finished yet: max_tokens
    for _ in range(10):
        lengths.observe(4)  # short answers (summaries)
    assert lengths.remaining(produced=1, max_tokens=64) == 3
    assert lengths.remaining(produced=20, max_tokens=64) == 20  # outlived them: a long one
    assert lengths.remaining(produced=60, max_tokens=64) == 4  # never past max_tokens
    for _ in range(10):
        lengths.observe(64, capped=True)  # long answers cut at max_tokens
    assert lengths.remaining(produced=20, max_tokens=64) == 44
    for _ in range(10):
        lengths.observe(1, capped=True)  # priming requests (max_tokens = 1) say nothing of length
    assert lengths.remaining(produced=20, max_tokens=64) == 44
    fresh = OutputLengths()
    fresh.observe(1, capped=True)
    assert fresh.typical is None


def test_a_request_is_not_expected_to_outrun_its_own_evidence() -> None:
    """However long the window's answers, a request that has produced n tokens is expected to
    have at most EVIDENCE_MULTIPLE * n left: the window may be another kind of request's."""
    lengths = OutputLengths()
    assert lengths.remaining(produced=1, max_tokens=64) == EVIDENCE_MULTIPLE
    for _ in range(8):
        lengths.observe(64, capped=True)
    assert lengths.remaining(produced=1, max_tokens=64) == EVIDENCE_MULTIPLE
    assert lengths.remaining(produced=0, max_tokens=64) == EVIDENCE_MULTIPLE
    assert lengths.remaining(produced=3, max_tokens=64) == 3 * EVIDENCE_MULTIPLE
    assert lengths.remaining(produced=30, max_tokens=64) == 34


def test_two_short_answers_after_long_ones_stop_the_bet_on_length() -> None:
    """A wrong "long" pays a whole prompt catch-up, a wrong "short" only delays drafting: two
    short answers among the last eight make the typical answer short; seven long ones after them
    are needed to make it long again."""
    lengths = OutputLengths()
    for _ in range(8):
        lengths.observe(64)
    lengths.observe(2)
    assert lengths.remaining(produced=10, max_tokens=64) == 40  # one short answer: still long
    lengths.observe(6)
    assert lengths.remaining(produced=10, max_tokens=64) == 10  # two: short, so no more than seen
    for n in range(7):
        assert lengths.remaining(produced=10, max_tokens=64) == 10, n  # only its own evidence
        lengths.observe(64, capped=True)
    assert lengths.remaining(produced=10, max_tokens=64) == 40


def test_a_short_answer_does_not_pay_for_a_catch_up_on_its_prompt() -> None:
    """The catch-up is priced on the tokens the request is expected to have left: after a run of
    short answers a fresh request with a long prompt keeps to plain steps; once it has produced
    as many tokens as the lag's price needs, it catches up."""
    planner = _planner()
    for _ in range(10):
        planner.lengths.observe(3)
    seq = Sequence(
        request_id="r",
        prompt_token_ids=list(range(300)),
        params=SamplingParams(max_tokens=400, temperature=0.0),
        times=RequestTimes(arrival=0.0),
        detokenizer=None,  # type: ignore[arg-type]
        seed_stream=None,
        num_speculative_tokens=3,
    )
    seq.num_computed_tokens = seq.num_tokens - 1
    item = ScheduledSeq(seq, 1, 3, {"draft": 3})
    assert planner._option(0, item, lambda _: 0, 1, 1, prefilling=False) is None
    seq.token_ids.extend(range(150))
    seq.num_computed_tokens = seq.num_tokens - 1
    option = planner._option(0, item, lambda _: 0, 1, 1, prefilling=False)
    assert option is not None and option.proposer == "draft"


def test_an_ngram_match_is_taken_over_the_draft_only_where_it_gives_more_tokens_a_second() -> None:
    """Tiled target (a 4-row tile per second), draft forwards 0.1 s a row: a weak match loses
    to a sure draft model, a match about as good as the draft wins, being free."""
    planner = _planner()
    weak, sure_draft = [0.5, 0.3], [0.9, 0.8, 0.7]
    # n-gram: (1 + 0.8) tokens / 1 s; draft: (1 + 2.4) / (1 s + 0.2 + 2 x 0.1) = 2.4 tokens/s
    assert not planner._ngram_pays_more(weak, sure_draft, base_rows=1, batch_size=1)
    assert planner._ngram_pays_more([0.9, 0.8], sure_draft, base_rows=1, batch_size=1)


def test_planner_keeps_separate_records_per_proposer() -> None:
    planner = _planner()
    state = RequestSpecState()
    for _ in range(15):
        planner.observe(state, "ngram", 3, 3)
        planner.observe(state, "draft", 3, 0)
    assert state.track("ngram").acceptance.rates(1, 0.5)[0] > 0.8
    assert state.track("draft").acceptance.rates(1, 0.5)[0] < 0.2


def test_a_few_early_failures_do_not_talk_everyone_out_of_drafting() -> None:
    planner = _planner()
    planner.observe(RequestSpecState(), "ngram", 2, 0)
    gains, probe = planner._gains(RequestSpecState(), "ngram", 3)
    assert not probe and plan_step([DraftOption(0, "ngram", gains)], 1, 1, planner.costs) == {0: 3}


def test_pooled_rate_starts_from_the_prior() -> None:
    est = AcceptanceEstimate()
    assert 0.5 < est.pooled_rate() < 0.7


def test_step_overheads_are_measured_and_priced() -> None:
    c = costs(draft_per_row=0.1)
    for _ in range(50):  # 0.1 s of each draft forward is sampling, 0.05 s of the step is neither
        c.observe_step(seconds=1.45, target_seconds=1.0, draft_seconds=[0.1, 0.1], propose=0.4)
    assert c.draft_overhead == pytest.approx(0.1, rel=1e-3)
    assert c.overhead == pytest.approx(0.05, rel=1e-3)
    paid = DraftOption(0, "draft", [0.9, 0.8, 0.7], draft_rows=2)
    assert plan_step([paid], 1, 1, c) == {0: 3}
    c.draft_overhead = 1.0  # drafting's own bookkeeping as dear as a step: no longer pays
    assert plan_step([paid], 1, 1, c) == {}
