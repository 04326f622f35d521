"""The trainer harness against real user trainers: real subprocesses, CPU, ``nn.Linear(4, 2)``.

Each trainer is a script written into ``tmp_path`` that uses only ``hadar_sdk`` and torch.
What is checked: a good trainer trains several rounds in one process; a stop ends a round at
a step boundary with the state saved; every hand-back the harness must not pass on is refused
with its reason; a trainer that looks for credentials, the checkout, the network or the
harness finds nothing (Landlock + no capability, even as uid 0); it cannot change any file's
mode, owner or times (seccomp), yet trains; what it starts outside its session is ended with
it; it gets the worker's threads and trains at an emulated GPU's slowdown; a trainer that will
not stop, crashes or never connects is ended and the result says why. After every test the
harness (this process) still has its privileges, its files and no signal from a trainer.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hadar_sdk import state_tensors
from services.agent.usercode import launch
from services.agent.usercode.sandbox import SandboxError, SandboxPolicy
from services.agent.usercode.trainer import RoundRequest, RoundResult, Trainer, TrainerLaunch, TrainerLimits

ROOT = Path(__file__).resolve().parents[2]
FAST = TrainerLimits(hello_s=60, stop_grace_s=2, term_grace_s=1, log_bytes=16 << 10)
STUBBORN = TrainerLimits(hello_s=60, stop_grace_s=0.5, term_grace_s=0.5)

pytestmark = pytest.mark.usefixtures("requires_landlock")

# One script, its behaviour chosen by its first argument; the others are probe targets.
TRAINER = '''
import errno, os, signal, socket, sys, time
import torch
from torch import nn
import hadar_sdk
import hadar_sdk.run

MODE = sys.argv[1]
if MODE == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if MODE == "pickle":
    hadar_sdk.run.save_file = lambda tensors, path: torch.save(tensors, path)
if MODE == "symlink":
    hadar_sdk.run.save_file = lambda tensors, path: os.symlink(os.path.join(os.path.dirname(path),
                                                                            "..", "inbox", "start.safetensors"), path)


def probe(name, attempt):
    try:
        attempt()
    except OSError as exc:
        print(f"probe {name}: denied ({type(exc).__name__})", flush=True)
        return 0
    print(f"probe {name}: FOUND", flush=True)
    return 1


def snoop(secret_file, victim, port, repo_file, code_dir):
    ppid = os.getppid()
    leaked = [k for k, v in os.environ.items() if "S3" in k or "SECRET" in k or "s3cr3t" in v]
    print(f"probe environment: {'FOUND ' + ','.join(leaked) if leaked else 'denied (clean)'}", flush=True)
    found = len(leaked)
    found += probe("secret file", lambda: open(secret_file, "rb").read())
    found += probe("harness environ", lambda: open(f"/proc/{ppid}/environ", "rb").read())
    found += probe("init environ", lambda: open("/proc/1/environ", "rb").read())
    found += probe("victim environ", lambda: open(f"/proc/{victim}/environ", "rb").read())
    found += probe("victim mem", lambda: open(f"/proc/{victim}/mem", "rb").read(1))
    found += probe("repository file", lambda: open(repo_file, "rb").read())
    found += probe("repository listing", lambda: os.listdir(os.path.dirname(repo_file)))
    found += probe("shadow", lambda: open("/etc/shadow", "rb").read())
    found += probe("write code bundle", lambda: open(os.path.join(code_dir, "planted.py"), "w").write("x"))
    found += probe("tcp connect", lambda: socket.create_connection(("127.0.0.1", int(port)), timeout=2))
    found += probe("signal 0 harness", lambda: os.kill(ppid, 0))
    found += probe("sigterm harness", lambda: os.kill(ppid, signal.SIGTERM))
    found += probe("sigterm victim", lambda: os.kill(int(victim), signal.SIGTERM))
    caps = [line for line in open("/proc/self/status") if line.startswith(("CapEff", "CapPrm", "CapBnd"))]
    found += sum(int(line.split()[1], 16) != 0 for line in caps)
    print("caps", " ".join(line.split()[1] for line in caps), "uid", os.getuid(), flush=True)
    return found


def refused(name, attempt):
    try:
        attempt()
    except OSError as exc:
        print(f"meta {name}: {errno.errorcode.get(exc.errno, exc.errno)}", flush=True)
        return int(exc.errno != errno.EPERM)
    print(f"meta {name}: DONE", flush=True)
    return 1


def change_metadata(outside, code_file):
    import ctypes, shutil
    libc = ctypes.CDLL(None, use_errno=True)

    def call(result):
        if result != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

    own = os.path.join(os.environ["HOME"], "own.txt")
    open(own, "w").write("mine")
    uid, gid = os.getuid(), os.getgid()
    failed = 0
    for where, path in (("outside", outside), ("code", code_file), ("scratch", own)):
        failed += refused(f"chmod {where}", lambda: os.chmod(path, 0o6777))
        failed += refused(f"chown {where}", lambda: os.chown(path, uid, gid))
        failed += refused(f"utime {where}", lambda: os.utime(path, (0, 0)))
        failed += refused(f"setxattr {where}", lambda: os.setxattr(path, "user.hadar", b"x"))
    failed += refused("fchmod scratch", lambda: os.fchmod(os.open(own, os.O_RDONLY), 0o777))
    failed += refused("mkfifo scratch", lambda: os.mkfifo(own + ".fifo"))
    failed += refused("shutil.copy scratch", lambda: shutil.copy(own, own + ".copy"))
    shutil.copyfile(own, own + ".copyfile")
    failed += refused("ptrace", lambda: call(libc.ptrace(0, 0, 0, 0)))
    failed += refused("unshare user", lambda: call(libc.unshare(0x10000000)))
    print("seccomp", [line.split()[1] for line in open("/proc/self/status") if line.startswith("Seccomp:")], flush=True)
    return failed


with hadar_sdk.connect() as run:
    torch.manual_seed(run.seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for rnd in run.rounds():
        restored = rnd.restore(model, opt)
        rnd.metric("pid", os.getpid(), of="start")
        rnd.metric("restored", float(bool(restored)), of="start")
        rnd.metric("restored_optimizer", float(restored.optimizer), of="start")
        rnd.metric("weight_sum", float(model.weight.detach().sum()), of="start")
        if MODE == "snoop":                 # the targets are only known once the test runs
            targets = open(os.path.join(os.path.dirname(__file__), "targets.txt")).read().split()
            rnd.metric("found", snoop(*targets))
        if MODE == "meta":
            rnd.metric("changed", change_metadata(*sys.argv[2:4]))
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "HADAR_SLOWDOWN"):
            rnd.metric(name, float(os.environ[name]), of="start")
        rnd.metric("torch_threads", torch.get_num_threads(), of="start")
        while MODE == "stubborn":           # never looks at the round's steps, its stop or SIGTERM
            time.sleep(0.1)
        x, y = torch.randn(run.batch_size, 4), torch.randn(run.batch_size, 2)
        began, work = time.monotonic(), 0.0
        for step in rnd.steps():
            step_began = time.monotonic()
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rnd.report(samples=run.batch_size * (100 if MODE == "samples" else 1), loss=float(loss))
            time.sleep(0.05 if MODE == "slow" else 0.02)
            work += time.monotonic() - step_began
        rnd.metric("elapsed", time.monotonic() - began)
        rnd.metric("work", work)
        if MODE == "fails_at_stop":         # as a rank's collective fails once a stopped peer is ended
            raise RuntimeError("Connection closed by peer")
        if MODE == "extra":
            model.register_buffer("extra", torch.zeros(1))
        if MODE == "steps":
            rnd.steps_done += 5
        rnd.save(nn.Linear(4, 3) if MODE == "reshape" else model, opt)
'''


@pytest.fixture(autouse=True)
def harness_unaffected() -> Iterator[list[int]]:
    """Records any SIGTERM this process gets; afterwards it must have none, its privileges and its files."""
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)
    status = Path("/proc/self/status").read_text()
    assert received == []
    assert "NoNewPrivs:\t0" in status
    assert (ROOT / "pyproject.toml").read_bytes()   # no Landlock domain on the harness


def trainer(tmp_path: Path, mode: str, *, limits: TrainerLimits = FAST, text: str = TRAINER,
            start: bool = True, args: tuple[str, ...] = (), **launch: Any) -> Trainer:
    """A trainer running ``text`` with ``mode`` in its own scratch folder (started unless told not to)."""
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / f"trainer_{mode}.py").write_text(text)   # not pickle.py: it would shadow the standard module
    t = Trainer(TrainerLaunch(code_dir=code, entrypoint=f"trainer_{mode}.py", scratch=tmp_path / f"scratch-{mode}",
                              seed=7, batch_size=2, args=(mode, *args), **launch), limits)
    if start:
        t.start()
    return t


MODES = ("good", "extra", "reshape", "pickle", "symlink", "steps", "samples", "snoop", "stubborn", "meta", "slow",
         "fails_at_stop")
ESCAPE_MARKER = f"hadar-escape-{os.getpid()}"   # in the command line of every process the escaper starts

# Starts a child that leaves the session and a double fork's grandchild in a session of its
# own (both sleep for ever), then waits for the harness's "exit" (no torch: it starts at once).
ESCAPER = """
import os, socket, subprocess, sys
FORK = ("import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    if os.fork() == 0:\\n        time.sleep(1000)\\n"
        "else:\\n    os.wait()\\n")
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)", sys.argv[-1]], start_new_session=True)
subprocess.run([sys.executable, "-c", FORK, sys.argv[-1]], check=True)
print("escaped", flush=True)
channel = socket.socket(fileno=int(os.environ["HADAR_SDK_FD"]))
while b"exit" not in channel.recv(4096):
    pass
"""


def escaped() -> list[tuple[int, int, str]]:
    """(pid, parent pid, state) of every process whose command line holds ESCAPE_MARKER (the trainer too)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and ESCAPE_MARKER.encode() in (entry / "cmdline").read_bytes():
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                found.append((int(entry.name), int(fields[1]), fields[0]))
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def trainers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Trainer]]:
    """A trainer of each mode, all started at once (each spends seconds of CPU importing torch),
    by a harness whose environment holds fake credentials: ``HADAR_S3_SECRET_KEY`` and
    ``HADAR_S3_SECRET_KEY_FILE``, naming an owner-only file beside the code bundle."""
    root = tmp_path_factory.mktemp("trainers")
    secret = root / "secret"
    secret.write_text("s3cr3t-from-file")
    secret.chmod(0o600)
    outside = root / "outside.txt"          # the harness's file (root's, when it runs as root)
    outside.write_text("not yours")
    outside.chmod(0o644)
    (root / "code").mkdir()
    (root / "code" / "data.txt").write_text("the bundle's")
    extra = {"meta": {"args": (str(outside), str(root / "code" / "data.txt"))},
             "slow": {"threads": 2, "slowdown": 3.0, "passthrough": ("OMP_NUM_THREADS",)}}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HADAR_S3_SECRET_KEY", "s3cr3t-in-env")
        env.setenv("HADAR_S3_SECRET_KEY_FILE", str(secret))
        env.setenv("OMP_NUM_THREADS", "7")  # passed through, yet the launch's threads win
        started = {mode: trainer(root, mode, limits=STUBBORN if mode == "stubborn" else FAST,
                                 **extra.get(mode, {})) for mode in MODES}
        try:
            yield started
        finally:
            with ThreadPoolExecutor(len(started)) as pool:
                list(pool.map(Trainer.close, started.values()))


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    return state_tensors(nn.Linear(4, 2), None)


def request(round_: int = 1, *, start: dict[str, torch.Tensor] | None = None, max_steps: int = 3,
            seconds: float = 30.0) -> RoundRequest:
    return RoundRequest(round=round_, copy=0, start_steps=0, max_steps=max_steps, seconds=seconds,
                        max_samples_per_step=2, start=start)


def metric(result: RoundResult, name: str) -> float:
    return next(value for n, _, value in result.metrics if n == name)


def test_a_trainer_trains_rounds_in_one_process_until_stopped(trainers: dict[str, Trainer]) -> None:
    t = trainers["good"]
    seen: list[tuple[int, int, float | None]] = []
    first = t.run_round(request(1), on_progress=lambda *p: seen.append(p))
    assert first.ok, (first.reason, t.log_tail)
    assert (first.steps, first.samples, first.stopped) == (3, 6, False)
    assert first.tensors is not None and set(first.tensors) == {"weight", "bias"}
    assert seen[-1][:2] == (3, 6) and seen[-1][2] == first.loss
    second = t.run_round(request(2, start=first.tensors))
    assert second.ok, second.reason
    assert metric(first, "pid") == metric(second, "pid") == t.pid
    assert (metric(first, "restored"), metric(second, "restored")) == (0.0, 1.0)
    assert (metric(first, "restored_optimizer"), metric(second, "restored_optimizer")) == (0.0, 0.0)   # SGD
    assert metric(first, "elapsed") < 1.5 * metric(first, "work") + 0.2   # no slowdown: no sleep between steps
    assert metric(second, "weight_sum") == pytest.approx(float(first.tensors["weight"].sum()), abs=1e-5)
    assert second.tensors is not None and not torch.equal(second.tensors["weight"], first.tensors["weight"])

    timer: list[threading.Timer] = []

    def stop_soon(steps: int, samples: int, loss: float | None) -> None:
        if not timer:                       # from another thread, while run_round waits
            timer.append(threading.Timer(0.5, t.request_stop))
            timer[0].start()

    began = time.monotonic()
    third = t.run_round(request(3, start=second.tensors, max_steps=100_000, seconds=60), on_progress=stop_soon)
    assert third.ok and third.stopped, third.reason
    assert 0 < third.steps < 1000 and third.samples == 2 * third.steps
    assert third.tensors is not None and time.monotonic() - began < 20
    t.request_stop()                        # between rounds: the next round stops at once
    fourth = t.run_round(request(4, start=third.tensors, max_steps=100_000, seconds=60))
    assert fourth.ok and fourth.stopped and fourth.steps == 0, fourth.reason
    assert fourth.tensors is not None and torch.equal(fourth.tensors["weight"], third.tensors["weight"])
    assert t.close() == 0                   # "exit": the script leaves its loop and ends by itself


@pytest.mark.parametrize(("mode", "reason"), [
    ("extra", "extra ['extra']"),
    ("reshape", "tensor 'weight' is float32[3, 4], the start state's is float32[2, 4]"),
    ("pickle", "the state file is not safetensors"),
    ("symlink", "the state file is not a regular file"),
    ("steps", "the trainer claims 8 steps, over the round's budget of 3"),
    ("samples", "the trainer claims 200 samples in 0 steps, over 2 a step"),
])
def test_bad_hand_backs_are_refused_with_their_reason(trainers: dict[str, Trainer], mode: str, reason: str) -> None:
    result = trainers[mode].run_round(request(start=initial_state()))
    assert not result.ok and result.tensors is None
    assert result.reason.startswith("refused: ") and reason in result.reason, result.reason
    assert result.exit_code is not None     # a trainer that broke a rule is ended ...
    assert trainers[mode].run_round(request(2)).reason == "the trainer is not running"   # ... for good


def test_a_trainer_finds_no_credential_and_cannot_reach_the_harness(trainers: dict[str, Trainer]) -> None:
    t = trainers["snoop"]
    code, secret = t.launch.code_dir, t.launch.code_dir.parent / "secret"
    drop = "from services.agent.usercode.sandbox import drop_privileges; drop_privileges(); "
    victim = subprocess.Popen([sys.executable, "-c", drop + "import time; print('ready', flush=True); time.sleep(60)"],
                              env={**os.environ, "VICTIM": "s3cr3t-victim"}, stdout=subprocess.PIPE, text=True)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        assert victim.stdout is not None and victim.stdout.readline() == "ready\n"
        # The victim has dropped its capabilities: only Landlock guards its environ now.
        control = subprocess.run([sys.executable, "-c", drop + f"print(open('/proc/{victim.pid}/environ').read())"],
                                 capture_output=True, text=True, check=True)
        assert "s3cr3t-victim" in control.stdout   # the same uid, without Landlock, could read it
        (code / "targets.txt").write_text(f"{secret} {victim.pid} {listener.getsockname()[1]} "
                                          f"{ROOT / 'pyproject.toml'} {code}")
        result = t.run_round(request())
        assert result.ok, (result.reason, t.log_tail)
        assert metric(result, "found") == 0, t.log_tail
        for name in ("environment", "secret file", "harness environ", "init environ", "victim environ", "victim mem",
                     "repository file", "repository listing", "shadow", "write code bundle", "tcp connect",
                     "signal 0 harness", "sigterm harness", "sigterm victim"):
            assert f"probe {name}: denied" in t.log_tail, name
        if os.getuid() == 0:
            assert "caps 0000000000000000 0000000000000000 0000000000000000 uid 0" in t.log_tail
        assert "s3cr3t" not in t.log_tail and not (code / "planted.py").exists()
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()               # nothing connected
        assert victim.poll() is None        # the victim was not signalled
    finally:
        victim.kill()
        victim.wait()
        listener.close()


def test_a_trainer_cannot_change_file_metadata_yet_trains(trainers: dict[str, Trainer]) -> None:
    t = trainers["meta"]
    outside, code_file = (Path(p) for p in t.launch.args[1:3])
    before = [os.stat(p) for p in (outside, code_file)]
    # Without the seccomp filter the same uid, privileges dropped, could (set the same mode and times):
    control = subprocess.run([sys.executable, "-c", "from services.agent.usercode.sandbox import drop_privileges; "
                              f"import os; drop_privileges(); os.chmod({str(outside)!r}, 0o644); "
                              f"os.utime({str(outside)!r}, ns=({before[0].st_atime_ns}, {before[0].st_mtime_ns}))"],
                             capture_output=True, text=True, cwd=ROOT)
    assert control.returncode == 0, control.stderr
    result = t.run_round(request())
    assert result.ok and result.steps == 3 and result.tensors is not None, (result.reason, t.log_tail)
    assert metric(result, "changed") == 0, t.log_tail
    for where in ("outside", "code", "scratch"):
        for call in ("chmod", "chown", "utime", "setxattr"):
            assert f"meta {call} {where}: EPERM" in t.log_tail
    for name in ("fchmod scratch", "mkfifo scratch", "shutil.copy scratch", "ptrace", "unshare user"):
        assert f"meta {name}: EPERM" in t.log_tail
    assert "seccomp ['2']" in t.log_tail
    after = [os.stat(p) for p in (outside, code_file)]
    assert [(s.st_mode, s.st_uid, s.st_gid, s.st_mtime_ns) for s in after] == \
        [(s.st_mode, s.st_uid, s.st_gid, s.st_mtime_ns) for s in before]
    assert oct(outside.stat().st_mode & 0o7777) == "0o644"


def test_processes_that_leave_the_session_end_with_the_trainer(trainers: dict[str, Trainer], tmp_path: Path) -> None:
    t = trainer(tmp_path, "escape", text=ESCAPER, args=(ESCAPE_MARKER,))
    try:
        until = time.monotonic() + 30
        while "escaped" not in t.log_tail and t.process.poll() is None and time.monotonic() < until:
            time.sleep(0.02)
        alive = [(pid, ppid) for pid, ppid, state in escaped() if state != "Z" and pid != t.pid]
        assert len(alive) == 2, (escaped(), t.log_tail)   # the setsid child and the double fork's grandchild ...
        assert sum(ppid == os.getpid() for _, ppid in alive) == 1   # ... the orphan already the harness's
        assert all(os.getsid(pid) != os.getsid(t.pid or 0) for pid, _ in alive)   # out of reach of killpg
    finally:
        assert t.close() == 0
    assert escaped() == []                  # killed and reaped: not even a zombie is left
    assert trainers["slow"].process.poll() is None   # another trainer, a child of the harness too, lives on


def test_a_trainer_gets_its_threads_and_trains_at_the_emulated_rate(trainers: dict[str, Trainer]) -> None:
    t = trainers["slow"]
    result = t.run_round(request(max_steps=8))
    assert result.ok and result.steps == 8, (result.reason, t.log_tail)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "torch_threads"):
        assert metric(result, name) == 2, name   # the launch's, not the harness's OMP_NUM_THREADS=7
    assert metric(result, "HADAR_SLOWDOWN") == 3.0
    ratio = metric(result, "elapsed") / metric(result, "work")
    assert 2.4 < ratio < 4.0, ratio         # 8 steps of 50 ms work take about 3 x 0.4 s


def test_a_trainer_that_ignores_sigterm_is_killed(trainers: dict[str, Trainer]) -> None:
    result = trainers["stubborn"].run_round(request(seconds=1.0))
    assert not result.ok and result.stopped and result.killed
    assert result.reason == ("the trainer did not end the round within 0.5 s of the stop: "
                             "killed (SIGTERM, then SIGKILL)")
    assert result.exit_code == -signal.SIGKILL


def test_a_trainer_that_fails_once_stopped_did_not_end_the_round(trainers: dict[str, Trainer]) -> None:
    """The stop is the cause; what the trainer says after it may be a consequence (in a copy of
    several ranks, a peer ended at the deadline fails the collective this rank waits in), so the
    reason says first that the round did not end at the stop, then what the trainer said."""
    t = trainers["fails_at_stop"]
    result = t.run_round(request(max_steps=10**6, seconds=4.0))
    assert not result.ok and result.stopped and not result.killed and result.steps > 0, (result, t.log_tail)
    assert re.fullmatch(r"the trainer did not end the round at the stop: [0-9.]+ s later, the trainer failed: "
                        r"RuntimeError: Connection closed by peer", result.reason), result.reason


def test_crashes_silence_and_floods_are_ended_with_their_reason(tmp_path: Path) -> None:
    limits = TrainerLimits(hello_s=2, stop_grace_s=1, term_grace_s=1, log_bytes=4096)
    crash = trainer(tmp_path, "crash", limits=limits, text='print("loading")\nraise RuntimeError("broken at import")\n')
    silent = trainer(tmp_path, "silent", limits=limits,
                     text='import time\nprint("not connecting", flush=True)\ntime.sleep(60)\n')
    flood = trainer(tmp_path, "flood", limits=limits,
                    text='import sys\nfor i in range(5000):\n    print("x" * 99)\nprint("last words")\nsys.exit(3)\n')
    try:
        result = crash.run_round(request())
        assert not result.ok and result.exit_code == 1
        assert result.reason == "the trainer exited (code 1) without saving: RuntimeError: broken at import"
        result = silent.run_round(request())
        assert not result.ok and result.exit_code == -signal.SIGTERM
        assert result.reason == "the trainer did not connect to the SDK within 2 s"
        result = flood.run_round(request())
        assert result.reason == "the trainer exited (code 3) without saving: last words"
        assert len(flood.log_tail.encode()) <= 4096 and flood.log_tail.endswith("last words\n")
        assert flood.process.kept_bytes <= 4096 + 8192   # the kept chunks, not the 500 kB written
    finally:
        for t in (crash, silent, flood):
            t.close()


def test_the_launcher_fails_closed_without_landlock(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    policy = SandboxPolicy(read_only=(), read_write=(tmp_path,))
    command = ["--nofile", "64", "--fsize", "1000000", "--sandbox-json", policy.to_json(), "--",
               "/bin/sh", "-c", f"touch {marker}"]
    fake = ("import sys; sys.argv[0] = 'launch'; import services.agent.usercode.sandbox as s; "
            f"s.landlock_abi = lambda: 0; from services.agent.usercode.launch import main; main({command!r})")
    done = subprocess.run([sys.executable, "-c", fake], capture_output=True, text=True, timeout=30)
    assert done.returncode == launch.REFUSED and not marker.exists()
    assert "refusing to run the trainer unsandboxed: Landlock is unavailable" in done.stderr
    bad = subprocess.run([sys.executable, launch.__file__, *command[:4], "--sandbox-json", "[1]", "--", "/bin/true"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == launch.REFUSED and "sandbox policy" in bad.stderr
    opted_out = subprocess.run([sys.executable, launch.__file__, *command[:4], "--no-sandbox", *command[6:]],
                               timeout=30)
    assert opted_out.returncode == 0 and marker.exists()


def test_the_policy_round_trips_and_keeps_the_checkout_closed(tmp_path: Path) -> None:
    policy = trainer(tmp_path, "policy", start=False).sandbox_policy()
    assert SandboxPolicy.from_json(policy.to_json()) == policy
    assert ROOT not in policy.read_only and ROOT / "hadar_sdk" in policy.read_only and not policy.allow_network
    assert tmp_path / "scratch-policy" / "inbox" in policy.read_only
    assert {tmp_path / "scratch-policy" / f for f in ("home", "tmp", "outbox")} <= set(policy.read_write)
    assert tmp_path / "scratch-policy" not in policy.read_write   # not the inbox, not the harness's received/
    assert Path("/etc/shadow") not in policy.read_only and Path("/etc") not in policy.read_only
    assert Path(sys.prefix) in policy.read_only and Path("/dev/shm") in policy.read_write
    with pytest.raises(SandboxError, match="not absolute"):
        SandboxPolicy(read_only=(Path("relative"),), read_write=())
