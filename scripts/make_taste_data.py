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
"""

from __future__ import annotations

import argparse
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
    args = p.parse_args()
    lines = generate(args)
    args.path.parent.mkdir(parents=True, exist_ok=True)
    # raw ids start at 1, as in the files SASRec ships
    args.path.write_text("".join(f"{u} {i + 1}\n" for u, i in lines))
    users = len({u for u, _ in lines})
    print(f"wrote {args.path}: {users} users, {len(lines)} interactions")


if __name__ == "__main__":
    main()
