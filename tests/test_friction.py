"""The small things a new user trips over: the public API in ``dir()``, the README's
trainer snippet that runs as written, log lines that say what happened (whole-table caches,
one set of data/cache lines for ``compare``), a quiet ``sharding=auto``, and install docs
that do not break torchx's pins."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torchrec import EmbeddingBagConfig

from tests.test_cli import TINY, cli
from torchrec_proactive.app.compose import compose_config
from torchrec_proactive.app.model import cache_slots, describe_growth

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_dir_lists_the_public_api() -> None:
    code = "import torchrec_proactive as t, sys; print(sorted(dir(t))); print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 0, p.stderr
    names, torch_loaded = p.stdout.splitlines()
    for name in ("ProactiveEmbeddingBagCollectionSharder", "ProactiveTrainPipeline", "LinkModel", "__version__"):
        assert f"'{name}'" in names, names
    assert "'Any'" not in names and torch_loaded == "False"  # still lazy
    import torchrec_proactive
    from torchrec_proactive.fetch import LinkModel

    assert torchrec_proactive.LinkModel is LinkModel
    assert set(torchrec_proactive.__all__) <= set(dir(torchrec_proactive))


def test_what_the_docstrings_point_to_can_be_imported_and_every_argument_is_documented() -> None:
    """The sharder's docstring points to ProactiveOptions: importable from the package; the
    constructor arguments of LinkModel and ProactiveTrainPipeline each documented; the
    near-zero stall on CPU without a link said where users read (the pipeline, the README)."""
    import inspect

    import torchrec_proactive
    from torchrec_proactive.integration.options import ProactiveOptions

    assert "ProactiveOptions" in torchrec_proactive.ProactiveEmbeddingBagCollectionSharder.__doc__
    assert torchrec_proactive.ProactiveOptions is ProactiveOptions and "ProactiveOptions" in dir(torchrec_proactive)
    for cls in (torchrec_proactive.LinkModel, torchrec_proactive.ProactiveTrainPipeline, ProactiveOptions):
        doc = inspect.getdoc(cls)
        for name in inspect.signature(cls).parameters:
            assert re.search(rf"^\s*{name}\b.*:", doc, re.M), (cls.__name__, name)
    pipeline_doc = inspect.getdoc(torchrec_proactive.ProactiveTrainPipeline)
    readme = " ".join((REPO / "README.md").read_text().split())
    for where in (" ".join(pipeline_doc.split()), readme):
        assert "stall_s stays near 0" in where.replace("`", ""), where[:200]


def _snippet() -> str:
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- trainer-snippet -->\n```python\n(.*?)```\n<!-- /trainer-snippet -->", text, re.S)
    assert block, "README.md lost its trainer snippet markers"
    return block.group(1)


def test_readme_snippet_says_what_users_must_know() -> None:
    code = _snippet()
    assert "fused_params = {" in code and "EmbOptimType" in code
    assert "in_backward_optimizer_filter(model.named_parameters())" in code
    assert "from torchrec_proactive import LinkModel" in code and "torchrec_proactive.fetch.LinkModel" in code


@pytest.mark.multiprocess
def test_readme_trainer_snippet_runs_on_two_gloo_ranks(tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(_snippet())
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", "2", str(script)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
    # the README's constraints leave TorchRec's planner nothing to warn about (a kernel list
    # without data_parallel's kernels, with sharding types that have them: no "No available
    # compute kernels ... data_parallel" per table)
    assert "No available compute kernels" not in p.stdout + p.stderr, p.stderr[-3000:]
    lines = re.findall(r"rank (\d): loss ([\d.]+), eval loss ([\d.]+), hit rate ([\d.]+)", p.stdout)
    assert sorted(r for r, *_ in lines) == ["0", "1"], p.stdout
    assert all(math.isfinite(float(v)) for _, *values in lines for v in values)


def test_fit_depth_log_says_whole_table() -> None:
    cfg = compose_config(["experiment=ci_tiny"])  # batch 64, load factor 0.2: depth 2 pins 3 x 64 rows
    tables = [EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=rows, feature_names=[n])
              for n, rows in (("small", 100), ("medium", 500), ("big", 100_000))]
    slots, notes = cache_slots(tables, cfg, world_size=1, local_size=1, depth=2)
    assert slots == {"small": 100, "medium": 192}
    assert notes == ["small: 20 -> 100 slots (whole table)", "medium: 100 -> 192 slots"]
    assert "grown to hold 3 batches for 2 table(s), 1 of them to the whole table" in describe_growth(notes, 2)
    _, small = cache_slots(tables[:1], cfg, 1, 1, 2)
    assert "every one of the 1 table(s) whole (every row on the device: nothing is fetched" in describe_growth(small, 2)


@pytest.mark.multiprocess
def test_compare_logs_data_and_caches_once_and_names_the_modes(ci_tiny_compare) -> None:
    run = ci_tiny_compare.run  # (conftest: one ci_tiny compare run several modules read)
    assert len(re.findall(r"\] data: \d+ training steps", run.err)) == 1, run
    assert len(re.findall(r"\] cache\.fit_depth:", run.err)) == 1, run
    assert "compare: reactive (prefetch off, depth 0) and proactive (depth 2)" in run.err, run


@pytest.mark.multiprocess
def test_sharding_auto_is_quiet(tmp_path: Path) -> None:
    run = cli("train", "--nproc", "2", *TINY, "train.max_steps=2", "sharding=auto", "data.max_cardinality=300",
              f"data.root={tmp_path / 'd'}", f"train.output_dir={tmp_path / 'out'}")
    assert run.rc == 0, run
    assert "torchrec.distributed.planner" not in run.err and "Warning" not in run.err, run
    assert "warning:" not in run.err, run  # (this package's warnings, in config words)
    # the log and the caches agree: the planner may put a table whole on one rank, and the
    # caches are sized from its plan's shards, so "whole table" means nothing is fetched
    assert "every one of the 26 table(s) whole (every row on the device: nothing is fetched" in run.err, run
    assert run.result()["hit_rate"] == 1.0, run


def test_cache_sizes_follow_the_plans_shards() -> None:
    import torch

    from torchrec_proactive.app.model import build_model, build_sharder, shard_rows, table_configs
    from torchrec_proactive.planning import build_plan

    cfg = compose_config(["experiment=ci_tiny", "sharding=auto"])
    rows = [300] * 26
    model = build_model(cfg.model, rows, torch.device("cpu"))
    plan = build_plan(model, build_sharder(cfg, {}), "table_wise", world_size=2, local_size=2)
    shards = shard_rows(plan)
    assert shards == {f"t_cat_{f}": 300 for f in range(26)}  # table-wise: a table's one shard is all of it
    slots, notes = cache_slots(table_configs(cfg.model, rows), cfg, 2, 2, depth=2, shard_rows=shards)
    assert set(slots.values()) == {300} and all(n.endswith("-> 300 slots (whole table)") for n in notes), notes


def test_docs_do_not_break_torchxs_urllib3_pin() -> None:
    # torchx 0.7.0 pins urllib3<1.27; the newest kubernetes client needs urllib3 2.x
    docs = [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("examples/**/*.md")]
    pinned = False
    for doc in docs:
        for line in doc.read_text().splitlines():
            pinned |= 'pip install "kubernetes==25.3.0"' in line
            if re.search(r"pip install \"?kubernetes(?![=<])", line):  # unpinned: only as a warning
                assert "urllib3" in line, f"{doc}: {line}"
    assert pinned


def test_gen_data_says_when_it_replaces_a_data_set(tmp_path):
    from tests.test_cli import cli

    first = cli("gen-data", "--out-dir", str(tmp_path / "d"), "--num-samples", "200")
    assert first.rc == 0 and "replacing" not in first.err, first
    again = cli("gen-data", "--out-dir", str(tmp_path / "d"), "--num-samples", "100")
    assert again.rc == 0 and f"replacing the data set in {tmp_path / 'd'}" in again.err, again


def test_synthetic_data_says_it_ignores_criteo_files_in_data_root(tmp_path, caplog):
    import logging

    from torchrec_proactive.app.compose import compose_config
    from torchrec_proactive.app.data import _synthetic_files

    (tmp_path / "train_sparse.npy").write_bytes(b"")  # a TorchRec-preprocessed set, as a user has it
    cfg = compose_config(["experiment=ci_tiny", "data.num_samples=200", f"data.root={tmp_path}"])
    with caplog.at_level(logging.WARNING):
        _synthetic_files(cfg.data, logging.getLogger("t"), progress=False)
    assert any("are not used" in r.getMessage() and "train_sparse.npy" in r.getMessage() for r in caplog.records)


def test_known_third_party_noise_is_hidden(monkeypatch, caplog) -> None:
    """Resume's ShardedTensor FutureWarning comes from TorchRec's KeyedOptimizer, and
    fbgemm_gpu logs every library it loads on the root logger (14 lines in compare's log)."""
    import logging
    import warnings

    from torchrec_proactive import quiet

    monkeypatch.setattr(quiet, "_quieted", False)
    root = logging.getLogger()
    before = list(root.filters)
    try:
        with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.INFO):
            warnings.simplefilter("always")
            quiet.quiet_third_party()
            warnings.warn_explicit("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning,
                                   "keyed.py", 300, module="torchrec.optim.keyed")
            warnings.warn_explicit("something else", FutureWarning, "keyed.py", 301, module="torchrec.optim.keyed")
            logging.info("Successfully loaded: 'fbgemm_gpu_config.so'")
            logging.info("another line")
        assert [str(w.message) for w in seen] == ["something else"]
        assert [r.getMessage() for r in caplog.records] == ["another line"]
    finally:
        root.filters[:] = before


def _plan(sharder, kernel: str):
    import torch
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=16, num_embeddings=5000, feature_names=[f])
              for f in "abc"]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    constraints = {t.name: ParameterConstraints(compute_kernels=[kernel]) for t in tables}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"), constraints=constraints)
    return planner.plan(ebc, [sharder]).plan[""]


def test_planner_notes_match_stocks_and_sharding_says_how_many_tables_are_proactive(caplog) -> None:
    import logging
    import warnings

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder as Sharder

    def notes(sharder, kernel: str):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torchrec.distributed.planner"):
            plan = _plan(sharder, kernel)
        return plan, [r for r in caplog.records if r.getMessage().startswith("No available compute kernels")]

    _, stock = notes(EmbeddingBagCollectionSharder(), "fused")  # a CPU trainer's constraint for stock
    plan, ours = notes(Sharder(), "fused_uvm_caching")  # the same trainer with the plugin
    assert len(stock) == len(ours) == 3, [r.getMessage()[-200:] for r in ours]  # data_parallel, once per table

    with caplog.at_level(logging.WARNING, logger="torchrec_proactive.integration.sharder"):
        assert Sharder.announce(plan) == 3
    assert "3 of 3 table(s) are proactive" in caplog.text  # (a WARNING: shown with no logging set up)

    fused, _ = notes(Sharder(), "fused")  # the sharder swapped, the constraints kept
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert Sharder.announce(fused) == 0
    assert len(seen) == 1, [str(w.message) for w in seen]
    text = str(seen[0].message)
    for fragment in ("none of the 3 table(s) is proactive", "3 fused", 'compute_kernels=["fused_uvm_caching"]'):
        assert fragment in text, text


def test_no_proactive_table_advice_is_in_config_words() -> None:
    import warnings

    from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder as Sharder
    from torchrec_proactive.app.config_words import in_config_words

    cfg = compose_config(["experiment=ci_tiny", "sharding.kernel=fused", "prefetch=off"])
    plan = _plan(Sharder(), "fused")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Sharder.announce(plan)
    text = in_config_words(str(seen[0].message), cfg)
    assert text.endswith("plan the tables to tier with sharding.kernel=fused_uvm_caching (now fused)"), text


@pytest.fixture(scope="module")
def one_rank():
    """The module's three 1-rank pipeline cases in one launch (starting a rank costs more than a case)."""
    from . import pipeline_worker
    from .cases_worker import call, launch_cases

    cases = {"untraceable": dict(fn=pipeline_worker.untraceable_forward, wrapped=False),
             "wrapped": dict(fn=pipeline_worker.untraceable_forward, wrapped=True),
             "unpipelined": dict(fn=pipeline_worker.unpipelined_module)}
    return launch_cases(call, list(cases), list(cases.values()), world_size=1)


def test_a_forward_fx_cannot_trace_is_named_with_the_fix(one_rank) -> None:
    """ProactiveTrainPipeline, like TorchRec's, finds the sharded modules by FX-tracing the
    forward: a forward it cannot trace gets one error naming that and the fix (stock: a bare
    ``TypeError`` about a ``Proxy``), and the fix trains with prefetching."""
    from .cases_worker import ok

    (bad,) = ok(one_rank["untraceable"])
    assert bad["error"] == "ModelNotTraceableError", bad
    for words in ("FX-trac", "_DataDependentModel.forward", "torch.fx.wrap", "Proxy"):
        assert words in bad["message"], (words, bad["message"])
    (good,) = ok(one_rank["wrapped"])
    assert good["steps"] == 4 and good["lead"] > 0, good


def test_a_proactive_module_the_pipeline_leaves_unpipelined_is_named(one_rank) -> None:
    """TorchRec's pipeline pipelines only modules whose KJT comes straight from the batch; a
    proactive module it leaves out trains exactly but fetches at its lookup (reactive): the
    pipeline says so once, naming the module and why, instead of running reactive silently."""
    from .cases_worker import ok

    (res,) = ok(one_rank["unpipelined"])
    assert res["steps"] == 4 and res["lookups"] == 4 and res["lead"] == 0, res
    assert len(res["warnings"]) == 1, res["warnings"]
    text = res["warnings"][0]
    for words in ("'ebc'", "not pipelined", "at its lookup", "prefetch_depth=2", "batch.sparse_features"):
        assert words in text, (words, text)
