"""Unpack a container's tar archive into a directory without leaving it and without running its files.

The wrapper applies what a checkpointed container wrote (its rootfs diff, its /dev/shm files) to the
new container before `runc restore`. The archive is the tenant's, and so is the directory it goes
into (a sidecar may be writing the pod's /dev/shm meanwhile), yet the wrapper runs as root on the node.
So the node's own process writes every file relative to a directory fd of that root, one path
component at a time, never through a symlink:

- no chroot and no child process: nothing is imported, and no library loaded, from the container's
  files, whatever the node's Python does lazily (Python 3.13's tarfile imports `warnings` at extract);
- every directory on the way is opened `O_DIRECTORY|O_NOFOLLOW` from its parent's fd, so a symlink
  (the archive's or one already there) ends the unpack instead of leading somewhere else;
- names that are absolute or hold `..`, device nodes and hard links to anything the archive did not
  write itself are refused; a whiteout (a 0/0 character device: overlayfs's mark of a deleted file)
  removes what is at its path, without following links either;
- modes of what it makes are masked (no setuid, setgid or sticky bit, no group or other write; a
  directory already there keeps the image's mode) and owners are set by number: no user or group
  is ever looked up by name (glibc would load the NSS modules that /etc/nsswitch.conf names, and a
  chroot would have made them the container's).

Standard library only, like the rest of the hook (tests/hook/test_imports.py); imported only when a
restore has an archive to apply.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile

from ibckpt_node.hook.oci import Refused

# No setuid, setgid or sticky bit and no group or other write: the bytes come from a tenant and are
# written as root (the image store masks its trees the same way: ibckpt/store/download.py).
MODE_MASK = 0o755
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FIFO_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC  # opened at once, never waits
COPY_CHUNK = 1 << 20


class Unpack:
    """One archive into one root: `Unpack(root, what).run(archive)`."""

    def __init__(self, root: str, what: str) -> None:
        self.root = root
        self.what = what
        self.written: set[str] = set()  # regular files this archive wrote: what a hard link may name

    def refuse(self, name: str, why: str) -> Refused:
        return Refused(f"applying {self.what}: refusing {name!r} in the archive: {why}")

    def run(self, archive: str) -> None:
        """Unpack `archive` (a tar file) into the root; Refused says which member was refused and why."""
        fd = os.open(archive, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as stream:
            root_fd = os.open(self.root, DIR_FLAGS)
            old_umask = os.umask(0)  # modes are set exactly as masked, never widened by the caller's umask
            try:
                with tarfile.open(fileobj=stream, mode="r:") as tar:
                    for member in tar:
                        self.member(tar, member, root_fd)
            except tarfile.TarError as exc:
                raise Refused(f"applying {self.what}: {archive} is not a readable tar: {exc}") from None
            finally:
                os.umask(old_umask)
                os.close(root_fd)

    def member(self, tar: tarfile.TarFile, member: tarfile.TarInfo, root_fd: int) -> None:
        parts = self.components(member.name)
        if not parts:
            return  # the root itself keeps the mode and owner it has
        path = "/".join(parts)
        whiteout = member.ischr() and member.devmajor == 0 and member.devminor == 0
        name = parts[-1]
        parent_fd = None
        try:
            parent_fd = self.directory(root_fd, parts[:-1], path, create=not whiteout)
            if parent_fd is None:
                return  # a whiteout under a directory that is not there: nothing to remove
            if whiteout:
                remove(parent_fd, name)
            elif member.isdir():
                self.make_dir(parent_fd, name, member)
            elif member.isreg():
                self.make_file(tar, parent_fd, name, member)
                self.written.add(path)
            elif member.issym():
                remove(parent_fd, name)
                os.symlink(member.linkname, name, dir_fd=parent_fd)  # written, never followed
                os.chown(name, member.uid, member.gid, dir_fd=parent_fd, follow_symlinks=False)
                os.utime(name, (member.mtime, member.mtime), dir_fd=parent_fd, follow_symlinks=False)
            elif member.islnk():
                self.make_link(root_fd, parent_fd, name, member)
                self.written.add(path)
            elif member.isfifo():
                remove(parent_fd, name)
                os.mkfifo(name, member.mode & MODE_MASK, dir_fd=parent_fd)
                fifo = os.open(name, FIFO_FLAGS, dir_fd=parent_fd)
                try:
                    if not stat.S_ISFIFO(os.fstat(fifo).st_mode):  # swapped meanwhile (a sidecar)
                        raise self.refuse(member.name, "the fifo made for it was replaced")
                    self.set_attrs(fifo, member)
                finally:
                    os.close(fifo)
            else:
                raise self.refuse(member.name, "a device node, or an entry of an unknown type")
        except (OSError, ValueError, OverflowError) as exc:  # an owner or mtime out of range too
            raise self.refuse(member.name, str(exc)) from None
        finally:
            if parent_fd is not None:
                os.close(parent_fd)

    def components(self, name: str) -> list[str]:
        """The member's path as components below the root ([] for the root itself)."""
        if name.startswith("/"):
            raise self.refuse(name, "an absolute path")
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise self.refuse(name, "a '..' component")
        return parts

    def directory(self, root_fd: int, parts: list[str], path: str, create: bool = True) -> int | None:
        """An fd of the directory `parts` below the root, made (0o755, root's) where missing if `create`
        (else None when missing). Each component is opened without following: a symlink on the way is
        refused, not followed."""
        fd = os.dup(root_fd)
        try:
            for part in parts:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                try:
                    child = os.open(part, DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if isinstance(exc, FileNotFoundError) and not create:
                        os.close(fd)
                        return None
                    raise self.refuse(
                        path, f"{part!r} on its way is not a directory (a symlink is never followed): {exc}"
                    ) from None
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def make_dir(self, parent_fd: int, name: str, member: tarfile.TarInfo) -> None:
        """A directory: one already there keeps its mode and owner (the image's: its /tmp stays
        1777); one that is not is made with the member's, masked."""
        try:
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            return
        if st is not None:
            remove(parent_fd, name)
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        try:
            self.set_attrs(fd, member)
        finally:
            os.close(fd)

    def make_file(self, tar: tarfile.TarFile, parent_fd: int, name: str, member: tarfile.TarInfo) -> None:
        """A new file (whatever was at its name is removed first: nothing is written through an
        existing link or into another name's inode)."""
        remove(parent_fd, name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o600, dir_fd=parent_fd)
        try:
            source = tar.extractfile(member)
            if source is not None:
                while True:
                    chunk = source.read(COPY_CHUNK)
                    if not chunk:
                        break
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
            self.set_attrs(fd, member)
        finally:
            os.close(fd)

    def make_link(self, root_fd: int, parent_fd: int, name: str, member: tarfile.TarInfo) -> None:
        """A hard link to a file this archive wrote (a link to anything else in the root is refused)."""
        target = "/".join(self.components(member.linkname))
        to = f"a hard link to {member.linkname!r}"
        if target not in self.written:
            raise self.refuse(member.name, f"{to}, which the archive did not write")
        target_parts = target.split("/")
        source_fd = self.directory(root_fd, target_parts[:-1], target, create=False)
        if source_fd is None:
            raise self.refuse(member.name, f"{to}, which is no longer there")
        try:
            st = os.stat(target_parts[-1], dir_fd=source_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise self.refuse(member.name, f"{to}, which is no longer a file")
            remove(parent_fd, name)
            os.link(target_parts[-1], name, src_dir_fd=source_fd, dst_dir_fd=parent_fd, follow_symlinks=False)
        finally:
            os.close(source_fd)

    @staticmethod
    def set_attrs(fd: int, member: tarfile.TarInfo) -> None:
        """Owner by number, then the masked mode (chown clears setuid bits; the mask keeps them off
        anyway), then the mtime: all through the fd of what was just made."""
        os.fchown(fd, member.uid, member.gid)
        os.fchmod(fd, member.mode & MODE_MASK)
        os.utime(fd, (member.mtime, member.mtime))


def remove(parent_fd: int, name: str) -> None:
    """Remove what is at `name` (a directory with everything in it), following no link; nothing there
    is fine."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent_fd)
        return
    fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    try:
        empty(fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def empty(top_fd: int) -> None:
    """Remove everything inside the directory `top_fd`, depth first, with a stack of directory fds (no
    recursion: a deep tree must not end in RecursionError), never following a link."""
    stack: list[tuple[int, str]] = [(os.dup(top_fd), "")]  # (fd, its name in the one below it)
    try:
        while stack:
            fd = stack[-1][0]
            subdir = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        subdir = subdir or entry.name
                    else:
                        os.unlink(entry.name, dir_fd=fd)
            if subdir is not None:
                stack.append((os.open(subdir, DIR_FLAGS, dir_fd=fd), subdir))
                continue
            done_fd, done_name = stack.pop()
            os.close(done_fd)
            if stack:
                os.rmdir(done_name, dir_fd=stack[-1][0])
    finally:
        for fd, _ in stack:
            os.close(fd)
