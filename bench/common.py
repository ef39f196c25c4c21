"""What the benchmark harnesses share: statistics, machine facts, /proc CPU readings, a tiny
HTTP client, Prometheus text parsing, child processes and `flexlb up` start-up, report JSON.

Not a harness: `python bench/<harness>.py` runs one (bench/README.md lists them). Every
helper here measures nothing by itself; each harness's docstring says what it measures.

- `percentile` / `summarize`: linear-interpolated percentiles of a list (q in [0, 100]).
- `proc_cpu_times` / `proc_cpu_s` / `machine_busy_s`: CPU seconds from /proc (Linux), and
  `CpuSampler`, a thread that turns them into busy cores per process every `interval` s.
- `machine_facts`: cores, CPU model, memory, package versions and the git commit, for reports.
- `http_get`, `http_body_parts`, `parse_metrics`: blocking GET, an HTTP/1.1 body reader for
  asyncio streams, Prometheus text -> {"name{labels}": value}.
- `Proc`, `stop_all`, `wait_http`, `wait_up_state`, `UpStack`, `flexlb_exe`, `child_env`:
  children in their own process groups, stopped by SIGTERM then SIGKILL to the group;
  `flexlb up`'s state file and readiness.
- `load_rows`: rows of a JSONL trace (Mooncake's format) as dicts, each with its row number.
- `dump_json`, `fmt`, `print_table`: the reports' JSON layout, table cells and terminal tables.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from services.infra import free_port  # noqa: E402, F401  (re-exported: the harnesses' port picker)

CLK_TCK = os.sysconf("SC_CLK_TCK")
# Packages whose versions a report records (machine_facts).
REPORT_PACKAGES = ("uvicorn", "fastapi", "nats-py", "redis", "msgspec", "uvloop", "httptools")


# --------------------------------------------------------------------------- statistics
def percentile(sorted_values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of an ascending list."""
    if not sorted_values:
        return None
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: list[float], nd: int = 1) -> dict[str, float | None]:
    """n, mean, p50, p90, p99 and max of `values`, floats rounded to `nd` digits."""
    v = sorted(values)
    out: dict[str, float | None] = {"n": len(v), "mean": sum(v) / len(v) if v else None}
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        out[name] = percentile(v, q)
    out["max"] = v[-1] if v else None
    return {k: (round(x, nd) if isinstance(x, float) else x) for k, x in out.items()}


# --------------------------------------------------------------------------- CPU from /proc
def proc_cpu_times(pid: int) -> tuple[float, float] | None:
    """(user, system) CPU seconds of a process (Linux /proc), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return None


def proc_cpu_s(pid: int) -> float | None:
    """user + system CPU seconds of a process (Linux /proc), None if it is gone."""
    times = proc_cpu_times(pid)
    return None if times is None else times[0] + times[1]


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine spent busy (all cores, /proc/stat): all but idle and iowait."""
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
        return (sum(f[:8]) - f[3] - f[4]) / CLK_TCK
    except (OSError, ValueError, IndexError):
        return None


class CpuSampler(threading.Thread):
    """Every `interval` s: busy cores of the whole machine, and of each process of `pids`
    and of this load generator (from /proc), until stop() (which returns the summary)."""

    def __init__(self, pids: dict[str, int], interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pids = {**pids, "loadgen": os.getpid()}
        self.interval = interval
        self.stop_event = threading.Event()
        self.samples: list[dict[str, float]] = []

    def run(self) -> None:
        prev_t, prev_m = time.monotonic(), machine_busy_s()
        prev_p = {k: proc_cpu_s(p) for k, p in self.pids.items()}
        while not self.stop_event.wait(self.interval):
            t, mb = time.monotonic(), machine_busy_s()
            cur = {k: proc_cpu_s(p) for k, p in self.pids.items()}
            dt = t - prev_t
            s: dict[str, float] = {"t": round(t, 3)}
            if mb is not None and prev_m is not None and dt > 0:
                s["machine"] = (mb - prev_m) / dt
            for k, v in cur.items():
                if v is not None and prev_p.get(k) is not None and dt > 0:
                    s[k] = (v - prev_p[k]) / dt
            self.samples.append(s)
            prev_t, prev_m, prev_p = t, mb, cur

    def stop(self) -> dict[str, Any]:
        self.stop_event.set()
        self.join(5)
        cores = os.cpu_count() or 1
        machine = sorted(s["machine"] for s in self.samples if "machine" in s)
        per_proc: dict[str, list[float]] = defaultdict(list)
        for s in self.samples:
            for k, v in s.items():
                if k not in ("t", "machine"):
                    per_proc[k].append(v)
        groups: dict[str, float] = defaultdict(float)
        for k, vs in per_proc.items():
            g = "workers" if k.startswith("worker-") else "engines" if k.startswith("engine-") else k
            groups[g] += sum(vs) / len(vs)
        # Busy cores of the machine not used by the stack or this process: others' load.
        foreign = sorted(s["machine"] - sum(v for k, v in s.items() if k not in ("t", "machine"))
                         for s in self.samples if "machine" in s)
        return {
            "samples": len(self.samples),
            "cores": cores,
            "machine_busy_cores": {"mean": round(sum(machine) / len(machine), 2) if machine else None,
                                   "p90": round(percentile(machine, 90), 2) if machine else None,
                                   "max": round(machine[-1], 2) if machine else None},
            # Share of 1-s samples with the machine at least 90% busy: the stack was CPU-bound.
            "saturated_fraction": (round(sum(1 for x in machine if x >= 0.9 * cores) / len(machine), 3)
                                   if machine else None),
            "mean_cores_by_process": {k: round(v, 3) for k, v in sorted(groups.items())},
            "stack_and_loadgen_cores_mean": round(sum(groups.values()), 2),
            "foreign_cores": {"mean": round(sum(foreign) / len(foreign), 2) if foreign else None,
                              "max": round(foreign[-1], 2) if foreign else None},
        }


# --------------------------------------------------------------------------- machine facts
def machine_facts(packages: tuple[str, ...] = REPORT_PACKAGES, binaries: tuple[str, ...] = ()) -> dict[str, Any]:
    """What a report records of the machine: cores, Python, CPU model, memory, the versions
    of `packages` and of `binaries` (`BINARY --version`), the git commit and dirty files."""
    facts: dict[str, Any] = {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    facts["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as fh:
            facts["mem_total_gib"] = round(int(fh.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    from importlib import metadata

    versions = {}
    for pkg in packages:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    facts["packages"] = versions
    for binary in binaries:
        try:
            from services.infra import find_binary

            out = subprocess.run([find_binary(binary), "--version"], capture_output=True, text=True, timeout=10)
            facts[binary] = (out.stdout or out.stderr).strip().splitlines()[0]
        except Exception as exc:  # noqa: BLE001 - a fact we could not read is reported, not fatal
            facts[binary] = f"unknown ({exc.__class__.__name__})"
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
        facts["git_commit"] = commit.stdout.strip()
        facts["git_dirty_files"] = [ln[3:] for ln in dirty.stdout.splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass
    return facts


# --------------------------------------------------------------------------- HTTP
def http_get(url: str, timeout: float = 5.0) -> tuple[int | None, str]:
    """(status, body text) of a GET; (None, the error) when nothing answered."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return None, str(exc)


async def http_body_parts(reader, chunked: bool, length: int | None):
    """The parts of an HTTP/1.1 response body from an asyncio.StreamReader as they arrive:
    chunked, by Content-Length, or until the connection closes."""
    if chunked:
        while True:
            size_line = await reader.readline()
            if not size_line:
                return
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif length is not None:
        yield await reader.readexactly(length)
    else:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value} (labels as printed)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


# --------------------------------------------------------------------------- processes
_LIVE: list["Proc"] = []  # every process started and not yet stopped (stop_all stops them)


class Proc:
    """A child in its own session (process group), logging to a file; stopped by SIGTERM to
    it, SIGKILL to its group after `timeout_s`, and its group's leftovers reaped."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path = REPO) -> None:
        self.name, self.argv, self.log_path, self.env, self.cwd = name, argv, log_path, env, cwd
        self.popen: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.killed = False

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen else 0

    def start(self) -> None:
        self.log = open(self.log_path, "w")
        self.popen = subprocess.Popen(self.argv, cwd=self.cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)
        _LIVE.append(self)

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float) -> int | None:
        """The exit status after SIGTERM; None when it had to be killed."""
        if self.popen is None:
            return None
        p = self.popen
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.killed = True
                _killpg(p.pid, signal.SIGKILL)  # only the group this harness started
                p.wait(10)
        self.exit_code = None if self.killed else p.returncode
        # Children it left behind in its group (e.g. a worker `flexlb up` could not stop).
        if _group_alive(p.pid):
            _killpg(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + 3
            while _group_alive(p.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _group_alive(p.pid):
                _killpg(p.pid, signal.SIGKILL)
        self.log.close()
        if self in _LIVE:
            _LIVE.remove(self)
        return self.exit_code


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_all(timeout_s: float = 10.0) -> None:
    """Stop every Proc still running, the last started first."""
    for p in list(reversed(_LIVE)):
        p.stop(timeout_s)


def wait_http(url: str, deadline: float, procs: list[Proc], ok: Callable[[int | None, str], bool]) -> str:
    """Poll a URL until `ok(status, text)`; fail when a process died or the deadline passed."""
    last = "no answer yet"
    while True:
        for p in procs:
            if not p.running():
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode if p.popen else None} during start-up:\n"
                                   f"{p.log_tail()}")
        status, text = http_get(url, timeout=2.0)
        if ok(status, text):
            return text
        last = f"{status} {text[:200]}"
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready in time: {last}")
        time.sleep(0.2)


def wait_up_state(up: Proc, state_file: Path, deadline: float, timeout_s: float) -> dict[str, Any]:
    """`flexlb up`'s state file (router URL, NATS URL, pids) once it is written; fails when
    `up` exits first or the deadline (`timeout_s` after the start) passes."""
    while not state_file.exists():
        if not up.running():
            raise RuntimeError(f"flexlb up exited with {up.popen.returncode} during start-up:\n{up.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no state file from flexlb up after {timeout_s}s:\n{up.log_tail()}")
        time.sleep(0.1)
    from services.up import with_secrets

    return with_secrets(json.loads(state_file.read_text()))  # (NATS and Redis URLs with the credentials up made)


class UpStack:
    """`flexlb up` as a child in its own session: started (its state file, then /readyz
    answering 200 within `startup_timeout_s`), probed through its state, stopped by SIGTERM
    (SIGKILL to its group after `stop_timeout_s`)."""

    def __init__(self, up: Proc, state_file: Path, startup_timeout_s: float, stop_timeout_s: float) -> None:
        self.up, self.state_file = up, state_file
        self.startup_timeout_s, self.stop_timeout_s = startup_timeout_s, stop_timeout_s
        self.state: dict[str, Any] = {}  # the state file: router_url, nats_url, redis_url, pids

    def start(self) -> None:
        self.up.start()
        deadline = time.monotonic() + self.startup_timeout_s
        self.state = wait_up_state(self.up, self.state_file, deadline, self.startup_timeout_s)
        wait_http(self.url + "/readyz", deadline, [self.up], lambda status, _: status == 200)

    @property
    def url(self) -> str:
        return self.state["router_url"]

    def log_tail(self, n: int = 40) -> str:
        return self.up.log_tail(n)

    def stop(self) -> int | None:
        """SIGTERM `flexlb up`; returns its exit status (None: it had to be killed)."""
        return self.up.stop(self.stop_timeout_s)


def flexlb_exe() -> list[str]:
    """The `flexlb` command: the installed script beside this Python, else `python -m services.cli`."""
    exe = shutil.which("flexlb") or str(Path(sys.executable).parent / "flexlb")
    return [exe] if Path(exe).exists() else [sys.executable, "-m", "services.cli"]


_CLOSED_PORT: int | None = None


def child_env(workdir: Path) -> dict[str, str]:
    """The environment of every child: no FLEXLB_* overrides of ours (a fresh stack each
    time), and Hugging Face pointed at a closed loopback port, offline: a router that tries
    to fetch a tokenizer fails at once and nothing leaves the machine."""
    global _CLOSED_PORT
    if _CLOSED_PORT is None:  # a loopback port nobody listens on (picked once, then left closed)
        _CLOSED_PORT = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXLB_")}
    env.update(FLEXLB_UP_STATE=str(workdir / "last-up.json"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_ENDPOINT=f"http://127.0.0.1:{_CLOSED_PORT}", HF_HOME=str(workdir / "hf"),
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return env


# --------------------------------------------------------------------------- traces
def load_rows(path: Path, start: int, count: int) -> list[dict[str, Any]]:
    """Rows [start, start + count) of a JSONL trace as dicts, each with its row number in `_row`
    (blank lines skipped)."""
    rows = []
    with open(path) as fh:
        for i, line in enumerate(fh):
            if i < start:
                continue
            if len(rows) >= count:
                break
            if line.strip():
                row = json.loads(line)
                row["_row"] = i
                rows.append(row)
    return rows


# --------------------------------------------------------------------------- reports
def fmt(x: Any, nd: int = 0, sep: str = ",") -> str:
    """A table cell: "-" for None, floats with `nd` digits and `sep` between thousands."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:{sep}.{nd}f}"
    return str(x)


def dump_json(result: dict[str, Any]) -> str:
    """Indented JSON, except the per-request rows of each run: one compact line each."""
    rows_by_key = {}
    runs = []
    for i, run in enumerate(result.get("runs", [])):
        if "per_request" in run:
            key = f"@@per_request_{i}@@"
            rows_by_key[key] = run["per_request"]
            run = {**run, "per_request": key}
        runs.append(run)
    text = json.dumps({**result, "runs": runs}, indent=1)
    for key, rows in rows_by_key.items():
        text = text.replace(json.dumps(key), "[\n" + ",\n".join(json.dumps(r, separators=(",", ":")) for r in rows) + "\n]")
    return text


def print_table(title: str, cols: list[str], rows: list[list[str]], left: tuple[str, ...] = ()) -> None:
    """A table on the terminal: with rich when it is installed (columns in `left` aligned
    left), else plain right-aligned text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional: plain text then
        Table = None  # noqa: N806
    if Table is not None:
        table = Table(title=title, title_justify="left")
        for c in cols:
            table.add_column(c, justify="left" if c in left else "right")
        for r in rows:
            table.add_row(*r)
        Console(width=max(200, shutil.get_terminal_size().columns)).print(table)
    else:
        print(title)
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
        for r in rows:
            print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
