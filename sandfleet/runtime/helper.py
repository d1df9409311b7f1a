"""The local runtime's privileged steps, run as host root in a process of their own:
``python3 -I -S helper.py seal|enter|suid ARGS``. Standard library only, no package
imports (``-I -S``: nothing from the environment, the user or site-packages is read).

``seal`` builds one sandbox's root filesystem, then execs bubblewrap on it, as the sandbox
leader's child. It

1. enters a private mount namespace (everything below lives and dies with the sandbox:
   nothing reaches the host's mount table, nothing is left to clean up after a crash);
2. joins the sandbox's cgroups;
3. mounts the SIF's squashfs partition read-only through a loop device (no unpacking) and
   re-mounts it *idmapped* to the sandbox's uid range, so the image's root-owned files
   are owned by the sandbox's own (unprivileged) root (each layer so, for a layered image);
4. mounts the sandbox's own disk, ``home/disk.img`` (a fresh ext4 file system of
   ``storage_mb`` in a sparse file, with the overlay's folders and a reserve, made by the
   runtime just before or ahead: ``sandfleet.runtime.prepared``; used once, then deleted)
   through a loop device: the writable layer, so writes past the quota fail with ENOSPC
   inside and the node's disk is untouched;
5. mounts the overlay (image below, disk above) at ``root`` and the image alone at
   ``image_dir`` (fixed, world-traversable paths: this namespace's own mounts there hide
   nobody else's), becomes the sandbox's host uid (no
   capabilities left on the host) and execs the given argv (bwrap).

``enter`` runs a command inside a running sandbox (in place of ``nsenter``): it joins the
sandbox's cgroups, enters its network namespace, then its user namespace and then its
mount, pid, ipc, uts and cgroup namespaces (no user namespaces can be made below the
sandbox's), becomes root *of that namespace* (the sandbox's unprivileged
uid on the host), changes root to the sandbox's, drops every capability a container does
not need (bounding set included: no ``CAP_SYS_ADMIN``, so no mounts, no cgroup or
namespace tricks; ``setns`` into a user namespace hands out a full set, which is why this
step exists), forks (the pid namespace applies to children) and execs the command in the
child with exactly the given environment. The parent waits and exits as the child did.
Everything it needs is loaded before the root changes: nothing of the sandbox's file
system is read while it is privileged.

Loop devices are attached with autoclear (``LOOP_CONFIGURE``, no ``mount`` process): they
detach when the namespace's last process exits. An image's read-only loop device is
shared with the sandboxes that have the same image mounted (as ``mount -o loop`` does:
one page cache per image), after checking its backing file's device, inode, offset and
size. Errors go to stderr (the runtime's init.log) and exit non-zero.
"""

from __future__ import annotations

import _struct
import ctypes
import os
import stat
import sys

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC = 1, 0o2000000
AT_FDCWD, AT_EMPTY_PATH = -100, 0x1000
MOUNT_ATTR_IDMAP, MOUNT_ATTR_NOSUID, AT_SYMLINK_NOFOLLOW = 0x00100000, 0x2, 0x100
MOVE_MOUNT_F_EMPTY_PATH = 0x4
OOM_SCORE_ADJ = 500
VERIFIER_TOOLS = "/.tmax/verifier"
"""Where an image keeps what its verifier needs (prepared at build time): hidden from the
agent by an empty read-only mount, shown to the verifier (see the runtime's ``verify``)."""
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
NAMESPACES = (("net", 0x40000000), ("user", 0x10000000), ("mnt", CLONE_NEWNS),
              ("pid", 0x20000000), ("ipc", 0x08000000), ("uts", 0x04000000),
              ("cgroup", 0x02000000))
"""In the order ``enter`` joins them: the network first, while still host root (a
verifier's is its sandbox's, whose user namespace is not the verifier's: from inside the
verifier's, it could not be joined), then the user namespace, which owns the rest."""
# What a container keeps (Docker's default set): chown, dac_override, fowner, fsetid, kill,
# setgid, setuid, setpcap, net_bind_service, net_raw, sys_chroot, mknod, audit_write,
# setfcap. Notably absent: sys_admin, sys_ptrace, sys_module, sys_rawio, net_admin,
# sys_resource, sys_time, syslog, bpf, perfmon.
CONTAINER_CAPS = (0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31)
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_libc = ctypes.CDLL(None, use_errno=True)


LOOP_CTL_GET_FREE, LOOP_CONFIGURE, LOOP_GET_STATUS64 = 0x4C82, 0x4C0A, 0x4C05
LO_FLAGS_READ_ONLY, LO_FLAGS_AUTOCLEAR = 1, 4
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOATIME = 1, 2, 4, 1024


LOOP_INFO = "=5Q4I64s64s32s2Q"  # struct loop_info64; struct loop_config is fd, block
LOOP_CONFIG = "=2I" + LOOP_INFO[1:] + "8Q"  # size, loop_info64, 8 reserved


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


class SealError(Exception):
    pass


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise SealError(f"{what}: {os.strerror(err)}")
    return result


def private_mount_namespace() -> None:
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")


def mapping_userns(uid_base: int, count: int) -> int:
    """An fd of a fresh user namespace mapping 0..count-1 to uid_base.. (uids and gids)."""
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: a user namespace held open until the parent has its fd
        try:
            os.close(ready_r)
            os.close(hold_w)
            code = 0 if _libc.unshare(CLONE_NEWUSER) == 0 else 1
            os.write(ready_w, b"%d" % code)
            os.read(hold_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(hold_r)
    try:
        if os.read(ready_r, 1) != b"0":
            raise SealError("cannot create a user namespace (user namespaces disabled?)")
        line = f"0 {uid_base} {count}\n"
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(line)
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_r)
        os.close(hold_w)
        os.waitpid(pid, 0)


def idmapped_bind(src: str, dest: str, userns_fd: int) -> None:
    """Mount ``src`` again at ``dest``, its ids shifted through ``userns_fd``'s mapping."""
    tree = _check(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, src.encode(),
                                OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC), f"open_tree {src}")
    try:
        attr = MountAttr(MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
        _check(_libc.syscall(SYS_MOUNT_SETATTR, tree, b"", AT_EMPTY_PATH, ctypes.byref(attr),
                             ctypes.sizeof(attr)),
               f"idmapped mount of {src} (kernel without idmapped squashfs/ext4 mounts?)")
        _check(_libc.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, dest.encode(),
                             MOVE_MOUNT_F_EMPTY_PATH), f"move_mount to {dest}")
    finally:
        os.close(tree)


def allow_setuid(pid: int, paths: list[str]) -> None:
    """Clear ``nosuid`` on the mount points ``paths`` of process ``pid``'s mount namespace
    (a verifier's: bwrap binds every folder nosuid, and the image's own set-user-ID
    programs must work there as under Docker); no link is followed at a mount point."""
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, CLONE_NEWNS), "setns mnt")
    finally:
        os.close(fd)
    attr = MountAttr(0, MOUNT_ATTR_NOSUID, 0, 0)
    for path in paths:
        _check(_libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_SYMLINK_NOFOLLOW,
                             ctypes.byref(attr), ctypes.sizeof(attr)), f"suid on {path}")


def mount(source: str, target: str, fstype: str, flags: int, data: str = "") -> None:
    _check(_libc.mount(source.encode(), target.encode(), fstype.encode(), flags,
                       data.encode() if data else None), f"mount {fstype} on {target}")


def _loop_status(fd: int) -> tuple | None:
    """(device, inode, offset, size limit, flags) of an open loop device, None if unbound."""
    buf = ctypes.create_string_buffer(_struct.calcsize(LOOP_INFO))
    if _libc.ioctl(fd, LOOP_GET_STATUS64, buf) != 0:
        return None
    info = _struct.unpack(LOOP_INFO, buf.raw)
    return info[0], info[1], info[3], info[4], info[8]


def shared_loop(path: str, offset: int, size: int) -> int | None:
    """An open fd of a read-only loop device already showing ``path`` at ``offset`` and
    ``size`` (another sandbox's), checked through the device once it is open (an open fd
    keeps it from being cleared); None when there is none."""
    st = os.stat(path)
    for name in os.listdir("/sys/block"):
        if not name.startswith("loop"):
            continue
        try:
            with open(f"/sys/block/{name}/loop/backing_file") as f:
                if f.read().rstrip("\n") != path:
                    continue
            fd = os.open(f"/dev/{name}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        info = _loop_status(fd)
        if info is not None and info[:4] == (st.st_dev, st.st_ino, offset, size) \
                and info[4] & LO_FLAGS_READ_ONLY:
            return fd
        os.close(fd)
    return None


def loop_attach(path: str, *, offset: int = 0, size: int = 0, read_only: bool = False) -> int:
    """An open fd of a fresh loop device over ``path`` (autoclear: it detaches once its
    last user, fd or mount, is gone); mount it as ``/proc/self/fd/<fd>``."""
    mode = (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC
    backing = os.open(path, mode)
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        flags = LO_FLAGS_AUTOCLEAR | (LO_FLAGS_READ_ONLY if read_only else 0)
        config = ctypes.create_string_buffer(_struct.pack(
            LOOP_CONFIG, backing, 0, 0, 0, 0, offset, size, 0, 0, 0, flags, b"", b"", b"",
            0, 0, *[0] * 8))
        for _ in range(64):  # another process may take the free device first
            number = _check(_libc.ioctl(ctl, LOOP_CTL_GET_FREE), "LOOP_CTL_GET_FREE")
            fd = os.open(f"/dev/loop{number}", mode)
            if _libc.ioctl(fd, LOOP_CONFIGURE, config) == 0:
                return fd
            err = ctypes.get_errno()
            os.close(fd)
            if err != 16:  # EBUSY
                raise SealError(f"LOOP_CONFIGURE {path}: {os.strerror(err)}")
        raise SealError(f"no free loop device for {path}")
    finally:
        os.close(ctl)
        os.close(backing)


def mount_loop(path: str, target: str, fstype: str, flags: int, *, offset: int = 0,
               size: int = 0, share: bool = False) -> None:
    """``path`` (``offset``/``size`` of it) mounted at ``target`` through a loop device:
    with ``share`` (read-only), one another sandbox already has, else a fresh one."""
    read_only = bool(flags & MS_RDONLY)
    fd = shared_loop(path, offset, size) if share else None
    if fd is None:
        fd = loop_attach(path, offset=offset, size=size, read_only=read_only)
    try:
        mount(f"/proc/self/fd/{fd}", target, fstype, flags)
    finally:
        os.close(fd)


HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


def localhost(lower: str, upper: str, owner: int, hostname: str) -> None:
    """An /etc/hosts in the sandbox's own layer that names localhost and the sandbox
    (Docker writes one for every container; a debootstrapped image has an empty one, and
    then `localhost` does not resolve), the image's own lines after it; nothing where the
    image's already names localhost. The image's file is read without following a link
    (the image is not trusted to point the host at its files)."""
    text = _image_file(lower, "hosts")
    if text is None or any("localhost" in line.split("#")[0].split()[1:]
                           for line in text.splitlines()):
        return
    name = hostname if hostname.replace("-", "").replace(".", "").isalnum() else "sandbox"
    _layer_file(upper, "hosts", HOSTS + f"127.0.1.1\t{name}\n" + text, owner)


def _image_file(lower: str, name: str) -> str | None:
    """The text of the image's /etc/<name> ('' when empty or absent), read without following
    a link; None when /etc is not a real directory of the image."""
    etc = os.path.join(lower, "etc")
    try:
        if not stat.S_ISDIR(os.lstat(etc).st_mode):
            return None
        fd = os.open(os.path.join(etc, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # none, or a link
        return ""
    try:
        return os.read(fd, 1 << 16).decode(errors="replace") \
            if stat.S_ISREG(os.fstat(fd).st_mode) else ""
    finally:
        os.close(fd)


def _layer_file(upper: str, name: str, text: str, owner: int) -> None:
    """/etc/<name> in the sandbox's own layer, owned by its root."""
    etc = os.path.join(upper, "etc")
    if not os.path.isdir(etc):
        os.mkdir(etc, 0o755)
        os.chown(etc, owner, owner)
    fd = os.open(os.path.join(etc, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW,
                 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chown(os.path.join(etc, name), owner, owner)


def resolver(lower: str, upper: str, owner: int, host: str = "/etc/resolv.conf") -> None:
    """With the network, the host's /etc/resolv.conf where the image's is empty (as Docker
    gives a container its host's): names resolve as on the node."""
    text = _image_file(lower, "resolv.conf")
    if text is None or text.strip():
        return
    try:
        with open(host) as f:
            _layer_file(upper, "resolv.conf", f.read(1 << 16), owner)
    except OSError:
        pass


def image_layers(spec: dict, home: str, image_dir: str) -> list[str]:
    """Step 3 for each layer (``spec["layers"]``: (file, offset, size), top first); the
    idmapped mounts, top first. The image alone at ``image_dir``: the one layer, or a
    read-only overlay of them."""
    layers, userns, lowers = spec["layers"], mapping_userns(spec["uid_base"],
                                                            spec["uid_count"]), []
    try:
        for i, (path, offset, size) in enumerate(layers):
            raw = os.path.join(home, f"raw{i}" if i else "raw")
            mapped = image_dir if len(layers) == 1 else os.path.join(home, f"layer{i}")
            for folder in (raw, mapped):
                os.makedirs(folder, 0o700, exist_ok=True)
            mount_loop(path, raw, "squashfs", MS_RDONLY | MS_NODEV, offset=offset, size=size,
                       share=True)
            idmapped_bind(raw, mapped, userns)
            lowers.append(mapped)
    finally:
        os.close(userns)
    if len(layers) > 1:
        mount("overlay", image_dir, "overlay", MS_RDONLY | MS_NODEV,
              f"lowerdir={':'.join(lowers)}")
    return lowers


def seal(spec: dict) -> list[str]:
    """Steps 1-5 of the module doc; the argv to exec."""
    private_mount_namespace()
    for procs in spec["cgroup_procs"]:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    home, root, lower = spec["home"], spec["root"], spec["image_dir"]
    disk = os.path.join(home, "disk")
    lowers = image_layers(spec, home, lower)
    image = os.path.join(home, "disk.img")  # made by the runtime for this sandbox alone
    mount_loop(image, disk, "ext4", MS_NODEV | MS_NOSUID | MS_NOATIME)
    upper, work = os.path.join(disk, "upper"), os.path.join(disk, "work")
    if os.listdir(upper) or not os.path.isdir(os.path.join(disk, "reserve")):
        raise SealError(f"{image}: not a fresh disk")
    os.chown(upper, spec["uid_base"], spec["uid_base"])
    localhost(lower, upper, spec["uid_base"], spec.get("hostname", "sandbox"))
    if spec.get("network"):
        resolver(lower, upper, spec["uid_base"])
    mount("overlay", root, "overlay", MS_NODEV,
          f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}")
    tools = os.path.join(root, VERIFIER_TOOLS.lstrip("/"))
    if os.path.isdir(os.path.join(lower, VERIFIER_TOOLS.lstrip("/"))):  # only the verifier's
        mount("tmpfs", tools, "tmpfs", MS_RDONLY, "size=4k,mode=0755")
    for fd in spec.get("close_fds", []):
        os.close(fd)
    # bwrap runs as the sandbox's host uid: its new user namespace then maps that uid as 0
    # (the runtime writes the map), and nothing of host root crosses into the sandbox.
    os.setgroups([])
    os.setresgid(spec["uid_base"], spec["uid_base"], spec["uid_base"])
    os.setresuid(spec["uid_base"], spec["uid_base"], spec["uid_base"])
    return spec["argv"]


def drop_capabilities(keep: tuple[int, ...] = CONTAINER_CAPS, last: int = 40) -> None:
    """Bounding, ambient, inheritable, permitted and effective sets down to ``keep``."""
    for cap in range(last + 1):
        if cap not in keep:
            _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    mask = sum(1 << cap for cap in keep)
    data = (CapData * 2)(CapData(mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0),
                         CapData(mask >> 32, mask >> 32, 0))
    _check(_libc.capset(ctypes.byref(CapHeader(0x20080522, 0)), data), "capset")


def _ns_id(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def no_nested_userns() -> None:
    """No user namespaces below the current one (the limit is per user namespace; raising
    it again needs sys_resource there, which the sandbox does not keep)."""
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")


def enter(spec: dict) -> int:
    """Run ``spec["argv"]`` in the sandbox whose pid 1 is ``spec["init"]``; its exit code."""
    import _signal as signal  # the C module: ``signal`` imports enum

    init = spec["init"]
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    for procs in spec["cgroup_procs"]:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    with open("/proc/self/oom_score_adj", "w") as f:  # the agent's: the OOM killer's first
        f.write(str(spec["oom_score_adj"]))           # choice (it cannot go back below 0)
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    # A namespace the sandbox shares with the host (the network, with ``network``) is one
    # we are in already: entering it again from the sandbox's user namespace is refused.
    fds = [(os.open(f"/proc/{init}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC), flag)
           for name, flag in NAMESPACES
           if _ns_id(f"/proc/{init}/ns/{name}") != _ns_id(f"/proc/self/ns/{name}")]
    root = os.open(f"/proc/{init}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for fd, flag in fds:
        _check(_libc.setns(fd, flag), f"setns {flag:#x}")
        os.close(fd)
        if flag == CLONE_NEWUSER:  # in the sandbox's user namespace, still in the host's mounts
            no_nested_userns()
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    os.fchdir(root)
    os.chroot(".")
    os.close(root)
    drop_capabilities(last=last_cap)
    env, argv, cwd = spec["env"], spec["argv"], spec["cwd"]
    if spec.get("user"):  # its capabilities go with root, as in a container
        if spec["user"].startswith("#"):  # "#uid:gid:groups", resolved by the caller
            uid, gid, groups = _ids(spec["user"][1:])
        else:
            uid, gid, groups, home = resolve_user(spec["user"])
            env = {**env, "HOME": home}
        os.setgroups(groups)
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    pid = os.fork()
    if pid == 0:
        default_signals(signal)
        try:
            os.chdir(cwd)
        except OSError as e:
            os.write(2, f"cannot enter {cwd}: {e.strerror}\n".encode())
            os._exit(126)
        try:
            execvpe(argv, env)
        except OSError as e:
            os.write(2, f"{argv[0]}: {e.strerror}\n".encode())
            os._exit(127 if isinstance(e, FileNotFoundError) else 126)
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the child decides; we report how it ended
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


def _ids(text: str) -> tuple[int, int, list[int]]:
    """uid, gid and groups from "uid:gid:g1,g2" (``user_ids``)."""
    uid, gid, groups = text.split(":")
    return int(uid), int(gid), [int(g) for g in groups.split(",") if g]


def user_ids(uid: int, gid: int, groups: list[int]) -> str:
    """``enter``'s user for ids resolved beforehand (its HOME is then the caller's)."""
    return f"#{uid}:{gid}:{','.join(map(str, groups))}"


def execvpe(argv: list[str], env: dict[str, str]) -> None:
    """``os.execvpe`` without its lazy import (of ``warnings``): after the root has changed,
    an import would read the sandbox's files."""
    if "/" in argv[0]:
        os.execve(argv[0], argv, env)
    error: OSError | None = None
    for folder in env.get("PATH", PATH).split(":"):
        try:
            os.execve(os.path.join(folder or ".", argv[0]), argv, env)
        except (FileNotFoundError, NotADirectoryError) as e:
            error = error or e
        except PermissionError as e:
            error = e
    raise error or FileNotFoundError(2, "No such file or directory", argv[0])


def default_signals(signal) -> None:
    """Every signal at its default action and none blocked, as a ``docker exec`` starts:
    an exec passes ignored signals and the mask on. Python's start-up ignores SIGPIPE and
    SIGXFSZ (``yes | head`` must end by SIGPIPE, not by an error message); a runtime started
    in the background (``cmd &`` without job control, nohup) ignores SIGINT, SIGQUIT,
    SIGHUP (a task's ``kill -INT`` of its own python must raise KeyboardInterrupt)."""
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):  # (32, 33: the C library's own)
                pass
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def enter_spec(args: list[str]) -> dict:
    """``enter``'s arguments: INIT CPUS|- CWD USER|- OOM_SCORE_ADJ N PROCS*N M ENV*M ARGV...
    (no JSON: it runs on every command, and json's import costs more than the rest of its
    start-up)."""
    n = int(args[5])
    m = int(args[6 + n])
    env = dict(item.split("=", 1) for item in args[7 + n:7 + n + m])
    return {"init": int(args[0]), "cpus": [int(c) for c in args[1].split(",")]
            if args[1] != "-" else None, "cwd": args[2],
            "user": args[3] if args[3] != "-" else "", "oom_score_adj": int(args[4]),
            "cgroup_procs": args[6:6 + n], "env": env, "argv": args[7 + n + m:]}


def _db(path: str) -> list[list[str]]:
    """The colon-separated lines of /etc/passwd or /etc/group (the sandbox's, after the
    root changed: the sandbox's root may have written them; it can only name its own ids)."""
    try:  # never blocks: a fifo there is not read (no imports here: the root has changed)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        if os.fstat(fd).st_mode & 0o170000 != 0o100000:  # not a regular file
            return []
        chunks, left = [], 1 << 20
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
        text = b"".join(chunks).decode("utf-8", "replace")
    except OSError:
        return []
    finally:
        os.close(fd)
    return db_lines(text)


def db_lines(text: str) -> list[list[str]]:
    """The entries of an /etc/passwd or /etc/group text, as their colon-separated fields."""
    return [line.split(":") for line in text.splitlines() if line.count(":") >= 3]


def resolve_user(user: str, dbs: tuple[list[list[str]], list[list[str]]] | None = None,
                 where: str = "sandbox") -> tuple[int, int, list[int], str]:
    """Docker's USER (``name|uid[:group|gid]``) in the current root (or in ``dbs``, the
    entries of an /etc/passwd and an /etc/group: ``db_lines``): uid, gid, groups (without a
    group given, the user's memberships in /etc/group too, as initgroups) and home.
    A name that is not there is an OSError naming ``where`` it was looked for; a uid that is
    not there runs with gid 0 and home /, as Docker does."""
    name, _, group = user.partition(":")
    passwd, groups = dbs if dbs is not None else (_db("/etc/passwd"), _db("/etc/group"))
    entry = next((e for e in passwd
                  if (e[0] == name if not name.isdigit() else e[2] == name)), None)
    if entry is None and not name.isdigit():
        raise OSError(f"no user {name!r} in the {where}'s /etc/passwd")
    uid = int(entry[2]) if entry else int(name)
    gid = int(entry[3]) if entry and entry[3].isdigit() else 0
    home = entry[5] if entry and len(entry) > 5 and entry[5] else "/"
    if group:
        found = next((g for g in groups if (g[2] == group if group.isdigit() else
                                             g[0] == group)), None)
        if found is None and not group.isdigit():
            raise OSError(f"no group {group!r} in the {where}'s /etc/group")
        gid = int(found[2]) if found else int(group)
        return uid, gid, [gid], home  # a group given: that group alone (runc's rule)
    login = entry[0] if entry else ""
    extra = sorted({int(g[2]) for g in groups if g[2].isdigit() and login
                    and login in g[3].split(",")} - {gid})
    return uid, gid, [gid, *extra], home


def main() -> None:
    what = sys.argv[1]
    if what == "enter":
        try:
            code = enter(enter_spec(sys.argv[2:]))
        except (SealError, OSError) as e:
            os.write(2, f"sandfleet enter: {e}\n".encode())
            code = 125
        os._exit(code)  # nothing to flush, nothing to finalize
    if what == "suid":
        try:
            allow_setuid(int(sys.argv[2]), sys.argv[3:])
        except (SealError, OSError, ValueError) as e:
            os.write(2, f"sandfleet suid: {e}\n".encode())
            os._exit(125)
        os._exit(0)
    import marshal  # built in: json's import would cost more than the rest of start-up

    spec = marshal.loads(bytes.fromhex(sys.argv[2]))
    try:
        argv = seal(spec)
    except (SealError, OSError, ValueError, KeyError) as e:
        print(f"sandbox setup: {e}", file=sys.stderr, flush=True)
        sys.exit(125)
    import _signal

    default_signals(_signal)
    execvpe(argv, {"PATH": PATH})


if __name__ == "__main__":
    main()
