"""Write a small SASRec-format file (``user item`` lines) with learnable structure.

No public dataset ships with the packages this project depends on (and the
machines are offline), so the "small real dataset" of the docs is generated,
deterministically: the same arguments give the same bytes.

Users belong to one of a few taste clusters (a third of them to a second
one as well). A history starts at an item of the user's cluster; each next
item is, with probability ``--follow``, one of the three fixed "follow-up"
items of the current one (co-occurrence: people who watch A then watch B),
else a popular item of one of the user's clusters, else (``--noise``) an
item of the global popularity law. Popularity alone predicts part of it; a
sequence model can learn the clusters and the follow-ups.

    python scripts/make_taste_data.py /tmp/taste.txt

With ``--files K`` the destination is a directory of K Parquet files (row
groups of ``--row-group`` rows) in the layout ``parquet-stream`` reads
(`freescale.data.parquet_stream`): one row per user, ``user_id`` and the
list columns ``items`` (ids as given, below ``--items``), ``actions``
(below 4) and ``timestamps`` (increasing); each file's metadata carries
``freescale.num_items`` and ``freescale.num_actions``. The same taste
process, drawn for all users of a file at once (a different random stream
than the text file's), so millions of events take seconds:

    python scripts/make_taste_data.py /tmp/taste --users 100000 --files 8 --row-group 5000
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def zipf_weights(n: int, alpha: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** alpha
    return w / w.sum()


def generate(args: argparse.Namespace) -> list[tuple[int, int]]:
    rng = np.random.default_rng(args.seed)
    per = args.items // args.clusters
    members = rng.permutation(args.clusters * per).reshape(args.clusters, per)
    cluster_law = zipf_weights(per, 1.0)
    global_law = zipf_weights(args.clusters * per, 1.1)
    global_order = rng.permutation(args.clusters * per)
    cluster_of = np.empty(args.clusters * per, dtype=np.int64)
    for c in range(args.clusters):
        cluster_of[members[c]] = c
    # three follow-ups per item, inside its own cluster
    follow = np.stack(
        [members[cluster_of[i]][rng.integers(0, per, 3)] for i in range(len(cluster_of))]
    )
    lines = []
    for user in range(1, args.users + 1):
        tastes = [int(rng.integers(args.clusters))]
        if rng.random() < 1 / 3:
            tastes.append(int(rng.integers(args.clusters)))
        n = int(np.clip(rng.lognormal(np.log(args.median_len), 0.6), 4, args.max_len))
        item = int(members[tastes[0]][rng.choice(per, p=cluster_law)])
        for _ in range(n):
            lines.append((user, item))
            u = rng.random()
            if u < args.follow:
                item = int(follow[item][rng.integers(3)])
            elif u < 1.0 - args.noise:
                c = tastes[int(rng.integers(len(tastes)))]
                item = int(members[c][rng.choice(per, p=cluster_law)])
            else:
                item = int(global_order[rng.choice(len(global_order), p=global_law)])
    return lines


NUM_ACTIONS = 4  # Parquet: a random action per event (click, like, ...)


def generate_lists(args: argparse.Namespace, rng: np.random.Generator, users: int):
    """``users`` histories of the taste process as (lengths, items), all users
    advanced one event at a time together."""
    per = args.items // args.clusters
    world = np.random.default_rng(args.seed)  # clusters and follow-ups: one world for all files
    members = world.permutation(args.clusters * per).reshape(args.clusters, per)
    cluster_of = np.empty(args.clusters * per, dtype=np.int64)
    cluster_of[members] = np.arange(args.clusters)[:, None]
    follow = members[cluster_of[:, None], world.integers(0, per, (cluster_of.size, 3))]
    global_order = world.permutation(args.clusters * per)
    cum_cluster = np.cumsum(zipf_weights(per, 1.0))
    cum_global = np.cumsum(zipf_weights(args.clusters * per, 1.1))

    def popular(cum: np.ndarray, n: int) -> np.ndarray:
        return np.minimum(np.searchsorted(cum, rng.random(n)), cum.size - 1)

    tastes = rng.integers(0, args.clusters, (users, 2))
    second = rng.random(users) < 1 / 3
    tastes[~second, 1] = tastes[~second, 0]
    lengths = np.clip(
        rng.lognormal(np.log(args.median_len), 0.6, users).astype(np.int64), 4, args.max_len
    )
    steps = np.zeros((users, int(lengths.max())), dtype=np.int64)
    item = members[tastes[:, 0], popular(cum_cluster, users)]
    for j in range(steps.shape[1]):
        steps[:, j] = item
        u = rng.random(users)
        taste = tastes[np.arange(users), rng.integers(0, 2, users)]
        by_taste = members[taste, popular(cum_cluster, users)]
        item = np.where(
            u < args.follow,
            follow[item, rng.integers(0, 3, users)],
            np.where(u < 1.0 - args.noise, by_taste, global_order[popular(cum_global, users)]),
        )
    keep = np.arange(steps.shape[1])[None, :] < lengths[:, None]
    return lengths, steps[keep]


def write_parquet(args: argparse.Namespace) -> dict:
    """``--files`` Parquet files of about ``--users / --files`` users each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    args.path.mkdir(parents=True, exist_ok=True)
    metadata = {
        "freescale.num_items": str(args.clusters * (args.items // args.clusters)),
        "freescale.num_actions": str(NUM_ACTIONS),
    }
    per_file = np.diff(np.linspace(0, args.users, args.files + 1).astype(np.int64)).tolist()
    events = groups = first = 0
    for k, users in enumerate(per_file):
        rng = np.random.default_rng([args.seed, k])
        lengths, items = generate_lists(args, rng, users)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        starts = np.repeat(rng.integers(1_600_000_000, 1_700_000_000, users), lengths)
        within = np.arange(items.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        lists = {
            "items": items,
            "actions": rng.integers(0, NUM_ACTIONS, items.size),
            "timestamps": starts + 60 * within,
        }
        table = pa.table(
            {
                "user_id": np.arange(first, first + users, dtype=np.int64),
                **{c: pa.ListArray.from_arrays(offsets, pa.array(v)) for c, v in lists.items()},
            }
        ).replace_schema_metadata(metadata)
        pq.write_table(table, args.path / f"part-{k:05d}.parquet", row_group_size=args.row_group)
        events, groups = events + items.size, groups + -(-users // args.row_group)
        first += users
    return {"users": args.users, "events": events, "files": args.files, "row_groups": groups}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", type=Path)
    p.add_argument("--users", type=int, default=4000)
    p.add_argument("--items", type=int, default=2000)
    p.add_argument("--clusters", type=int, default=10)
    p.add_argument("--median-len", type=float, default=20.0)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--follow", type=float, default=0.5)
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--files", type=int, default=0, help="Parquet files (0: one SASRec text file)")
    p.add_argument("--row-group", type=int, default=10_000, help="Parquet rows per row group")
    args = p.parse_args()
    if args.files:
        if not 1 <= args.files <= args.users or args.row_group < 1:
            p.error("--files must be in 1..--users and --row-group >= 1")
        print(json.dumps(write_parquet(args)))
        return
    lines = generate(args)
    args.path.parent.mkdir(parents=True, exist_ok=True)
    # raw ids start at 1, as in the files SASRec ships
    args.path.write_text("".join(f"{u} {i + 1}\n" for u, i in lines))
    users = len({u for u, _ in lines})
    print(f"wrote {args.path}: {users} users, {len(lines)} interactions")


if __name__ == "__main__":
    main()
