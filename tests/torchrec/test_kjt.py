"""KJT <-> {feature: JaggedTensor}: TorchRec's own split is the reference; bad KJTs raise."""

import pytest
import torch

from freescale.comm import run_threads
from freescale.embedding import (
    SGD,
    ShardedEmbeddingCollection,
    ShardingPlan,
    SparseDataDist,
    TableConfig,
)
from freescale.jagged import JaggedTensor
from freescale.jagged.interop import features_to_kjt, is_kjt, kjt_to_features

torchrec = pytest.importorskip("torchrec")
KJT = torchrec.KeyedJaggedTensor


def _random_kjt(seed: int, keys: int, stride: int, dtype: torch.dtype, offsets_only: bool):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (keys * stride,), generator=g)
    lengths[::3] = 0  # zero-length samples
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
    names = [f"k{i}" for i in range(keys)]
    if offsets_only:
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        return KJT(keys=names, values=values, offsets=offsets.to(dtype), stride=stride)
    return KJT(keys=names, values=values, lengths=lengths.to(dtype), stride=stride)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("offsets_only", [False, True])
@pytest.mark.parametrize(("seed", "keys", "stride"), [(0, 1, 1), (1, 3, 5), (2, 4, 2)])
def test_kjt_to_features_matches_torchrec_and_round_trips(seed, keys, stride, dtype, offsets_only):
    kjt = _random_kjt(seed, keys, stride, dtype, offsets_only)
    ours = kjt_to_features(kjt)
    reference = kjt.to_dict()  # TorchRec's own split
    assert list(ours) == list(reference)
    for key, jt in ours.items():
        assert jt.offsets.dtype == torch.int64
        assert torch.equal(jt.values, reference[key].values())
        assert torch.equal(jt.lengths(), reference[key].lengths().to(torch.int64))
    back = features_to_kjt(ours)
    assert back.keys() == kjt.keys() and back.stride() == stride
    assert torch.equal(back.values(), kjt.values())
    assert torch.equal(back.lengths().to(torch.int64), kjt.lengths().to(torch.int64))


def test_kjt_to_features_prefix_and_empty():
    kjt = KJT(
        keys=["a"],
        values=torch.empty(0, dtype=torch.int64),
        lengths=torch.zeros(3, dtype=torch.int64),
    )
    ((key, jt),) = kjt_to_features(kjt, "ec.").items()
    assert key == "ec.a" and jt.offsets.tolist() == [0, 0, 0, 0]
    assert kjt_to_features(KJT.empty()) == {}
    assert is_kjt(kjt) and not is_kjt({"a": jt})


def _kjt(lengths, n_values, keys=("a", "b"), **kw):
    return KJT(
        keys=list(keys),
        values=torch.arange(n_values),
        lengths=torch.tensor(lengths, dtype=torch.int32),
        **kw,
    )


@pytest.mark.parametrize(
    ("kjt", "match"),
    [
        (lambda: _kjt([1, 0, 2, 1], 3), "'b'.*lengths sum to 4 but the KJT has 3"),
        (lambda: _kjt([1, 0, 2, 1], 6), "'b'.*lengths sum to 4 but the KJT has 6"),
        (lambda: _kjt([1, -1, 2, 1], 3), "'a' has a negative length"),
        (lambda: _kjt([1, 1, 1], 3, stride=2), "'b'.*3 lengths for 2 keys"),
        (lambda: _kjt([1, 1, 1, 1], 4, keys=("a", "a")), "'a' appears more than once"),
        (
            lambda: KJT(
                keys=["a", "b"],
                values=torch.arange(4),
                lengths=torch.tensor([1, 1, 1, 1]),
                offsets=torch.tensor([0, 1, 2, 2, 4]),
            ),
            "'b'.*lengths and offsets disagree",
        ),
    ],
)
def test_inconsistent_kjt_raises_naming_the_key(kjt, match):
    with pytest.raises(ValueError, match=match):
        kjt_to_features(kjt())


def test_features_to_kjt_raises_naming_the_key():
    a = JaggedTensor(torch.arange(3), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match=r"'b' has 1 samples.*'a' has 2"):
        features_to_kjt({"a": a, "b": JaggedTensor(torch.arange(2), torch.tensor([0, 2]))})
    with pytest.raises(ValueError, match=r"'b' has 2 samples of torch.int32"):
        features_to_kjt({"a": a, "b": JaggedTensor(a.values.int(), a.offsets)})
    with pytest.raises(ValueError, match=r"'b'.*values must be 1-D"):
        features_to_kjt({"a": a, "b": JaggedTensor(torch.zeros(3, 2), a.offsets)})
    with pytest.raises(ValueError, match=r"feature 'b'"):
        features_to_kjt({"a": a, "b": JaggedTensor(a.values, torch.tensor([0, 1, 4]))})
    with pytest.raises(ValueError, match=r"'a': expected a JaggedTensor"):
        features_to_kjt({"a": a.values})


def _collection_rank(comm, kjt):
    tables = [
        TableConfig("t1", 10, 3, feature_names=("f1", "f2")),
        TableConfig("t2", 5, 3, feature_names=("f3",)),
    ]
    plan = ShardingPlan(optimizer=SGD(lr=0.0))
    coll = ShardedEmbeddingCollection(tables, comm, plan, seed=1, mode=SparseDataDist())
    via_kjt = coll(kjt)
    via_dict = coll(kjt_to_features(kjt))
    coll.prefetch(kjt)  # the sdd path takes a KJT too
    prefetched = coll(kjt)
    return via_kjt, via_dict, prefetched


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_collection_takes_a_kjt_and_returns_torchrec_jagged(dtype):
    kjt = KJT(
        keys=["f1", "f2", "f3"],
        values=torch.tensor([1, 2, 9, 3, 4, 0]),
        lengths=torch.tensor([1, 2, 0, 2, 1, 0], dtype=dtype),  # stride 2, empty samples
    )
    for via_kjt, via_dict, prefetched in run_threads(_collection_rank, 2, kjt):
        assert list(via_kjt) == ["f1", "f2", "f3"]
        for f, jt in via_kjt.items():
            assert isinstance(jt, torchrec.JaggedTensor)
            assert torch.equal(jt.values(), via_dict[f].values)
            assert torch.equal(jt.offsets(), via_dict[f].offsets)
            assert torch.equal(prefetched[f].values(), jt.values())
        lengths = {f: via_kjt[f].lengths().tolist() for f in via_kjt}
        assert lengths == {"f1": [1, 2], "f2": [0, 2], "f3": [1, 0]}
        assert via_kjt["f2"].values().shape == (2, 3)


def _swapped_bad_kjt_rank(comm):
    from torch import nn

    from freescale.embedding import swap

    ec = torchrec.EmbeddingCollection(
        tables=[
            torchrec.EmbeddingConfig(
                name="t", embedding_dim=2, num_embeddings=4, feature_names=["f", "g"]
            )
        ],
        device=torch.device("cpu"),
    )
    model = nn.Sequential(ec)
    swap(model, ShardingPlan(), comm)
    bad = KJT(keys=["f", "g"], values=torch.arange(2), lengths=torch.tensor([1, 1, 1, 0]))
    with pytest.raises(ValueError, match=r"KJT key 'g'"):
        model(bad)
    return True


def test_swapped_collection_rejects_an_inconsistent_kjt():
    assert run_threads(_swapped_bad_kjt_rank, 1) == [True]
