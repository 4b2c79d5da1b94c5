"""What one store is built on: the daemon's tiers, or one tenant's.

- `arena_name(socket_path)`: the arena's shm file name, one per socket.
- `store_settings(config, tenant)`: the `StoreSettings` of the daemon's store, or a tenant's.
- `Tiers(tenant, events)`: `open(config, socket_path, starting)` creates the arena (its first
  slab reserved, with prefault), recovers the disk tier, connects to the remote tier, allocates
  the GPU pools and builds the `Store` over them, then reserves the rest of the arena behind
  (`tiers.reserve`); `close(grace_s)` closes exactly what was opened, whatever failed after.
  A tenant's tiers are its own: a sealed arena of its cpu_bytes, a disk directory under
  `<tiers.disk.path>/tenants/<name>` of its share, its own remote connections.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import xxhash

from kvstore.config.root import Config, DiskTierConfig, TenantConfig
from kvstore.server.daemon_shutdown import cleanup
from kvstore.server.progress import progress_reporter
from kvstore.store.events import EventLog
from kvstore.store.policy import make_policy
from kvstore.store.store import Store
from kvstore.store.store_settings import StoreSettings
from kvstore.tiers.cpu import Arena, CpuTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.pinned import PinnedArena
from kvstore.tiers.remote import RemoteTier, start_remote
from kvstore.tiers.reserve import ArenaReserver

log = logging.getLogger("kvstored")


def store_settings(config: Config, tenant: TenantConfig | None) -> StoreSettings:
    """The settings of the daemon's store (`tenant` None), or of one tenant's."""
    return StoreSettings(
        lease_ttl_s=config.leases.ttl_s,
        max_lease_ttl_s=config.leases.max_ttl_s,
        pin_fraction=config.eviction.pin_fraction,
        max_pin_ttl_s=config.eviction.max_pin_ttl_s,
        quarantine_s=config.leases.quarantine_s,
        promote_after_hits=config.tiers.gpu.promote_after_hits,
        tenant=tenant.name if tenant is not None else "",
        max_namespaces=tenant.max_namespaces if tenant is not None else None,
    )


def arena_name(socket_path: Path) -> str:
    """The arena's shm file name: one per socket, so a restarted daemon finds its predecessor's."""
    return "kvstore-" + xxhash.xxh3_64_hexdigest(str(socket_path.resolve()).encode())


class Tiers:
    """What one store is built on (the daemon's, or one tenant's): each part set once open, so
    that `close` closes exactly what was opened, whatever failed after."""

    def __init__(self, tenant: TenantConfig | None, events: EventLog) -> None:
        self.tenant = tenant
        self.events = events
        self.arena: Arena | PinnedArena | None = None
        self.reserver: ArenaReserver | None = None
        self.disk: DiskTier | None = None
        self.remote: RemoteTier | None = None
        self.gpu: GpuTier | None = None
        self.store: Store | None = None

    @property
    def label(self) -> str:
        return f" of tenant {self.tenant.name!r}" if self.tenant is not None else ""

    async def open(self, config: Config, socket_path: Path, starting: Callable[[], None]) -> Store:
        """The store over this tenant's tiers, each opened in turn; `starting()` between the steps
        ends the start there if a stop signal came."""
        arena, cpu = self._open_arena(config, socket_path)
        starting()
        await self._open_lower_tiers(config, arena, starting)
        self.store = store = self._make_store(config, cpu)
        store.counters.update(arena.pages.figures())  # kvctl stats says which pages it got
        self._reserve_the_rest(arena, cpu)
        return store

    def _open_arena(self, config: Config, socket_path: Path) -> tuple[Arena | PinnedArena, CpuTier]:
        tenant, cpu_config = self.tenant, config.tiers.cpu
        name, size, sealed = arena_name(socket_path), cpu_config.bytes, tenant is not None
        if tenant is not None:
            name, size = f"{name}-{tenant.name}", tenant.cpu_bytes
        prefault = cpu_config.prefault or cpu_config.pinned
        if cpu_config.pinned:
            arena: Arena | PinnedArena = PinnedArena(
                name,
                size,
                min(cpu_config.slab_bytes, size),
                cpu_config.pinned_numa_node,
                cpu_config.file_mode,
            )
        else:
            arena = Arena(Path(cpu_config.shm_dir) / name, size, cpu_config.file_mode, prefault, sealed)
        self.arena = arena
        # With prefault, the first slab's memory is reserved before serving and the rest after
        # (`reserve.py`), each slab handed out once reserved; a pinned arena's slab is allocated so.
        cpu = CpuTier(arena, cpu_config.slab_bytes, 1 if prefault else None)
        if prefault:
            arena.reserve(0, cpu.slots.slab_bytes)
        return arena, cpu

    def _disk_config(self, config: Config) -> DiskTierConfig:
        """The disk tier's settings; a tenant's: its own directory, of its share."""
        tenant, disk_config = self.tenant, config.tiers.disk
        if tenant is None:
            return disk_config
        return replace(
            disk_config,
            path=str(Path(disk_config.path) / "tenants" / tenant.name),
            bytes=config.tenant_disk_bytes(tenant),
        )

    async def _open_lower_tiers(
        self, config: Config, arena: Arena | PinnedArena, starting: Callable[[], None]
    ) -> None:
        disk_config = self._disk_config(config)
        if disk_config.enabled:
            self.disk = DiskTier(disk_config)
            label = f"recovering the disk tier{self.label}"
            records = await asyncio.to_thread(self.disk.recover, progress_reporter(label))
            log.info("disk tier %s: %d pages recovered", disk_config.path, len(records))
            starting()
        if config.tiers.remote.enabled:
            self.remote = await asyncio.to_thread(start_remote, config.tiers.remote)
            starting()
        gpu_config = config.tiers.gpu
        if gpu_config.enabled:  # never with tenants (Config.validate)
            self.gpu = await asyncio.to_thread(GpuTier.start, gpu_config, arena)
            starting()

    def _make_store(self, config: Config, cpu: CpuTier) -> Store:
        return Store(
            cpu,
            make_policy(config.eviction.policy),
            store_settings(config, self.tenant),
            disk=self.disk,
            remote=self.remote,
            gpu=self.gpu,
            gpu_policy=make_policy(config.eviction.policy),
            events=self.events,
        )

    def _reserve_the_rest(self, arena: Arena | PinnedArena, cpu: CpuTier) -> None:
        """The arena's slabs past those reserved before serving, reserved behind in a thread."""
        if cpu.slots.num_reserved < cpu.slots.num_slabs:
            loop = asyncio.get_running_loop()
            self.reserver = ArenaReserver(
                arena.reserve,
                cpu.slots.slab_bytes,
                cpu.slots.num_slabs,
                cpu.slots.num_reserved,
                lambda count: loop.call_soon_threadsafe(cpu.add_reserved, count),
                f"arena {arena.path}{self.label}",
            )

    async def close(self, grace_s: float) -> None:
        if self.gpu is not None:
            await cleanup(f"the GPU tier{self.label}", asyncio.to_thread(self.gpu.close))
        if self.disk is not None:
            await cleanup(f"the disk tier{self.label}", asyncio.to_thread(self.disk.close))
        if self.remote is not None:
            await cleanup(f"the remote tier{self.label}", asyncio.to_thread(self.remote.close, grace_s))
        if self.reserver is not None:
            await cleanup(f"the arena's reservation{self.label}", asyncio.to_thread(self.reserver.stop))
        if self.arena is not None:
            await cleanup(f"the arena{self.label}", asyncio.to_thread(self.arena.close, True))
