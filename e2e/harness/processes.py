"""Start-time-checked process-group kills, shared by the harness kubelet and the launcher.

Every process the dev cluster starts leads its own session, and its pid is recorded together
with its kernel start time; a recorded pid is only signalled while that pair still matches, so
a pid the kernel has since reused for someone else's process is never touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            stat = stat_file.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces; everything after its ')' is space-separated.
    fields_after_name = stat.rsplit(")", 1)[1].split()
    return int(fields_after_name[19])


def is_same_process(pid: int, start_time: int | None) -> bool:
    """Whether `pid` is still the live (not zombie) process that started at `start_time`."""
    current = process_start_time(pid)
    if current is None or (start_time is not None and current != start_time):
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group `pgid` that are not zombies (orphaned zombies may linger until
    their new parent reaps them; they hold no resources that matter here)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat_file:
                fields = stat_file.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(live_group_members(pgid))


def kill_process_group(pid: int, grace_s: float, popen: subprocess.Popen | None = None) -> None:
    """SIGTERM the group led by `pid`, wait up to `grace_s`, then SIGKILL what is left.

    `popen`, when we are the parent, is reaped so no zombie stays behind.
    """
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if popen is not None:
            popen.poll()
        if not _group_alive(pid):
            break
        time.sleep(0.05)
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if popen is not None:
        try:
            popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    else:
        _reap_if_our_child(pid)


def _reap_if_our_child(pid: int) -> None:
    """Collect the exit status when the caller spawned `pid` (the pytest fixture does), so
    no zombie outlives the cluster; anyone else's child is left to its parent."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] != 0:
                return
        except ChildProcessError:
            return
        time.sleep(0.05)


def kill_recorded(pid: int, start_time: int | None, grace_s: float) -> bool:
    """Kill a recorded session leader and its group if it is still the recorded process."""
    if not is_same_process(pid, start_time):
        return False
    kill_process_group(pid, grace_s)
    return True
