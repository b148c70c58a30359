#!/bin/bash
# A Kubernetes node inside a Soft-RoCE guest: cgroups, CNI, containerd with the node's
# images, then the kubelet, joined to the host's apiserver. Runs as the guest's command
# (guest-init2.sh has set up rxe0 and the link) and stays up until the guest is killed.
# $1: the node's dir from the host (node.env, PKI, kubeconfig, kubelet config).
set -euo pipefail
dir=$1
# shellcheck disable=SC1091
. "$dir/node.env"  # NODE_NAME NODE_IP NODE_LABELS API_PORT NODE_STORE KUBELET PAUSE_IMAGE POD_SUBNET CLUSTER_API_IP

log() { echo "ibckpt-node: $NODE_NAME: $*"; }
started=$(date +%s.%N)
since() { awk -v s="$started" -v n="$(date +%s.%N)" 'BEGIN { printf "%.1f", n - s }'; }

# cgroup v1 on a tmpfs, as runc and the 1.20 kubelet (cgroupfs driver) expect it.
mount -t tmpfs -o mode=0755 cgroup /sys/fs/cgroup
for c in cpu,cpuacct cpuset memory devices freezer pids blkio hugetlb net_cls,net_prio perf_event; do
  mkdir -p "/sys/fs/cgroup/$c"
  mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c"
done
ln -s cpu,cpuacct /sys/fs/cgroup/cpu
ln -s cpu,cpuacct /sys/fs/cgroup/cpuacct
ln -s net_cls,net_prio /sys/fs/cgroup/net_cls
ln -s net_cls,net_prio /sys/fs/cgroup/net_prio
mkdir -p /sys/fs/cgroup/systemd
mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd

# State lives in the guest's memory; the host's tree underneath is read-only.
for d in /var/lib/containerd /var/lib/kubelet /var/log /run/containerd /etc/cni/net.d /var/lib/cni; do
  mkdir -p "$d"
done
mount -t tmpfs tmpfs /var/lib/containerd
mount -t tmpfs tmpfs /var/lib/kubelet
mount -t tmpfs tmpfs /var/log
mount --make-rshared /

for m in bridge veth overlay br_netfilter nf_conntrack iptable_nat iptable_filter xt_MASQUERADE xt_comment \
  xt_addrtype; do
  modprobe "$m" 2>/dev/null || true
done
sysctl -qw net.ipv4.ip_forward=1
sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true

# Pod network: one bridge per node, masqueraded towards everything else (the link, the host).
cat >/etc/cni/net.d/10-ibckpt.conflist <<EOF
{
  "cniVersion": "0.4.0",
  "name": "ibckpt-pods",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_SUBNET"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF

# Pod to pod across nodes (and a hostNetwork agent to the operator's pod on another node), as a
# cluster's CNI gives it: a route to each other node's pod subnet through that node's address.
for route in $POD_ROUTES; do
  ip route add "${route%,*}" via "${route#*,}"
done
# Traffic between pod subnets keeps its source address (the bridge plugin masquerades the rest).
iptables -t nat -I POSTROUTING -s "$POD_SUBNET" -d 10.88.0.0/16 -j RETURN

# The one Service a pod needs without kube-proxy: kubernetes.default, the apiserver on the
# host, which the guest reaches through qemu's forward at 10.0.2.100.
for chain in OUTPUT PREROUTING; do
  iptables -t nat -A "$chain" -d "$CLUSTER_API_IP" -p tcp --dport 443 -j DNAT --to-destination "10.0.2.100:$API_PORT"
done
iptables -t nat -A POSTROUTING -d 10.0.2.100 -j MASQUERADE
# The guest has no default route: a hostNetwork pod's connect to the Service IP needs a route
# before OUTPUT's DNAT can rewrite it (pod-network pods are DNAT'd in PREROUTING already).
user_nic=$(ip -o -4 addr show | awk '$4 == "10.0.2.15/24" {print $2; exit}')
ip route add "$CLUSTER_API_IP/32" dev "$user_nic"

# The images, unpacked once on the host (testbed/images.py, node_store): metadata is copied,
# layers are bind-mounted and serve as the read-only lower dirs of every container's overlay.
store_snaps=io.containerd.snapshotter.v1.overlayfs
mkdir -p "/var/lib/containerd/$store_snaps/snapshots"
cp -a "$NODE_STORE/io.containerd.metadata.v1.bolt" /var/lib/containerd/
cp -a "$NODE_STORE/$store_snaps/metadata.db" "/var/lib/containerd/$store_snaps/"
mkdir -p /var/lib/containerd/io.containerd.content.v1.content
mount --bind "$NODE_STORE/io.containerd.content.v1.content" /var/lib/containerd/io.containerd.content.v1.content
for snap in "$NODE_STORE/$store_snaps/snapshots"/*; do
  mkdir -p "/var/lib/containerd/$store_snaps/snapshots/${snap##*/}/fs"
  mount --bind "$snap/fs" "/var/lib/containerd/$store_snaps/snapshots/${snap##*/}/fs"
done
date +%s >"$dir/images.done"

mkdir -p /etc/containerd
cat >/etc/containerd/config.toml <<EOF
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
EOF
cp /etc/containerd/config.toml "$dir/containerd-config.stock.toml"  # for tests/helm/test_uninstall.py
# A stock configuration: the ibckpt agent adds its runtime handler and restarts containerd with
# SIGTERM (agent.containerd.restart=signal), as a supervisor would, this loop starts it again.
# Running containers live on in their shims meanwhile.
(while :; do containerd >>"$dir/containerd.log" 2>&1; sleep 0.2; done) &
for _ in $(seq 300); do
  ctr version >/dev/null 2>&1 && break
  sleep 0.2
done
ctr version >/dev/null 2>&1 || { tail -20 "$dir/containerd.log"; exit 1; }
log "containerd up at $(since)s"

# kubectl logs/exec: the apiserver reaches this kubelet through the host's egress proxy
# and qemu's forward of the user NIC's port 10250; only the host can connect.
# One OS thread for Go's scheduler and cAdvisor's passes every 30 s, not 10 s: an idle kubelet on these
# emulated nodes spent most of its CPU waking threads and reading cgroup files (profiled; docs/testbed.md).
GOMAXPROCS=1 "$KUBELET" \
  --housekeeping-interval=30s \
  --config="$dir/kubelet-config.yaml" \
  --kubeconfig="$dir/kubelet.kubeconfig" \
  --container-runtime=remote \
  --container-runtime-endpoint=unix:///run/containerd/containerd.sock \
  --runtime-request-timeout=10m \
  --hostname-override="$NODE_NAME" \
  --node-ip="$NODE_IP" \
  --node-labels="$NODE_LABELS" \
  --pod-infra-container-image="$PAUSE_IMAGE" \
  --root-dir=/var/lib/kubelet \
  --v=1 >"$dir/kubelet.log" 2>&1 &
kubelet_pid=$!
log "kubelet started at $(since)s"

# Every 30 s a line for the host's failure reports (cluster.py, diagnose): the guest's clock, free
# memory and tmpfs use (the node's disks are tmpfs), load, tasks in D state, OOM kills, and whether
# kubelet and containerd live. A report whose last line is old says the guest itself stalled.
(
  set +euo pipefail
  while :; do
    mem=$(awk '/^MemAvailable:/ {a=$2} /^Shmem:/ {s=$2} END {printf "avail=%dM shmem=%dM", a/1024, s/1024}' /proc/meminfo)
    dstate=$(ps -eo stat= | grep -c '^D')
    oom=$(dmesg | grep -c 'Out of memory')
    hung=$(dmesg | grep -c 'blocked for more than')
    kubelet=gone; kill -0 "$kubelet_pid" 2>/dev/null && kubelet=up
    containerd=gone; pgrep -x containerd >/dev/null && containerd=up
    echo "$(date -u +%T) $mem load=$(cut -d' ' -f1 /proc/loadavg) D=$dstate oom=$oom hung=$hung" \
      "kubelet=$kubelet containerd=$containerd" >>"$dir/health.log"
    sleep 30
  done
) &
wait "$kubelet_pid"
log "kubelet exited ($?)"
exit 1
