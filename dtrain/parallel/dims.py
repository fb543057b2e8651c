"""ParallelDims: the parallel degrees of a run, checked, and the DeviceMesh they describe.

Mesh dimensions, outermost first: ``pp, dp_replicate, dp_shard, cp, tp`` (only those > 1 are
built). Flattened submeshes: ``dp`` (dp_replicate x dp_shard: data loading), ``dp_shard_cp``
(FSDP shards over it) and ``dp_cp`` (loss and gradient-norm reduction).

Expert parallel borrows its ranks from ``dp_shard x cp``: with ``ep > 1`` the ``dp_shard``
dimension is built as ``dp_shard_mod_ep x dp_shard_in_ep`` (the first kept even at size 1) and
``dp_shard`` becomes their flattening. ``ep`` = dp_shard_in_ep x cp holds the experts;
``ep_fsdp`` = dp_replicate x dp_shard_mod_ep x tp shards each expert's weights (the data ranks
outside ep, and the tp ranks, which route their own sequence shards); ``moe_fsdp`` (tp > 1) =
every rank of a pipeline stage, for the router and shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtrain.config import ConfigError, ParallelConfig

# Degrees that have an implementation in dtrain.parallel; the rest are refused with a message.
IMPLEMENTED = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


@dataclass
class ParallelDims:
    """The degrees of one run and, after ``build_mesh``, its meshes: ``dims.mesh("dp")`` etc."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolves ``dp_shard = -1`` to the ranks left over and checks that the degrees
        multiply to ``world_size``. Raises ConfigError naming the numbers to change."""
        others = cfg.dp_replicate * cfg.cp * cfg.tp * cfg.pp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallel degrees dp_replicate={cfg.dp_replicate} x cp={cfg.cp} x "
                    f"tp={cfg.tp} x pp={cfg.pp} = {others} do not divide the world size "
                    f"{world_size}: change them so their product divides {world_size}")
            dp_shard = world_size // others
        if others * dp_shard != world_size:
            raise ConfigError(
                f"parallel degrees dp_replicate={cfg.dp_replicate} x dp_shard={dp_shard} x "
                f"cp={cfg.cp} x tp={cfg.tp} x pp={cfg.pp} = {others * dp_shard} but the world "
                f"size is {world_size}: make the product {world_size} (dp_shard=-1 fills it)")
        if (dp_shard * cfg.cp) % cfg.ep:
            raise ConfigError(f"parallel.ep={cfg.ep} must divide dp_shard x cp = "
                              f"{dp_shard * cfg.cp}: experts are spread over those ranks")
        if cfg.ep > 1 and cfg.cp > 1 and cfg.ep % cfg.cp:
            raise ConfigError(f"parallel.ep={cfg.ep} must be a multiple of cp={cfg.cp}: expert "
                              "parallel takes all context-parallel ranks and some dp_shard ones")
        dims = cls(cfg.dp_replicate, dp_shard, cfg.cp, cfg.tp, cfg.pp, cfg.ep, world_size)
        missing = [f"{name}={getattr(dims, name)}" for name in ("cp", "tp", "pp", "ep")
                   if getattr(dims, name) > 1 and name not in IMPLEMENTED]
        if missing:
            raise ConfigError(f"parallel {', '.join(missing)} is not available in this version "
                              f"of dtrain: set {' and '.join(m.split('=')[0] for m in missing)} "
                              "to 1 (implemented: dp_shard, dp_replicate, cp, tp, pp, ep)")
        return dims

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """Whether parameters need data-parallel sharding or gradient synchronisation."""
        return self.dp_replicate * self.dp_shard * self.cp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Builds the world mesh (dimensions > 1 only) and its flattened submeshes, kept for
        ``mesh(name)``. Needs an initialised process group of ``world_size`` ranks."""
        if self.ep > 1:
            return self._build_ep_mesh(device_type)
        names = [n for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp")
                 if getattr(self, n) > 1] or ["dp_shard"]
        world = init_device_mesh(device_type, tuple(getattr(self, n) for n in names),
                                 mesh_dim_names=tuple(names))
        self._meshes = {"world": world, **{n: world[n] for n in names}}
        for flat, parts in (("dp", ("dp_replicate", "dp_shard")),
                            ("dp_shard_cp", ("dp_shard", "cp")),
                            ("dp_cp", ("dp_replicate", "dp_shard", "cp")),
                            ("cp_tp", ("cp", "tp"))):
            present = tuple(p for p in parts if p in names)
            if len(present) == 1:
                self._meshes[flat] = world[present[0]]
            elif present:
                self._meshes[flat] = world[present]._flatten(mesh_dim_name=flat)
        return world

    def _build_ep_mesh(self, device_type: str) -> DeviceMesh:
        """``build_mesh`` with dp_shard split for expert parallel (see the module docstring)."""
        in_ep = self.ep // self.cp if self.cp > 1 else self.ep
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate,
                 "dp_shard_mod_ep": self.dp_shard // in_ep, "dp_shard_in_ep": in_ep,
                 "cp": self.cp, "tp": self.tp}
        names = [n for n, size in sizes.items() if size > 1 or n == "dp_shard_mod_ep"]
        world = init_device_mesh(device_type, tuple(sizes[n] for n in names),
                                 mesh_dim_names=tuple(names))
        self._meshes = {"world": world, **{n: world[n] for n in names}}
        shard = ("dp_shard_mod_ep", "dp_shard_in_ep")
        built: dict[tuple[str, ...], DeviceMesh] = {}
        for flat, parts in (("dp_shard", shard), ("dp", ("dp_replicate", *shard)),
                            ("dp_shard_cp", (*shard, "cp")),
                            ("dp_cp", ("dp_replicate", *shard, "cp")),
                            ("ep", ("dp_shard_in_ep", "cp")),
                            ("ep_fsdp", ("dp_replicate", "dp_shard_mod_ep", "tp")),
                            ("moe_fsdp", ("dp_replicate", *shard, "cp", "tp")),
                            ("cp_tp", ("cp", "tp"))):
            present = tuple(p for p in parts if p in names)
            if (flat == "moe_fsdp" and self.tp == 1) or not present:
                continue
            if len(present) == 1:
                self._meshes[flat] = world[present[0]]
            elif present in built:  # the same ranks under another name
                self._meshes[flat] = built[present]
            else:
                self._meshes[flat] = built[present] = world[present]._flatten(
                    mesh_dim_name=flat)
        return world

    def mesh(self, name: str) -> DeviceMesh | None:
        """A named or flattened submesh ("dp", "dp_shard_cp", "dp_cp", "tp", ...), or None when
        that dimension has size 1 (or no mesh was built: a single process)."""
        return self._meshes.get(name)

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP works on: 2-D (replicate, shard) for HSDP, else 1-D. Replicas without
        sharding are treated as FSDP over the replicas (same gradients, less memory)."""
        if self.dp_replicate > 1 and self.dp_shard * self.cp > 1:
            shard = "dp_shard" if self.cp == 1 else "dp_shard_cp"
            return self._meshes["world"]["dp_replicate", shard]
        return self._meshes["dp_replicate" if self.dp_replicate > 1 else "dp_shard_cp"]
