"""The batch rule (strata/engine/batching.py, --batch-max): groupings of the ready rows, and the
auto rule run by the scheduler over stand-in works whose steps cost what a fake clock is told (a
step of s rows costs cost(s) ms). It must settle on the cheapest grouping: rows apart where each
extra row costs more than a step of its own (experts over the bus), one step where batching pays
(resident), and follow costs that change."""
import itertools

import pytest

from strata.config import EngineConfig, SamplingParams
from strata.engine.batching import AutoBatch, FixedBatch, batch_rule, split
from strata.engine.scheduler import Request, Scheduler
from strata.engine.types import Completion, Delta, Usage
from strata.errors import InvalidArgument


def test_split_groups_are_near_equal_under_the_cap():
    for rows, cap in itertools.product(range(1, 9), range(1, 9)):
        g = split(rows, cap)
        assert sum(g) == rows and max(g) <= cap and max(g) - min(g) <= 1 and list(g) == sorted(g, reverse=True)
        assert len(g) == -(-rows // min(cap, rows))
    assert split(5, 2) == (2, 2, 1) and split(8, 3) == (3, 3, 2) and split(4, 8) == (4,) and split(0, 2) == ()


def test_fixed_rule_and_its_step_times():
    rule = FixedBatch(2)
    assert rule.groups(5) == (2, 2, 1)
    for ms in (50.0, 40.0, 3.0, 5.0, 4.0):           # the first WARM_STEPS are not counted
        rule.observe(2, ms)
    assert rule.cost_ms(2) == 4.0 and rule.cost_ms(1) is None
    assert rule.to_dict() == {"batch_max": 2, "auto": False, "cap": 2, "step_ms": {2: 4.0}, "row_ms": {2: 2.0}}
    assert isinstance(batch_rule(0, 4), AutoBatch) and batch_rule(0, 4).max_rows == 4
    assert not isinstance(batch_rule(3, 4), AutoBatch) and batch_rule(3, 4).max_rows == 3


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class CostWork:
    """A stand-in Generation whose every step is a plain decode step (pending set after each token);
    a step it takes alone advances the clock by cost(1), a batched one was paid by batch()."""

    def __init__(self, ids, params, clock, cost, slot):
        self.ids, self.n, self.clock, self.cost, self.slot = ids, params.max_tokens, clock, cost, slot
        self.out, self.completion, self.pending, self.stepped = [], None, None, False

    def __iter__(self):
        return self

    def __next__(self):
        if len(self.out) == self.n:
            self.completion = Completion("", self.out, "length", Usage(len(self.ids), len(self.out)))
            raise StopIteration
        if self.out and not self.stepped:
            self.clock.t += self.cost(1) / 1e3
        self.stepped = False
        self.out.append(self.ids[0] * 1000 + len(self.out))
        self.pending = self.out[-1] if len(self.out) < self.n else None
        return Delta("", self.out[-1])

    def cancel(self):
        pass


def run(rule, cost, clients=4, tokens=400, change=None):
    """Serve `clients` requests of `tokens` tokens each over --parallel `clients` slots; -> (the
    grouping of each iteration, the fake time in ms, the requests). change(iteration) may swap cost."""
    clock, groupings, costs = Clock(), [], [cost]
    counts = {}

    def batch(works):
        clock.t += costs[0](len(works)) / 1e3
        for w in works:
            w.pending, w.stepped = None, True

    def begin(ids, params, on_progress=None, slot=0, **extra):
        return CostWork(ids, params, clock, lambda s: costs[0](s), slot)

    groups = rule.groups

    def record(rows):
        g = groups(rows)
        groupings.append(g)
        if change is not None:
            costs[0] = change(len(groupings)) or costs[0]
        counts[g] = counts.get(g, 0) + 1
        return g
    rule.groups = record
    s = Scheduler(begin, 16, num_slots=clients, batch=batch, batch_rule=rule, clock=clock)
    reqs = [s.submit(Request([p], SamplingParams(max_tokens=tokens))) for p in range(1, clients + 1)]
    while s.step():
        pass
    assert [r.completion.token_ids for r in reqs] == [[p * 1000 + i for i in range(tokens)] for p in range(1, clients + 1)]
    return groupings, clock.t * 1e3


def misses(s):          # each extra row's experts over the bus: a step of s rows costs more than s steps of one
    return 4.0 * s + 0.6 * (s - 1)


def resident(s):        # the dense weights read once for every row: batching pays
    return 2.2 + 0.7 * s


def pairs_best(s):      # two rows a step is cheapest: 4 rows as 2 + 2
    return {1: 3.0, 2: 4.0, 3: 7.0, 4: 10.0}[s]


@pytest.mark.parametrize("cost, want", [(misses, (1, 1, 1, 1)), (resident, (4,)), (pairs_best, (2, 2))])
def test_auto_settles_on_the_cheapest_grouping(cost, want):
    groupings, _ = run(AutoBatch(4), cost)
    tail = groupings[len(groupings) // 4:]
    assert tail.count(want) >= 0.95 * len(tail), {g: tail.count(g) for g in set(tail)}
    assert groupings[-40:].count(want) >= 38


def test_auto_costs_little_more_than_the_best_fixed_cap():
    for cost in (misses, resident, pairs_best):
        _, auto_ms = run(AutoBatch(4), cost)
        best_ms = min(run(FixedBatch(cap), cost)[1] for cap in (1, 2, 4))
        assert auto_ms <= 1.05 * best_ms, (cost.__name__, auto_ms, best_ms)


def test_the_first_steps_of_a_shape_are_not_counted():
    # a shape's eager step and its graph capture cost 20x: a rule that counted them would run 4 rows
    # apart for about a hundred iterations before its probes corrected it (measured with WARM_STEPS 0)
    seen = {}

    def warming(s):                 # called once a step of s rows
        seen[s] = seen.get(s, 0) + 1
        return pairs_best(s) * (20 if seen[s] <= 2 else 1)
    groupings, _ = run(AutoBatch(4), warming)
    assert sum(g != (2, 2) for g in groupings[10:]) <= 6        # the probes only


def test_auto_follows_costs_that_change():
    # resident first, then the same rows' experts come over the bus (the cache pushed out)
    groupings, _ = run(AutoBatch(4, probe=8, max_probe=64), resident, tokens=1500,
                       change=lambda i: misses if i == 500 else None)
    assert groupings[400:500].count((4,)) >= 95
    assert groupings[-100:].count((1, 1, 1, 1)) >= 95


def test_every_ready_row_steps_once_an_iteration_whatever_the_grouping():
    rule = AutoBatch(3)
    groupings, _ = run(rule, pairs_best, clients=3, tokens=50)
    assert all(sum(g) == 3 for g in groupings[:48])      # each iteration: every slot one token
    assert rule.to_dict()["auto"] and rule.to_dict()["batch_max"] == 0


@pytest.mark.parametrize("kw, match", [({"batch_max": -1}, "batch_max must be 0"),
                                       ({"batch_max": 3, "parallel": 2}, r"from 1 to --parallel \(2\)"),
                                       ({"batch_max": True, "parallel": 2}, "batch_max must be"),
                                       ({"batch_max": "2", "parallel": 2}, "batch_max must be")])
def test_batch_max_is_checked(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        EngineConfig(**kw)
    assert EngineConfig(parallel=4, batch_max=2).batch_max == 2 and EngineConfig().batch_max == 0


def test_batch_max_through_the_environment(monkeypatch):
    monkeypatch.setenv("STRATA_BATCH_MAX", "1")
    assert EngineConfig.from_kwargs(parallel=4).batch_max == 1
    monkeypatch.setenv("STRATA_BATCH_MAX", "5")
    with pytest.raises(InvalidArgument, match="batch_max"):
        EngineConfig.from_kwargs(parallel=4)


def test_a_failed_step_ends_its_groups_requests_only():
    clock, calls = Clock(), []

    def batch(works):
        calls.append(sorted(w.slot for w in works))
        if len(calls) == 1:
            raise RuntimeError("device fault")
        for w in works:
            w.pending, w.stepped = None, True

    def begin(ids, params, on_progress=None, slot=0, **extra):
        return CostWork(ids, params, clock, misses, slot)
    s = Scheduler(begin, 8, num_slots=4, batch=batch, batch_rule=FixedBatch(2), clock=clock)
    reqs = [s.submit(Request([p], SamplingParams(max_tokens=5))) for p in range(1, 5)]
    while s.step():
        pass
    failed = [r for r in reqs if r.state == "error"]
    assert len(failed) == 2 and all(r.inbox[-1][0] == "error" for r in failed)
    assert all(r.completion.token_ids == [p * 1000 + i for i in range(5)] for p, r in enumerate(reqs, 1)
               if r.state == "done")
    assert sum(r.state == "done" for r in reqs) == 2


def test_costs_measured_in_a_cold_cache_are_measured_again():
    # 12 GiB, two clients (H100, session 22): the 2-row steps first measured right after the prompts,
    # while most experts missed, took 25 ms; warm, one took 4.5 ms against two 1-row steps of 3.2. The
    # cold samples held the median, and the rule ran rows apart for the whole round.
    def cold(s):
        return {1: 3.2, 2: 25.0}[s]

    def warm(s):
        return {1: 3.2, 2: 4.5}[s]
    groupings, _ = run(AutoBatch(2), cold, clients=2, tokens=300, change=lambda i: warm if i == 12 else None)
    assert groupings[:12].count((1, 1)) >= 6                    # cold: rows apart is right
    assert groupings[80:].count((2,)) >= 0.95 * len(groupings[80:]), groupings[12:80]


def test_a_choice_whose_cost_halves_measures_the_others_again():
    # 12 GiB, 8 clients (H100, session 22): after the prompts every step is slow while the cache refills
    # (here 6x falling to 1x over 60 iterations, 8-row steps worse while cold). The rule settled on
    # 4 + 4 cold, probed 8 rows while still cold, and ran 4 + 4 until a probe 97 iterations in; with
    # the probes doubling apart, here it never left 4 + 4. Once the choice's own cost has halved, the
    # others are measured again.
    warm = {1: 3.3, 2: 4.5, 3: 5.2, 4: 7.0, 8: 11.5}

    def at(i):
        f = max(1.0, 6.0 - 5.0 * i / 60)
        return lambda s: warm[s] * f * (1.6 if s == 8 and f > 1.0 else 1.0)
    groupings, _ = run(AutoBatch(8), at(0), clients=8, tokens=200, change=at)
    assert groupings[100:].count((8,)) >= 0.9 * len(groupings[100:]), {g: groupings[100:].count(g) for g in set(groupings[100:])}
    assert groupings[80:100].count((8,)) >= 15


def test_probes_come_further_apart_while_the_choice_holds():
    groupings, _ = run(AutoBatch(4), resident, tokens=1200)
    probes = [i for i, g in enumerate(groupings) if g != (4,) and i > 10]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert 4 <= len(probes) <= 6 and gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0], probes


def test_the_iteration_trace_splits_each_iteration_into_its_steps():
    """Scheduler.trace (opt-in, tools/parallel_bench.py --trace): each iteration's time, its batched
    groups' rows and step times, and the time spent outside them."""
    import collections
    clock = Clock()

    def batch(works):
        clock.t += resident(len(works)) / 1e3
        for w in works:
            w.pending, w.stepped = None, True

    def begin(ids, params, on_progress=None, slot=0, **extra):
        return CostWork(ids, params, clock, resident, slot)
    s = Scheduler(begin, 8, num_slots=4, batch=batch, batch_rule=FixedBatch(2), clock=clock)
    s.trace = collections.deque()
    for p in range(1, 5):
        s.submit(Request([p], SamplingParams(max_tokens=6)))
    while s.step():
        pass
    # the first tokens (each work alone), five batched iterations in lockstep, then the works' ends
    assert [[rows for rows, _ in groups] for _, groups, _, _ in s.trace] == [[]] + [[2, 2]] * 5 + [[]]
    for total, groups, alone, prompts in s.trace:
        assert all(sec == pytest.approx(resident(2) / 1e3) for _, sec in groups)
        assert total == pytest.approx(sum(sec for _, sec in groups) + alone + prompts)
