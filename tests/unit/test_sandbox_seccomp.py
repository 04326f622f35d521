"""The trainer's seccomp filter (:mod:`services.agent.usercode.seccomp`).

The program is run here by a small classic-BPF interpreter on made-up ``seccomp_data``, for
both architectures (aarch64 is checked without an aarch64 machine): every refused call gets
EPERM, ordinary calls pass, a foreign architecture is killed, x32 calls and namespace flags of
``clone`` are refused, ``clone3`` gets ENOSYS. The tables are compared with the system's
headers where present. Then the real kernel: a process under the filter cannot chmod, chown or
utime even its own file, yet starts threads and subprocesses; the launcher refuses to run a
trainer on a machine without a table.
"""

from __future__ import annotations

import errno
import platform
import re
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from services.agent.usercode import launch
from services.agent.usercode.sandbox import SandboxPolicy, landlock_abi
from services.agent.usercode.seccomp import (
    AUDIT_ARCH_AARCH64,
    AUDIT_ARCH_X86_64,
    DENIED,
    DENIED_IOCTLS,
    JEQ_K,
    JGE_K,
    JSET_K,
    LD_W_ABS,
    RET_ALLOW,
    RET_ERRNO,
    RET_K,
    RET_KILL_PROCESS,
    TABLES,
    SeccompError,
    filter_program,
    table_for,
)

ROOT = Path(__file__).resolve().parents[2]
EPERM, ENOSYS = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS
AUDIT_ARCH_I386 = 0x40000003
THREAD_FLAGS = 0x003D0F00   # CLONE_VM | FS | FILES | SIGHAND | THREAD | SYSVSEM | SETTLS | PARENT_SETTID | ...
# Calls every trainer makes, and that must pass: (x86_64, aarch64) numbers.
ORDINARY = {"read": (0, 63), "openat": (257, 56), "mmap": (9, 222), "execve": (59, 221), "setsid": (112, 157),
            "prctl": (157, 167), "kill": (62, 129), "wait4": (61, 260), "futex": (202, 98)}


def run(program: Sequence[tuple[int, int, int, int]], nr: int, arch: int, *args: int) -> int:
    """What the filter returns for one system call (a classic-BPF interpreter for its opcodes)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    pc, acc = 0, 0
    for _ in range(len(program)):
        code, jt, jf, k = program[pc]
        if code == LD_W_ABS:
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code in (JEQ_K, JGE_K, JSET_K):
            taken = acc == k if code == JEQ_K else acc >= k if code == JGE_K else bool(acc & k)
            pc += 1 + (jt if taken else jf)
        elif code == RET_K:
            return k
        else:
            raise AssertionError(f"unknown opcode {code:#x}")
    raise AssertionError("the program did not return")


@pytest.mark.parametrize("machine", sorted(TABLES))
def test_the_filter_refuses_exactly_what_it_lists(machine: str) -> None:
    table = TABLES[machine]
    program = filter_program(table)
    assert len(program) < 4096 and program[-1] == (RET_K, 0, 0, RET_KILL_PROCESS)
    missing = set(DENIED) - set(table.numbers)
    assert missing == (set() if machine == "x86_64" else
                       {"chmod", "chown", "lchown", "utime", "utimes", "futimesat", "mknod"})   # no such calls
    for name in set(DENIED) - missing:
        assert run(program, table.numbers[name], table.audit_arch) == EPERM, name
    for name, numbers in ORDINARY.items():
        assert run(program, numbers[machine == "aarch64"], table.audit_arch) == RET_ALLOW, name
    clone, ioctl = table.numbers["clone"], table.numbers["ioctl"]
    assert run(program, clone, table.audit_arch, THREAD_FLAGS | 17) == RET_ALLOW   # threads, fork
    for flag in (0x10000000, 0x40000000, 0x20000, 0x20000000):                   # NEWUSER, NEWNET, NEWNS, NEWPID
        assert run(program, clone, table.audit_arch, flag | 17) == EPERM
    assert run(program, table.numbers["clone3"], table.audit_arch) == ENOSYS       # the C library falls back
    for request in DENIED_IOCTLS:
        assert run(program, ioctl, table.audit_arch, 3, request) == EPERM
    assert run(program, ioctl, table.audit_arch, 3, 0x80086601) == RET_ALLOW       # FS_IOC_GETFLAGS
    assert run(program, ioctl, table.audit_arch, 3, 0x5401) == RET_ALLOW           # TCGETS
    for foreign in {AUDIT_ARCH_I386, AUDIT_ARCH_X86_64, AUDIT_ARCH_AARCH64} - {table.audit_arch}:
        assert run(program, 0, foreign) == RET_KILL_PROCESS


@pytest.mark.parametrize("machine", sorted(TABLES))
def test_without_the_network_no_ip_socket_is_made_and_unix_sockets_are(machine: str) -> None:
    table = TABLES[machine]
    closed, open_ = filter_program(table, ip_sockets=False), filter_program(table)
    socket_nr = table.numbers["socket"]
    for domain in (2, 10):                                                      # AF_INET, AF_INET6
        for kind in (1, 2, 3, 0x80802):                                         # stream, dgram, raw, dgram|flags
            assert run(closed, socket_nr, table.audit_arch, domain, kind) == EPERM
            assert run(open_, socket_nr, table.audit_arch, domain, kind) == RET_ALLOW
    assert run(closed, socket_nr, table.audit_arch, 1, 1) == RET_ALLOW          # AF_UNIX
    assert run(closed, table.numbers["chmod" if machine == "x86_64" else "fchmod"], table.audit_arch) == EPERM
    assert run(closed, table.numbers["clone"], table.audit_arch, THREAD_FLAGS | 17) == RET_ALLOW


NO_NETWORK_SCRIPT = """
import ctypes, socket
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0
from services.agent.usercode.seccomp import apply_seccomp, filter_program, table_for
apply_seccomp(filter_program(table_for(), ip_sockets=False))
for family, kind in ((socket.AF_INET, socket.SOCK_DGRAM), (socket.AF_INET6, socket.SOCK_DGRAM),
                     (socket.AF_INET, socket.SOCK_STREAM)):
    try:
        socket.socket(family, kind).sendto(b"x", ("127.0.0.1", 9))
        print("sent")
    except OSError as exc:
        print(exc.strerror)
a, b = socket.socketpair()
a.sendall(b"unix ok")
print(b.recv(16).decode())
"""


@pytest.mark.skipif(platform.machine() not in TABLES or sys.platform != "linux", reason="no seccomp table here")
def test_under_the_filter_without_network_no_udp_leaves_and_unix_sockets_work() -> None:
    done = subprocess.run([sys.executable, "-c", NO_NETWORK_SCRIPT], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["Operation not permitted"] * 3 + ["unix ok"]


def test_x32_calls_are_refused_on_x86_64() -> None:
    program = filter_program(TABLES["x86_64"])
    assert run(program, 0x40000000 | 0, AUDIT_ARCH_X86_64) == EPERM       # x32 read
    assert run(program, 0x40000000 | 90, AUDIT_ARCH_X86_64) == EPERM      # x32 chmod


@pytest.mark.parametrize(("machine", "header"), [
    ("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    ("aarch64", "/usr/include/asm-generic/unistd.h"),
])
def test_the_tables_match_the_system_headers(machine: str, header: str) -> None:
    path = Path(header)
    if not path.exists():
        pytest.skip(f"{header} is not installed")
    defined = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)\b", path.read_text())}
    compared = {name: number for name, number in TABLES[machine].numbers.items() if name in defined}
    assert len(compared) > 30   # the header is older than the newest calls, not empty
    assert compared == {name: defined[name] for name in compared}


def test_an_unknown_machine_has_no_table() -> None:
    assert table_for("amd64") is TABLES["x86_64"] and table_for("arm64") is TABLES["aarch64"]
    with pytest.raises(SeccompError, match="no seccomp table for the machine 'riscv64'"):
        table_for("riscv64")


SCRIPT = """
import ctypes, os, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0          # no_new_privs, as the sandbox sets it first
from services.agent.usercode.seccomp import apply_seccomp
apply_seccomp()
path = sys.argv[1]
for name, call in (("chmod", lambda: os.chmod(path, 0o777)), ("chown", lambda: os.chown(path, os.getuid(), -1)),
                   ("utime", lambda: os.utime(path, (0, 0)))):
    try:
        call()
        print(name, "done")
    except OSError as exc:
        print(name, os.strerror(exc.errno))
thread = threading.Thread(target=print, args=("thread ran",))
thread.start()
thread.join()
print(subprocess.run(["/bin/echo", "subprocess ran"], capture_output=True, text=True).stdout.strip())
"""


@pytest.mark.skipif(platform.machine() not in TABLES or sys.platform != "linux", reason="no seccomp table here")
def test_under_the_filter_metadata_is_refused_and_processes_still_start(tmp_path: Path) -> None:
    own = tmp_path / "own.txt"
    own.write_text("mine")
    own.chmod(0o600)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(own)], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["chmod Operation not permitted", "chown Operation not permitted",
                                        "utime Operation not permitted", "thread ran", "subprocess ran"]
    assert own.stat().st_mode & 0o777 == 0o600


def test_the_launcher_refuses_a_machine_without_a_table(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    policy = SandboxPolicy(read_only=(), read_write=(tmp_path,))
    command = ["--nofile", "64", "--fsize", "1000000", "--sandbox-json", policy.to_json(), "--",
               "/bin/sh", "-c", f"touch {marker}"]
    fake = ("import platform, sys; sys.argv[0] = 'launch'; platform.machine = lambda: 'riscv64'; "
            f"from services.agent.usercode.launch import main; main({command!r})")
    done = subprocess.run([sys.executable, "-c", fake], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.returncode == launch.REFUSED and not marker.exists()
    expected = "no seccomp table for the machine 'riscv64'" if landlock_abi() else "Landlock is unavailable"
    assert expected in done.stderr
