"""The daemon's shared-memory arena, mapped into a worker on the daemon's host.

`MappedArena.map(arena, identity)` maps the file a Connect reply names once it is proven to be
the file the daemon maps: on this host (boot id) and the same file (`identity`: st_dev, st_ino).
Otherwise page bytes go inline, or (`shared_memory=True`) ConnectionError. With a GPU it is
registered with CUDA (`cudaHostRegister`), so the kernels move pages at PCIe speed. `tensor` is
the mapping as uint8 (None when nothing is mapped); `epoch` is the mapped arena's (0: none).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time
from typing import Any

import torch

from kvstore.peers import boot_id
from kvstore.wire import MEMFD_PREFIX
from kvstore_client.transfers import Streams

log = logging.getLogger(__name__)


class MappedArena:
    def __init__(self, want_shared_memory: bool | None, pin: bool | None) -> None:
        self.want_shared_memory = want_shared_memory
        self.pin = pin
        self._mmap: mmap.mmap | None = None
        self.tensor: torch.Tensor | None = None
        self.registered = False
        self.epoch = 0
        self.identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the daemon's arena file

    def map(
        self, arena: Any, identity: tuple[int, int], streams: Streams | None = None, handed: int | None = None
    ) -> None:
        """Maps the arena `pb.Arena` names (dropping any mapping first). A sealed arena (a
        tenant's: no path) is mapped from `handed`, the descriptor its Connect reply carried
        (the caller keeps and closes it)."""
        self.unmap(streams)
        if self.want_shared_memory is False:
            return
        path, size = arena.shm_path, arena.size
        if arena.boot_id and arena.boot_id != boot_id():
            if self.want_shared_memory:
                raise ConnectionError(f"the daemon runs on another host: its arena {path!r} cannot be mapped")
            log.info("the daemon runs on another host: page bytes go inline")
            return
        try:
            if path.startswith(MEMFD_PREFIX):
                if handed is None:
                    raise OSError(
                        errno.ENOENT, "it is handed only with a Connect on the daemon's local channel"
                    )
                fd = os.dup(handed)
            else:
                fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            if self.want_shared_memory:
                raise ConnectionError(
                    f"cannot map the daemon's arena {path!r}: {exc.strerror}; "
                    f"connect with shared_memory=False to send bytes instead"
                ) from exc
            log.info("arena %s not reachable (%s): page bytes go inline", path, exc.strerror)
            return
        try:
            st = os.fstat(fd)
            if identity != (0, 0) and (st.st_dev, st.st_ino) != identity:
                message = f"the file at {path} is not the daemon's arena (the daemon restarted meanwhile?)"
                if self.want_shared_memory:
                    raise ConnectionError(message)
                log.warning("%s: page bytes go inline until the client connects again", message)
                return
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        if self.pin is not False:
            self._register()

    def _register(self) -> None:
        """Pins the arena for DMA (cudaHostRegister) so kernels read and write it at PCIe speed."""
        if self.tensor is None or not torch.cuda.is_available():
            return
        started = time.perf_counter()
        code = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.tensor.numel(), 0)
        if int(code) != 0:
            log.warning(
                "cudaHostRegister of the %d MiB arena failed (error %d): transfers fall back to "
                "pageable speed; raise the memlock limit (LimitMEMLOCK=infinity)",
                self.tensor.numel() >> 20,
                int(code),
            )
            return
        self.registered = True
        log.info(
            "registered the %d MiB arena with CUDA in %.2f s",
            self.tensor.numel() >> 20,
            time.perf_counter() - started,
        )

    def unmap(self, streams: Streams | None = None) -> None:
        """Drops the mapping once no transfer can touch it (those on `streams` and on every
        device's streams). The mapping itself goes when the last tensor viewing it does (closing
        it under a live view would fault)."""
        if self.registered and self.tensor is not None:
            if streams is not None:
                streams.synchronize()
            for device in range(torch.cuda.device_count()):  # transfers on the caller's streams too
                torch.cuda.synchronize(device)
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
        self.tensor = None
        self._mmap = None
        self.epoch = 0
