#!/bin/sh
# cgroup v1 hierarchies on a tmpfs at /sys/fs/cgroup, as runc, crun and podman need them.
# The test guest's init mounts no cgroups; idempotent, so every guest test may call it.
set -e
mountpoint -q /sys/fs/cgroup || mount -t tmpfs -o mode=755,nosuid,nodev,noexec cgroup /sys/fs/cgroup
for c in cpu,cpuacct cpuset memory devices freezer pids blkio hugetlb net_cls,net_prio perf_event; do
  mkdir -p "/sys/fs/cgroup/$c"
  mountpoint -q "/sys/fs/cgroup/$c" || mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c"
done
# the single names runtimes also look for
for pair in cpu:cpu,cpuacct cpuacct:cpu,cpuacct net_cls:net_cls,net_prio net_prio:net_cls,net_prio; do
  [ -e "/sys/fs/cgroup/${pair%%:*}" ] || ln -s "${pair#*:}" "/sys/fs/cgroup/${pair%%:*}"
done
