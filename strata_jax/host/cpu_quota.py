"""How many CPUs this process may really use, for sizing the host expert worker pool.

`os.cpu_count()` reports the machine's CPUs, not the share a container is granted: a container that sees 256
CPUs but has a cgroup quota of 30 runs a 255-thread pool ~5x slower than a 29-thread one (throttling). So the
pool size comes from the smallest of: the CPU affinity mask (`sched_getaffinity`) and every cgroup CPU quota
between the process's own cgroup and the root of the visible hierarchy (cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`), because a parent's quota binds its children too.

Every file is read below `root` so tests can point it at a fake tree.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path, PurePosixPath


@dataclasses.dataclass(frozen=True)
class CpuBudget:
    """visible: os.cpu_count(); affinity: CPUs in the affinity mask; quota: the most restrictive cgroup quota in
    CPUs (None = unlimited or unknown); source: where the quota came from (and any file ignored, with why);
    workers: the host pool size; overridden: workers came from --pool-workers."""

    visible: int
    affinity: int
    quota: float | None
    source: str
    workers: int
    overridden: bool = False

    @property
    def granted(self) -> float:
        """CPUs this process can actually use at once."""
        return min(float(self.affinity), self.quota if self.quota is not None else math.inf)


@dataclasses.dataclass(frozen=True)
class _Mount:
    root: str  # the hierarchy path mounted here (mountinfo field 4)
    point: str  # where it is mounted
    version: int  # 1 or 2


def pool_workers_for(affinity: int, quota: float | None) -> int:
    """Pool size from the granted CPUs: floor(min(affinity, quota)) - 1, at least 1.

    Floor, not round: a thread beyond the quota only adds throttling (1.5 CPUs -> 1 CPU's worth of threads).
    Minus one: the engine thread that drives the device needs a CPU of its own. At least one: the pool must exist
    even under a quota below 2 CPUs (it then shares the CPU with the engine thread).
    """
    granted = min(float(affinity), quota if quota is not None else math.inf)
    return max(1, math.floor(granted) - 1)


def cpu_budget(
    root: Path = Path("/"),
    pool_workers: int | None = None,
    *,
    visible: int | None = None,
    affinity: int | None = None,
) -> CpuBudget:
    """The CPU budget of this process. `pool_workers` (from --pool-workers) overrides the computed pool size;
    `visible` / `affinity` default to os.cpu_count() / len(os.sched_getaffinity(0)) (tests pass them)."""
    if pool_workers is not None and pool_workers < 1:
        raise ValueError(f"--pool-workers must be >= 1, got {pool_workers}")
    if visible is None:
        visible = os.cpu_count() or 1
    if affinity is None:
        affinity = _affinity(visible)
    quota, source = cgroup_quota(Path(root))
    if pool_workers is not None:
        return CpuBudget(visible, affinity, quota, source, pool_workers, overridden=True)
    return CpuBudget(visible, affinity, quota, source, pool_workers_for(affinity, quota))


def _affinity(visible: int) -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return visible


def cgroup_quota(root: Path = Path("/")) -> tuple[float | None, str]:
    """The most restrictive cgroup CPU quota (in CPUs) on the path from this process's cgroup up to the root of
    each visible cgroup hierarchy (v2, and v1's `cpu` controller), and a description of where it came from.
    Malformed files are skipped; their reasons are appended to the description."""
    notes: list[str] = []
    mounts = _read_mounts(root, notes)
    paths = _read_proc_cgroup(root, notes)
    best: tuple[float, str] | None = None
    searched: list[str] = []
    for mount in mounts:
        chain = _walk_up(root, mount, paths.get(mount.version))
        searched.append(f"cgroup v{mount.version} {chain[0]}" + (" and parents" if len(chain) > 1 else ""))
        for directory in chain:
            found = _read_quota(root, directory, mount.version, notes)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
    if best is not None:
        source = best[1]
    elif searched:
        source = f"no cgroup CPU limit in {', '.join(searched)}"
    else:
        source = "no cgroup CPU controller found"
    if notes:
        source += "; ignored " + "; ".join(notes)
    return (best[0] if best else None), source


def _under(root: Path, absolute: str) -> Path:
    return root / absolute.lstrip("/")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1 : i + 4]) == 3 and all(c in "01234567" for c in field[i + 1 : i + 4]):
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _read_mounts(root: Path, notes: list[str]) -> list[_Mount]:
    """cgroup2 mounts and cgroup v1 mounts carrying the `cpu` controller, from /proc/self/mountinfo.

    Without a mount table, assume the conventional mount points (hierarchy root mounted there)."""
    file = _under(root, "/proc/self/mountinfo")
    try:
        text = file.read_text()
    except OSError:
        return _default_mounts(root)
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 1:
            if line.strip():
                notes.append(f"malformed line in /proc/self/mountinfo: {line[:60]!r}")
            continue
        fstype = tail[0]
        if fstype == "cgroup2":
            mounts.append(_Mount(_unescape(fields[3]), _unescape(fields[4]), 2))
        elif fstype == "cgroup" and len(tail) >= 3 and "cpu" in tail[2].split(","):
            mounts.append(_Mount(_unescape(fields[3]), _unescape(fields[4]), 1))
    return mounts


def _default_mounts(root: Path) -> list[_Mount]:
    mounts = []
    if _under(root, "/sys/fs/cgroup/cgroup.controllers").exists() or _under(root, "/sys/fs/cgroup/cpu.max").exists():
        mounts.append(_Mount("/", "/sys/fs/cgroup", 2))
    for point in ("/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpu"):
        if _under(root, point).is_dir():
            mounts.append(_Mount("/", point, 1))
            break
    return mounts


def _read_proc_cgroup(root: Path, notes: list[str]) -> dict[int, str]:
    """{2: the process's v2 cgroup path, 1: its v1 `cpu` cgroup path} from /proc/self/cgroup."""
    try:
        text = _under(root, "/proc/self/cgroup").read_text()
    except OSError:
        return {}
    paths: dict[int, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            if line.strip():
                notes.append(f"malformed line in /proc/self/cgroup: {line[:60]!r}")
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            paths[2] = path
        elif "cpu" in controllers.split(","):
            paths[1] = path
    return paths


def _walk_up(root: Path, mount: _Mount, cg_path: str | None) -> list[str]:
    """Directories (absolute, as seen by the process) from the process's cgroup up to the mount point.

    The process's cgroup path is relative to the hierarchy root; the mount shows the subtree `mount.root` of it.
    When the path is unknown or lies outside the mounted subtree (common in containers without a cgroup
    namespace, where the container's own cgroup is mounted as the root), only the mount point itself is used."""
    point = PurePosixPath(mount.point)
    chain = [point]
    if cg_path is not None:
        try:
            rel = PurePosixPath(cg_path).relative_to(PurePosixPath(mount.root))
        except ValueError:
            rel = None
        if rel is not None and ".." not in rel.parts:
            here = point / rel
            if _under(root, str(here)).is_dir():
                chain = []
                while here != point:
                    chain.append(here)
                    here = here.parent
                chain.append(point)
    return [str(p) for p in chain]


def _read_quota(root: Path, directory: str, version: int, notes: list[str]) -> tuple[float, str] | None:
    """(quota in CPUs, description) of one cgroup directory, or None if it sets no limit."""
    base = _under(root, directory)
    if version == 2:
        file = base / "cpu.max"
        text = _read(file)
        if text is None:
            return None
        parts = text.split()
        shown = f"{directory}/cpu.max"
        if not parts or parts[0] == "max":
            return None
        try:
            quota = int(parts[0])
            period = int(parts[1]) if len(parts) > 1 else 100_000
        except ValueError:
            notes.append(f"malformed {shown}: {text.strip()[:40]!r}")
            return None
        if quota <= 0 or period <= 0:
            notes.append(f"malformed {shown}: {text.strip()[:40]!r}")
            return None
        return quota / period, f"cgroup v2 {shown}"
    quota_text = _read(base / "cpu.cfs_quota_us")
    if quota_text is None:
        return None
    shown = f"{directory}/cpu.cfs_quota_us"
    try:
        quota = int(quota_text.strip())
    except ValueError:
        notes.append(f"malformed {shown}: {quota_text.strip()[:40]!r}")
        return None
    if quota < 0:  # -1: unlimited
        return None
    period_text = _read(base / "cpu.cfs_period_us")
    try:
        period = int(period_text.strip()) if period_text is not None else 100_000
    except ValueError:
        notes.append(f"malformed {directory}/cpu.cfs_period_us: {period_text.strip()[:40]!r}")
        return None
    if quota == 0 or period <= 0:
        notes.append(f"malformed {shown}: quota {quota} / period {period}")
        return None
    return quota / period, f"cgroup v1 {shown}"


def _read(file: Path) -> str | None:
    try:
        return file.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _quota(q: float) -> str:
    return f"{q:.1f}" if round(q, 1) == q else f"{q:.2f}"


def _fmt(x: float) -> str:
    """CPU counts: whole numbers plain (an affinity), fractions like quotas."""
    return str(int(x)) if x == int(x) else _quota(x)


def disagreement(budget: CpuBudget) -> str | None:
    """A warning when the visible CPUs, the affinity mask and the quota disagree (or the override exceeds what is
    granted), else None."""
    granted = budget.granted
    if budget.overridden:
        if budget.workers + 1 > granted:
            return (f"warning: --pool-workers {budget.workers} (+1 engine thread) exceeds the {_fmt(granted)} CPUs "
                    f"granted ({_limits(budget)}): threads will be throttled")
        return None
    if granted < budget.visible:
        return (f"warning: {budget.visible} CPUs are visible but only {_fmt(granted)} are granted "
                f"({_limits(budget)}); the pool is sized from the granted CPUs, not os.cpu_count()")
    return None


def _limits(budget: CpuBudget) -> str:
    parts = [f"affinity {budget.affinity}"]
    if budget.quota is not None:
        parts.append(f"cgroup quota {_quota(budget.quota)}")
    return ", ".join(parts)


def describe(budget: CpuBudget) -> str:
    """The start-up log line(s): visible CPUs, affinity, the quota and its source, the chosen pool size, and a
    second `warning:` line when they disagree."""
    quota = "none" if budget.quota is None else _quota(budget.quota)
    how = " (--pool-workers)" if budget.overridden else ""
    line = (f"visible CPUs {budget.visible}, affinity {budget.affinity}, cgroup quota {quota} ({budget.source}): "
            f"{budget.workers} pool workers{how}")
    warning = disagreement(budget)
    return line if warning is None else f"{line}\n{warning}"
