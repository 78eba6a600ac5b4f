"""HSDP under torchft, on a rank (rank/ft.py): a model sharded with ``fully_shard`` over the
last dimension of the device mesh (``--mesh replicate=2,shard=2``, ``fully_shard(model,
mesh=mesh["shard"])``) is FSDP within its replica group, the ranks of one slice, and torchft
across the groups.

Replica group ``g`` of size ``S`` is ranks ``g*S .. g*S+S-1``, each at its place in the slice
(torchft numbers the ranks of a quorum that way). Its torchft Manager spans the group: group
rank 0 serves the group's store and its Manager server, the others reach them. After the
backward pass (FSDP's reduce-scatter within the group), the wrapped optimizer averages each
rank's gradient shards across the groups in the quorum through torchft, in one flat
allreduce per step, before it commits. A returning group heals shard by shard: each of its
ranks from the rank at the same place in a live group, as local tensors, made DTensors again
like the parameters they belong to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SHARD_LAST = (
    "shard it over the mesh's last dimension, which torchft's replica groups are the slices of: "
    '%monarch up --ft --mesh replicate=2,shard=2, then fully_shard(model, mesh=mesh["shard"])'
)


@dataclass
class Group:
    """This rank's replica group: ``index`` among the groups, ``rank`` within it."""

    size: int
    index: int
    rank: int
    dims: tuple[str, ...]
    mesh: Any = field(repr=False)

    @property
    def ranks(self) -> list[int]:
        return list(range(self.index * self.size, (self.index + 1) * self.size))


def group_of(model, rank: int, world: int) -> Group:
    """The replica group of ``model``'s sharding on this rank, or a one-line ValueError saying
    how to shard it where torchft cannot replicate it."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    if not params:
        raise ValueError(
            f"ft.wrap: the model is an FSDP module without sharded parameters; {SHARD_LAST}"
        )
    mesh = params[0].device_mesh
    if any(p.device_mesh != mesh for p in params):
        raise ValueError(
            f"ft.wrap: the model's parameters are sharded over different meshes; {SHARD_LAST}"
        )
    if not _formed(model, mesh):
        raise ValueError(
            "ft.wrap: the model is sharded over a process group that is gone (the cluster's "
            "group formed again since: a replica group came back, or a restart); run the "
            "--setup cells again, which shard a new model over the new `mesh`, and ft.wrap "
            "carries this one's shards, optimizer state and step over to it"
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"ft.wrap: the model is sharded over a {mesh.ndim}-D mesh (FSDP's own HSDP), where "
            f"torchft replicates across groups itself; {SHARD_LAST}"
        )
    size = mesh.size()
    if size >= world:
        raise ValueError(
            f"ft.wrap: the model is sharded over all {world} ranks, one replica group that "
            f"nothing could go on without; {SHARD_LAST}"
        )
    index, place = divmod(rank, size)
    members = mesh.mesh.flatten().tolist()
    consecutive = (list(range(index * size, (index + 1) * size)), list(range(size)))
    if world % size or mesh.get_local_rank() != place or members not in consecutive:
        raise ValueError(
            f"ft.wrap: the model is sharded over ranks {members}, not a run of consecutive ranks "
            f"with this one (rank {rank}) at its place; {SHARD_LAST}"
        )
    return Group(size, index, place, tuple(mesh.mesh_dim_names or ()), mesh)


def _formed(model, mesh) -> bool:
    """Whether the model's sharding is over process groups of the cluster's group as it is
    now: forming it again destroys every group, and a mesh's groups are then found by name
    among the new ones (another part's on a rank that came back)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    groups = getattr(getattr(c10d, "_world", None), "pg_map", None)
    if groups is None:
        return True  # a torch without the table: nothing to tell by
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
    info = getattr(getattr(state, "_fsdp_param_group", None), "mesh_info", None)
    held = getattr(info, "shard_process_group", None)  # the group FSDP holds
    if held is not None and held not in groups:
        return False
    return dist.get_rank() in mesh.mesh.flatten().tolist()


def formed(model) -> bool:
    """``_formed`` for a model sharded over a 1-D mesh (a wrapped one)."""
    from torch.distributed.tensor import DTensor

    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    return mesh is None or _formed(model, mesh)


def carried(old_model, old_optimizer, model) -> dict[str, Any] | None:
    """The shards and optimizer state of ``old_model``, whose groups are gone, to load into
    ``model``, sharded anew over the new mesh (``state_fns``' load): where both have the same
    parameters, each shard the same shape; None where they differ (a new model to train)."""
    old = state_fns(old_model, old_optimizer)[0]()
    new = state_fns(model, None)[0](optim=False)["model"]
    if old["model"].keys() != new.keys():
        return None
    if any(tuple(old["model"][k].shape) != tuple(v.shape) for k, v in new.items()):
        return None
    return old


def group_store(group: Group, host: str):
    """The replica group's TCPStore, served by its rank 0 (its Manager server's address is
    found there), and ``(host, port)`` where every rank of the group reaches it: told over the
    group's process group. The store object is returned where this rank serves it."""
    import torch.distributed as dist
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False) if group.rank == 0 else None
    box = [(host, store.port) if store is not None else None]
    pg = group.mesh.get_group()
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    return store, box[0]


def sync_grads(manager, optimizer) -> None:
    """Average this rank's gradient shards across the replica groups of the quorum (torchft's
    allreduce: a failure is the Manager's, which then does not commit the step)."""
    import torch
    from torch.distributed.tensor import DTensor

    grads = [
        p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None
    ]
    if not grads:
        return
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    flat = torch.cat([t.reshape(-1) for t in local])
    manager.allreduce(flat).wait()
    offset = 0
    for t in local:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def state_fns(model, optimizer):
    """``state_dict`` and ``load_state_dict`` for torchft's heal: this rank's shards as plain
    tensors (what its checkpoint transport sends), loaded into the parameters in place and into
    the optimizer as DTensors like the parameters'."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map

    def local(tree):
        return tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, tree)

    def state_dict(optim: bool = True) -> dict[str, Any]:
        state = {"model": local(model.state_dict())}
        if optim:
            state["optim"] = local(optimizer.state_dict())
        return state

    def load_state_dict(state: dict[str, Any]) -> None:
        with torch.no_grad():
            for key, mine in model.state_dict().items():
                (mine.to_local() if isinstance(mine, DTensor) else mine).copy_(state["model"][key])
        optimizer.load_state_dict(_as_params(state["optim"], optimizer))

    return state_dict, load_state_dict


def _as_params(state: dict[str, Any], optimizer) -> dict[str, Any]:
    """An optimizer state of local tensors, each made a DTensor where its parameter is one
    (momentum, Adam's moments: a local tensor would not mix with the DTensor gradients)."""
    import torch
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in state.get("state", {}).items():
        p = params[index]
        if not isinstance(p, DTensor):
            continue
        shape = tuple(p.to_local().shape)
        for key, value in entry.items():
            plain = torch.is_tensor(value) and not isinstance(value, DTensor)
            if plain and key != "step" and tuple(value.shape) == shape:
                entry[key] = DTensor.from_local(
                    value,
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
    return state
