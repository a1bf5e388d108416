"""TorchRec's own sharding test harness, run with the proactive sharder (issue #9).

``ModelParallelTestShared._test_sharding`` (installed with the torchrec wheel) builds
TorchRec's ``TestSparseNN`` (weighted + unweighted + shared-feature tables), plans it with
TorchRec's planner under the given sharder, trains the sharded model on 2 gloo ranks and
compares it with the unsharded model. The sharders below restrict sharding type and kernel
the way TorchRec's ``TestEBCSharder`` does, on top of stock or proactive.

Sequence tables run through TorchRec's mixed test model (``TestMixedEmbeddingSparseArch``:
an ``EmbeddingCollection`` alone, or beside an ``EmbeddingBagCollection``) under the proactive
sequence sharder.

(Its VBE inputs, ``variable_batch_per_feature=True``, give each rank a batch of its own size,
whose predictions it all-gathers: gloo refuses tensors of unequal sizes, for stock's sharder as
for ours, so VBE is checked against stock in ``test_vbe.py`` instead.)

Default run: the stock sanity config, one proactive config per sharding type, and two sequence
configs; the full matrices (poolings x shardings x cache sizes) are marked ``slow``.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Dict, List, Optional

import pytest
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import PoolingType

from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder, ProactiveEmbeddingCollectionSharder


def _install_sequence_model_stub() -> None:
    """The wheel ships torchrec/distributed/test_utils but not torchrec/distributed/tests,
    which test_sharding.py imports one sharder class from (used only for sequence models,
    not by the pooled tests here). Register a stand-in module so the harness imports."""
    name = "torchrec.distributed.tests.test_sequence_model"
    if name in sys.modules:
        return
    try:
        __import__(name)
        return
    except ImportError:
        pass
    pkg = types.ModuleType("torchrec.distributed.tests")
    pkg.__path__ = []  # type: ignore[attr-defined]
    mod = types.ModuleType(name)

    class TestEmbeddingCollectionSharder(EmbeddingCollectionSharder):  # noqa: N801 - imported by name
        pass

    mod.TestEmbeddingCollectionSharder = TestEmbeddingCollectionSharder  # type: ignore[attr-defined]
    sys.modules.setdefault("torchrec.distributed.tests", pkg)
    sys.modules[name] = mod


_install_sequence_model_stub()

from torchrec.distributed.test_utils.multi_process import MultiProcessTestBase  # noqa: E402
from torchrec.distributed.test_utils.test_model import TestMixedEmbeddingSparseArch, TestSparseNN  # noqa: E402
from torchrec.distributed.test_utils.test_sharding import sharding_single_rank_test  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig  # noqa: E402

pytestmark = pytest.mark.multiprocess

SGD = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
SHARDINGS = [ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value, ShardingType.COLUMN_WISE.value,
             ShardingType.TABLE_ROW_WISE.value]


class StockTestSharder(EmbeddingBagCollectionSharder):
    """One sharding type and one kernel, as TorchRec's TestEBCSharder restricts them."""

    def __init__(self, sharding_type: str, kernel_type: str, fused_params: Optional[Dict[str, Any]] = None) -> None:
        self._sharding_type, self._kernel_type = sharding_type, kernel_type
        super().__init__(fused_params or {})

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [self._sharding_type]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [self._kernel_type]


class _OneTypeOneKernel:
    """TestEBCSharder's restriction (one sharding type, one kernel) on top of a proactive
    sharder (kernel ``fused_uvm_caching``)."""

    def __init__(self, sharding_type: str, kernel_type: str = "fused_uvm_caching",
                 fused_params: Optional[Dict[str, Any]] = None, cache_load_factor: float = 0.5) -> None:
        self._sharding_type, self._kernel_type = sharding_type, kernel_type
        super().__init__(fused_params or {}, cache_load_factor=cache_load_factor)  # type: ignore[call-arg]

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [self._sharding_type]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [self._kernel_type]


class ProactiveTestSharder(_OneTypeOneKernel, ProactiveEmbeddingBagCollectionSharder):
    """The restriction on top of the proactive EBC sharder."""


class ProactiveSequenceTestSharder(_OneTypeOneKernel, ProactiveEmbeddingCollectionSharder):
    """The restriction on top of the proactive sequence sharder."""


def _sequence_tables(pooled: bool):
    """Sequence tables (one dim, as an EmbeddingCollection needs) and, with ``pooled``, the
    pooled tables of TorchRec's mixed test model beside them."""
    tables: List[Any] = [EmbeddingConfig(num_embeddings=(i + 1) * 10, embedding_dim=16, name=f"seq_table_{i}",
                                         feature_names=[f"seq_feature_{i}"]) for i in range(3)]
    if pooled:
        tables += [EmbeddingBagConfig(num_embeddings=(i + 1) * 10, embedding_dim=(i + 1) * 8, name=f"table_{i}",
                                      feature_names=[f"feature_{i}"]) for i in range(2)]
    return tables


def _tables(pooling: PoolingType):
    """TorchRec's test-suite table set: 4 tables + 2 sharing features, 2 weighted tables."""
    tables = [EmbeddingBagConfig(num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 8, name=f"table_{i}",
                                 feature_names=[f"feature_{i}"], pooling=pooling) for i in range(4)]
    tables += [EmbeddingBagConfig(num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 8, name=f"table_{i + 4}",
                                  feature_names=[f"feature_{i}"], pooling=pooling) for i in range(2)]
    weighted = [EmbeddingBagConfig(num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 4, name=f"weighted_table_{i}",
                                   feature_names=[f"weighted_feature_{i}"]) for i in range(2)]
    shared = {f"feature_{i}" for i in range(2)}
    groups = {"group_0": [f"{f}@{t.name}" if f in shared else f for t in tables for f in t.feature_names]}
    return tables, weighted, groups


def _harness_rank(**kwargs: Any) -> None:
    """Rank entry point: pickled by reference to this module, so importing it in the
    spawned worker installs the stub before TorchRec's harness is imported."""
    sharding_single_rank_test(**kwargs)


class _Harness(MultiProcessTestBase):
    def run_harness(self, sharder, pooling: PoolingType = PoolingType.SUM) -> None:
        tables, weighted, groups = _tables(pooling)
        self._run_multi_process_test(
            callable=_harness_rank, world_size=2, model_class=TestSparseNN,
            tables=tables, weighted_tables=weighted, embedding_groups=groups, sharders=[sharder],
            backend="gloo", optim=EmbOptimType.EXACT_SGD,
        )


class _SequenceHarness(MultiProcessTestBase):
    def run_sequence(self, sharders, pooled: bool) -> None:
        """TorchRec's mixed EBC + EC test model (``TestMixedEmbeddingSparseArch``)."""
        self._run_multi_process_test(
            callable=_harness_rank, world_size=2, model_class=TestMixedEmbeddingSparseArch,
            tables=_sequence_tables(pooled), weighted_tables=None, embedding_groups={}, sharders=sharders,
            backend="gloo", optim=EmbOptimType.EXACT_SGD,
        )


class TestSequenceHarnessDefault(_SequenceHarness):
    def test_proactive_sequence_table_wise(self) -> None:
        self.run_sequence([ProactiveSequenceTestSharder(ShardingType.TABLE_WISE.value, fused_params=dict(SGD))],
                          pooled=False)

    def test_proactive_mixed_row_wise(self) -> None:
        self.run_sequence([ProactiveSequenceTestSharder(ShardingType.ROW_WISE.value, fused_params=dict(SGD)),
                           ProactiveTestSharder(ShardingType.ROW_WISE.value, fused_params=dict(SGD))], pooled=True)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", [ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value,
                                      ShardingType.COLUMN_WISE.value])
@pytest.mark.parametrize("pooled", [False, True], ids=["ec", "ec+ebc"])
@pytest.mark.parametrize("load_factor", [0.1, 1.0])
def test_sequence_harness_matrix(sharding, pooled, load_factor):
    case = _SequenceHarness("run_sequence")
    case.setUp()
    try:
        sharders = [ProactiveSequenceTestSharder(sharding, fused_params=dict(SGD), cache_load_factor=load_factor)]
        if pooled:
            sharders.append(ProactiveTestSharder(sharding, fused_params=dict(SGD), cache_load_factor=load_factor))
        case.run_sequence(sharders, pooled)
    finally:
        case.tearDown()


class TestHarnessDefault(_Harness):
    def test_stock_table_wise_sanity(self) -> None:
        # the harness itself works on CPU / gloo with the stock sharder
        self.run_harness(StockTestSharder(ShardingType.TABLE_WISE.value, "fused", dict(SGD)))

    def test_proactive_table_wise(self) -> None:
        self.run_harness(ProactiveTestSharder(ShardingType.TABLE_WISE.value, fused_params=dict(SGD)))

    def test_proactive_row_wise_mean(self) -> None:
        self.run_harness(ProactiveTestSharder(ShardingType.ROW_WISE.value, fused_params=dict(SGD)), PoolingType.MEAN)

    def test_proactive_column_wise(self) -> None:
        self.run_harness(ProactiveTestSharder(ShardingType.COLUMN_WISE.value, fused_params=dict(SGD)))

    def test_proactive_table_row_wise(self) -> None:
        self.run_harness(ProactiveTestSharder(ShardingType.TABLE_ROW_WISE.value, fused_params=dict(SGD)))


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN], ids=["sum", "mean"])
@pytest.mark.parametrize("load_factor", [0.1, 1.0])
def test_harness_matrix(sharding, pooling, load_factor):
    case = _Harness("run_harness")
    case.setUp()
    try:
        case.run_harness(ProactiveTestSharder(sharding, fused_params=dict(SGD), cache_load_factor=load_factor), pooling)
    finally:
        case.tearDown()
