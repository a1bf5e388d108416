"""Cache planning: miss-ratio curves, the profile, TorchRec's planner with proactive costs."""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Sequence

import numpy as np
import pytest
import torch

from torchrec_proactive.bench.cache_replay import replay_table
from torchrec_proactive.cacheplan.curve import MissRatioCurve, pinned_rows, reuse_distances, shard_steps


def _lru_hits(steps: Sequence[np.ndarray], num_slots: int, warmup: int = 0) -> int:
    """Brute force: a batch-granular LRU cache of ``num_slots`` rows; a batch's distinct rows
    (in id order) are looked up, then become the most recent; victims are the least recent
    rows of other batches."""
    cache: "OrderedDict[int, None]" = OrderedDict()
    hits = 0
    for t, ids in enumerate(steps):
        rows = [int(r) for r in np.unique(ids)]
        assert len(rows) <= num_slots
        if t >= warmup:
            hits += sum(r in cache for r in rows)
        for r in rows:
            cache.pop(r, None)
            cache[r] = None
        while len(cache) > num_slots:
            cache.popitem(last=False)
    return hits


def _trace(seed: int, num_rows: int, batch: int, num_batches: int, alpha: float) -> List[np.ndarray]:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, num_rows + 1) ** alpha
    p /= p.sum()
    perm = rng.permutation(num_rows)
    return [perm[rng.choice(num_rows, size=batch, p=p)] for _ in range(num_batches)]


@pytest.mark.parametrize("seed", [0, 1])
def test_curve_equals_brute_force_lru_at_every_size(seed: int) -> None:
    steps = _trace(seed, num_rows=300, batch=24, num_batches=60, alpha=0.9)
    curve = MissRatioCurve.from_steps(steps, num_rows=300, depth=0, warmup=5)
    assert curve.accesses == sum(np.unique(s).size for s in steps[5:])
    checked = 0
    for slots in range(curve.pinned_rows, 301, 7):
        lru = _lru_hits(steps, slots, warmup=5)
        assert curve.hit_rows(slots) == lru, slots
        assert curve.expected_miss_rate(slots / 300) == pytest.approx(1 - lru / curve.accesses)
        checked += 1
    assert checked > 30
    assert curve.expected_miss_rate(0.0) == 1.0 and curve.expected_miss_rate(1.0) == 0.0
    rates = [curve.expected_miss_rate(x) for x in np.linspace(0, 1, 50)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # monotone
    assert 0.0 < curve.cacheability < 1.0


def test_reuse_distance_small_example() -> None:
    # batch 0: {1,2}; batch 1: {3}; batch 2: {1}: after 1 (position 1), rows 2 and 3 were planned
    d = reuse_distances([np.array([2, 1, 1]), np.array([3]), np.array([1, 3])])
    assert [x.tolist() for x in d] == [[-1, -1], [-1], [2, 0]]


def test_depth_pins_k_plus_one_batches() -> None:
    steps = [np.array([0, 1]), np.array([2, 3]), np.array([0, 4]), np.array([5, 6, 7])]
    assert pinned_rows(steps, 0) == 3
    assert pinned_rows(steps, 1) == 5  # {0,4} + {5,6,7}
    assert pinned_rows(steps, 2) == 7  # {2,3} + {0,4} + {5,6,7}
    curve = MissRatioCurve.from_steps(steps, num_rows=10, depth=1)
    assert curve.pinned_rows == 5 and curve.min_load_factor == 0.5
    # below the pinned rows no batch is planned ahead: nothing counts as a hit
    assert curve.expected_miss_rate(0.4) == 1.0


def test_curve_matches_the_real_store_replay() -> None:
    """The store's eviction is sampled LRU: its hit count is close to the curve's."""
    steps = _trace(3, num_rows=2000, batch=64, num_batches=80, alpha=1.0)
    for depth in (0, 2):
        curve = MissRatioCurve.from_steps(steps, num_rows=2000, depth=depth, warmup=10)
        for fraction in (0.2, 0.5):
            got = replay_table(steps, 2000, fraction, depth, warmup=10)
            predicted = curve.hit_rows(int(fraction * 2000))
            assert got["unique_rows"] == curve.accesses
            assert abs(got["hits"] - predicted) <= 0.05 * curve.accesses, (depth, fraction)


def test_json_round_trip_and_shards() -> None:
    steps = _trace(4, num_rows=100, batch=10, num_batches=20, alpha=1.1)
    curve = MissRatioCurve.from_steps(steps, num_rows=100, depth=1)
    again = MissRatioCurve.from_dict(curve.to_dict())
    assert again == curve
    lo = MissRatioCurve.from_steps(shard_steps(steps, 0, 50), 50)
    hi = MissRatioCurve.from_steps(shard_steps(steps, 50, 100), 50)
    assert lo.accesses + hi.accesses == MissRatioCurve.from_steps(steps, 100).accesses
    with pytest.raises(ValueError, match="num_rows"):
        MissRatioCurve.from_steps(steps, num_rows=10)


# -- TorchRec's planner with the curves ------------------------------------------------------

def _ebc(specs):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name=n, embedding_dim=16, num_embeddings=rows, feature_names=[f"f_{n}"])
              for n, rows in specs.items()]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _zipf_steps(seed: int, rows: int, alpha: float, ids_per_batch: int, num_batches: int = 60):
    from torchrec_proactive.data.criteo_synth import sample_zipf_ranks

    rng = np.random.default_rng(seed)
    return [sample_zipf_ranks(rng, rows, alpha, ids_per_batch) for _ in range(num_batches)]


def test_proposer_gives_more_cache_to_the_table_with_more_reuse() -> None:
    """Same rows and skew; ``busy`` looks up 4x the ids per batch (more reuse, more misses to
    save): TorchRec's EmbeddingOffloadScaleupProposer, fed our curves, gives it more cache."""
    from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder
    from torchrec_proactive.cacheplan.planner import plan_cache_sizes

    curves = {"busy": MissRatioCurve.from_steps(_zipf_steps(0, 20000, 1.0, 1024), 20000, depth=1, warmup=5),
              "quiet": MissRatioCurve.from_steps(_zipf_steps(1, 20000, 1.0, 256), 20000, depth=1, warmup=5)}
    assert curves["busy"].expected_lookups > 2 * curves["quiet"].expected_lookups
    plan = plan_cache_sizes(_ebc({"busy": 20000, "quiet": 20000}), ProactiveEmbeddingBagCollectionSharder(),
                            curves, budget_bytes=1_000_000, prefetch_depth=1, world_size=1, batch_size=256)
    lf = plan.load_factors
    assert lf["busy"] > lf["quiet"] >= curves["quiet"].min_load_factor, lf
    assert lf["busy"] < 0.999  # the budget binds: not everything is resident
    # both grew well past the pinned floors they started from: the proposer spent the budget
    assert lf["busy"] > 3 * curves["busy"].min_load_factor and lf["quiet"] > 3 * curves["quiet"].min_load_factor
    assert lf["busy"] - curves["busy"].min_load_factor > 2 * (lf["quiet"] - curves["quiet"].min_load_factor)
    assert "busy=" in plan.describe() and "budget 1000000" in plan.describe()


@pytest.mark.parametrize("world_size", [1, 2])
def test_budget_below_the_minimum_is_refused_naming_a_minimum_that_plans(world_size: int) -> None:
    """Issue 41: the refusal named the pinned rows' bytes (rows x dim x 4), a budget TorchRec's
    planner then refused too (it also counts optimizer state and I/O buffers). The one line
    must name cache.budget_bytes, its value and a minimum at which the planner does place
    every cache at its floor."""
    import re

    from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder
    from torchrec_proactive.cacheplan.planner import CacheBudgetError, plan_cache_sizes

    curves = {n: MissRatioCurve.from_steps(_zipf_steps(seed, 5000, 0.8, 512), 5000, depth=3)
              for seed, n in enumerate(("a", "b", "c"))}
    pinned_bytes = sum(c.pinned_rows for c in curves.values()) * 16 * 4  # the old figure
    model, sharder = _ebc({n: 5000 for n in curves}), ProactiveEmbeddingBagCollectionSharder()
    with pytest.raises(CacheBudgetError) as e:
        plan_cache_sizes(model, sharder, curves, budget_bytes=pinned_bytes // world_size, prefetch_depth=3,
                         world_size=world_size, batch_size=512)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"cache.budget_bytes={pinned_bytes // world_size} ")
    assert "prefetch depth 3" in msg and "a: " in msg and "b: " in msg
    minimum = int(re.search(r"minimum of (\d+) bytes per device", msg).group(1))
    assert e.value.minimum_bytes == minimum and f"cache.budget_bytes >= {minimum}" in msg
    plan = plan_cache_sizes(model, sharder, curves, budget_bytes=minimum, prefetch_depth=3,
                            world_size=world_size, batch_size=512)
    assert plan.min_budget_bytes == minimum
    for name, c in curves.items():
        assert c.pinned_rows <= plan.slots[name] < c.num_rows, (name, plan.slots)
    # profile-cache's figure is the same number, without a budget to check
    assert plan_cache_sizes(model, sharder, curves, 1, 3, world_size, batch_size=512,
                            minimum_only=True).min_budget_bytes == minimum


def test_planned_slots_never_below_the_floor_even_for_whole_tables() -> None:
    """Issue 41: the plan handed the store load factors, which it rounds into slots; a table
    whose k + 1 batches pin every one of its 600 rows was planned 0.999 (TorchRec's largest),
    599 slots as the store rounds it. The slots the store gets hold every floor."""
    from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder
    from torchrec_proactive.cacheplan.planner import plan_cache_sizes
    from torchrec_proactive.integration.options import ProactiveOptions

    full = [np.arange(600)[i % 3::3] for i in range(30)]  # any 3 consecutive batches: every row
    curves = {"full": MissRatioCurve.from_steps(full, 600, depth=2),
              "zipf": MissRatioCurve.from_steps(_zipf_steps(0, 5000, 0.8, 512), 5000, depth=2)}
    assert curves["full"].pinned_rows == 600
    plan = plan_cache_sizes(_ebc({"full": 600, "zipf": 5000}), ProactiveEmbeddingBagCollectionSharder(), curves,
                            budget_bytes=2_000_000, prefetch_depth=2, world_size=1, batch_size=512)
    # what a store of each table gets from the plan (the app gives the sharder plan.slots)
    options = ProactiveOptions(num_slots=getattr(plan, "slots", {}))
    store_slots = {t: min(options.num_slots_for(t, c.num_rows, plan.load_factors[t]), c.num_rows)
                   for t, c in curves.items()}
    assert store_slots["full"] == 600, store_slots
    assert all(store_slots[t] >= c.pinned_rows for t, c in curves.items()), store_slots


def test_device_planner_floor_counts_ids_until_sizes_come_back() -> None:
    """The device planner counts a batch by its ids (repeats included) until its sizes come
    back: its floor is the most ids of k + 1 consecutive batches, at most the rows."""
    from torchrec_proactive.cacheplan.curve import pinned_ids

    steps = [np.array([0, 0, 1]), np.array([2, 2, 2, 3]), np.array([0, 4])]
    assert [pinned_ids(steps, k) for k in (0, 1, 2)] == [4, 7, 9]
    c = MissRatioCurve.from_steps(steps, num_rows=8, depth=1)
    assert c.pinned_rows == 4 and c.pinned_ids == 7
    assert c.for_planner(on_device=False) is c
    device = c.for_planner(on_device=True)
    assert device.pinned_rows == 7 and device.min_load_factor == 7 / 8 and device.hit_rows(6) == 0.0
    assert MissRatioCurve.from_dict(c.to_dict()) == c
    assert MissRatioCurve.from_steps(steps, num_rows=5, depth=2).for_planner(on_device=True).pinned_rows == 5


def test_profile_reads_whole_global_batches_on_several_ranks(tmp_path) -> None:
    """Issue 41: on 2 ranks the profile measured rank 0's share of each global batch only
    (KeyedJaggedTensor.concat joins keys: the second rank's copy of a key was never read),
    so its floors were about half of what the store needs, and a run sized at them deferred
    every batch to its lookup. Batch t of the profile holds every rank's ids of step t."""
    import logging

    from torchrec_proactive.app.cache_plan import _global_batches
    from torchrec_proactive.app.compose import compose_config
    from torchrec_proactive.app.data import _prepare_here
    from torchrec_proactive.data.criteo import make_dataloaders

    cfg = compose_config(["experiment=ci_tiny", f"data.root={tmp_path}", "cache.profile_batches=3"])
    pre = _prepare_here(cfg.data, logging.getLogger("test"), False)
    batches = list(_global_batches(pre, cfg, 2))
    assert len(batches) == 3
    ranks = [iter(make_dataloaders(pre, cfg.train.batch_size, r, 2, eval_fraction=cfg.data.eval_fraction)[0])
             for r in range(2)]
    for kjt in batches:
        parts = [next(it).sparse_features.to_dict() for it in ranks]
        got = kjt.to_dict()
        assert list(got) == list(parts[0]) and len(got) == 26
        for key, jt in got.items():
            assert jt.values().tolist() == parts[0][key].values().tolist() + parts[1][key].values().tolist(), key


def test_perf_estimate_charges_only_the_unhidden_fetch() -> None:
    """Depth 0: TorchRec's own prefetch cost; deeper: never more, and less once the fetch
    fits behind the k batches ahead."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.distributed.types import CacheParams

    from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder
    from torchrec_proactive.cacheplan.planner import ProactivePerfEstimator

    curve = MissRatioCurve.from_steps(_zipf_steps(0, 20000, 0.9, 512), 20000, depth=0)
    constraints = {"t": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused_uvm_caching"],
                                             cache_params=CacheParams(load_factor=0.1, stats=curve))}
    topo = TopologyFactory.create_topology(TrainerConfig(world_size=1, local_world_size=1),
                                           kernel_config=KernelConfig(compute_device="cuda"))

    def prefetch(estimator) -> float:
        e = EmbeddingEnumerator(topology=topo, batch_size=512, constraints=constraints, estimator=[estimator])
        options = e.enumerate(_ebc({"t": 20000}), [ProactiveEmbeddingBagCollectionSharder()])
        return sum(s.perf.prefetch_compute for o in options for s in o.shards)

    stock = prefetch(EmbeddingPerfEstimator(topo, constraints))
    assert stock > 0
    assert prefetch(ProactivePerfEstimator(topo, constraints, prefetch_depth=0)) == pytest.approx(stock)
    deep = [prefetch(ProactivePerfEstimator(topo, constraints, prefetch_depth=k)) for k in (1, 2, 4)]
    assert all(d <= stock for d in deep) and deep[-1] < stock
    assert all(a >= b for a, b in zip(deep, deep[1:]))


def test_bench_cache_planning_writes_both_arms_at_equal_bytes(tmp_path) -> None:
    """`bench --cache-planning --quick --json F`: the keys the checks read, equal cache bytes
    (each within the budget), per-table caches in both arms; counters only, never times."""
    import json

    from torchrec_proactive.bench.runner import main

    out = tmp_path / "cp.json"
    assert main(["--cache-planning", "--quick", "--json", str(out)]) == 0
    cp = json.loads(out.read_text())["cache_planning"]
    budget = cp["budget_bytes"]
    assert set(cp["load_factors"]) == {"t0", "t1", "t2", "t3"}
    assert all(0 < lf < 1 for lf in cp["load_factors"].values())
    row_bytes = 16 * 4
    for arm in ("uniform", "planned", "uniform_shared"):
        a = cp[arm]
        assert set(a) >= {"hit_rate", "rows_fetched_per_step", "step_ms", "cache_bytes"}
        assert 0.0 <= a["hit_rate"] <= 1.0 and a["rows_fetched_per_step"] > 0 and a["cache_bytes"] <= budget
        assert a["cache_bytes"] == sum(a["slots"].values()) * row_bytes
    # equal bytes: the uniform arm rounds down, by less than a row per table
    assert 0 <= cp["planned"]["cache_bytes"] - cp["uniform"]["cache_bytes"] < 4 * row_bytes
    # TorchRec's grouping kept (one store for the four tables) in every arm; the planned and
    # uniform arms give each table its own budget of its slots, the shared arm does not
    assert cp["planned"]["stores"] == cp["uniform"]["stores"] == cp["uniform_shared"]["stores"] == 1
    assert cp["planned"]["per_table_slots"] == cp["planned"]["slots"]
    assert cp["uniform"]["per_table_slots"] == cp["uniform"]["slots"]
    assert cp["uniform_shared"]["per_table_slots"] == {}
    # the planned slots are the planner's load factors
    rows = {t: v["rows"] for t, v in cp["tables"].items()}
    assert cp["planned"]["slots"] == {t: max(1, round(lf * rows[t])) for t, lf in cp["load_factors"].items()}


# -- the run: profile-cache, cache.budget_bytes ----------------------------------------------

def _profile_cli(tmp_path, *extra: str):
    from torchrec_proactive.cli import main

    return main(["profile-cache", "--nproc", "1", "experiment=ci_tiny", "sharding=auto",
                 f"data.root={tmp_path / 'data'}", "cache.profile_batches=12", *extra])


def test_profile_cache_saves_reuses_and_plans(tmp_path, capsys) -> None:
    import json

    assert _profile_cli(tmp_path, f"train.output_dir={tmp_path / 'a'}") == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["reused"] is False and first["prefetch_depth"] == 2 and len(first["tables"]) == 26
    saved = json.loads(open(first["profile"]).read())
    assert set(saved["tables"]) == set(first["tables"]) and saved["prefetch_depth"] == 2
    # same data and config: reused; with a budget, the planner's load factors too
    assert _profile_cli(tmp_path, f"train.output_dir={tmp_path / 'b'}", "cache.budget_bytes=700000") == 0
    out = capsys.readouterr().out
    second = json.loads(out.strip().splitlines()[-1])
    assert second["reused"] is True and "cache plan (TorchRec planner" in out
    assert set(second["plan"]["load_factors"]) == set(first["tables"])
    # a different sample (or depth, batch, data): profiled again
    assert _profile_cli(tmp_path, f"train.output_dir={tmp_path / 'c'}", "prefetch.depth=1") == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["reused"] is False


def test_a_budget_at_the_refusals_minimum_prefetches_on_two_ranks(tmp_path, capsys) -> None:
    """Issue 41's repro, on ci_tiny: 2 ranks, sharding=auto, a budget. profile-cache prints the
    minimum budget; a smaller one is refused in one line naming it, before anything is
    written; a run given it plans every cache at its floor and prefetches: at most 5% of its
    rows fetched at lookup, nothing deferred. (On the code before, a 2-rank profile measured
    half of each global batch, so caches at its floors deferred every batch to its lookup.)"""
    import json

    from torchrec_proactive.cli import main

    def code_of(argv) -> int:
        try:
            return main(argv)
        except SystemExit as e:  # (an error inside Hydra's app exits with the CLI's code)
            return int(e.code)

    common = ["--nproc", "2", "experiment=ci_tiny", "sharding=auto", f"data.root={tmp_path / 'data'}",
              "train.epochs=1"]
    assert code_of(["profile-cache", *common, f"train.output_dir={tmp_path / 'p'}"]) == 0
    out = capsys.readouterr().out
    profile = json.loads(out.strip().splitlines()[-1])
    minimum = profile["min_budget_bytes"]
    assert f"minimum cache.budget_bytes at prefetch depth 2: {minimum} bytes per device" in out

    small = minimum // 2
    assert code_of(["train", *common, f"train.output_dir={tmp_path / 'small'}", f"cache.budget_bytes={small}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"torchrec-proactive train: error: cache.budget_bytes={small} is below the minimum of "
                              f"{minimum} bytes per device for prefetch depth 2: "), err[-1]
    assert "t_cat_" in err[-1] and f"give cache.budget_bytes >= {minimum}" in err[-1]
    assert not (tmp_path / "small").exists()  # refused before anything was written

    run = tmp_path / "run"
    assert code_of(["train", *common, f"train.output_dir={run}", f"cache.budget_bytes={minimum}"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    result = json.loads((run / "result.json").read_text())
    assert result == printed  # the run directory's copy of the result line
    assert result["rows_fetched_per_step"] > 0 and result["deferred_batches"] == 0, result
    assert result["rows_fetched_at_lookup_per_step"] <= 0.05 * result["rows_fetched_per_step"], result
    floors = {name: t["min_slots"] for name, t in profile["tables"].items()}
    assert set(result["cache_slots"]) == set(floors)
    assert all(result["cache_slots"][name] >= floor for name, floor in floors.items()), (result["cache_slots"], floors)
    log = (run / "rank_0" / "train.log").read_text()
    assert f"budget {minimum} bytes/device" in next(x for x in log.splitlines() if "cache plan (TorchRec planner" in x)
    assert (run / "cache_profile.json").is_file()


def test_advice_under_a_budget_names_the_budget_not_the_load_factor_it_overrides() -> None:
    """Issue 41: under cache.budget_bytes a deferral advised 'cache.load_factor (now 0.2) >=
    0.663', a setting the budget overrides."""
    from torchrec_proactive.app.compose import compose_config
    from torchrec_proactive.app.config_words import capacity_error, in_config_words
    from torchrec_proactive.store import CacheCapacityError

    store_says = ("table 't_cat_0': its budget has 277 slots but 280 rows must be resident at once; with "
                  "prefetch_depth=2 about 540 slots are needed (depth + 1 batches of ~180 rows: "
                  "CacheParams.load_factor >= 0.663 of the 811 rows this store holds on this rank)")
    planned = compose_config(["sharding=auto", "cache.budget_bytes=700000"])
    text = in_config_words(store_says, planned)
    assert "cache.load_factor" not in text and "CacheParams" not in text, text
    assert "planned load factor (from cache.budget_bytes=700000: raise the budget) >= 0.663" in text, text
    refused = str(capacity_error(planned, CacheCapacityError(store_says)))
    assert refused.startswith("cache.budget_bytes=700000 is too small for prefetch.depth=2: ") and \
        "cache.load_factor" not in refused, refused
    # without a budget the load factor is the user's setting
    assert "cache.load_factor (now 0.2) >= 0.663" in in_config_words(store_says, compose_config([]))


def test_budget_needs_auto_sharding() -> None:
    from torchrec_proactive.app.compose import compose_config

    with pytest.raises(Exception, match=r"cache\.budget_bytes=1000 is invalid: needs sharding\.type='auto'"):
        compose_config(["sharding=table_wise", "cache.budget_bytes=1000"])


@pytest.mark.parametrize("world_size", [2])
def test_planned_sizes_are_exact_across_depths_and_vs_stock(world_size: int) -> None:
    """Planner-chosen per-table sizes (per-table budgets in one group store) change speed
    only: bit-identical parameters and outputs at depths 0, 1 and 3, stock TorchRec's within
    fp32 tolerance (2 gloo ranks)."""
    from torchrec_proactive.launch import run_ranks

    from . import cacheplan_worker

    results = run_ranks(cacheplan_worker.planned_exactness, world_size=world_size, depths=[0, 1, 3],
                        budget_bytes=BUDGET_FOR_EXACTNESS)
    lfs = results[0]["load_factors"]
    assert all(r["load_factors"] == lfs for r in results)  # every rank planned the same
    assert all(0 < lf < 0.999 for lf in lfs.values()) and len(set(lfs.values())) > 1, lfs
    per_table = 0
    for r in results:
        assert r["bitwise_equal_across_depths"] and r["same_keys_as_stock"], r["rank"]
        assert r["max_param_diff_vs_stock"] < 1e-5 and r["max_out_diff_vs_stock"] < 1e-5, r
        assert r["stats"][3]["rows_fetched"] > 0  # the caches really were smaller than the tables
        for sizes in r["sizes"].values():  # TorchRec's groups kept; each table its planned budget
            assert len(sizes) == 1, sizes  # (this rank's tables: one group, one store)
            for store_name, store in sizes.items():
                names = store_name.split("+")
                if len({lfs[n] for n in names}) > 1:
                    assert set(store["tables"]) == set(names), store
                    for name, s in store["tables"].items():
                        assert s["num_slots"] == max(1, round(lfs[name] * s["num_rows"])), (name, s)
                else:  # equal load factors: one shared cache of their slots
                    assert "tables" not in store, store
        per_table += sum("tables" in store for sizes in r["sizes"].values() for store in sizes.values())
    assert per_table > 0  # some store really split its slots among its tables


BUDGET_FOR_EXACTNESS = 30_000


def test_miss_curve_allocation_beats_every_other_split_on_a_grid() -> None:
    """allocate_by_curves (the miss-curve proposer's split) hits at least as many rows as any
    split of the same bytes on a grid, and never spends more than the budget."""
    import itertools

    from torchrec_proactive.cacheplan.proposer import allocate_by_curves

    curves = [MissRatioCurve.from_steps(_zipf_steps(s, 2000, a, 256, 80), 2000, depth=0, warmup=10)
              for s, a in ((0, 1.3), (1, 0.8), (2, 0.4))]
    per_clf = [2000 * 64.0] * 3
    start = [c.min_load_factor for c in curves]
    budget = 0.3 * 2000 * 64

    def hits(lfs):
        return sum(c.hit_rows(lf * c.num_rows) / c.num_batches for c, lf in zip(curves, lfs))

    got = allocate_by_curves(curves, per_clf, start, budget, 0.999)
    spent = sum((g - s) * a for g, s, a in zip(got, start, per_clf))
    assert spent <= budget + 1e-6 and all(g >= s for g, s in zip(got, start))
    best_grid = 0.0
    steps = [i / 20 for i in range(21)]
    for x, y in itertools.product(steps, steps):
        if x + y <= 1:
            share = [x, y, 1 - x - y]
            lfs = [min(0.999, s + f * budget / a) for s, f, a in zip(start, share, per_clf)]
            best_grid = max(best_grid, hits(lfs))
    assert hits(got) >= best_grid - 1e-6
    assert got[0] != got[2]  # skew decides: not a uniform split


def test_left_over_hbm_budget_needs_cuda() -> None:
    from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder
    from torchrec_proactive.cacheplan.planner import plan_cache_sizes

    curves = {"a": MissRatioCurve.from_steps(_zipf_steps(0, 1000, 0.8, 64, 10), 1000)}
    with pytest.raises(ValueError, match=r"cache\.budget_bytes=-1 .* needs a CUDA device"):
        plan_cache_sizes(_ebc({"a": 1000}), ProactiveEmbeddingBagCollectionSharder(), curves, None, 0, 1,
                         device_type="cpu")


def test_row_wise_shards_combine_into_the_tables_curve() -> None:
    """Each row-wise shard caches clf x its rows: the combined curve is the sum of the
    shards' brute-force LRU hits, and its floor is the fullest shard's pinned rows."""
    steps = _trace(5, num_rows=300, batch=40, num_batches=50, alpha=1.0)
    shards = [MissRatioCurve.from_steps(shard_steps(steps, lo, lo + 150), 150, depth=1, warmup=5) for lo in (0, 150)]
    table = MissRatioCurve.combine_shards(shards)
    assert table.num_rows == 300 and table.accesses == sum(s.accesses for s in shards)
    assert table.min_load_factor == pytest.approx(max(s.min_load_factor for s in shards), abs=1 / 300)
    for k in range(0, 151, 10):
        if k / 150 < table.min_load_factor:
            assert table.hit_rows(2 * k) == 0.0
            continue
        brute = sum(_lru_hits(shard_steps(steps, lo, lo + 150), k, warmup=5) for lo in (0, 150))
        assert table.hit_rows(2 * k) == pytest.approx(brute), k
    assert MissRatioCurve.from_dict(table.to_dict()) == table


def test_profile_of_row_wise_shards() -> None:
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    from torchrec_proactive.cacheplan.profile import profile_batches

    steps = _trace(6, num_rows=301, batch=30, num_batches=30, alpha=1.0)
    t = EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=301, feature_names=["f"])
    kjts = [KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.as_tensor(s),
                                                lengths=torch.ones(len(s), dtype=torch.int64)) for s in steps]
    whole = profile_batches(kjts, [t], depth=0)["t"]
    split = profile_batches(kjts, [t], depth=0, row_wise_shards=2)["t"]
    assert whole.accesses == split.accesses and split.num_rows == 301
    parts = [MissRatioCurve.from_steps(shard_steps(steps, lo, hi), hi - lo) for lo, hi in ((0, 151), (151, 301))]
    assert split == MissRatioCurve.combine_shards(parts)


def test_the_documented_python_path_runs() -> None:
    """docs/cache_planning.md's snippet, as written, on a user's EBC and sampled KJTs: every
    table gets a load factor at or above its pinned floor and a CacheParams with its curve."""
    import re
    from pathlib import Path

    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder

    doc = (Path(__file__).resolve().parent.parent / "docs" / "cache_planning.md").read_text()
    code = re.search(r"<!-- cacheplan-snippet -->\s*```python\n(.*?)```", doc, re.S).group(1)
    rows, batch_size = {"busy": 20000, "quiet": 5000}, 256
    tables = [EmbeddingBagConfig(name=n, embedding_dim=16, num_embeddings=r, feature_names=[f"f_{n}"])
              for n, r in rows.items()]
    rng = np.random.default_rng(0)
    sample_kjts = [
        KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f_{n}" for n in rows],
            values=torch.from_numpy(np.concatenate([(rng.zipf(1.2, batch_size) - 1) % r for r in rows.values()])),
            lengths=torch.ones(batch_size * len(rows), dtype=torch.int32))
        for _ in range(60)
    ]
    scope = {"sample_kjts": sample_kjts, "tables": tables, "model": _ebc(rows),
             "sharder": ProactiveEmbeddingBagCollectionSharder(), "budget_bytes": 1_000_000, "world_size": 1,
             "batch_size": batch_size}
    exec(compile(code, "docs/cache_planning.md", "exec"), scope)
    constraints, curves = scope["constraints"], scope["curves"]
    assert sorted(constraints) == sorted(rows)
    for name, c in constraints.items():
        assert c.cache_params.stats is curves[name]
        assert curves[name].min_load_factor <= c.cache_params.load_factor <= 1.0, (name, c.cache_params)
        # the sharder sizes each cache in slots, never below the floor
        assert curves[name].pinned_rows <= scope["sharder"].options.num_slots[name] == scope["plan"].slots[name]


def test_sequence_tables_get_curves_and_planned_caches_beside_pooled_ones() -> None:
    """An EmbeddingCollection's tables are profiled (one curve per table, from its features'
    ids: a history's many ids a sample) and sized by TorchRec's planner with the EC sharder,
    beside the EBC's tables: the busier history table gets the larger cache."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torch import nn

    from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder, ProactiveEmbeddingCollectionSharder
    from torchrec_proactive.cacheplan.planner import plan_cache_sizes
    from torchrec_proactive.cacheplan.profile import profile_batches
    from tests.sequence_model import make_sequence_batch

    meta = torch.device("meta")
    seq = [EmbeddingConfig(name="history", embedding_dim=16, num_embeddings=20000, feature_names=["h"])]
    pooled = [EmbeddingBagConfig(name="user", embedding_dim=16, num_embeddings=20000, feature_names=["u"])]
    model = nn.Module()
    model.ec, model.ebc = EmbeddingCollection(tables=seq, device=meta), EmbeddingBagCollection(tables=pooled, device=meta)
    # histories of 0..24 ids a sample (mean 12) against 1..3 pooled ids: far more reuse to cache
    kjts = [make_sequence_batch(seq, pooled, 256, seed=i, max_history=24, zipf=1.0).sparse_features for i in range(40)]
    curves = profile_batches(kjts, seq + pooled, depth=1, warmup=5)
    assert sorted(curves) == ["history", "user"]
    assert curves["history"].expected_lookups > 4 * curves["user"].expected_lookups
    plan = plan_cache_sizes(model, [ProactiveEmbeddingCollectionSharder(), ProactiveEmbeddingBagCollectionSharder()],
                            curves, budget_bytes=1_000_000, prefetch_depth=1, world_size=1, batch_size=256)
    lf = plan.load_factors
    assert sorted(lf) == ["history", "user"]
    assert all(plan.slots[t] >= curves[t].pinned_rows for t in lf)  # never below a floor
    assert lf["history"] > lf["user"], lf
