"""CPU budget from fake cgroup trees: v2 cpu.max, v1 cfs quota/period, nesting, affinity and the override."""

from pathlib import Path

import pytest

from strata_jax.host.cpu_quota import (
    CpuBudget,
    cgroup_quota,
    cpu_budget,
    describe,
    disagreement,
    pool_workers_for,
)

V2_MOUNT = "30 25 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "25 1 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
    "34 25 0:29 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
    "35 25 0:30 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
)


def tree(tmp_path: Path, proc_cgroup: str | None, mountinfo: str | None, files: dict[str, str]) -> Path:
    """A fake root: /proc/self/{cgroup,mountinfo} and cgroup files (absolute paths below the root)."""
    if proc_cgroup is not None:
        (tmp_path / "proc/self").mkdir(parents=True, exist_ok=True)
        (tmp_path / "proc/self/cgroup").write_text(proc_cgroup)
    if mountinfo is not None:
        (tmp_path / "proc/self").mkdir(parents=True, exist_ok=True)
        (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    for path, text in files.items():
        f = tmp_path / path.lstrip("/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return tmp_path


def test_v2_no_limit(tmp_path):
    root = tree(tmp_path, "0::/\n", V2_MOUNT, {"/sys/fs/cgroup/cpu.max": "max 100000\n"})
    b = cpu_budget(root, visible=16, affinity=16)
    assert b.quota is None and b.workers == 15 and not b.overridden
    assert "no cgroup CPU limit" in b.source and "/sys/fs/cgroup" in b.source
    assert disagreement(b) is None
    assert describe(b).startswith("visible CPUs 16, affinity 16, cgroup quota none (")
    assert describe(b).endswith(": 15 pool workers")


@pytest.mark.parametrize(
    "cpu_max, quota, workers",
    [("150000 100000", 1.5, 1), ("250000 100000", 2.5, 1), ("50000 100000", 0.5, 1), ("3000000 100000", 30.0, 29)],
)
def test_v2_fractional_quota_rounds_down(tmp_path, cpu_max, quota, workers):
    # Rule (pool_workers_for's docstring): floor(granted) - 1 for the engine thread, at least 1.
    root = tree(tmp_path, "0::/\n", V2_MOUNT, {"/sys/fs/cgroup/cpu.max": cpu_max + "\n"})
    b = cpu_budget(root, visible=256, affinity=256)
    assert b.quota == pytest.approx(quota)
    assert b.workers == workers
    assert b.source == "cgroup v2 /sys/fs/cgroup/cpu.max"


def test_seed_system_container_line(tmp_path):
    # The seed system's failure: 256 visible CPUs, 30 granted. We must size for 30 and say so.
    root = tree(tmp_path, "0::/\n", V2_MOUNT, {"/sys/fs/cgroup/cpu.max": "3000000 100000\n"})
    text = describe(cpu_budget(root, visible=256, affinity=256))
    line, warning = text.split("\n")
    assert line == ("visible CPUs 256, affinity 256, cgroup quota 30.0 (cgroup v2 /sys/fs/cgroup/cpu.max): "
                    "29 pool workers")
    assert warning.startswith("warning: 256 CPUs are visible but only 30 are granted")


def test_v2_nested_parent_more_restrictive(tmp_path):
    leaf = "/kubepods/pod1/ctr"
    root = tree(tmp_path, f"0::{leaf}\n", V2_MOUNT, {
        "/sys/fs/cgroup/cpu.max": "max 100000",  # (the real root has none; harmless)
        "/sys/fs/cgroup/kubepods/cpu.max": "max 100000",
        "/sys/fs/cgroup/kubepods/pod1/cpu.max": "200000 100000",  # 2 CPUs: binding
        f"/sys/fs/cgroup{leaf}/cpu.max": "800000 100000",  # 8 CPUs
    })
    b = cpu_budget(root, visible=64, affinity=64)
    assert b.quota == 2.0 and b.workers == 1
    assert b.source == "cgroup v2 /sys/fs/cgroup/kubepods/pod1/cpu.max"


def test_v2_leaf_more_restrictive_and_unrelated_sibling_ignored(tmp_path):
    leaf = "/a/b"
    root = tree(tmp_path, f"0::{leaf}\n", V2_MOUNT, {
        "/sys/fs/cgroup/a/cpu.max": "800000 100000",
        "/sys/fs/cgroup/a/b/cpu.max": "400000 100000",
        "/sys/fs/cgroup/other/cpu.max": "100000 100000",  # not an ancestor: ignored
    })
    b = cpu_budget(root, visible=64, affinity=64)
    assert b.quota == 4.0 and b.workers == 3


def test_v2_namespaced_mount_root(tmp_path):
    # With a cgroup namespace the process sees "0::/" and its container's cgroup is the mount's root.
    root = tree(tmp_path, "0::/\n", "30 25 0:26 /kubepods/x /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                {"/sys/fs/cgroup/cpu.max": "600000 100000"})
    b = cpu_budget(root, visible=8, affinity=8)
    assert b.quota == 6.0 and b.workers == 5


def test_v1_quota_period(tmp_path):
    # Docker without a cgroup namespace: the process's path /docker/abc is the mount's root.
    root = tree(tmp_path, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n", V1_MOUNTS, {
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "400000\n",
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    b = cpu_budget(root, visible=32, affinity=32)
    assert b.quota == 4.0 and b.workers == 3
    assert b.source == "cgroup v1 /sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us"


def test_v1_nested_path_below_mount(tmp_path):
    mounts = "34 25 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpuacct,cpu\n"
    root = tree(tmp_path, "4:cpuacct,cpu:/system.slice/app.service\n", mounts, {
        "/sys/fs/cgroup/cpu,cpuacct/system.slice/cpu.cfs_quota_us": "150000",
        "/sys/fs/cgroup/cpu,cpuacct/system.slice/cpu.cfs_period_us": "50000",  # 3 CPUs
        "/sys/fs/cgroup/cpu,cpuacct/system.slice/app.service/cpu.cfs_quota_us": "-1",
        "/sys/fs/cgroup/cpu,cpuacct/system.slice/app.service/cpu.cfs_period_us": "100000",
    })
    b = cpu_budget(root, visible=32, affinity=32)
    assert b.quota == 3.0 and b.workers == 2
    assert "system.slice/cpu.cfs_quota_us" in b.source


def test_v1_unlimited(tmp_path):
    root = tree(tmp_path, "4:cpu,cpuacct:/docker/abc\n", V1_MOUNTS, {
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    b = cpu_budget(root, visible=12, affinity=12)
    assert b.quota is None and b.workers == 11
    assert "no cgroup CPU limit in cgroup v1" in b.source


def test_hybrid_v1_and_v2_takes_the_smaller(tmp_path):
    mounts = V2_MOUNT + "34 25 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    root = tree(tmp_path, "4:cpu,cpuacct:/\n0::/\n", mounts, {
        "/sys/fs/cgroup/cpu.max": "1000000 100000",
        "/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "500000",
        "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000",
    })
    quota, source = cgroup_quota(root)
    assert quota == 5.0 and source.startswith("cgroup v1")


def test_affinity_smaller_than_quota(tmp_path):
    root = tree(tmp_path, "0::/\n", V2_MOUNT, {"/sys/fs/cgroup/cpu.max": "800000 100000"})
    b = cpu_budget(root, visible=64, affinity=4)
    assert b.quota == 8.0 and b.workers == 3
    warning = disagreement(b)
    assert warning is not None and "only 4 are granted" in warning and "affinity 4" in warning


def test_no_cgroup_files_at_all(tmp_path):
    b = cpu_budget(tmp_path, visible=8, affinity=8)
    assert b.quota is None and b.workers == 7
    assert b.source == "no cgroup CPU controller found"
    expected = "visible CPUs 8, affinity 8, cgroup quota none (no cgroup CPU controller found): 7 pool workers"
    assert describe(b) == expected


def test_no_mount_table_falls_back_to_conventional_path(tmp_path):
    root = tree(tmp_path, None, None, {"/sys/fs/cgroup/cpu.max": "200000 100000"})
    b = cpu_budget(root, visible=8, affinity=8)
    assert b.quota == 2.0 and b.workers == 1


@pytest.mark.parametrize("text", ["banana", "150000 zero", "-5 100000", ""])
def test_v2_malformed_is_ignored_with_reason(tmp_path, text):
    root = tree(tmp_path, "0::/a\n", V2_MOUNT, {"/sys/fs/cgroup/a/cpu.max": text})
    b = cpu_budget(root, visible=8, affinity=8)
    assert b.quota is None and b.workers == 7
    if text:
        assert "ignored malformed /sys/fs/cgroup/a/cpu.max" in b.source


def test_malformed_leaf_does_not_hide_a_valid_parent(tmp_path):
    root = tree(tmp_path, "0::/a\n", V2_MOUNT, {
        "/sys/fs/cgroup/a/cpu.max": "lots 100000",
        "/sys/fs/cgroup/cpu.max": "300000 100000",
    })
    b = cpu_budget(root, visible=8, affinity=8)
    assert b.quota == 3.0 and b.workers == 2
    assert b.source.startswith("cgroup v2 /sys/fs/cgroup/cpu.max; ignored malformed /sys/fs/cgroup/a/cpu.max")


def test_v1_malformed_quota_and_period(tmp_path):
    root = tree(tmp_path, "4:cpu,cpuacct:/docker/abc\n", V1_MOUNTS, {
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "400000",
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "often",
    })
    b = cpu_budget(root, visible=8, affinity=8)
    assert b.quota is None and "malformed /sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us" in b.source


def test_malformed_proc_files(tmp_path):
    files = {"/sys/fs/cgroup/cpu.max": "400000 100000"}
    root = tree(tmp_path, "garbage\n0::/\n", "nonsense line\n" + V2_MOUNT, files)
    b = cpu_budget(root, visible=8, affinity=8)
    assert b.quota == 4.0
    assert "malformed line in /proc/self/cgroup" in b.source and "malformed line in /proc/self/mountinfo" in b.source


def test_escaped_mount_point(tmp_path):
    mounts = "30 25 0:26 / /sys/fs/cg\\040roup rw - cgroup2 cgroup2 rw\n"
    root = tree(tmp_path, "0::/\n", mounts, {"/sys/fs/cg roup/cpu.max": "200000 100000"})
    assert cgroup_quota(root)[0] == 2.0


def test_override(tmp_path):
    root = tree(tmp_path, "0::/\n", V2_MOUNT, {"/sys/fs/cgroup/cpu.max": "3000000 100000"})
    b = cpu_budget(root, pool_workers=8, visible=256, affinity=256)
    assert b.workers == 8 and b.overridden and b.quota == 30.0
    assert disagreement(b) is None
    assert describe(b).endswith(": 8 pool workers (--pool-workers)")
    over = cpu_budget(root, pool_workers=64, visible=256, affinity=256)
    assert "exceeds the 30 CPUs granted" in disagreement(over)
    with pytest.raises(ValueError):
        cpu_budget(root, pool_workers=0)


def test_pool_workers_rule():
    assert pool_workers_for(16, None) == 15
    assert pool_workers_for(1, None) == 1
    assert pool_workers_for(16, 1.99) == 1
    assert pool_workers_for(16, 4.0) == 3
    assert CpuBudget(8, 4, 6.0, "x", 3).granted == 4.0


def test_this_machine():
    b = cpu_budget()
    assert b.workers >= 1 and b.visible >= b.affinity >= 1
    assert "pool workers" in describe(b)
