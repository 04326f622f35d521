"""The trainer's sandbox: no privilege, a Landlock allow-list of files and network, seccomp.

:func:`apply_sandbox` is called in the trainer process by :mod:`~services.agent.usercode.launch`
right before it ``execv``\\ s the user's script; it holds for that process and everything it
starts, and cannot be undone. After it returns:

* **Privilege:** ``no_new_privs`` is set (no setuid, setgid or file capability takes effect),
  the capability bounding, ambient, effective, permitted and inheritable sets are empty, and
  root's implicit capabilities are off for later ``execve`` (securebits, where allowed): a
  trainer running as uid 0 holds no capability, checked with ``capget`` before returning.
* **Files** (Landlock, every access right the kernel's ABI knows is handled): only the paths
  of :class:`SandboxPolicy` -- ``read_only`` (read, list, execute) and ``read_write``
  (also create, write, remove, rename within) -- and what lies beneath them. A missing path is
  skipped. A path that is a file gets only the rights a file can have.
* **Processes:** Landlock closes ptrace-mode access (``/proc/<pid>/environ``, ``mem``, ...) to
  every process outside the sandbox's domain, whatever the uid.
* **Network** (ABI >= 4): with ``allow_network`` False no TCP bind or connect at all, and
  (seccomp) no IP socket of any kind: no UDP either.
* **Scope** (ABI >= 6): no signal to, and no abstract unix socket of, a process outside the
  domain (the harness, the agent, other trainers).
* **System calls** (:mod:`~services.agent.usercode.seccomp`, last): no change to any file's
  mode, owner, times or xattrs (Landlock has no right for these, and uid 0 owns the system's
  files), no ``mknod``, no ``ptrace`` or other process's memory, no new namespace, mount,
  module, BPF, keyring, ``io_uring`` or ``perf_event_open``; a foreign architecture's call
  kills the process. On a machine without a system call table the sandbox is refused.

Not covered (a ``run_as`` uid that owns nothing outside its scratch closes most of it): UDP
for a copy of several ranks (its rendezvous may need a name lookup); ``connect`` to an
existing pathname unix socket; files of other processes in ``/dev/shm``.
A child that leaves the trainer's session (``setsid``) is the harness's to end
(:mod:`services.agent.usercode.process`).

Trusted code that runs in the untrusted process; imports only the standard library,
:mod:`shared.errors` and the seccomp module, so the launcher starts in milliseconds.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import site
import stat
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from services.agent.usercode.seccomp import SeccompError, apply_seccomp, filter_program, table_for
from shared.errors import HadarError

__all__ = ["SandboxError", "SandboxPolicy", "landlock_abi", "python_paths", "trainer_policy",
           "drop_privileges", "apply_sandbox", "make_undumpable", "SYSTEM_READ_ONLY", "ETC_FILES"]

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446   # the same number on every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH, _RULE_NET_PORT = 1, 2
_PR_SET_DUMPABLE, _PR_CAPBSET_READ, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS = 4, 23, 24, 28
_PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT = 38, 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_SECBITS_LOCKED_NOROOT = 0b11101111   # noroot, no_setuid_fixup, no_cap_ambient_raise (+ locks), keep_caps locked
_CAP_VERSION_3 = 0x20080522

# Landlock filesystem access rights, by the ABI that introduced them.
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_REMOVE_DIR, _FS_REMOVE_FILE, _FS_MAKE_CHAR, _FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
_FS_MAKE_REG, _FS_MAKE_SOCK, _FS_MAKE_FIFO, _FS_MAKE_BLOCK, _FS_MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FS_ABI1 = (1 << 13) - 1
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1

_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
_READ_RIGHTS = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR | _FS_IOCTL_DEV
_WRITE_RIGHTS = (_FS_ABI1 | _FS_REFER | _FS_TRUNCATE | _FS_IOCTL_DEV) & ~(_FS_MAKE_CHAR | _FS_MAKE_BLOCK)

SYSTEM_READ_ONLY = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/proc", "/sys", "/dev/urandom", "/dev/random")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group", "nsswitch.conf",
             "hosts", "host.conf", "gai.conf", "resolv.conf", "os-release", "ssl")
SYSTEM_READ_WRITE = ("/dev/null", "/dev/zero", "/dev/shm")


class SandboxError(HadarError):
    """The sandbox could not be set up as asked (the trainer must not run)."""


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _syscall(number: int, *args: int | ctypes.c_void_p) -> int:
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    return int(libc.syscall(ctypes.c_long(number), *(a if isinstance(a, ctypes.c_void_p) else ctypes.c_long(a)
                                                     for a in args)))


def _prctl(option: int, arg: int = 0) -> int:
    libc = _libc()
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return int(libc.prctl(option, arg, 0, 0, 0))


def _errno_text() -> str:
    return os.strerror(ctypes.get_errno())


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is unavailable (old kernel, not enabled)."""
    try:
        version = _syscall(_CREATE_RULESET, ctypes.c_void_p(None), 0, _CREATE_RULESET_VERSION)
    except (OSError, AttributeError):
        return 0
    return max(0, version)


@dataclass(frozen=True, kw_only=True)
class SandboxPolicy:
    """What a trainer may touch; paths are absolute, ``allow_network`` opens TCP (DDP ranks)."""

    read_only: tuple[Path, ...]
    read_write: tuple[Path, ...]
    allow_network: bool = False

    def __post_init__(self) -> None:
        for path in (*self.read_only, *self.read_write):
            if not isinstance(path, Path) or not path.is_absolute():
                raise SandboxError(f"sandbox path {str(path)!r} is not absolute")

    def to_json(self) -> str:
        return json.dumps({"read_only": [str(p) for p in self.read_only],
                           "read_write": [str(p) for p in self.read_write], "allow_network": self.allow_network})

    @classmethod
    def from_json(cls, text: str) -> SandboxPolicy:
        """The policy :meth:`to_json` wrote; SandboxError for anything else."""
        try:
            value = json.loads(text)
        except ValueError:
            raise SandboxError("sandbox policy: not JSON") from None
        if not isinstance(value, dict) or set(value) != {"read_only", "read_write", "allow_network"}:
            raise SandboxError("sandbox policy: expected read_only, read_write and allow_network")
        lists = value["read_only"], value["read_write"]
        if not all(isinstance(v, list) and all(isinstance(p, str) for p in v) for v in lists) or \
                not isinstance(value["allow_network"], bool):
            raise SandboxError("sandbox policy: paths must be lists of text, allow_network a boolean")
        return cls(read_only=tuple(Path(p) for p in lists[0]), read_write=tuple(Path(p) for p in lists[1]),
                   allow_network=value["allow_network"])


_PYTHON_SNIPPET = ("import json,os,site,sys,sysconfig;print(json.dumps([sys.base_prefix,sys.prefix,"
                   "sys.base_exec_prefix,sys.exec_prefix,os.path.dirname(os.path.realpath(sys.executable)),"
                   "*site.getsitepackages(),*(sysconfig.get_path(n) for n in ('stdlib','platstdlib','purelib',"
                   "'platlib'))]))")


def python_paths(python: str | None = None) -> tuple[Path, ...]:
    """The folders the interpreter ``python`` (default: this one) reads its code from."""
    if python is None or os.path.realpath(python) == os.path.realpath(sys.executable):
        found = [sys.base_prefix, sys.prefix, sys.base_exec_prefix, sys.exec_prefix,
                 os.path.dirname(os.path.realpath(sys.executable)), *site.getsitepackages(),
                 *(sysconfig.get_path(n) for n in ("stdlib", "platstdlib", "purelib", "platlib"))]
    else:
        try:
            out = subprocess.run([python, "-I", "-c", _PYTHON_SNIPPET], capture_output=True, check=True,
                                 timeout=60, env={"PATH": os.defpath}).stdout
            found = json.loads(out)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            raise SandboxError(f"cannot ask {python} for its paths: {type(exc).__name__}") from None
    return tuple(dict.fromkeys(Path(p) for p in found if isinstance(p, str) and p))


def trainer_policy(*, read_only: tuple[Path, ...], read_write: tuple[Path, ...], allow_network: bool,
                   python: str | None = None) -> SandboxPolicy:
    """``read_only`` and ``read_write`` plus what any trainer needs: its interpreter's folders,
    the system libraries, a few ``/etc`` files (not ``shadow``), ``/proc`` and ``/sys`` read-only,
    ``/dev/null``, ``/dev/zero``, ``/dev/shm`` and the NVIDIA devices read-write."""
    devices = [Path(p) for p in sorted(glob.glob("/dev/nvidia*"))]
    return SandboxPolicy(
        read_only=(*python_paths(python), *map(Path, SYSTEM_READ_ONLY), *(Path("/etc") / f for f in ETC_FILES),
                   *(d for d in devices if d.is_dir()), *read_only),
        read_write=(*map(Path, SYSTEM_READ_WRITE), *(d for d in devices if not d.is_dir()), *read_write),
        allow_network=allow_network)


def make_undumpable() -> bool:
    """Close this process's ``/proc`` entries to other processes of its uid (for the harness)."""
    try:
        return _prctl(_PR_SET_DUMPABLE, 0) == 0
    except (OSError, AttributeError):
        return False


def drop_privileges() -> None:
    """Set ``no_new_privs`` and empty every capability set of this process (see the module)."""
    libc = _libc()
    _prctl(_PR_SET_SECUREBITS, _SECBITS_LOCKED_NOROOT)   # needs CAP_SETPCAP; without it root has none to lose
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        if _prctl(_PR_CAPBSET_READ, cap) == 1 and _prctl(_PR_CAPBSET_DROP, cap) != 0 and ctypes.get_errno() != 1:
            raise SandboxError(f"cannot drop capability {cap} from the bounding set: {_errno_text()}")
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)    # EINVAL before Linux 4.3: nothing to clear
    header, data = _CapHeader(_CAP_VERSION_3, 0), (_CapData * 2)()
    if libc.capset(ctypes.byref(header), ctypes.byref(data)) != 0:
        raise SandboxError(f"cannot clear the capability sets: {_errno_text()}")
    if _prctl(_PR_SET_NO_NEW_PRIVS, 1) != 0:
        raise SandboxError(f"cannot set no_new_privs: {_errno_text()}")
    header, check = _CapHeader(_CAP_VERSION_3, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(header), ctypes.byref(check)) != 0 or any(
            d.effective or d.permitted or d.inheritable for d in check):
        raise SandboxError("capabilities are still held after clearing them")


def _handled_fs(abi: int) -> int:
    return _FS_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0) | (
        _FS_IOCTL_DEV if abi >= 5 else 0)


def _add_path(ruleset: int, path: Path, access: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return   # missing paths are skipped
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            access &= _FILE_RIGHTS
        rule = _PathBeneathAttr(access, fd)
        if access and _syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH,
                               ctypes.c_void_p(ctypes.addressof(rule)), 0) != 0:
            raise SandboxError(f"cannot allow {path}: {_errno_text()}")
    finally:
        os.close(fd)


def apply_sandbox(policy: SandboxPolicy) -> int:
    """Drop privileges, restrict this process to ``policy`` and install the seccomp filter,
    for good; the Landlock ABI used.

    Raises SandboxError (the caller must not run the trainer) when Landlock is unavailable,
    the machine has no seccomp table, or any step fails; rules on missing paths are skipped."""
    abi = landlock_abi()
    if abi < 1:
        raise SandboxError("Landlock is unavailable in this kernel")
    try:
        # before anything changes: an unknown machine fails closed
        program = filter_program(table_for(), ip_sockets=policy.allow_network)
    except SeccompError as exc:
        raise SandboxError(str(exc)) from None
    drop_privileges()
    handled = _handled_fs(abi)
    attr = _RulesetAttr(handled, _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 and not policy.allow_network else 0,
                        _SCOPE_SIGNAL | _SCOPE_ABSTRACT_UNIX_SOCKET if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = _syscall(_CREATE_RULESET, ctypes.c_void_p(ctypes.addressof(attr)), size, 0)
    if ruleset < 0:
        raise SandboxError(f"cannot create a Landlock ruleset (ABI {abi}): {_errno_text()}")
    try:
        for path in policy.read_only:
            _add_path(ruleset, path, _READ_RIGHTS & handled)
        for path in policy.read_write:
            _add_path(ruleset, path, _WRITE_RIGHTS & handled)
        if _syscall(_RESTRICT_SELF, ruleset, 0) != 0:
            raise SandboxError(f"cannot enforce the Landlock ruleset: {_errno_text()}")
    finally:
        os.close(ruleset)
    try:
        apply_seccomp(program)
    except SeccompError as exc:
        raise SandboxError(str(exc)) from None
    return abi
