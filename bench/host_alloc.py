"""What a worker pays to make a host-scale arena DMA-able, two ways (issue 31, part 1, measured
before anything is built on it).

- register (today): the daemon's arena is a shared mapping (`/dev/shm`, or `--shm-dir`); each
  worker faults it in and pins its own mapping with `cudaHostRegister`: seconds per 10 GiB, per
  process (bench/NOTES-connect.md).
- export: the host memory is allocated pinned once, by one process, with CUDA's virtual memory
  API (`cuMemCreate`, a pinned allocation on host NUMA node 0, exportable as a POSIX file
  descriptor); another process imports the descriptor and maps it for its GPU
  (`cuMemImportFromShareableHandle`, `cuMemMap`, `cuMemSetAccess`): the question is what that
  import costs, whether copies from it run at the pinned rate, and whether the CPU of the
  exporting process can read and write it (the daemon's own tiers need that).

    python bench/host_alloc.py [--gib 16] [--slab-mib 256] [--no-register]

`--slab-mib`: one allocation (and one descriptor) per slab, mapped one after the other into one
address range on both sides, as an arena mapped slab by slab would be (`cuMemMap` maps an
allocation from its start only); 0, one allocation for the whole arena.

Prints a table and writes bench/results/host-alloc.json (`--name`). Needs a GPU and cuda-bindings.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402

COPY_BYTES = 1 << 30


def call(result: Any) -> Any:
    """The values of a cuda-bindings call after its status; raises on an error."""
    from cuda.bindings import driver as cu

    status, *values = result if isinstance(result, tuple) else (result,)
    if status != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{status.name}")
    return values[0] if len(values) == 1 else values


def context() -> None:
    from cuda.bindings import driver as cu

    call(cu.cuInit(0))
    device = call(cu.cuDeviceGet(0))
    call(cu.cuCtxSetCurrent(call(cu.cuDevicePrimaryCtxRetain(device))))


def access(kind: str) -> Any:
    from cuda.bindings import driver as cu

    desc = cu.CUmemAccessDesc()
    desc.location.type = getattr(cu.CUmemLocationType, f"CU_MEM_LOCATION_TYPE_{kind}")
    desc.location.id = 0
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def fd_type() -> Any:
    from cuda.bindings import driver as cu

    return cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def mapped(handles: list[Any], slab: int, kinds: list[str]) -> tuple[int, list[float]]:
    """Reserves one address range and maps the `handles` (allocations of `slab` bytes each) in
    it, one after the other, granting the `kinds` of location access: the pointer and each
    slab's seconds. (`cuMemMap` maps an allocation from its start only: a worker that maps slab
    by slab needs one allocation per slab.)"""
    from cuda.bindings import driver as cu

    pointer = int(call(cu.cuMemAddressReserve(slab * len(handles), 0, 0, 0)))
    seconds = []
    for i, handle in enumerate(handles):
        started = time.perf_counter()
        call(cu.cuMemMap(pointer + i * slab, slab, 0, handle, 0))
        call(cu.cuMemSetAccess(pointer + i * slab, slab, [access(kind) for kind in kinds], len(kinds)))
        seconds.append(time.perf_counter() - started)
    return pointer, seconds


def copy_rates(host: int) -> dict[str, float]:
    """GB/s of 1 GiB copies between `host` and the GPU each way (the copy engines), best of 5."""
    import torch

    from kvstore.shared.cudart import load_runtime

    runtime = load_runtime()
    device = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    rates = {}
    for name, (dst, src) in {"h2d": (device.data_ptr(), host), "d2h": (host, device.data_ptr())}.items():
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            started = time.perf_counter()
            runtime.memcpy_async(dst, src, COPY_BYTES, 0)  # cudaMemcpyDefault (UVA), the null stream
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
        rates[name] = COPY_BYTES / best / 1e9
    return rates


def cpu_rates(pointer: int, size: int, threads: int = 1) -> dict[str, float]:
    """GB/s of the CPU writing and reading `size` bytes at `pointer` (ctypes.memmove releases the
    GIL: `threads` copy one share each), best of 3."""
    from concurrent.futures import ThreadPoolExecutor

    share = size // threads
    other = [ctypes.create_string_buffer(share) for _ in range(threads)]
    rates = {}
    with ThreadPoolExecutor(threads) as pool:
        for name in ("write", "read"):
            best = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                jobs = [
                    pool.submit(
                        ctypes.memmove,
                        *(
                            (pointer + i * share, other[i], share)
                            if name == "write"
                            else (other[i], pointer + i * share, share)
                        ),
                    )
                    for i in range(threads)
                ]
                for job in jobs:
                    job.result()
                best = min(best, time.perf_counter() - started)
            rates[f"cpu_{name}_{threads}t"] = share * threads / best / 1e9
    return rates


def cpu_baseline(size: int) -> dict[str, float]:
    """The same CPU copies into plain shared memory, faulted in first: the reference."""
    memory = mmap.mmap(-1, size)
    pointer = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    ctypes.memset(pointer, 1, size)
    out = {**cpu_rates(pointer, size), **cpu_rates(pointer, size, 8)}
    return out


def mmap_directly(fd: int, size: int, pointer: int) -> str:
    """Whether the exported descriptor maps with plain mmap and shows what the CUDA mapping at
    `pointer` holds."""
    try:
        memory = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as exc:
        return f"refused: {exc}"
    try:
        memory[:4096] = bytes(range(256)) * 16
        seen = ctypes.string_at(pointer, 4096) == bytes(range(256)) * 16
        return f"mapped; the CUDA mapping sees its writes: {seen}"
    finally:
        memory.close()


def overlapped_fill(
    handles: list[Any], slab: int, kinds: tuple[str, ...] = ("DEVICE",), threads: int = 1
) -> dict[str, Any]:
    """A worker that stores from its first moment: one thread maps the slabs in order while the
    main thread copies 1 GiB stores (GPU to host) into the slabs already mapped, waiting for the
    next ones where it catches up; then the same stores again with everything mapped (steady).
    The share of the fill lost to mapping is what part 1's target bounds (<= 10%)."""
    import threading

    import torch
    from cuda.bindings import driver as cu

    from kvstore.shared.cudart import load_runtime

    runtime = load_runtime()
    size = slab * len(handles)
    pointer = int(call(cu.cuMemAddressReserve(size, 0, 0, 0)))
    done = [0]
    ready = threading.Condition()
    context_here = cu.cuCtxGetCurrent()[1]

    taken = [0]
    finished = [False] * len(handles)

    def map_all() -> None:  # `threads` of these take the slabs in order
        call(cu.cuCtxSetCurrent(context_here))
        while True:
            with ready:
                i = taken[0]
                if i == len(handles):
                    return
                taken[0] += 1
            call(cu.cuMemMap(pointer + i * slab, slab, 0, handles[i], 0))
            call(cu.cuMemSetAccess(pointer + i * slab, slab, [access(k) for k in kinds], len(kinds)))
            with ready:
                finished[i] = True
                while done[0] < len(handles) and finished[done[0]]:
                    done[0] += 1
                ready.notify_all()

    device = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    stores = size // COPY_BYTES
    mappers = [threading.Thread(target=map_all) for _ in range(threads)]
    started = time.perf_counter()
    for mapper in mappers:
        mapper.start()
    waited = 0.0
    for k in range(stores):
        need = -(-((k + 1) * COPY_BYTES) // slab)
        with ready:
            before = time.perf_counter()
            ready.wait_for(lambda need=need: done[0] >= need)
            waited += time.perf_counter() - before
        runtime.memcpy_async(pointer + k * COPY_BYTES, device.data_ptr(), COPY_BYTES, 0)
        torch.cuda.synchronize()
    fill_s = time.perf_counter() - started
    for mapper in mappers:
        mapper.join()
    mapped_s = time.perf_counter() - started
    started = time.perf_counter()
    for k in range(stores):
        runtime.memcpy_async(pointer + k * COPY_BYTES, device.data_ptr(), COPY_BYTES, 0)
        torch.cuda.synchronize()
    steady_s = time.perf_counter() - started
    for i in range(len(handles)):
        call(cu.cuMemUnmap(pointer + i * slab, slab))
    call(cu.cuMemAddressFree(pointer, size))
    return {
        "fill_s": fill_s,
        "steady_s": steady_s,
        "fill_lost": 1 - steady_s / fill_s,
        "waited_s": waited,
        "all_mapped_s": mapped_s,
        "access": list(kinds),
        "threads": threads,
    }


def importer(fds: list[int], slab: int) -> dict[str, Any]:
    """The worker's side: imports the exported allocations, maps them for the GPU in one range,
    copies, checks the page the exporter's CPU wrote last."""
    import torch
    from cuda.bindings import driver as cu

    from kvstore.shared.cudart import load_runtime

    torch.cuda.init()
    context()
    started = time.perf_counter()
    handles = [call(cu.cuMemImportFromShareableHandle(fd, fd_type())) for fd in fds]
    imported_s = time.perf_counter() - started
    fill = overlapped_fill(handles, slab)
    variants = [
        overlapped_fill(handles, slab, kinds, threads)
        for kinds in (("DEVICE",), ("DEVICE", "HOST"))
        for threads in (1, 2, 4)
    ]
    try:
        pointer, seconds = mapped(handles, slab, ["DEVICE", "HOST"])
        cpu = True
    except RuntimeError:
        pointer, seconds = mapped(handles, slab, ["DEVICE"])
        cpu = False
    size = slab * len(fds)
    device = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    load_runtime().memcpy_async(device.data_ptr(), pointer + size - (1 << 20), 1 << 20, 0)
    torch.cuda.synchronize()
    return {
        "import_s": imported_s + sum(seconds),
        "of_which_import_s": imported_s,
        "overlapped_fill": fill,
        "overlapped_variants": variants,
        "of_which_map_s": sum(seconds),
        "slab_map_ms_max": max(seconds) * 1e3,
        "slab_map_ms_median": sorted(seconds)[len(seconds) // 2] * 1e3,
        "importer_cpu_access": cpu,
        **(cpu_rates(pointer, min(size, 1 << 30), 8) if cpu else {}),
        "pattern_seen": bytes(device.cpu().numpy()) == bytes(range(256)) * 4096,
        **copy_rates(pointer),  # 1 GiB: across slabs where they are smaller
    }


def exporter(gib: int, slab_mib: int, threads: int) -> dict[str, Any]:
    """The daemon's side: the arena allocated pinned on host NUMA node 0 (one allocation, or one
    per slab of `slab_mib`), exportable; mapped here with host access; handed to an importer."""
    from cuda.bindings import driver as cu

    context()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    prop.location.id = 0
    prop.requestedHandleTypes = fd_type()
    granularity = int(
        call(
            cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            )
        )
    )
    size = -(-(gib << 30) // granularity) * granularity
    slab = size if slab_mib <= 0 else -(-(slab_mib << 20) // granularity) * granularity
    count = -(-size // slab)
    started = time.perf_counter()
    current = cu.cuCtxGetCurrent()[1]

    def create(_: int) -> Any:
        call(cu.cuCtxSetCurrent(current))
        return call(cu.cuMemCreate(slab, prop, 0))

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        handles = list(pool.map(create, range(count)))
    out: dict[str, Any] = {
        "granularity": granularity,
        "slab": slab,
        "allocations": count,
        "create_threads": threads,
    }
    out["create_s"] = time.perf_counter() - started
    fds = [int(call(cu.cuMemExportToShareableHandle(handle, fd_type(), 0))) for handle in handles]
    size = slab * count
    for kinds in (["DEVICE", "HOST"], ["DEVICE", "HOST_NUMA"], ["DEVICE"]):
        try:
            pointer, _ = mapped(handles, slab, kinds)
            out["exporter_access"] = kinds
            break
        except RuntimeError as exc:
            out.setdefault("access_refused", []).append(f"{kinds}: {exc}")
    cpu = "HOST" in out["exporter_access"][-1]
    if cpu:  # the daemon's CPU writes a page the importer then reads over the GPU
        piece = (ctypes.c_uint8 * (1 << 20)).from_address(pointer + size - (1 << 20))
        ctypes.memmove(piece, bytes(range(256)) * 4096, 1 << 20)
        started = time.perf_counter()
        ctypes.memset(pointer, 7, min(size, 4 << 30))
        out["cpu_memset_gbps"] = min(size, 4 << 30) / (time.perf_counter() - started) / 1e9
        out.update(cpu_rates(pointer, 1 << 30))
        out.update(cpu_rates(pointer, 1 << 30, 8))
        out["cpu_baseline"] = cpu_baseline(1 << 30)
        out["mmap_fd"] = mmap_directly(fds[0], slab, pointer)
    out["exporter_cpu_access"] = cpu
    out["exporter"] = copy_rates(pointer)
    child = subprocess.run(
        [sys.executable, __file__, "--import-fds", ",".join(map(str, fds)), "--slab", str(slab)],
        pass_fds=fds,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = child.stdout.strip().splitlines()
    out["importer"] = json.loads(lines[-1]) if child.returncode == 0 and lines else child.stderr[-2000:]
    return out


def registered(gib: int, shm_dir: str) -> dict[str, Any]:
    """Today's way: a shared mapping faulted in, then pinned with cudaHostRegister."""
    from kvstore.shared.cudart import load_runtime
    from kvstore_client.faulting import populate

    path = Path(shm_dir) / f"kvstore-host-alloc-{os.getpid()}"
    size = gib << 30
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        memory = mmap.mmap(fd, size)
        address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        started = time.perf_counter()
        populate(address, size)
        fault_s = time.perf_counter() - started
        started = time.perf_counter()
        runtime = load_runtime()
        runtime.host_register(address, size, portable=True)
        out = {"fault_s": fault_s, "register_s": time.perf_counter() - started}
        out.update(copy_rates(address))
        runtime.host_unregister(address)
        return out
    finally:
        os.close(fd)
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=int, default=16)
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--slab-mib", type=int, default=0, help="one allocation per slab (0: one in all)")
    parser.add_argument("--create-threads", type=int, default=1, help="cuMemCreate on N threads")
    parser.add_argument("--import-fds", help=argparse.SUPPRESS)
    parser.add_argument("--slab", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--name", default="host-alloc")
    parser.add_argument("--no-register", action="store_true", help="the export only")
    args = parser.parse_args()
    if args.import_fds is not None:
        print(json.dumps(importer([int(fd) for fd in args.import_fds.split(",")], args.slab)))
        return
    import torch

    results = {
        "gib": args.gib,
        "device": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    if not args.no_register:
        results["register"] = registered(args.gib, args.shm_dir)
    results["export"] = exporter(args.gib, args.slab_mib, args.create_threads)
    report(results)
    path = write_results(args.name, results)
    print(f"wrote {path}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{args.name}.json").write_text(path.read_text())


def report(results: dict[str, Any]) -> None:
    """One row per way: what the worker pays (and, for the export, the exporter once), the copies."""
    rows = []
    register = results.get("register")
    if register:
        rows.append(
            [
                "register (per worker)",
                register["fault_s"] + register["register_s"],
                "-",
                register["h2d"],
                register["d2h"],
            ]
        )
    export = results["export"]
    imported = export["importer"]
    if isinstance(imported, dict):
        rows.append(
            [
                "export (per worker)",
                imported["import_s"],
                export["create_s"],
                imported["h2d"],
                imported["d2h"],
            ]
        )
    else:
        print(f"the import failed: {imported}")
    cpu = export["exporter_cpu_access"]
    print(f"{results['gib']} GiB on {results['device']}; the exporter's CPU reads and writes it: {cpu}")
    cpu_keys = [key for key in export if key.startswith("cpu_")]
    print("exporter CPU GB/s:", {key: export[key] for key in cpu_keys})
    if isinstance(imported, dict):
        print(
            "importer:",
            {k: v for k, v in imported.items() if k.startswith(("cpu_", "slab_", "importer", "of_"))},
        )
        print("overlapped fill:", imported["overlapped_fill"])
        for variant in imported.get("overlapped_variants", []):
            print(
                f"  access {'+'.join(variant['access'])}, {variant['threads']} mapping threads: fill lost "
                f"{100 * variant['fill_lost']:.1f}%, waited {variant['waited_s']:.3f} s, "
                f"all mapped {variant['all_mapped_s']:.2f} s (steady {variant['steady_s']:.2f} s)"
            )
    print("plain mmap of the descriptor:", export.get("mmap_fd"))
    print_table(["way", "worker s", "once s", "h2d GB/s", "d2h GB/s"], rows)


if __name__ == "__main__":
    main()
