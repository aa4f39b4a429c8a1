"""The scheduler is plain Python over records: tested on synthetic traces, nothing compiles."""
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from deferfuse.scheduler import memory, steps

pytestmark = pytest.mark.modes("strict")   # no device work: one mode is enough


@settings(max_examples=60, deadline=None)
@given(prefix=st.lists(st.integers(0, 5), max_size=30),
       body=st.lists(st.integers(0, 1000), min_size=8, max_size=40),
       reps=st.integers(4, 8), tail=st.integers(0, 7))
def test_find_period_finds_the_loop_body(prefix, body, reps, tail):
    trace = prefix + body * reps + body[:tail]
    # find_period's precondition: the repetition covers the last half plus one more period (a long
    # prefix with few repetitions is not yet a detectable loop)
    assume(len(body) * reps + tail >= len(trace) // 2 + len(body))
    L = steps.find_period(trace)
    assert L is not None
    # whatever period is found, the last half of the trace repeats with it
    n = len(trace)
    assert all(trace[i] == trace[i - L] for i in range(n - n // 2, n))
    assert L <= len(body) or L % len(body) == 0 or len(set(body)) < len(body)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=0, max_size=200))
def test_find_period_is_deterministic(trace):
    assert steps.find_period(list(trace)) == steps.find_period(list(trace))


def test_find_period_none_without_repetition():
    assert steps.find_period(list(range(500))) is None
    assert steps.find_period([1, 2, 3]) is None


@settings(max_examples=60, deadline=None)
@given(prefix=st.lists(st.integers(0, 5), max_size=30),
       body=st.lists(st.integers(6, 1000), min_size=8, max_size=40, unique=True),
       reps=st.integers(3, 40), tail=st.lists(st.integers(2000, 3000), max_size=40, unique=True))
def test_periodic_cuts_give_one_piece_per_repetition(prefix, body, reps, tail):
    trace = prefix + body * reps + tail
    cuts = steps.periodic_cuts(trace)
    if len(trace) < steps.LOOP_SPLIT_MIN_OPS or len(body) * reps < len(trace) / 2:
        assert cuts is None
        return
    assert cuts is not None and cuts[-1] == len(trace) and list(cuts) == sorted(set(cuts))
    # the pieces between the prefix and the suffix are repetitions of one op structure (one compile
    # for all of them)
    starts = (0,) + cuts[:-1]
    pieces = [tuple(trace[a:b]) for a, b in zip(starts, cuts)]
    middle = pieces[1:-1]
    assert len(middle) >= reps - 2 and len(set(middle)) == 1 and len(middle[0]) == len(body)


def test_periodic_cuts_leave_short_and_single_step_traces_whole():
    assert steps.periodic_cuts([1, 2, 3] * 50) is None          # shorter than the threshold
    assert steps.periodic_cuts(list(range(1000))) is None        # no repetition
    layer = list(range(200, 215))                                # one step of a deep model: the
    one = [1, 2] + layer * 24 + [3, 4] + list(range(300, 700))   # layers cover under half of it
    assert steps.periodic_cuts(one) is None


def test_body_signature_matches_rolling_hash():
    ks = [11, 22, 33, 44] * 5
    L, h = steps.body_signature(ks, 4)
    hh = 0
    for k in ks[:4]:
        hh = steps.rolling(hh, k)
    assert (L, h) == (4, hh)


@given(st.lists(st.tuples(st.integers(0, 10**9), st.booleans()), max_size=50),
       st.lists(st.integers(0, 10**9), max_size=20), st.booleans())
def test_memory_plan_donates_only_unheld_inputs(inputs, outs, enabled):
    p = memory.plan([n for n, _ in inputs], [h for _, h in inputs], outs, sum(outs) + 5,
                    temp_bytes=7, enabled=enabled)
    assert len(p.donate) == len(inputs)
    for (n, held), d in zip(inputs, p.donate):
        if d:
            assert enabled and not held and n > 0
        elif enabled:
            assert held or n == 0
    assert p.donated_bytes == sum(n for (n, _), d in zip(inputs, p.donate) if d)
    assert p.elided_bytes == 5
    assert p.peak_estimate >= sum(n for n, _ in inputs) + 7


def test_memory_plan_off_switch():
    p = memory.plan([100], [False], [100], 100, enabled=False)
    assert p.donate == (False,) and p.donated_bytes == 0


def test_liveness_simulation():
    from deferfuse.scheduler import liveness
    # x (ext 0, 100 B, dropped by the user) -> a = f(x) 10 B -> b = g(a) 20 B -> c = h(a, b) 5 B (kept)
    wiring = [(0,), ((0, 0),), ((0, 0), (1, 0))]
    out_bytes = [[10], [20], [5]]
    live = liveness.simulate(wiring, out_bytes, [100], [False], {(2, 0)})
    assert live == [110, 30, 35]       # x dies after op 0, a after op 2
    live_held = liveness.simulate(wiring, out_bytes, [100], [True], {(2, 0)})
    assert live_held == [110, 130, 135]
    with pytest.raises(AssertionError):        # an op reading a later op's output: not a trace
        liveness.simulate([((1, 0),), (0,)], [[4], [4]], [100], [False], set())


def test_churn_cuts_separate_changing_ops_from_stable_runs():
    from deferfuse.scheduler import cut
    first = ["a", "b", "c", "d", "e", "f"]
    vary: set = set()
    assert cut.churn_cuts(first, first, vary) is None                 # nothing changed
    assert cut.churn_cuts(first, ["a", "B", "c", "d", "E", "f"], vary) == (1, 2, 4, 5, 6)
    # positions that changed once stay apart, even when a later version matches the first again
    assert cut.churn_cuts(first, ["a", "b", "c", "D", "e", "f"], vary) == (1, 2, 3, 5, 6)
    assert cut.churn_cuts(first, list("ABCDEF"), set()) is None        # every op changed


def test_budget_cut_picks_the_least_live_point():
    from deferfuse.scheduler import cut
    # a chain 0 -> 1 -> 2 -> 3 with a big value produced by op 0 read by op 3
    wiring = [(0,), ((0, 0),), ((1, 0),), ((2, 0), (0, 0))]
    out_bytes = [[100], [10], [10], [10]]
    pieces = cut.budget_cut(wiring, out_bytes, [4], [True], {(3, 0)})
    assert pieces[-1] == 4 and len(pieces) == 2 and 1 <= pieces[0] <= 3


def test_needed_first_orders_the_read_value_s_ops_first():
    from deferfuse.scheduler import cut
    # op 0 reads input 0; ops 1..10 form a chain from op 0 that the read value (op 11) never uses;
    # op 11 reads op 0 only
    wiring = [(0,)] + [((i - 1, 0),) for i in range(1, 11)] + [((0, 0), 1)]
    order, n_first = cut.needed_first(wiring, (11,))
    assert n_first == 2 and order[:2] == (0, 11)
    assert order[2:] == tuple(range(1, 11))            # the rest, in trace order
    # a value that needs everything, or a rest too small to be worth a program: no split
    assert cut.needed_first(wiring, (10,)) is None
    assert cut.needed_first(wiring[:3] + [((0, 0),)], (3,)) is None


def test_setup_first_takes_only_leading_kept_factories():
    """NOTE [setup first]: the leading ops that only make a value, read nothing of the trace and
    leave it (or are carried: NOTE [carried setup]) run first; anything else (a factory read only
    inside, one reading a pending value, an op that computes, the whole trace) does not."""
    from types import SimpleNamespace as E

    from deferfuse.scheduler import cut
    f32, b8 = "float32", "bool"
    avals = {"ones_like": ((2, 3), f32), "zeros": ((4,), f32), "eq": ((2, 3), b8), "any": ((), b8)}
    ops = [E(name=f"aten.{n}.default", res_avals=(avals[n] + (0,),))
           for n in ("ones_like", "zeros", "eq", "any")]
    wiring = [(0,), (), ((0, 0),), ((2, 0),)]

    def outs(*ps):
        return tuple((p, 0) for p in ps)
    assert cut.setup_first(ops, wiring, outs(0, 1, 3)) == 2
    assert cut.setup_first(ops, wiring, outs(0, 3)) == 1              # zeros: used inside only
    assert cut.setup_first(ops, wiring, outs(1, 3)) == 0              # ones_like not kept
    assert cut.setup_first(ops, [(0,), ((0, 0),), ((0, 0),), ((2, 0),)], outs(0, 1, 3)) == 1
    assert cut.setup_first(ops[:1], wiring[:1], outs(0)) == 0         # never the whole trace
    assert cut.setup_first([E(name="aten.rand_like.default", res_avals=(((2, 3), f32, 0),))]
                           + ops[2:], [(0,), ((0, 0),), ((1, 0),)], outs(0, 2)) == 0
    assert not cut.is_setup("myns.ones.default") and not cut.is_setup("ones")
    # NOTE [carried setup]: a state made by a factory that no tensor holds after the sync runs
    # first when the rest leaves a value of its shape and dtype (the state that replaces it)...
    h0 = E(name="aten.new_zeros.default", res_avals=(((1, 4, 8), f32, 0),))
    cell = E(name="aten.tanh.default", res_avals=(((1, 4, 8), f32, 0),))
    loss = E(name="aten.sum.default", res_avals=(((), f32, 0),))
    chain = [(0,), ((0, 0),), ((1, 0),)]
    assert cut.setup_first([h0, cell, loss], chain, outs(1, 2)) == 1
    # ... and not when nothing of its shape and dtype leaves (a position arange read inside)
    assert cut.setup_first([h0, cell, loss], chain, outs(2)) == 0
    # another setup op's value is no replacement
    assert cut.setup_first([h0, h0, loss], [(0,), (), ((0, 0), (1, 0))], outs(1, 2)) == 0


def test_pieces_plan_renumbers_and_finds_what_crosses():
    from types import SimpleNamespace as NS
    from deferfuse.scheduler import pieces
    from deferfuse.scheduler.records import Value

    def node(wiring, n_out=1, scalars=()):
        return NS(wiring=wiring, key=NS(khash=len(wiring)), scalars=list(scalars), src="x.py:1",
                  ins=[], outs=tuple(Value((1,), "f4", 4) for _ in range(n_out)))
    # op 0 reads input 0; op 1 reads op 0; op 2 reads input 1 and op 0 (and has a scalar)
    nodes = [node((0,)), node(((0, 0),)), node((1, (0, 0)), scalars=[2.5])]
    first, second = pieces.plan(nodes, (0, 2, 1), (2, 3))      # ops 0 and 2 first, then op 1
    assert list(first.pos) == [0, 2] and list(second.pos) == [1]
    assert first.wiring == [(0,), (1, (0, 0))] and first.src == [0, 1]
    assert first.needed == [(0, 0)]                  # op 0's output leaves: op 1 reads it later
    assert second.src == [(0, 0)] and second.wiring == [(0,)] and second.needed == []
    built = list(pieces.PieceNodes(nodes, first))
    assert [m.pos for m in built] == [0, 1] and [m.s0 for m in built] == [0, 0]
    assert built[1].scalars == [2.5] and nodes[0].outs[0].node is built[0]


def test_outer_loop_forgets_inner_bodies_once_the_interval_repeats():
    # NOTE [outermost body]: an interval (traces from one sync to the next) seen again, cut by an
    # inner body and short enough, makes that body forgotten and later short intervals with the
    # same first op whole.
    o = steps.OuterLoop()
    o.learned("time step", 10)
    forget = set()
    for _ in range(2):
        assert not o.within(10, "embedding")
        o.cut_by("time step")
        o.trace_ended(200, 1, False, "embedding")
        forget |= o.trace_ended(277, 2, True, "mm")
    assert forget == {"time step"} and o.suppressed == {"time step"} and o.found == 1
    assert o.within(steps.OUTER_MAX_OPS, "embedding")
    assert not o.within(steps.OUTER_MAX_OPS + 1, "embedding")
    assert not o.within(10, "linear")           # another loop: searched as before
    # A longer interval ends: long intervals are searched again, and a body that cut one is a
    # long loop's body, never forgotten for a short interval that is a piece of it.
    o.cut_by("long body")
    assert o.trace_ended(steps.OUTER_MAX_OPS + 1, 3, True, "embedding") == set()
    assert not o.within(1, "embedding")
    for _ in range(3):
        o.cut_by("long body")
        assert o.trace_ended(100, 4, True, "tanh") == set()
    assert "long body" not in o.suppressed


def test_outer_loop_needs_a_repeat_and_a_short_interval():
    o = steps.OuterLoop()
    for h in range(6):                      # every interval new: no outer loop
        o.cut_by("b")
        assert o.trace_ended(300, h, True, "x") == set()
    for _ in range(3):                      # repeats, but longer than an outer body may be
        o.cut_by("c")
        assert o.trace_ended(steps.OUTER_MAX_OPS + 5, 9, True, "x") == set()
    assert not o.quiet and o.found == 0


def test_a_loop_of_long_iterations_repeated_is_no_outer_body():
    # A short pipeline call repeated (4 denoising steps of 117 ops, then a decode; read once per
    # call): its steps stay cut, so every call, whatever its count of steps, runs the same pieces
    # (NOTE [outermost body]). A time loop of 10-op steps in the same place makes an outer body.
    for period, outer in ((117, False), (steps.OUTER_MAX_PERIOD, False), (10, True)):
        o = steps.OuterLoop()
        o.learned("step", period)
        for _ in range(3):
            assert o.within(10, "linear") == (outer and o.quiet)
            o.cut_by("step")
            o.trace_ended(353, 1, False, "linear")
            o.trace_ended(185, 2, True, "conv")
        assert o.quiet == outer and ("step" in o.suppressed) == outer and o.found == int(outer)


def test_an_interval_no_loop_splits_is_no_outer_body():
    # 281 ops with no loop in them, read every call: nothing to keep whole. One the runner splits
    # at a loop of short iterations (an LSTM's backward pass) is an outer body.
    o = steps.OuterLoop()
    for _ in range(3):
        assert o.trace_ended(281, 1, True, "sin") == set()
    assert not o.quiet and o.found == 0
    for _ in range(2):
        o.trace_ended(112, 2, False, "embedding")
        o.trace_ended(365, 3, False, "mm", period=12)
        o.trace_ended(20, 4, True, "add")
    assert o.quiet and o.found == 1 and o.within(100, "embedding")
    long = steps.OuterLoop()
    for _ in range(3):
        long.trace_ended(400, 5, True, "linear", period=117)
    assert not long.quiet


def test_split_period_is_the_length_of_the_pieces_a_loop_split_makes():
    trace = [7, 8] + [1, 2, 3, 4, 5, 6, 7, 8, 9] * 40 + [10, 11]
    cuts = steps.periodic_cuts(trace)
    assert steps.split_period(trace) == 9 == cuts[2] - cuts[1]
    assert steps.split_period(list(range(300))) is None and steps.periodic_cuts(list(range(300))) is None


def test_an_interval_of_nothing_but_inner_pieces_stays_cut():
    # An evaluation loop read once at its end: every trace but the last is a piece its body cut;
    # cut, each piece runs while the next is recorded (NOTE [outermost body]).
    o = steps.OuterLoop()
    for _ in range(3):
        for _ in range(7):
            o.cut_by("forward")
            o.trace_ended(128, 1, False, "embedding")
        assert o.trace_ended(20, 2, True, "embedding") == set()
    assert not o.quiet and o.found == 0 and not o.within(10, "embedding")


def test_cut_policy_plans_from_counts_and_reasons():
    # scheduler/policy.py: the cut decisions in one place; reasons are strings to every counter.
    from deferfuse.scheduler import policy
    Cut, P = policy.Cut, policy.CutPolicy()
    assert Cut.LOOP_BOUNDARY == "loop boundary" and {"loop boundary": 1}[Cut.LOOP_BOUNDARY] == 1
    assert f"{Cut.BACKWARD}" == "backward" and policy.is_async("trace limit")
    assert not policy.is_async("item")
    big = steps.LOOP_SPLIT_MIN_OPS
    assert P.at_sync("item", big, "x", None) == policy.SyncPlan(False, "body", True)
    assert P.at_sync("item", 10, "x", "body") == policy.SyncPlan(False, "rephase", False)
    assert P.at_sync(Cut.LOOP_BOUNDARY, big, "x", None) == policy.SyncPlan(False, None, True)
    assert P.at_sync("item", big, "x", None, detect=False) == policy.SyncPlan(False, None, False)
    assert P.search_at_cut("trace limit") and not P.search_at_cut("trace limit", detect=False)
    assert not P.search_at_cut("cpu")
    assert P.loop_split(big, False) and not P.loop_split(big, True)
    assert not P.loop_split(big - 1, False) and not P.loop_split(big, False, cross_check=True)
    # An outer body found (a time loop of 10-op steps): its intervals run whole, unsearched.
    P.outer.learned("t", 10)
    for _ in range(2):
        P.outer.cut_by("t")
        P.trace_ended(Cut.LOOP_BOUNDARY, 130, 1, "emb", None)
        P.trace_ended("item", 300, 2, "mm", None)
    assert P.search_while_recording(10, "other") and not P.search_while_recording(10, "emb")
    assert P.at_sync("item", big, "emb", None) == policy.SyncPlan(True, None, False)


def test_cut_policy_says_how_the_runner_splits_and_when_backward_cuts():
    # The runner's choices among its splits, buckets and the memory budget, and the front end's
    # cut at backward(), are the policy's (typed answers from counts and flags).
    from deferfuse.scheduler import policy
    P, Split, big = policy.CutPolicy, policy.Split, steps.LOOP_SPLIT_MIN_OPS
    assert P.trace_splits(big, False, True) == (Split.LOOP, Split.NEEDED_FIRST)
    assert P.trace_splits(big, True, True) == (Split.NEEDED_FIRST,)      # an outer body: whole
    assert P.trace_splits(big - 1, False, False) == ()
    assert P.trace_splits(big, False, True, loop_split=False) == (Split.NEEDED_FIRST,)
    assert P.trace_splits(big, False, True, cross_check=True) == ()      # compared op by op
    assert P.setup_split(5, True) and not P.setup_split(1, True)
    assert not P.setup_split(5, False) and not P.setup_split(5, True, setup_first=False)
    assert P.in_buckets() and not P.in_buckets(cross_check=True) and not P.in_buckets(False)
    assert P.plan_ahead() and not P.plan_ahead(ahead=False) and not P.plan_ahead(False, True)
    assert P.over_budget(3, 200, 100) and not P.over_budget(1, 200, 100)
    assert not P.over_budget(3, 200, 0) and not P.over_budget(3, 100, 100)
    few = policy.GRAPH_STEP_OPS
    assert P.cut_at_backward(few + 1) and not P.cut_at_backward(0)
    assert not P.cut_at_backward(few + 1, enabled=False)
    assert P.cut_at_backward(3, ())                             # eager ops only: cut
    assert not P.cut_at_backward(3, ("forward",))               # a compiled step's forward pass
    assert P.cut_at_backward(3, ("backward", "forward"))        # still holds a backward graph
    # sync reasons are typed too, and strings to every counter
    assert policy.Sync.ITEM == "item" and {"mode exit": 1}[policy.Sync.MODE_EXIT] == 1
    assert f"{policy.Sync.COLLECTIVE}" == "collective"
    assert not any(policy.is_async(r) for r in policy.Sync)


def test_cut_policy_says_how_a_churning_structure_runs():
    # NOTE [shape churn] (runtime/flush.py), decided by CutPolicy.new_shapes: compiled whole until
    # the limit, then split between changing and stable ops (remembered for the version), or op
    # by op when every op changed (and whole when that version comes back).
    from deferfuse.scheduler.policy import WHOLE, CutPolicy, ShapePlan, Shapes
    first = list("abcdef")
    assert CutPolicy.new_shapes(1, 2, None, first, list("aBcdef"), set()) == (WHOLE, None)
    vary = set()
    plan, keep = CutPolicy.new_shapes(2, 2, None, first, list("aBcdef"), vary)
    assert plan == ShapePlan(Shapes.SPLIT, (1, 2, 6)) and keep == (1, 2, 6) and vary == {1}
    assert CutPolicy.new_shapes(3, 2, keep, first, list("aBcdef"), vary) == (plan, None)
    plan, keep = CutPolicy.new_shapes(2, 2, None, first, list("ABCDEF"), set())
    assert plan.how is Shapes.OP_BY_OP and keep == "whole" and str(plan.how) == "op by op"
    assert CutPolicy.new_shapes(2, 2, keep, first, list("ABCDEF"), set()) == (WHOLE, None)
    # the first version at a new base of a structure that runs in buckets compiles whole, past
    # the limit too (NOTE [new bases] in runtime/buckets.py), and nothing is remembered for it
    assert CutPolicy.new_shapes(5, 2, None, first, list("aBcdef"), set(), True) == (WHOLE, None)


def test_report_words_every_cut_reason():
    """report() names each asynchronous cut in words; a reason without them raised KeyError."""
    from deferfuse.reporting import _CUT_WORDS
    from deferfuse.scheduler.policy import Cut
    assert set(_CUT_WORDS) == set(Cut)
