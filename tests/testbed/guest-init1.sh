#!/bin/busybox sh
# Stage 1, PID 1 in the initramfs: mount the host's / (virtio-9p, read-only)
# under a tmpfs overlay and switch_root into it. Stage 2 runs from the host tree.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev

# Module parameters come from the command line as "module.param=value", as modprobe would read them.
for ko in $(cat /modules.order); do
  name=$(basename "$ko" .ko)
  insmod "$ko" $(tr ' ' '\n' < /proc/cmdline | sed -n "s/^$name\.//p") 2>/dev/null
done

arg() { sed -n "s/.*$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
stage2=$(arg ibckpt.init)
kmods=$(arg ibckpt.modules)

mkdir -p /lower /rw /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /lower || {
  echo "ibckpt-guest: cannot mount host root"; poweroff -f; }
mount -t tmpfs -o mode=0755 rw /rw
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot || {
  echo "ibckpt-guest: overlay failed"; poweroff -f; }
# Module autoload needs /lib/modules/$KVER, which lives in the host's cache.
mkdir -p "/newroot/lib/modules/$(uname -r)"
mount -o bind "/newroot$kmods" "/newroot/lib/modules/$(uname -r)"

umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /bin/bash "$stage2"
