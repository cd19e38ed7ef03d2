#!/usr/bin/env python3
"""Emulated hosts on this machine: several cluster nodes for multi-node runs, tests and CI (run as root).

    launch/hosts.py start [N]              hosts node1..nodeN (default 2)
    launch/hosts.py stop                   every host gone, with every process in it
    launch/hosts.py status                 each host: up, cut or down; exit 0 when all are up, 3 if not
    launch/hosts.py run HOST CMD [ARG...]  CMD on HOST, in this folder, with this environment (TMPDIR: HOST's)
    launch/hosts.py ssh [OPTS] HOST WORDS  the remote shell for launchers: ssh's arguments, ssh's clean login
    launch/hosts.py kill HOST              a node failure: every process of HOST killed at once, the host down
    launch/hosts.py cut HOST               HOST's link down (its switch port): a node cut off the network
    launch/hosts.py mend HOST              its link up again
    launch/hosts.py procs HOST             the processes running on HOST (pid here, then the command)
    launch/hosts.py bytes HOST             bytes sent and received by HOST's network interface so far

A host is what a cluster node is to an MPI job:

* its own network namespace: interface ``eth0`` at ``10.211.0.K/24``, plugged into one bridge that lives in a
  namespace of its own, so no traffic leaves the hosts and this machine's network is not touched;
* its own hostname (UTS), IPC and PID namespaces: no host sees another's processes, so no MPI can attach to
  a peer's memory (CMA, ``/proc/PID/fd``) across hosts;
* its own mount namespace: a private ``/dev/shm`` (shared memory cannot cross hosts), ``/etc/hosts`` naming
  every host, and a node-local scratch folder, a tmpfs at the same path on every host (``TMPDIR``; empty
  as seen from outside the hosts).  Everything else of the file system is shared, as a cluster's shared file
  system is.

One process per host holds its namespaces (pid 1 of its PID namespace): killing it ends every process of
the host at once.  A sibling PID namespace cannot be entered from inside another, so commands reach a host
through a broker in this machine's namespaces (``serve``, started with the hosts): ``run`` and ``ssh`` hand
it their standard input, output and error and wait for the exit status, as ``ssh`` does with ``sshd``.
``ssh`` is also installed as ``launch/hosts-ssh``, one program for the launchers' remote-shell options:

    launch/hosts.py run node1 mpirun -launcher ssh -launcher-exec $PWD/launch/hosts-ssh \\
        -hosts node1:2,node2:1 -n 3 python -m mpifl.run                        # MPICH's Hydra
    launch/hosts.py run node1 mpirun --mca plm_rsh_agent $PWD/launch/hosts-ssh \\
        --host node1:2,node2:1 -n 3 python -m mpifl.run                        # Open MPI (PRRTE)

State lives in ``$MPIFL_HOSTS_STATE`` (default ``/run/mpifl-hosts``); ``$MPIFL_HOSTS_NET`` sets the first
three numbers of the hosts' addresses.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

STATE = Path(os.environ.get("MPIFL_HOSTS_STATE", "/run/mpifl-hosts"))
NET = os.environ.get("MPIFL_HOSTS_NET", "10.211.0")
PREFIX = "mpifl-"  # of the network namespaces: mpifl-node1, ..., mpifl-switch
SWITCH = f"{PREFIX}switch"
NODE_TMP = STATE / "node-tmp"  # each host's TMPDIR: a tmpfs of its own at this path
SOCKET = STATE / "rsh.sock"  # the broker's
LOGIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)
# a host's pid 1: it holds the namespaces and, as an init does, reaps the processes orphaned on the host
REAPER = "import os, time\nwhile True:\n    try: os.wait()\n    except ChildProcessError: time.sleep(0.5)"
SSH_VALUE_OPTIONS = set("bcDEeFIiJLlmOoPpQRSWw")  # ssh's one-letter options that take a value


class Refusal(Exception):
    """A one-line refusal: printed as ``hosts: error: ...``, exit 1."""


# ------------------------------------------------------------------ the hosts' state

def names() -> list[str]:
    path = STATE / "names"
    return path.read_text().split() if path.exists() else []


def address(host: str) -> str:
    return f"{NET}.{names().index(host) + 1}"


def host_of(given: str) -> str:
    """The host a launcher means: its name, a fully qualified name, or its address."""
    for k, name in enumerate(names(), 1):
        if given in (name, f"{NET}.{k}") or given.split(".")[0] == name:
            return name
    raise Refusal(f"no emulated host '{given}' (hosts: {' '.join(names()) or 'none'}); "
                  "start them with: launch/hosts.py start N")


def init_pid(host: str) -> int | None:
    """The process holding ``host``'s namespaces, if it lives."""
    try:
        pid = int((STATE / f"{host}.pid").read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def host_pids(host: str) -> list[int]:
    """Every process of ``host`` but its pid 1 (the processes in its PID namespace)."""
    init = init_pid(host)
    if init is None:
        return []
    mine = os.readlink(f"/proc/{init}/ns/pid")
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != init:
            try:
                if os.readlink(entry / "ns" / "pid") == mine:
                    pids.append(int(entry.name))
            except OSError:
                pass  # ended meanwhile
    return sorted(pids)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode:
        raise Refusal(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@contextlib.contextmanager
def exclusive():
    """One ``start`` or ``stop`` at a time on this machine."""
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def link_up(host: str) -> bool:
    return "state UP" in ip("-n", SWITCH, "link", "show", f"{host}-port").stdout


# ------------------------------------------------------------------ start, stop, status

def start(n: int) -> None:
    if names():
        if len(names()) == n and status(quiet=True) == 0:
            if not broker_alive():
                start_broker()
            print(f"hosts: {n} hosts already up", file=sys.stderr)
            return
        stop()
    STATE.mkdir(parents=True, exist_ok=True)
    NODE_TMP.mkdir(exist_ok=True)
    hosts = [f"node{k}" for k in range(1, n + 1)]
    (STATE / "etc-hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{NET}.{k} {h}\n"
                                                                     for k, h in enumerate(hosts, 1)))
    (STATE / "names").write_text("\n".join(hosts) + "\n")
    ip("netns", "add", SWITCH)
    ip("-n", SWITCH, "link", "add", "br0", "type", "bridge")
    ip("-n", SWITCH, "link", "set", "br0", "up")
    for k, host in enumerate(hosts, 1):
        start_host(k, host)
    start_broker()
    status()


def start_host(k: int, host: str) -> None:
    ns = PREFIX + host
    ip("netns", "add", ns)
    ip("link", "add", f"{host}-eth0", "type", "veth", "peer", "name", f"{host}-port")
    ip("link", "set", f"{host}-port", "netns", SWITCH)
    ip("-n", SWITCH, "link", "set", f"{host}-port", "master", "br0", "up")
    ip("link", "set", f"{host}-eth0", "netns", ns)
    ip("-n", ns, "link", "set", f"{host}-eth0", "name", "eth0")
    ip("-n", ns, "addr", "add", f"{NET}.{k}/24", "dev", "eth0")
    ip("-n", ns, "link", "set", "lo", "up")
    ip("-n", ns, "link", "set", "eth0", "up")
    ready = STATE / f"{host}.ready"
    ready.unlink(missing_ok=True)
    setup = (f"hostname {host} && mount -t tmpfs -o mode=1777 shm /dev/shm "
             f"&& mount -t tmpfs -o mode=1777 node-tmp {NODE_TMP} && mount --bind {STATE / 'etc-hosts'} /etc/hosts "
             f"{''.join(f'&& {command} ' for command in cgroup_mounts())}"
             f"&& touch {ready} && exec {sys.executable} -c '{REAPER}'")
    with open(STATE / f"{host}.log", "w") as log:
        subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "--ipc", "--mount", "--pid", "--fork",
                          "--kill-child", "--mount-proc", "--propagation", "private", "sh", "-c", setup],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 10
    while not ready.exists():
        if time.monotonic() > deadline:
            raise Refusal(f"host {host} did not come up: {(STATE / f'{host}.log').read_text().strip()}")
        time.sleep(0.02)
    # its pid 1: NSpid gives a process's number here, then in its own PID namespace
    for pid in ip("netns", "pids", ns).stdout.split():
        try:
            nspid = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                         if line.startswith("NSpid:")).split()
        except (OSError, StopIteration):
            continue
        if len(nspid) == 3 and nspid[2] == "1":
            (STATE / f"{host}.pid").write_text(pid)
            return
    raise Refusal(f"host {host}: no init process found")


def cgroup_mounts() -> list[str]:
    """Commands that mount in a host the control groups mounted here (``ip netns exec`` gives the host a /sys of
    its own, without them; slurmd needs them)."""
    commands = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, where, kind, options = line.split()[:4]
        if not where.startswith("/sys/fs/cgroup"):
            continue
        if kind == "cgroup":  # v1: one hierarchy per controller (or a named one)
            chosen = [o for o in options.split(",") if o not in ("rw", "ro", "relatime", "nosuid", "nodev", "noexec")]
            if all(o.startswith("name=") for o in chosen):
                chosen.insert(0, "none")
            commands.append(f"mkdir -p {where} && mount -t cgroup -o {','.join(chosen)} cgroup {where}")
        elif kind in ("cgroup2", "tmpfs"):
            commands.append(f"mkdir -p {where} && mount -t {kind} {kind} {where}")
    return commands


def broker_alive() -> bool:
    """Whether the broker answers on its socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(SOCKET))
        except OSError:
            return False
    return True


def start_broker() -> None:
    SOCKET.unlink(missing_ok=True)
    with open(STATE / "broker.log", "a") as log:
        broker = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "serve"], stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=log, start_new_session=True)
    (STATE / "broker.pid").write_text(str(broker.pid))
    deadline = time.monotonic() + 10
    while not SOCKET.exists():
        if time.monotonic() > deadline or broker.poll() is not None:
            raise Refusal(f"the hosts' broker did not start (see {STATE / 'broker.log'})")
        time.sleep(0.02)


def stop() -> None:
    for host in names():
        pid = init_pid(host)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        ip("netns", "del", PREFIX + host, check=False)
    ip("netns", "del", SWITCH, check=False)
    try:
        os.kill(int((STATE / "broker.pid").read_text()), signal.SIGTERM)
    except (OSError, ValueError):
        pass
    for name in ("names", "etc-hosts", "broker.pid", "rsh.sock", *(f"{h}.{s}" for h in names()
                                                                 for s in ("pid", "ready", "log"))):
        (STATE / name).unlink(missing_ok=True)


def status(quiet: bool = False) -> int:
    if not names():
        if not quiet:
            print("hosts: none (launch/hosts.py start N)", file=sys.stderr)
        return 3
    code = 0
    for host in names():
        state = "down" if init_pid(host) is None else "up" if link_up(host) else "cut"
        code = code or (0 if state == "up" else 3)
        if not quiet:
            print(f"{host} {address(host)} {state}")
    return code


def kill(host: str) -> None:
    pid = init_pid(host)
    if pid is None:
        raise Refusal(f"host {host} is down already")
    os.kill(pid, signal.SIGKILL)  # the kernel ends every process of its PID namespace with it
    while init_pid(host) is not None:
        time.sleep(0.02)


def set_link(host: str, state: str) -> None:
    ip("-n", SWITCH, "link", "set", f"{host}-port", state)


def interface_bytes(host: str) -> tuple[int, int]:
    stats = json.loads(ip("-n", PREFIX + host, "-s", "-j", "link", "show", "eth0").stdout)[0]["stats64"]
    return stats["tx"]["bytes"], stats["rx"]["bytes"]


# ------------------------------------------------------------------ the broker: commands into a host

def serve() -> None:
    """Accept ``run`` and ``ssh`` requests on :data:`SOCKET`, each in a thread of its own."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.umask(0o077)  # the socket is root's alone: whoever may connect runs commands as root in the hosts
    server.bind(str(SOCKET))
    server.listen(64)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()


def _serve_one(conn: socket.socket) -> None:
    with conn:
        try:
            request, fds = _receive_request(conn)
        except (OSError, ValueError):
            return
        try:
            process = _spawn(request, fds)
        except Refusal as exc:
            _send(conn, {"error": str(exc)})
            return
        finally:
            for fd in fds:
                os.close(fd)
        threading.Thread(target=_forward_signals, args=(conn, process, request["mode"]), daemon=True).start()
        code = process.wait()
        if code < 0:  # nsenter ended by the signal that ended the command
            code = 255 if request["mode"] == "ssh" else 128 - code
        try:
            _send(conn, {"exit": code})
        except OSError:
            pass  # the client is gone


def _receive_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            raise ValueError("cut short")
        data += more
    return json.loads(data), fds


def _spawn(request: dict, fds: list[int]) -> subprocess.Popen:
    host = host_of(request["host"])
    pid = init_pid(host)
    if pid is None:
        raise Refusal(f"host {host} is down (killed, or stopped): launch/hosts.py start N")
    enter = ["nsenter", "--target", str(pid), "--net", "--uts", "--ipc", "--mount", "--pid", "--"]
    if request["mode"] == "ssh":  # what sshd gives a command: a clean login environment, the home folder
        home = request["env"].get("HOME", "/root")
        login = {"HOME": home, "USER": "root", "LOGNAME": "root", "SHELL": "/bin/bash", "PATH": LOGIN_PATH,
                 "LANG": "C.UTF-8", "TMPDIR": str(NODE_TMP)}
        command = ["env", "-i", *(f"{k}={v}" for k, v in login.items()), "/bin/bash", "-c",
                   f"cd && {request['command']}"]
    else:
        env = {**request["env"], "TMPDIR": str(NODE_TMP), "HOSTNAME": host}
        command = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), "/bin/sh", "-c", 'cd "$0" && exec "$@"',
                   request["cwd"], *request["argv"]]
    return subprocess.Popen(enter + command, stdin=fds[0], stdout=fds[1], stderr=fds[2], close_fds=True)


def _forward_signals(conn: socket.socket, process: subprocess.Popen, mode: str) -> None:
    """Signals the client received go to the command; a ``run`` client gone (killed) hangs the command up."""
    buffered = b""
    while True:
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:
            if mode == "run":
                _signal_command(process, signal.SIGHUP)
            return
        buffered += data
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            _signal_command(process, json.loads(line)["signal"])


def _signal_command(process: subprocess.Popen, signum: int) -> None:
    """Signal the command inside the host: nsenter's child (nsenter forwards none)."""
    try:
        for child in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split():
            os.kill(int(child), signum)
    except (OSError, ValueError):
        pass  # ended meanwhile


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


# ------------------------------------------------------------------ the client: run and ssh

def request(mode: str, host: str, **fields) -> int:
    """Run a command on ``host`` through the broker; returns its exit status."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(SOCKET))
    except OSError:
        raise Refusal(f"the hosts are not up (no broker at {SOCKET}): launch/hosts.py start N") from None
    header = json.dumps({"mode": mode, "host": host, "env": dict(os.environ), **fields}).encode() + b"\n"
    socket.send_fds(conn, [header], [0, 1, 2])
    if mode == "run":
        for signum in FORWARDED:
            signal.signal(signum, lambda signum, _: conn.sendall(json.dumps({"signal": signum}).encode() + b"\n"))
    reply = b""
    while not reply.endswith(b"\n"):
        data = conn.recv(4096)
        if not data:
            return 255
        reply += data
    answer = json.loads(reply)
    if "error" in answer:
        raise Refusal(answer["error"])
    return answer["exit"]


def ssh(args: list[str]) -> int:
    """ssh's command line: options, the host, then the words of the remote shell's command."""
    while args and args[0].startswith("-"):
        option = args.pop(0)
        if len(option) == 2 and option[1] in SSH_VALUE_OPTIONS:
            args = args[1:]
    if len(args) < 2:
        raise Refusal("usage: launch/hosts-ssh [OPTIONS] HOST COMMAND...")
    return request("ssh", args[0], command=" ".join(args[1:]))


# ------------------------------------------------------------------ the command line

def main(argv: list[str]) -> int:
    if Path(argv[0]).name == "hosts-ssh":
        return ssh(argv[1:])
    verb, args = (argv[1], argv[2:]) if len(argv) > 1 else ("", [])
    if verb in ("start", "stop", "kill", "cut", "mend") and os.geteuid() != 0:  # before anything is touched
        raise Refusal(f"launch/hosts.py {verb} needs root (network namespaces, {STATE}); run it as root")
    one_host = {"kill", "cut", "mend", "procs", "bytes"}
    if verb == "start" and len(args) <= 1 and (not args or args[0].isdigit() and 1 <= int(args[0]) <= 9):
        with exclusive():
            start(int(args[0]) if args else 2)
    elif verb == "stop" and not args:
        with exclusive():
            stop()
    elif verb == "status" and not args:
        return status()
    elif verb == "names" and not args:
        print("\n".join(names()))
    elif verb == "run" and len(args) >= 2:
        return request("run", host_of(args[0]), argv=args[1:], cwd=os.getcwd())
    elif verb == "ssh":
        return ssh(args)
    elif verb == "serve" and not args:
        serve()
    elif verb in one_host and len(args) == 1:
        host = host_of(args[0])
        if verb == "kill":
            kill(host)
        elif verb in ("cut", "mend"):
            set_link(host, "down" if verb == "cut" else "up")
        elif verb == "procs":
            for pid in host_pids(host):
                try:
                    command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                except OSError:
                    continue
                if command:  # not a zombie, ended and about to be reaped
                    print(pid, command)
        else:
            print(*interface_bytes(host))
    else:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except Refusal as exc:
        print(f"hosts: error: {exc}", file=sys.stderr)
        sys.exit(1)
