"""The trainer's seccomp filter: the system calls Landlock has no right for, refused.

:func:`apply_seccomp` is called by :func:`~services.agent.usercode.sandbox.apply_sandbox`
after ``no_new_privs`` and the Landlock ruleset; the filter holds for the process and all it
starts, and cannot be removed. It is a hand-built classic BPF program, checked against the
architecture of each call:

* **A foreign architecture** (an i386 call from an x86-64 process, ...): the process is killed.
  On a machine this module has no table for, the filter is not built: :class:`SandboxError`,
  and the launcher refuses to run the trainer (fails closed, like Landlock).
* **File metadata** -- ``chmod``, ``fchmod``, ``fchmodat``, ``fchmodat2``, ``chown``,
  ``fchown``, ``lchown``, ``fchownat``, ``utime``, ``utimes``, ``futimesat``, ``utimensat``,
  the ``*xattr`` setters and removers (``setxattrat`` and ``removexattrat`` too),
  ``file_setattr``, the ``FS_IOC_SETFLAGS`` / ``FS_IOC_FSSETXATTR`` ioctls, ``mknod`` and
  ``mknodat``: ``EPERM``, on every file. A trainer running as uid 0 owns the system's files,
  and Landlock checks only opening, creating and removing -- without this it could make a
  root-owned file outside its allow-list world-writable or setuid.
* **The kernel and other processes** -- ``ptrace``, ``process_vm_readv``,
  ``process_vm_writev``, ``kexec_load``, ``kexec_file_load``, ``init_module``,
  ``finit_module``, ``delete_module``, ``bpf``, ``perf_event_open``, ``userfaultfd``,
  ``keyctl``, ``add_key``, ``request_key``, ``unshare``, ``setns``, ``clone`` with a
  ``CLONE_NEW*`` flag, ``mount``, ``umount2``, the new mount API, ``pivot_root``, ``chroot``,
  ``swapon``, ``swapoff``, ``reboot``, ``acct``, and ``io_uring_*`` (whose operations no
  seccomp filter sees): ``EPERM``. ``clone3`` gets ``ENOSYS`` (its flags lie in memory a
  filter cannot read), so the C library falls back to ``clone``, whose flags it can.
* On x86-64, the x32 system calls: ``EPERM``.
* **IP sockets**, when the trainer may not use the network (``ip_sockets=False``: a copy of
  one rank): ``socket`` of ``AF_INET`` or ``AF_INET6``, of any type: ``EPERM``. Landlock
  refuses only TCP bind and connect; this closes UDP (and any other IP protocol). Unix
  sockets stay (the harness's channel, a DataLoader's workers). A copy of several ranks keeps
  IP sockets: its rendezvous may need a name looked up over UDP.

**What a script notices:** it cannot change a file's mode, owner or times, not even of the
files it creates in its scratch. ``shutil.copy`` and ``shutil.copy2`` (which copy the mode
and times) raise ``PermissionError`` there, while ``shutil.copyfile`` works; ``os.utime``,
``Path.touch`` of an existing file, ``os.chmod`` and ``os.mkfifo`` raise it too.
``torch.save``, ``numpy.save``, ``safetensors`` and the SDK never change a mode or a time.

Trusted code that runs in the untrusted process; imports only the standard library and
:mod:`shared.errors`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.errors import HadarError

__all__ = ["SeccompError", "SyscallTable", "TABLES", "DENIED", "table_for", "filter_program", "apply_seccomp"]

_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
AUDIT_ARCH_X86_64, AUDIT_ARCH_AARCH64 = 0xC000003E, 0xC00000B7
X32_SYSCALL_BIT = 0x40000000

# Classic BPF opcodes (linux/bpf_common.h).
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (little-endian).
OFFSET_NR, OFFSET_ARCH = 0, 4


def offset_arg(index: int) -> int:
    """The offset of the low 32 bits of system call argument ``index``."""
    return 16 + 8 * index


AF_INET, AF_INET6 = 2, 10
CLONE_NEW_FLAGS = 0x7E020000   # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
# _IOW('f', 2, long), _IOW('f', 2, int), _IOW('X', 32, struct fsxattr): the same on both tables.
DENIED_IOCTLS = (0x40086602, 0x40046602, 0x401C5820)

# The refused calls, by name (those a table lacks, such as chmod on aarch64, do not exist there).
DENIED = (
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "utime", "utimes", "futimesat", "utimensat", "setxattr", "lsetxattr", "fsetxattr", "setxattrat",
    "removexattr", "lremovexattr", "fremovexattr", "removexattrat", "file_setattr", "mknod", "mknodat",
    "ptrace", "process_vm_readv", "process_vm_writev", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key",
    "request_key", "unshare", "setns", "mount", "umount2", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "open_tree_attr", "pivot_root", "chroot", "swapon", "swapoff",
    "reboot", "acct", "io_uring_setup", "io_uring_enter", "io_uring_register",
)

# Numbered alike on every architecture since Linux 5.1 (424 onwards).
_UNIFIED = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
            "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "clone3": 435,
            "mount_setattr": 442, "fchmodat2": 452, "setxattrat": 463, "removexattrat": 466,
            "open_tree_attr": 467, "file_setattr": 469}


@dataclass(frozen=True)
class SyscallTable:
    """One architecture's system call numbers (``x32``: also refuse the x32 ABI's calls)."""

    machine: str
    audit_arch: int
    numbers: dict[str, int]
    x32: bool = False


TABLES: dict[str, SyscallTable] = {
    "x86_64": SyscallTable("x86_64", AUDIT_ARCH_X86_64, x32=True, numbers={
        "ioctl": 16, "socket": 41, "clone": 56, "chmod": 90, "fchmod": 91, "chown": 92, "fchown": 93, "lchown": 94,
        "ptrace": 101, "utime": 132, "mknod": 133, "pivot_root": 155, "chroot": 161, "acct": 163,
        "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "init_module": 175,
        "delete_module": 176, "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197,
        "lremovexattr": 198, "fremovexattr": 199, "utimes": 235, "kexec_load": 246, "add_key": 248,
        "request_key": 249, "keyctl": 250, "mknodat": 259, "fchownat": 260, "futimesat": 261,
        "fchmodat": 268, "unshare": 272, "utimensat": 280, "perf_event_open": 298, "setns": 308,
        "process_vm_readv": 310, "process_vm_writev": 311, "finit_module": 313, "kexec_file_load": 320,
        "bpf": 321, "userfaultfd": 323, **_UNIFIED}),
    "aarch64": SyscallTable("aarch64", AUDIT_ARCH_AARCH64, numbers={   # asm-generic/unistd.h
        "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15,
        "fremovexattr": 16, "ioctl": 29, "mknodat": 33, "umount2": 39, "mount": 40, "pivot_root": 41,
        "chroot": 51, "fchmod": 52, "fchmodat": 53, "fchownat": 54, "fchown": 55, "utimensat": 88,
        "acct": 89, "unshare": 97, "socket": 198, "kexec_load": 104, "init_module": 105, "delete_module": 106,
        "ptrace": 117, "reboot": 142, "add_key": 217, "request_key": 218, "keyctl": 219, "clone": 220,
        "swapon": 224, "swapoff": 225, "perf_event_open": 241, "setns": 268, "process_vm_readv": 270,
        "process_vm_writev": 271, "finit_module": 273, "bpf": 280, "userfaultfd": 282,
        "kexec_file_load": 294, **_UNIFIED}),
}


class SeccompError(HadarError):
    """The seccomp filter could not be built or installed (the trainer must not run)."""


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def table_for(machine: str | None = None) -> SyscallTable:
    """The table of ``machine`` (default: this one's); SeccompError for one without a table."""
    machine = machine or platform.machine()
    name = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine.lower(), machine.lower())
    if name not in TABLES:
        raise SeccompError(f"no seccomp table for the machine {machine!r}")
    return TABLES[name]


class _Program:
    """Instructions with forward jumps to labels, resolved by :meth:`assemble`."""

    def __init__(self) -> None:
        self.code: list[tuple[int, int | str, int | str, int]] = []
        self.labels: dict[str, int] = {}

    def add(self, code: int, k: int, jt: int | str = 0, jf: int | str = 0) -> None:
        self.code.append((code, jt, jf, k))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> list[tuple[int, int, int, int]]:
        out = []
        for pc, (code, jt, jf, k) in enumerate(self.code):
            offsets = [self.labels[j] - pc - 1 if isinstance(j, str) else j for j in (jt, jf)]
            if not all(0 <= o <= 255 for o in offsets):
                raise SeccompError(f"jump out of range at instruction {pc}")
            out.append((code, offsets[0], offsets[1], k))
        return out


def filter_program(table: SyscallTable, denied: Iterable[str] = DENIED, *,
                   ip_sockets: bool = True) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions (see the module docstring)."""
    numbers = sorted({table.numbers[name] for name in denied if name in table.numbers})
    p = _Program()
    p.add(LD_W_ABS, OFFSET_ARCH)
    p.add(JEQ_K, table.audit_arch, 0, "kill")
    p.add(LD_W_ABS, OFFSET_NR)
    if table.x32:
        p.add(JGE_K, X32_SYSCALL_BIT, "eperm", 0)
    for number in numbers:
        p.add(JEQ_K, number, "eperm", 0)
    p.add(JEQ_K, table.numbers["clone3"], "enosys", 0)
    p.add(JEQ_K, table.numbers["clone"], "clone", 0)
    if not ip_sockets:
        p.add(JEQ_K, table.numbers["socket"], "socket", 0)
    p.add(JEQ_K, table.numbers["ioctl"], "ioctl", "allow")
    p.label("clone")
    p.add(LD_W_ABS, offset_arg(0))
    p.add(JSET_K, CLONE_NEW_FLAGS, "eperm", "allow")
    if not ip_sockets:
        p.label("socket")
        p.add(LD_W_ABS, offset_arg(0))
        p.add(JEQ_K, AF_INET, "eperm", 0)
        p.add(JEQ_K, AF_INET6, "eperm", "allow")
    p.label("ioctl")
    p.add(LD_W_ABS, offset_arg(1))
    for request in DENIED_IOCTLS:
        p.add(JEQ_K, request, "eperm", 0)
    p.label("allow")
    p.add(RET_K, RET_ALLOW)
    p.label("eperm")
    p.add(RET_K, RET_ERRNO | errno.EPERM)
    p.label("enosys")
    p.add(RET_K, RET_ERRNO | errno.ENOSYS)
    p.label("kill")
    p.add(RET_K, RET_KILL_PROCESS)
    return p.assemble()


def apply_seccomp(program: Sequence[tuple[int, int, int, int]] | None = None) -> None:
    """Install the filter (default: this machine's) on this thread, for good; needs
    ``no_new_privs`` (or CAP_SYS_ADMIN). Call it while the process has one thread (before
    ``execve``, the launcher's case): other threads would not get it."""
    instructions = filter_program(table_for()) if program is None else program
    array = (_SockFilter * len(instructions))(*(_SockFilter(c, jt, jf, k) for c, jt, jf, k in instructions))
    prog = _SockFprog(len(instructions), ctypes.cast(array, ctypes.POINTER(_SockFilter)))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise SeccompError(f"cannot install the seccomp filter: {os.strerror(ctypes.get_errno())}")
