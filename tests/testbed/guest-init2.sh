#!/bin/bash
# Stage 2, PID 1 in the host tree (overlay): mount the writable host dirs,
# bring up Soft-RoCE, run the job's command and power off.
# Kernel command line: ibckpt.job=DIR ibckpt.rw=TAG:PATH,... ibckpt.node=N ibckpt.link=0|1
# ibckpt.devices=1|2 (2: a second Soft-RoCE device, rxe1, on a second link NIC or a dummy netdev)
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
ln -sf /proc/self/fd /dev/fd

arg() { sed -n "s/.*$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
job=$(arg ibckpt.job)
node=$(arg ibckpt.node)
link=$(arg ibckpt.link)
devices=$(arg ibckpt.devices)

IFS=, read -ra rw_mounts <<<"$(arg ibckpt.rw)"
for m in "${rw_mounts[@]}"; do
  tag=${m%%:*} path=${m#*:}
  mkdir -p "$path"
  mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=mmap "$tag" "$path"
done

fail() { echo "ibckpt-guest: $*" >&2; echo 125 >"$job/rc"; reboot -f; }

hostname "node-$node"
# The clock, as NTP keeps a real node's: a TCG guest's clock drifts (tens of seconds in a CI run), and
# the cluster compares times across nodes (a container's finishedAt with a Checkpoint's creation, for the
# work a recovery lost). qemu's RTC follows the host's clock; a step every 15 s stays under a second.
(while sleep 15; do hwclock --hctosys --utc 2>/dev/null; done) &
ip link set lo up

# NICs are told apart by MAC: 52:54:00:12:34:56 is qemu's user-mode NIC (host
# services), 52:54:00:77:00:0N is the private link between the two guests.
nic_by_mac() { for d in /sys/class/net/*; do [[ $(cat "$d/address") == "$1" ]] && basename "$d"; done; }
user_nic=$(nic_by_mac 52:54:00:12:34:56)
if [[ -n $user_nic ]]; then
  ip addr add 10.0.2.15/24 dev "$user_nic"
  ip link set "$user_nic" up
fi

modprobe rdma_rxe || fail "modprobe rdma_rxe failed"
if [[ $link == 1 ]]; then
  roce_nic=$(nic_by_mac "52:54:00:77:00:0$node")
  [[ -n $roce_nic ]] || fail "no link NIC"
else
  modprobe dummy numdummies=0
  ip link add roce0 type dummy
  roce_nic=roce0
fi
ip addr add "10.77.0.$node/24" dev "$roce_nic"
ip link set "$roce_nic" mtu 1500 up
rdma link add rxe0 type rxe netdev "$roce_nic" || fail "rdma link add failed"
for _ in $(seq 100); do
  [[ -e /dev/infiniband/uverbs0 ]] && break
  sleep 0.05
done
[[ -e /dev/infiniband/uverbs0 ]] || fail "no /dev/infiniband/uverbs0"
# Opt-in: a second HCA (multi-rail), rxe1 on a subnet of its own: on the second link NIC
# (52:54:00:78:00:0N) when the guest has one (the cluster's nodes), else on a dummy netdev.
# tests/native/test_devices_guest.py runs this function in a guest booted without it.
second_device() {
  local nic
  nic=$(nic_by_mac "52:54:00:78:00:0$1")
  if [[ -z $nic ]]; then
    modprobe dummy numdummies=0
    ip link add roce1 type dummy || return 1
    nic=roce1
  fi
  ip addr add "10.78.0.$1/24" dev "$nic"
  ip link set "$nic" mtu 1500 up
  rdma link add rxe1 type rxe netdev "$nic" || return 1
  local v
  for _ in $(seq 100); do # until its uverbs node is there to open
    for v in /sys/class/infiniband_verbs/uverbs*; do
      [[ $(cat "$v/ibdev" 2>/dev/null) == rxe1 && -e /dev/infiniband/${v##*/} ]] && return 0
    done
    sleep 0.05
  done
  return 1
}
if [[ $devices == 2 ]]; then
  second_device "$node" || fail "no second Soft-RoCE device (rxe1)"
fi
if [[ $link == 1 ]]; then
  peer=10.77.0.$((3 - node))
  for _ in $(seq 200); do ping -c1 -W1 "$peer" >/dev/null 2>&1 && break; done
  if [[ $devices == 2 && -n $(nic_by_mac "52:54:00:78:00:0$node") ]]; then
    for _ in $(seq 200); do ping -c1 -W1 "10.78.0.$((3 - node))" >/dev/null 2>&1 && break; done
  fi
fi

export IBCKPT_GUEST=1 IBCKPT_NODE=$node HOME=/root
[[ -f $job/env ]] && set -a && . "$job/env" && set +a
cd "$(cat "$job/cwd")" || fail "no cwd"
echo "ibckpt-guest: node-$node ready"
setsid -w -c bash "$job/cmd.sh" </dev/ttyS0 >/dev/ttyS0 2>&1
rc=$?
echo "$rc" >"$job/rc"
sync
echo "ibckpt-guest: exit $rc"
reboot -f
