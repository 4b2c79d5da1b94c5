"""Runs a command under the seccomp policy that kvstored.service gives its process, without systemd.

What it applies, read from the unit and its drop-ins as systemd reads them (later assignments
add, `~` ones remove, an empty one resets): SystemCallFilter= with SystemCallErrorNumber= (the
groups expanded by `systemd-analyze syscall-filter`), RestrictAddressFamilies=,
MemoryDenyWriteExecute= (the seccomp rules systemd 252 loads for it: no mapping both writable and
executable, no mprotect that adds execute) and NoNewPrivileges=. Mounts, devices, users and
capabilities are systemd's alone: run the unit itself for those.

For checking, before a deploy, that a config (a tier, a listener) works under the unit, and for
tests/test_deploy.py:

    python3 deploy/systemd/sandbox.py configs/kvstored.service [DROP-IN ...] -- kvstored --config FILE
    python3 deploy/systemd/sandbox.py configs/kvstored.service --dump policy.json  # where systemd-analyze is
    python3 deploy/systemd/sandbox.py --policy policy.json -- COMMAND ...           # where it is not

Needs libseccomp (libseccomp.so.2, on every systemd host) and Linux.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ALLOW = 0x7FFF0000
KILL_PROCESS = 0x80000000
CMP_EQ, CMP_GT, CMP_MASKED_EQ = 4, 6, 7
AF_MAX = 46  # Linux 6.x; families above it do not exist
PROT_WRITE, PROT_EXEC, SHM_EXEC = 0x2, 0x4, 0o100000


def errno_action(number: int) -> int:
    return 0x00050000 | (number & 0xFFFF)


def service_settings(files: list[Path]) -> dict[str, list[str]]:
    """Each [Service] directive's assignments, in order, across the unit and its drop-ins."""
    settings: dict[str, list[str]] = {}
    for path in files:
        section = ""
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if line.startswith("[") and line.endswith("]"):
                section = line
            elif section == "[Service]" and (match := re.fullmatch(r"(\w+)=(.*)", line)):
                settings.setdefault(match.group(1), []).append(match.group(2).strip())
    return settings


def syscall_groups() -> dict[str, list[str]]:
    """Every @group and its members (syscalls or groups), from `systemd-analyze syscall-filter`."""
    text = subprocess.run(
        ["systemd-analyze", "syscall-filter"], capture_output=True, text=True, check=True
    ).stdout
    groups: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif line.strip() and not line.strip().startswith("#"):
            current.append(line.strip())
    return groups


def expand(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    for name in names:
        out |= expand(groups[name], groups) if name.startswith("@") else {name}
    return out


def policy_of(files: list[Path]) -> dict[str, Any]:
    """The unit's seccomp policy: allowed syscalls (None: no filter), the errno of a refused one
    (None: the process is killed), allowed address families (None: any), MDWE, no_new_privs."""
    settings = service_settings(files)
    groups = syscall_groups()
    allowed: set[str] | None = None
    for value in settings.get("SystemCallFilter", []):
        if not value:
            allowed = None
            continue
        deny = value.startswith("~")
        names = expand(value.lstrip("~").split(), groups)
        if allowed is None and deny:
            raise ValueError("a deny-list SystemCallFilter= is not emulated; start with an allow list")
        allowed = (allowed or set()) - names if deny else (allowed or set()) | names
    error = (settings.get("SystemCallErrorNumber") or [""])[-1]
    families: list[str] | None = None
    for value in settings.get("RestrictAddressFamilies", []):
        families = None if not value or value == "none" else value.split()
    return {
        "syscalls": sorted(allowed) if allowed is not None else None,
        "errno": getattr(errno, error) if error else None,
        "families": families,
        "mdwe": (settings.get("MemoryDenyWriteExecute") or ["no"])[-1] == "yes",
        "no_new_privs": (settings.get("NoNewPrivileges") or ["no"])[-1] == "yes",
    }


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


class _Seccomp:
    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2", use_errno=True)
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_rule_add_array.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint32,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.POINTER(_ArgCmp),
        ]
        lib.seccomp_load.argtypes = [ctypes.c_void_p]
        lib.seccomp_release.argtypes = [ctypes.c_void_p]
        self.lib = lib

    def load(self, default: int, rules: list[tuple[int, str, list[_ArgCmp]]]) -> None:
        """One filter: `default` for every call no rule matches. The kernel runs every filter
        loaded and takes the strictest answer, as it does for systemd's several filters."""
        ctx = self.lib.seccomp_init(default)
        for action, name, conditions in rules:
            number = self.lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                continue  # not a syscall of this architecture or of this libseccomp
            array = (_ArgCmp * len(conditions))(*conditions) if conditions else None
            status = self.lib.seccomp_rule_add_array(ctx, action, number, len(conditions), array)
            if status != 0:
                raise OSError(-status, f"seccomp_rule_add({name}): {os.strerror(-status)}")
        status = self.lib.seccomp_load(ctx)
        self.lib.seccomp_release(ctx)
        if status != 0:
            raise OSError(-status, f"seccomp_load: {os.strerror(-status)}")


def apply(policy: dict[str, Any]) -> None:
    """Restricts this process (and what it runs) as the policy says; it cannot be undone."""
    if policy["no_new_privs"] and ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    seccomp = _Seccomp()
    if policy["families"] is not None:
        allowed = {getattr(socket, name) for name in policy["families"]}
        refuse = errno_action(errno.EAFNOSUPPORT)
        others = [family for family in range(AF_MAX + 1) if family not in allowed]
        rules = [(refuse, "socket", [_ArgCmp(0, CMP_EQ, family, 0)]) for family in others]
        seccomp.load(ALLOW, [*rules, (refuse, "socket", [_ArgCmp(0, CMP_GT, AF_MAX, 0)])])
    if policy["mdwe"]:
        refuse = errno_action(errno.EPERM)
        wx = PROT_WRITE | PROT_EXEC
        seccomp.load(
            ALLOW,
            [
                (refuse, "mmap", [_ArgCmp(2, CMP_MASKED_EQ, wx, wx)]),
                (refuse, "mprotect", [_ArgCmp(2, CMP_MASKED_EQ, PROT_EXEC, PROT_EXEC)]),
                (refuse, "pkey_mprotect", [_ArgCmp(2, CMP_MASKED_EQ, PROT_EXEC, PROT_EXEC)]),
                (refuse, "shmat", [_ArgCmp(2, CMP_MASKED_EQ, SHM_EXEC, SHM_EXEC)]),
            ],
        )
    if policy["syscalls"] is not None:  # last: it may refuse seccomp() itself
        refused = KILL_PROCESS if policy["errno"] is None else errno_action(policy["errno"])
        seccomp.load(refused, [(ALLOW, name, []) for name in policy["syscalls"]])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    options, command = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        usage="%(prog)s [UNIT [DROP-IN ...] | --policy FILE] [--dump FILE] [-- COMMAND ...]",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument("unit", nargs="*", type=Path, help="the unit file, then its drop-ins in order")
    parser.add_argument("--policy", type=Path, help="a policy written by --dump, instead of the unit")
    parser.add_argument("--dump", type=Path, help="write the unit's policy as JSON here and exit")
    args = parser.parse_args(options)
    if bool(args.unit) == bool(args.policy):
        parser.error("give the unit (and its drop-ins) or --policy")
    policy = json.loads(args.policy.read_text()) if args.policy else policy_of(args.unit)
    if args.dump:
        args.dump.write_text(json.dumps(policy, indent=1) + "\n")
        return 0
    if not command:
        parser.error("give the command to run after --")
    apply(policy)
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
