"""Run by tests/hook/test_unpack_interpreters.py under each Python of the machine, with -I.

    python -I planted_root_child.py paths
        print this interpreter's import path as JSON (where a chrooted import would look)
    python -I planted_root_child.py bait ROOT
        prove the planted files are live: chrooted into ROOT, import the planted modules again and
        look a user up by name (each writes its marker when it runs)
    python -I planted_root_child.py unpack HOOK_LIB IMAGES ROOTFS SHM
        what the wrapper does: apply the rootfs diff to ROOTFS and the /dev/shm archive to SHM

Standard library only, and written for Python 3.9 and later.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys


def bait(root: str) -> None:
    import grp  # before the chroot: an extension module in some builds
    import pwd

    pid = os.fork()
    if pid == 0:  # the child ends here, whatever happens
        try:
            os.chroot(root)
            os.chdir("/")
            for name in ("warnings", "encodings", "sitecustomize"):
                sys.modules.pop(name, None)
                with contextlib.suppress(Exception):
                    __import__(name)
            for lookup in (pwd.getpwnam, grp.getgrnam):
                with contextlib.suppress(KeyError):
                    lookup("ibckpt-bait")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def main(argv: list[str]) -> int:
    if argv[0] == "paths":
        print(json.dumps([p for p in sys.path if p]))
    elif argv[0] == "bait":
        bait(argv[1])
    elif argv[0] == "unpack":
        hook_lib, images, rootfs, shm = argv[1:5]
        sys.path.insert(0, hook_lib)
        from ibckpt_node.hook import restore

        restore.apply_rootfs_diff(images, rootfs)
        spec = {"mounts": [{"destination": "/dev/shm", "type": "bind", "source": shm, "options": ["rbind"]}]}
        restore.apply_shm(images, spec)
        print("applied")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
