"""Prints, as JSON, what torch's DeviceMesh makes on every rank, for a grid of
mesh shapes (1-D to 4-D, world sizes up to 16, dims of size 1 included), each
laid out as `init_device_mesh` does (`arange(world).view(shape)`) and, from
2-D on, also given explicitly as the reversed ranks (`DeviceMesh(mesh=...)`).

consort's comm/tests/device_mesh_torch.rs requires its layout to equal this
(tests/golden/device_mesh_torch.json was made by this script; CI reruns it
against the installed torch and requires the same output).

One process plays every rank in turn, on torch's "fake" backend (groups are
made, no data moves). Per shape: the mesh (`mesh.tolist()`), and per rank:
- `coordinate`: `get_coordinate()`;
- `groups`: per dim, `get_process_group_ranks(mesh.get_group(d))`;
- `local_ranks`: per dim, `get_local_rank(d)`;
- `slices`: for every ordered pair of distinct dims (i, j), `mesh[ni, nj]`'s
  `mesh.tolist()` and `get_coordinate()`, or torch's refusal;
- `flatten`: for every pair i < j, `mesh[ni, nj]._flatten()`'s group ranks
  (read back through the root mesh's `get_group("ni_nj")`);
- `unflatten`: for every dim of size n, `_unflatten(d, (p, n // p), ...)`
  with p the smallest prime factor of n (1 when n is 1 or prime): the new
  mesh's groups per dim.

Usage: python torch_device_mesh.py > tests/golden/device_mesh_torch.json
"""
import itertools
import math
import json
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

WORLDS = (1, 2, 3, 4, 6, 8, 12, 16)
# 3-D and 4-D meshes: every shape up to 8 ranks, and these beyond.
LARGE = {(2, 2, 4), (4, 1, 3), (2, 3, 2), (2, 2, 2, 2), (1, 2, 3, 2), (3, 2, 1, 2)}


def shapes():
    for world in WORLDS:
        for nd in range(1, 5):
            for shape in itertools.product(range(1, world + 1), repeat=nd):
                if math.prod(shape) == world and (nd <= 2 or world <= 8 or shape in LARGE):
                    yield shape


def split_of(n):
    p = next((p for p in range(2, n) if n % p == 0), 1)
    return (p, n // p)


def ranks_of(group):
    return dist.get_process_group_ranks(group)


def rank_row(mesh, names):
    nd = len(names)
    row = {
        "coordinate": list(mesh.get_coordinate()),
        "groups": [ranks_of(mesh.get_group(d)) for d in range(nd)],
        "local_ranks": [mesh.get_local_rank(d) for d in range(nd)],
        "slices": [],
        "flatten": [],
        "unflatten": [],
    }
    for i, j in itertools.permutations(range(nd), 2):
        try:
            sub = mesh[names[i], names[j]]
            s = {"mesh": sub.mesh.tolist(), "coordinate": list(sub.get_coordinate())}
        except Exception as e:  # torch refuses this slice
            s = {"error": type(e).__name__}
        row["slices"].append({"dims": [i, j], **s})
    for i, j in itertools.combinations(range(nd), 2):
        mesh[names[i], names[j]]._flatten()
        flat = ranks_of(mesh.get_group(f"{names[i]}_{names[j]}"))
        row["flatten"].append({"dims": [i, j], "group": flat})
    for d in range(nd):
        sizes = split_of(mesh.size(d))
        new = (f"{names[d]}_a", f"{names[d]}_b")
        u = mesh._unflatten(d, sizes, new)
        groups = [ranks_of(u.get_group(k)) for k in range(u.ndim)]
        row["unflatten"].append({"dim": d, "sizes": list(sizes), "groups": groups})
    return row


def shape_rows(shape, reversed_ranks):
    world = math.prod(shape)
    names = tuple(f"d{i}" for i in range(len(shape)))
    out = {"shape": list(shape), "reversed": reversed_ranks, "ranks": []}
    for r in range(world):
        dist.init_process_group("fake", rank=r, world_size=world, store=FakeStore())
        try:
            if reversed_ranks:
                ranks = torch.arange(world - 1, -1, -1).view(shape)
                mesh = DeviceMesh("cpu", ranks, mesh_dim_names=names)
            else:
                mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            out["mesh"] = mesh.mesh.tolist()
            out["ranks"].append(rank_row(mesh, names))
        finally:
            dist.destroy_process_group()
    return out


rows = []
for shape in shapes():
    rows.append(shape_rows(shape, False))
    if len(shape) >= 2:
        rows.append(shape_rows(shape, True))
sys.stdout.write("[\n")
sys.stdout.write(",\n".join(json.dumps(r, separators=(",", ":")) for r in rows))
sys.stdout.write("\n]\n")
