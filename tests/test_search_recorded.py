"""The search over a recorded real profile, not a synthetic one: tests/data/llama4_cpu holds the dump (profile.json,
planning.json, graphs.json, gzipped) of a 4-layer LLaMA (hidden 64, 4 query and 2 key/value heads, vocab 96, batch 4
of 64 tokens) that `protrain_fx.explain` profiled and planned on a CPU with `options={"dump_dir": ...}`
(tests/data/README.md). Planned again from it (debug/from_dump.py) at capacities from above every chunk persistent
down to the least any plan needs, the search chooses what brute force ranks first, and less capacity never gives a
faster plan."""

import gzip
import shutil
from pathlib import Path

import pytest

from protrain_fx.debug.from_dump import plan_from_dump, read_dump
from protrain_fx.planner.cost import Candidate
from protrain_fx.planner.inputs import cost_model
from protrain_fx.planner.search import SEARCHED, brute_force, candidates, plan_graph, rank, ranked_step_s, tie_rel

RECORDED = Path(__file__).parent / "data" / "llama4_cpu"
FRACTIONS = (1.2, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)  # from all chunks persistent to the least


def _unpacked(packed_files, folder: Path) -> Path:
    """`folder` holding the gzipped `packed_files` unpacked."""
    for packed in packed_files:
        with gzip.open(packed) as src, open(folder / packed.stem, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return folder


@pytest.fixture
def recorded(tmp_path) -> Path:
    """The recorded graph folder, unpacked."""
    return _unpacked(RECORDED.glob("*.json.gz"), tmp_path)


def _config(plan) -> Candidate:
    return Candidate(*(getattr(plan, k) for k in SEARCHED))


def test_the_recorded_dump_plans_again_as_it_was_planned(recorded):
    """The dump holds what planning reads: planned again with its own forced fields (none) and capacity (none, on
    the CPU), every chunk stays persistent, as when it was recorded."""
    profile, inputs = read_dump(recorded)
    assert inputs.forced == {} and inputs.capacity_bytes is None and profile.device == "cpu"
    plan = plan_from_dump(recorded)
    assert plan.n_persist == inputs.layout.n_chunk > 1 and plan.n_checkpoint == plan.n_swap == 0


def test_search_over_a_recorded_profile_is_brute_force_and_monotone(recorded):
    profile, inputs = read_dump(recorded)
    costs = cost_model(profile, inputs, {})
    tie, ranked = tie_rel(costs), ranked_step_s(costs)
    everything = costs.reserved_bytes(Candidate(costs.n_chunk))
    least = min(costs.reserved_bytes(config, peak) for config, _, peak in brute_force(costs, None))
    chosen, fastest_above = set(), None
    for capacity in (int(least + (everything - least) * f) for f in FRACTIONS):
        plan = plan_graph(costs, {}, inputs.layout, capacity, inputs.host_bytes)
        fits = brute_force(costs, capacity)
        best, runners_up = rank(fits, capacity, alpha=costs.alpha, tie=tie)
        assert _config(plan) == best[0] and [_config(r) for r in plan.runners_up] == [r[0] for r in runners_up]
        assert plan.predicted_step_s == pytest.approx(costs.step_s(best[0]))
        fastest = min(step for _, step, _ in fits)
        assert ranked(best[0]) <= fastest * (1 + tie)  # (a tie goes to the plan that rewrites least)
        if fastest_above is not None:  # less capacity: nothing faster than the fastest with more
            assert fastest >= fastest_above and ranked(best[0]) >= fastest_above, capacity
        fastest_above = fastest
        chosen.add(best[0])
    assert len(chosen) > 3  # (the capacities leave the search choices to make)


GPU_PROFILES = Path(__file__).parent / "data" / "llama5b_h200"
# where the two GPU profiles chose apart while each copy ran at the rate where it started (planner/link.py)
GPU_FRACTIONS = (0.2, 0.75)


def _gpu_profiles(tmp_path) -> list[tuple]:
    """The two recorded GPU profiles of the 5.5B LLaMA-style model (tests/data/README.md), read back."""
    read = []
    for folder in sorted(GPU_PROFILES.glob("profile*")):
        (out := tmp_path / folder.name).mkdir()
        read.append(read_dump(_unpacked([*folder.glob("*.json.gz"), GPU_PROFILES / "graphs.json.gz"], out)))
    return read


def test_two_gpu_profiles_of_one_model_predict_and_choose_alike(tmp_path):
    """Two profiles of a 5.5B model on one H200 (node times at most 0.024 ms apart) price a host-bound plan alike
    and choose the same plan at every capacity tried: a copy's rate follows what runs during it, so a hair's
    shift of a host span's edge moves a copy's time by a hair (at the rate where it started, the plan below was
    priced 0.67% apart, and the two profiles chose apart at each of GPU_FRACTIONS)."""
    (profile, inputs), (other, other_inputs) = _gpu_profiles(tmp_path)
    costs, other_costs = cost_model(profile, inputs, {}), cost_model(other, other_inputs, {})
    host_bound = Candidate(n_persist=3, n_buffer=3, n_swap=0, n_checkpoint=25)
    assert other_costs.step_s(host_bound) == pytest.approx(costs.step_s(host_bound), rel=5e-4)
    everything = costs.reserved_bytes(Candidate(costs.n_chunk))
    least = min(costs.reserved_bytes(row[0]) for row in candidates(costs, {}) if row)
    for fraction in GPU_FRACTIONS:
        capacity = int(least + (everything - least) * fraction)
        plans = [
            plan_graph(c, {}, i.layout, capacity, i.host_bytes)
            for c, i in ((costs, inputs), (other_costs, other_inputs))
        ]
        assert _config(plans[0]) == _config(plans[1]), fraction
