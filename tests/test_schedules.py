"""The lookahead schedules on their own: what the cost model chooses from given costs and acceptance."""

from __future__ import annotations

from types import SimpleNamespace

from edge_sd.costs import CostModel
from edge_sd.sampling import SamplingConfig
from edge_sd.schedules import (
    CARRY,
    PROBE_EVERY,
    PROBE_EVERY_GENERATIONS,
    PROBE_EVERY_HOPELESS,
    Acceptance,
    CostSchedule,
    HeuristicSchedule,
    Round,
)

K = 6
TARGET = {s: 0.030 + 0.002 * (s - 1) for s in range(1, K + 2)}  # 30 ms, +2 ms per extra position


def schedule(draft_s: float, algos=("slem", "tli"), greedy: bool = False, catch_up: float = 0.0) -> CostSchedule:
    # one drafter state serves every proposer
    state = SimpleNamespace(behind=0, lagging=False)
    proposers = {a: SimpleNamespace(name=a, drafter=state) for a in algos}
    return CostSchedule(proposers, K, CostModel(TARGET, {a: draft_s for a in algos}, catch_up), greedy)


def run(sched: CostSchedule, accept: dict[str, float], rounds: int = 200, later: float | None = None) -> dict:
    """Feed the schedule rounds whose candidates are accepted with these per-algorithm rates (and,
    when `later` is given, every candidate after the first at that rate, whatever the algorithm)."""
    import random

    rng = random.Random(0)
    for _ in range(rounds):
        plan = sched.plan(K)
        if plan.proposer is None:
            sched.observe(plan, Round(0, 0, TARGET[1]))
            continue
        a = 0
        while a < plan.m and rng.random() < (accept[plan.proposer.name] if a == 0 or later is None else later):
            a += 1
        sched.observe(plan, Round(plan.m, a, TARGET[plan.m + 1], plan.m * sched.costs.draft(plan.proposer.name)))
    return sched.rounds


def test_expected_tokens() -> None:
    acc = Acceptance()
    for _ in range(50):
        acc.update(2, 2)  # always both accepted
    a = acc.rate(0)
    assert 0.95 < a < 1.0 and abs(acc.expected_tokens(2) - (1 + a + a * acc.rate(1))) < 1e-12
    assert Acceptance().expected_tokens(3) == 1 + 0.5 + 0.25 + 0.125  # the prior


def test_expensive_drafts_fall_back_to_plain_steps_with_probes() -> None:
    """A drafter costing 0.7 target steps does not pay at 40% acceptance: plain steps, but a short
    probe every few (a draft accepted in full would pay: acceptance decides)."""
    rounds = run(schedule(0.020), {"slem": 0.4, "tli": 0.4})
    drafted = sum(v for key, v in rounds.items() if key != "plain")
    assert rounds["plain"] > 150 and 200 // (PROBE_EVERY + 1) - 2 <= drafted <= 200 // PROBE_EVERY + 2
    assert all(key.endswith(":1") for key in rounds if key != "plain")  # probes draft one token


def test_a_drafter_that_cannot_pay_is_seldom_probed() -> None:
    """A drafter costing 1.5 target steps would not pay even if every draft were accepted: probes
    only every PROBE_EVERY_HOPELESS plain steps (they could refresh the costs, not change the verdict)."""
    rounds = run(schedule(0.045), {"slem": 0.6, "tli": 0.6}, rounds=300)
    drafted = sum(v for key, v in rounds.items() if key != "plain")
    assert 0 < drafted <= 300 // PROBE_EVERY_HOPELESS + 1 and rounds["plain"] >= 295


def test_cheap_accurate_drafts_go_long_with_the_better_algorithm() -> None:
    """A drafter at a tenth of a target step with 90% acceptance: long drafts, from the algorithm
    that is accepted more."""
    sched = schedule(0.003)
    rounds = run(sched, {"slem": 0.9, "tli": 0.5})
    slem = sum(v for key, v in rounds.items() if key.startswith("slem"))
    assert slem > 150 and rounds.get(f"slem:{K}", 0) > 100 and rounds.get("plain", 0) == 0
    assert sched.acceptance["slem"].rate(0) > 0.8 > 0.6 > sched.acceptance["tli"].rate(0)


def test_an_algorithm_unlucky_at_first_is_tried_again() -> None:
    """The better algorithm's two first drafts rejected outright, the other's accepted: optimism
    about an algorithm seldom tried brings the first back, and it ends up drafting most rounds."""
    from edge_sd.schedules import Plan

    sched = schedule(0.003)
    for algo, accepted in (("slem", 0), ("tli", 3)) * 2:
        sched.observe(Plan(sched.proposers[algo], 3), Round(3, accepted, TARGET[4], 3 * 0.003))
    rounds = run(sched, {"slem": 0.9, "tli": 0.6}, rounds=300)
    slem = sum(v for key, v in rounds.items() if key.startswith("slem"))
    assert slem > 200 and sched.acceptance["slem"].rate(0) > 0.8


def test_optimism_about_depth_finds_that_long_drafts_pay() -> None:
    """Greedy drafts agree in runs: half the first candidates are accepted, but 95% of the ones after
    an accepted one. Judged on the first position alone, a second candidate never looks worth its
    cost and the schedule drafts one token for ever; optimism about depths seldom verified tries
    them, sees the runs, and drafts long."""
    short = run(schedule(0.006), {"slem": 0.5, "tli": 0.5}, later=0.95)
    assert sum(v for key, v in short.items() if key.endswith(":1")) > 140
    long = run(schedule(0.006, greedy=True), {"slem": 0.5, "tli": 0.5}, later=0.95)
    assert sum(v for key, v in long.items() if key != "plain" and int(key.split(":")[1]) >= 4) > 150


def test_a_new_text_is_judged_on_its_own_rounds() -> None:
    """After a text where drafts were seldom accepted (plain steps with probes), a new generation
    keeps what that taught as a prior worth CARRY rounds: when the new text is predictable, the first
    probe's success is enough to draft long, where full counts kept it plain twice as long."""
    plain_steps = {}
    for carry in (CARRY, float("inf")):
        sched = schedule(0.006, greedy=True)
        sched.carry = carry
        run(sched, {"slem": 0.05, "tli": 0.05}, rounds=300)
        sched.rebind(sched.proposers)
        rounds = run(sched, {"slem": 0.9, "tli": 0.9}, rounds=30)
        plain_steps[carry] = rounds.get("plain", 0)
        if carry == CARRY:
            assert sum(v for key, v in rounds.items() if key.endswith(f":{K}")) >= 15
    assert plain_steps[CARRY] <= PROBE_EVERY < plain_steps[float("inf")]


def test_disco_on_the_cost_model_stops_drafts_that_may_run_to_the_longest() -> None:
    """Under auto with DISCO, the cost model decides whether a round drafts (and with what), DISCO's
    threshold when the draft stops: a draft that pays may run to K (or the budget), a probe stays one
    token, and a round where drafting does not pay stays a plain step."""
    import numpy as np

    from edge_sd.schedules import DiscoSchedule

    sched = schedule(0.006)
    run(sched, {"slem": 0.8, "tli": 0.5})
    plan = sched.plan(K)
    assert plan.proposer is not None and plan.m >= 1
    assert sched.plan(K, open_ended=True).m == K and sched.plan(3, open_ended=True).m == 3
    dear = schedule(0.020)
    run(dear, {"slem": 0.4, "tli": 0.4})
    assert {dear.plan(K, open_ended=True).m for _ in range(2 * PROBE_EVERY)} == {0, 1}

    model = SimpleNamespace(threshold=0.5, prob=lambda f: float(f[0]))  # the drafter's top probability
    disco = DiscoSchedule(sched, model, {id(p): a for a, p in sched.proposers.items()})
    stop = disco.plan(K).stop
    assert disco.plan(K).m == K and stop is not None
    assert stop(np.log([0.9, 0.1]), 1) and not stop(np.log([0.4, 0.3, 0.3]), 2)
    assert disco.summary()["disco"]["stopped_early"] == 1


def test_a_draft_starts_only_where_the_rest_gains_back_the_catching_up() -> None:
    """Drafts at 6 ms a token, accepted half the time (the prior), gain 4.67 ms a token over 30 ms plain
    steps. A drafter 100 positions behind (its prompt) at 1 ms a position owes 100 ms, paid once:
    drafting starts with 200 tokens to go, not with 10, and no probe pays that debt. 10 positions
    behind (10 ms, less than a plain step) with 2 tokens to go (9.3 ms to gain): no draft, but the
    probe after PROBE_EVERY plain steps goes ahead."""
    sched = schedule(0.006, catch_up=0.001)
    state = sched.proposers["slem"].drafter
    state.behind = 100
    assert sched.plan(199).proposer is not None
    sched.rebind(sched.proposers)
    assert {sched.plan(9).m for _ in range(3 * PROBE_EVERY)} == {0}
    assert sched.summary()["held_back"] == 3 * PROBE_EVERY
    state.behind = 10
    sched.rebind(sched.proposers)
    assert [sched.plan(1).m for _ in range(PROBE_EVERY + 1)] == [0] * PROBE_EVERY + [1]
    # What a draft's catching up measured is what later decisions use: here 3 ms a position.
    plan = sched.plan(199)
    sched.observe(plan, Round(plan.m, 0, TARGET[plan.m + 1], 0.030 + plan.m * 0.006, catch_up_s=0.030, caught_up=10))
    assert abs(sched.costs.catch_up.value - (0.001 + 0.003) / 2) < 1e-12


def test_a_probe_pays_the_catching_up_after_generations_without_a_draft() -> None:
    """A drafter a prompt behind (100 ms owed, more than a 30 ms plain step) and 10 tokens to go: no
    draft nor probe, generation after generation, until PROBE_EVERY_GENERATIONS of them drafted
    nothing; then one probe, after PROBE_EVERY plain steps, puts the carried estimates to the test.
    A generation that drafted starts the count again."""
    sched = schedule(0.006, catch_up=0.001)
    state = sched.proposers["slem"].drafter
    state.behind = 100
    steps, idle = [], []
    for generation in range(PROBE_EVERY_GENERATIONS + 2):
        if generation:
            sched.rebind(sched.proposers)
        ms = []
        for _ in range(PROBE_EVERY + 1):
            plan = sched.plan(9)
            ms.append(plan.m)
            caught = (0.100, 100) if plan.m else (0.0, 0)
            sched.observe(plan, Round(plan.m, 0, TARGET[plan.m + 1], plan.m * 0.006 + caught[0], 0.0, 0, *caught))
        steps.append(ms)
        idle.append(sched.summary()["idle_generations"])
    plain = [0] * (PROBE_EVERY + 1)
    assert steps[:PROBE_EVERY_GENERATIONS] == [plain] * PROBE_EVERY_GENERATIONS
    assert steps[PROBE_EVERY_GENERATIONS] == [0] * PROBE_EVERY + [1]
    assert steps[PROBE_EVERY_GENERATIONS + 1] == plain
    assert idle == [*range(PROBE_EVERY_GENERATIONS + 1), 0]  # what the statistics report
    # The probe measured the catching up: 1 ms a position after 100 positions for 100 ms.
    assert abs(sched.costs.catch_up.value - 0.001) < 1e-12


def test_costs_follow_what_rounds_measure() -> None:
    sched = schedule(0.003)
    for _ in range(100):
        plan = sched.plan(K)
        sched.observe(plan, Round(plan.m, 0, 0.060, plan.m * 0.050))  # everything slower than calibrated
    # Drafting measured at 50 ms a token instead of the calibrated 3: it noticed and steps aside.
    assert max(c.value for c in sched.costs.draft_cost.values()) > 0.015
    assert sched.rounds.get("plain", 0) > 50


def test_the_rest_of_a_round_is_charged_by_its_size() -> None:
    """Verification and warping cost more the more positions a round checks: a round over s positions
    is charged what rounds of that size measured, and an unmeasured size what the nearest smaller
    one measured, scaled by the number of positions."""
    sched = schedule(0.0)
    sched.observe(sched.plan(0), Round(0, 0, TARGET[1], other_s=0.004))
    assert sched.costs.other(1) == 0.004 and abs(sched.costs.other(3) - 0.012) < 1e-12
    plan = sched.plan(2)
    sched.observe(plan, Round(2, 2, TARGET[3], other_s=0.030))
    assert sched.costs.other(3) == 0.030 and abs(sched.costs.other(4) - 0.040) < 1e-12


def test_a_poor_starting_guess_is_outweighed_at_once() -> None:
    from edge_sd.costs import Estimate

    e = Estimate(0.001)  # the calibrated guess counts as one measurement
    for _ in range(3):
        e.add(0.010)
    assert abs(e.value - (0.001 + 3 * 0.010) / 4) < 1e-12


def test_heuristic_schedule() -> None:
    h = HeuristicSchedule(SimpleNamespace(name="tli"), 2, K)
    plan = h.plan(10)
    h.observe(plan, Round(2, 2, 0.03))
    assert h.plan(10).m == 4
    h.observe(h.plan(10), Round(4, 1, 0.03))
    assert h.plan(10).m == 3 and h.plan(1).m == 1


# --- DISCO ------------------------------------------------------------------------------------------

def test_logistic_fit_separates_confident_drafts() -> None:
    import numpy as np

    from edge_sd.disco import fit_logistic

    rng = np.random.default_rng(0)
    top = rng.uniform(0, 1, 2000)
    x = np.column_stack([top, rng.normal(size=2000)])  # the second feature is noise
    y = (rng.uniform(0, 1, 2000) < top).astype(float)  # accepted as often as the drafter is confident
    w, b, mean, scale = fit_logistic(x, y)
    assert w[0] > 5 * abs(w[1])
    p = 1 / (1 + np.exp(-(((np.array([0.9, 0.0]) - mean) / scale) @ w + b)))
    assert 0.75 < p < 0.97


def test_best_threshold() -> None:
    from edge_sd.disco import best_threshold

    # Every token accepted: never stop early (threshold 0).
    full = [([0.9, 0.9, 0.9], [1, 1, 1])] * 10
    assert best_threshold(full, TARGET, 0.005, 3) == 0.0
    # After a low-probability token the next one is rejected: stop after it (a threshold above 0.3),
    # but not after the confident ones (at most 0.9).
    mixed = full + [([0.9, 0.3, 0.9], [1, 1, 0])] * 10
    assert 0.3 < best_threshold(mixed, TARGET, 0.005, 3) <= 0.9


def test_calibrate_then_disco_and_auto_stay_lossless(tiny_root, tmp_path, pipelines) -> None:
    """calibrate writes disco.json; the disco schedule and auto (cost model + DISCO) then stop drafts
    early and still give plain decoding's tokens."""
    import json
    import shutil
    from dataclasses import replace

    from edge_sd import GenerationConfig, Pipeline
    from edge_sd.disco import DISCO_FILE
    from edge_sd.tools.calibrate import calibrate

    folder = tmp_path / "pair"
    shutil.copytree(tiny_root / "pairs" / "gemma_qwen", folder)
    # Costs an earlier calibration stored (here: absurd ones) are measured again, not kept.
    stale = {"target": {str(s): 10.0 for s in range(1, 8)}, "step": 10.0, "position": 10.0}
    (folder / "costs.json").write_text(json.dumps(stale))
    pipe = Pipeline.from_folder(folder, provider="cpu", threads=2)
    prompts = ["The cat", "def add(a, b):", "A small robot reads", "for i in range(10):\n"]
    found = calibrate(pipe, folder, prompts, ("slem", "tli", "slrs"), 6, 24)
    data = json.loads((folder / DISCO_FILE).read_text())
    assert found["drafted_tokens"] == data["trained_on"] > 50 and 0.0 <= data["threshold"] < 1.0
    pipe = Pipeline.from_folder(folder, provider="cpu", threads=2)
    assert pipe.disco is not None
    # The costs it measured are stored: seeded generations plan with them (Model.fixed_costs).
    from edge_sd.costs import Costs

    stored = json.loads((folder / "costs.json").read_text())
    assert pipe.fixed_costs(6) == Costs.from_json(stored).extended(6) and 0 < stored["step"] < 1
    assert max(stored["target"].values()) < 1
    for prompt in ["The old river sees the", "class Point:\n", "Every engineer "]:
        plain = pipe.generate(prompt, GenerationConfig(max_new_tokens=24, algorithm="ar")).token_ids
        for cfg in (GenerationConfig(max_new_tokens=24, algorithm="tli", schedule="disco"),
                    GenerationConfig(max_new_tokens=24)):
            r = pipe.generate(prompt, cfg)
            assert r.token_ids == plain, (cfg, prompt)
            assert "disco" in r.stats.schedule
            # auto drafts only where its measured costs say a draft pays: on these tiny models a drafter
            # step costs about a target step, so whether it does depends on the machine's timings.
            assert r.stats.proposed > 0 or cfg.algorithm == "auto"
    # Calibrated greedy (the default): auto leaves DISCO out when it samples; asked for, it runs.
    assert data["temperature"] == 0.0
    sampled = GenerationConfig(max_new_tokens=8, temperature=1.0, seed=0)
    assert "disco" not in pipe.generate("The cat", sampled).stats.schedule
    assert "disco" in pipe.generate("The cat", replace(sampled, algorithm="tli", schedule="disco")).stats.schedule


def test_uncalibrated_auto_ends_greedy_drafts_with_the_confidence_cut(pipelines) -> None:
    """On a pair without DISCO, auto's greedy drafts run under the cost model and stop at the confidence
    cut (still plain decoding's tokens); sampling keeps the cost model alone; `-s cost` names it alone."""
    from edge_sd import GenerationConfig

    pipe = pipelines["gemma_qwen"]
    assert pipe.disco is None
    prompt = "def add(a, b):"
    plain = pipe.generate(prompt, GenerationConfig(max_new_tokens=24, algorithm="ar")).token_ids
    r = pipe.generate(prompt, GenerationConfig(max_new_tokens=24))
    assert r.token_ids == plain
    assert "confidence" in r.stats.schedule and "rounds" in r.stats.schedule
    for cfg in (GenerationConfig(max_new_tokens=8, temperature=1.0, seed=1),
                GenerationConfig(max_new_tokens=8, schedule="cost")):
        assert "confidence" not in pipe.generate(prompt, cfg).stats.schedule


def test_auto_decodes_plainly_while_the_drafters_catching_up_would_not_pay(pipelines) -> None:
    """The pipeline times the drafter's catching up per position at load and the cost schedule carries
    it; when it is dear, auto leaves the drafter idle for the whole generation (no drafter forward at
    all) and the output is still plain decoding's."""
    from edge_sd import GenerationConfig

    pipe = pipelines["gemma_qwen"]
    prompt = "def add(a, b):"
    plain = pipe.generate(prompt, GenerationConfig(max_new_tokens=24, algorithm="ar")).token_ids
    first = pipe.generate(prompt, GenerationConfig(max_new_tokens=24, schedule="cost"))
    assert pipe.costs(6).position > 0 and first.stats.schedule["catch_up_ms_per_position"] > 0
    # greedy; the longest draft 6, a lookup's 16
    sched = pipe._schedules[(SamplingConfig(), 6, 16, ("slem", "lookup", "lookup+slem"))][0]
    kept = sched.costs.catch_up.value
    try:
        sched.costs.catch_up.value = 10.0  # seconds a position: nothing 24 tokens gain pays for that
        r = pipe.generate(prompt, GenerationConfig(max_new_tokens=24, schedule="cost"))
    finally:
        sched.costs.catch_up.value = kept
    assert r.token_ids == plain and r.stats.drafter_forwards == 0
    assert {key.split(":")[0] for key in r.stats.schedule["rounds"]} <= {"plain", "lookup"}  # no drafter round


def test_a_chain_extends_a_short_lookup_continuation_where_drafting_pays() -> None:
    """The lookup has two candidates ("1 2" followed the earlier "1 2"), both parts are accepted 90%
    of the time: with a drafter at a tenth of a target step the round chains the two (the lookup's
    free candidates, then drafted ones), and learns each part's acceptance as its own; with one
    dearer than a target step the lookup's two alone pay best."""
    import copy

    from edge_sd.algorithms import ChainProposer, LookupProposer
    from edge_sd.schedules import Plan

    history = [1, 2, 1, 2]
    for draft_s, chained in ((0.003, True), (0.045, False)):
        state = SimpleNamespace(behind=0, lagging=False, behind_after=lambda n: 0)
        slem = SimpleNamespace(name="slem", drafter=state, verifier=None)
        lookup = LookupProposer(history)
        chain = ChainProposer(lookup, slem, None, 8)
        sched = CostSchedule({"slem": slem, "lookup": lookup, "lookup+slem": chain}, K,
                             CostModel(TARGET, {"slem": draft_s, "lookup": 0.0}), greedy=True)
        for i in range(40):
            sched.observe(Plan(slem, 3), Round(3, 3 if i % 10 else 2, TARGET[4], 3 * draft_s))
            sched.observe(Plan(lookup, 2), Round(2, 2 if i % 10 else 1, TARGET[3]))
        plan = sched.plan(K)
        if not chained:
            assert plan.proposer is lookup and plan.m == 2, plan
            continue
        assert plan.proposer is chain and plan.lookup == 2 and plan.m > 2, plan
        expected = copy.deepcopy(sched.acceptance)
        for acc in expected.values():
            acc.decay()
        expected["lookup"].update(2, 2)
        expected["slem"].update(plan.m - 2, 1)  # the lookup's two and one drafted token accepted
        sched.observe(plan, Round(plan.m, 3, TARGET[plan.m + 1], (plan.m - 2) * draft_s))
        assert sched.acceptance == expected and sched.rounds[f"lookup+slem:{plan.m}"] == 1
        # A drafter lagging behind the text cannot take the lookup's candidates in: no chain.
        state.lagging = True
        assert sched.plan(K).proposer is not chain


def test_greedy_pays_the_drafters_prompt_on_its_estimates_not_its_hopes() -> None:
    """Greedy decoding chooses draft lengths on optimistic acceptance, but paying the drafter's prompt
    (100 positions at 1 ms) is judged on the estimates as they are: with 12 tokens to go, drafts at
    the prior acceptance gain 4.67 ms a token over plain steps (56 ms in all, less than the 100 ms
    owed) where optimistic depths would promise about 13 ms a token: no draft. With 200 tokens to go
    the same drafts gain it back."""
    sched = schedule(0.006, greedy=True, catch_up=0.001)
    sched.proposers["slem"].drafter.behind = 100
    assert [sched.plan(11).m for _ in range(3)] == [0, 0, 0]
    assert sched.summary()["held_back"] == 3
    assert sched.plan(199).m > 0


def test_a_lookup_continuation_runs_past_the_drafters_longest_draft() -> None:
    """A text repeating 16 tokens: where lookup_max allows, the lookup proposes all of them (its
    continuation costs no drafter forward, and every candidate has been accepted), past K, the longest
    draft of the drafter, which stays capped at K; without lookup_max, and within a short budget, the
    round stops at K and at the budget."""
    from edge_sd.algorithms import LookupProposer
    from edge_sd.schedules import Plan

    longest = 16
    target = {s: 0.030 + 0.002 * (s - 1) for s in range(1, longest + 2)}
    history = list(range(1, 21)) + [1, 2, 3, 4]  # "1 2 3 4" was followed by 5..20
    for lookup_max, budget, expected in ((longest, 100, 16), (None, 100, K), (longest, 9, 9)):
        state = SimpleNamespace(behind=0, lagging=False)
        slem = SimpleNamespace(name="slem", drafter=state, verifier=None)
        lookup = LookupProposer(history)
        sched = CostSchedule({"slem": slem, "lookup": lookup}, K, CostModel(target, {"slem": 0.001, "lookup": 0.0}),
                             greedy=True, lookup_max=lookup_max)
        for _ in range(30):
            sched.observe(Plan(lookup, K), Round(K, K, target[K + 1]))
            sched.observe(Plan(slem, K), Round(K, K, target[K + 1], K * 0.001))
        assert lookup.available(longest) == 16
        plan = sched.plan(budget)
        assert plan.proposer is lookup and plan.m == expected, (lookup_max, budget, plan)
        # The drafter's drafts stay within K whatever lookup_max.
        drafter_only = CostSchedule({"slem": slem}, K, CostModel(target, {"slem": 0.001}), greedy=True,
                                    lookup_max=lookup_max)
        for _ in range(30):
            drafter_only.observe(Plan(slem, K), Round(K, K, target[K + 1], K * 0.001))
        assert drafter_only.plan(budget).m == min(K, budget)


def test_starting_costs_from_a_busy_machine_move_with_the_measured_steps() -> None:
    """Costs stored while the machine was busy: a step at 36 ms and 9.5 ms more per position, where
    the machine now steps in 17 ms. Once plain steps have shown the factor, sizes not yet run (the
    drafter's token, its catching up) are estimated at the stored costs times that factor, and a text
    repeating itself is drafted by prompt lookup; at the stored costs as they were, no draft would
    ever look as fast as a step, run, and show otherwise. A size measured keeps its own estimate."""
    from edge_sd.algorithms import LookupProposer
    from edge_sd.schedules import Plan

    stored = {s: 0.036 + 0.0095 * (s - 1) for s in range(1, K + 2)}
    model = CostModel(stored, {"lookup": 0.0, "slem": 0.024}, 0.005)
    sched = CostSchedule({"lookup": LookupProposer(list(range(1, 9)) + [1, 2, 3])}, K, model, greedy=True)
    for _ in range(10):
        sched.observe(Plan(None, 0), Round(0, 0, 0.017))
    drift = model.target(1) / stored[1]
    assert 0.5 < drift < 0.6
    assert abs(model.target(3) - stored[3] * drift) < 1e-12
    assert abs(model.draft("slem") - 0.024 * drift) < 1e-12 and abs(model.catch_up_cost() - 0.005 * drift) < 1e-12
    plan = sched.plan(30)
    assert plan.proposer is not None and plan.proposer.name == "lookup" and plan.m > 0
    model.observe(3, 0.020, 0.0)
    assert model.target(3) == (stored[3] + 0.020) / 2  # its own measurements from here


def test_auto_starts_prompt_lookup_at_no_drafting_cost() -> None:
    """A lookup draft runs no model: its cost a token starts at nothing, the drafter's at its step."""
    from edge_sd.algorithms import LookupProposer
    from edge_sd.costs import Costs
    from edge_sd.schedules.choose import new_cost_schedule

    slem = SimpleNamespace(name="slem", drafter=SimpleNamespace(behind=0, lagging=False))
    costs = Costs({s: 0.02 + 0.001 * s for s in range(1, 18)}, 0.012, 0.002)
    sched = new_cost_schedule({"slem": slem, "lookup": LookupProposer([1, 2, 3])}, K, 16, costs, True, True)
    assert sched.costs.draft("lookup") == 0.0 and sched.costs.draft("slem") == 0.012


def test_plain_steps_teach_lookup_its_acceptance_where_it_had_a_candidate() -> None:
    """A plain sampled step where prompt lookup had a candidate: a lookup draft there would have been
    accepted with the target's probability of it, which counts as a round of lookup's first
    candidate. Probable candidates raise lookup's estimate until it drafts; improbable ones lower it;
    a step where lookup has no match (the control) teaches nothing."""
    from edge_sd.algorithms import LookupProposer

    # a forward of two positions costs 1.3 steps: a draft pays only if accepted often enough
    target = {s: 0.030 * (1 + 0.3 * (s - 1)) for s in range(1, K + 2)}

    def fresh(history: list[int]) -> CostSchedule:
        return CostSchedule({"lookup": LookupProposer(history)}, K, CostModel(target, {"lookup": 0.0}))

    repeating = [5, 6, 7, 8, 9, 5, 6, 7]  # "6 7" was followed by 8: lookup proposes 8
    low, high, none = fresh(repeating), fresh(repeating), fresh([1, 2, 3, 4])
    asked = []
    for sched, p in ((low, 0.02), (high, 0.95), (none, 0.95)):
        for _ in range(30):
            sched.plain_step_seen(lambda c, p=p: asked.append(c) or p)
    assert set(asked) == {8}
    assert low.acceptance["lookup"].rate(0) < 0.1 < 0.9 < high.acceptance["lookup"].rate(0)
    assert none.acceptance["lookup"].tried == []
    assert low.plan(K).proposer is None
    plan = high.plan(K)
    assert plan.proposer is not None and plan.proposer.name == "lookup"


def test_costs_are_measured_at_several_sizes_up_to_the_longest_lookup_verification(tiny_root) -> None:
    """A forward's cost is measured at 1, 2, 3, 5, 9 and 17 positions and interpolated between, so
    that a few-token draft is charged what its forward costs, not a line through 1 and 17."""
    from edge_sd import costs as costs_module
    from edge_sd.engines.ort import OrtEngine

    engine = OrtEngine(tiny_root / "engines" / "bl_llama", provider="cpu", threads=2)
    seen: list[int] = []
    forward = engine.forward

    def counting(ids, *args, **kw):
        seen.append(len(ids))
        return forward(ids, *args, **kw)

    engine.forward = counting
    measured = costs_module.measure(engine, None, 6)
    assert sorted(measured.target) == list(range(1, 18))
    assert {1, 2, 3, 5, 9, 17} <= set(seen)
    inside = measured.target
    assert min(inside[3], inside[5]) <= inside[4] <= max(inside[3], inside[5])


def test_a_sampled_plain_step_shows_the_schedule_what_lookup_would_have_had_accepted(pipelines, monkeypatch) -> None:
    """In the decoding loop, each plain sampled step hands the cost schedule its distribution: the
    probability it gives is the one the step drew from (a token drawn there with probability 0 never
    is), for whichever candidate lookup has there."""
    from edge_sd import GenerationConfig
    from edge_sd.schedules.cost import CostSchedule

    seen: list[tuple[int, float]] = []
    original = CostSchedule.plain_step_seen

    def spy(self, prob):
        peek = self.proposers["lookup"].peek()
        if peek is not None:
            seen.append((peek, prob(peek)))
        return original(self, prob)

    from edge_sd.schedules import Plan

    monkeypatch.setattr(CostSchedule, "plain_step_seen", spy)
    monkeypatch.setattr(CostSchedule, "plan", lambda self, budget, open_ended=False: Plan(None, 0))  # plain steps
    pipe = pipelines["gemma_qwen"]
    prompt = "one two three four one two three four one two three four one two"
    r = pipe.generate(prompt, GenerationConfig(max_new_tokens=24, temperature=1.0, seed=3, schedule="cost"))
    assert r.stats.schedule["rounds"] == {"plain": 23}  # the first token comes from the prefill
    assert seen and all(0.0 <= p <= 1.0 for _, p in seen) and len({p for _, p in seen}) > 1
    assert r.stats.schedule["acceptance"]["lookup"]  # learnt without a lookup draft
