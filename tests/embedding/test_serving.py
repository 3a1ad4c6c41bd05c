"""`ShardedEmbeddingCollection.serving`: one lookup answers each call of the step, once."""

import pytest
import torch

from freescale.comm import run_threads
from freescale.embedding import ShardedEmbeddingCollection, TableConfig


def _check(comm) -> bool:
    tables = [TableConfig("a", 20, 4), TableConfig("b", 7, 4)]
    coll = ShardedEmbeddingCollection(tables, comm)
    ids = {"a": torch.tensor([1, 5, 5]), "b": torch.tensor([0, 6])}
    direct = coll(ids)
    with coll.serving(ids):
        b = coll({"b": ids["b"]})  # separate calls, any order
        a = coll({"a": ids["a"]})
    assert torch.equal(a["a"], direct["a"]) and torch.equal(b["b"], direct["b"])
    with pytest.raises(RuntimeError, match="made twice"), coll.serving(ids):
        coll({"a": ids["a"]})
        coll({"a": ids["a"]})
    with pytest.raises(RuntimeError, match="never used"), coll.serving(ids):
        coll({"a": ids["a"]})
    with pytest.raises(RuntimeError, match="does not match"), coll.serving(ids):
        coll({"a": torch.tensor([1, 5, 4])})
    return True


def test_serving_answers_each_lookup_once_and_checks_it():
    assert run_threads(_check, 1) == [True]
