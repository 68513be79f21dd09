"""What only this user can change on a shared machine: the places and checks the server's key and the disk weight sync
rely on, for `or1-trl serve`, the server it starts and the trainer alike.

- `user_dir`: this user's folder on this machine, `/dev/shm/or1-trl-<uid>` (in the temporary directory where there
  is no `/dev/shm`), mode 0700. It is the server's default sync root, holds each run's sync folder
  (`weight_files.private_dir`) and the keys `or1-trl serve` makes (`key_file`).
- `private_problem`: why a folder is not one only this user can change (a link, another owner, a mode other than
  0700); `open_parent_problem`: why others could rename what is in a folder (another owner, writable by others
  without the sticky bit).
- `sync_root_problem`: a sync root must be a folder of this user's, mode 0700, on a path no one else can rename:
  `/`, `/tmp`, `/dev`, `/dev/shm` are refused (others write somewhere under them).
- `loadable_problem`: a folder under a sync root the server may load from: every folder from the root down owned by
  the server's user and writable by no one else, the folder itself 0700 — weights another user wrote, or could have
  changed, are never loaded.
- `key_file`, `read_key`, `write_key`: the key `or1-trl serve` makes when the user gives none, in a file only this
  user can read (0600, in `user_dir`), one per port; the trainer's client reads it for a server on this machine.

Standard library only: the server's environment has vLLM, not or1_trl (`or1-trl serve` puts this directory on its
`PYTHONPATH`).
"""

from __future__ import annotations

import os
import stat
import tempfile

TMPFS = "/dev/shm"
#: Where `or1-trl serve` tells the server to publish the key it made (`write_key`), once its port is bound.
KEY_FILE_ENV = "OR1_VLLM_KEY_FILE"
_NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def user_dir(create: bool = True, base: str | None = None) -> str:
    """`<base>/or1-trl-<uid>` (`base`: `/dev/shm`, else the temporary directory), symlinks of `base` resolved;
    `create`: made if missing (mode 0700) and checked (`private_problem`), `PermissionError` saying what is wrong.
    `base` itself must be a folder no one else can rename things in (`open_parent_problem`)."""
    base = os.path.realpath(base or (TMPFS if os.path.isdir(TMPFS) else tempfile.gettempdir()))
    path = os.path.join(base, f"or1-trl-{os.geteuid()}")
    if not create:
        return path
    if not os.path.isdir(base):
        raise NotADirectoryError(f"{base} is not a directory")
    problem = open_parent_problem(base)
    if problem:
        raise PermissionError(problem)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)  # ours (only we or root could have widened it): narrowed again
    problem = private_problem(path)
    if problem:
        raise PermissionError(problem)
    return path


def open_parent_problem(path: str) -> str | None:
    """Why another user could rename what is in the folder `path` (and put a link in its place), or `None`: it
    belongs to neither root nor this user, or others may write to it without the sticky bit (`/dev/shm` and `/tmp`
    are sticky: only an entry's owner renames it)."""
    info = os.stat(path)
    if info.st_uid not in (0, os.geteuid()):
        return f"{path} belongs to uid {info.st_uid}, neither root nor this user"
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return f"{path} is writable by others and not sticky: they could replace what is in it"
    return None


def private_problem(path: str) -> str | None:
    """Why `path` is not a folder only this user can enter and change, or `None`: it must be a folder itself (not a
    link), owned by this process's user, with no permission for group or others (mode 0700)."""
    try:
        info = os.lstat(path)
    except OSError as error:
        return f"{path}: {error.strerror}"
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a folder (a link, or a file)"
    if info.st_uid != os.geteuid():
        return f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        reach = "write to" if mode & 0o022 else "enter"
        return f"{path} has mode {mode:04o}, not 0700: other users can {reach} it"
    return None


def sync_root_problem(root: str) -> str | None:
    """Why `root` cannot be a sync root (`or1-trl serve --sync-root`), or `None`: it must be a folder of this user's,
    mode 0700 (`private_problem`), and no folder above it may let another user rename it (`open_parent_problem`), so
    that nothing under it can come from someone else."""
    real = os.path.realpath(root)
    problem = private_problem(real)
    parent = os.path.dirname(real)
    while not problem and parent != real:
        problem, real, parent = open_parent_problem(parent), parent, os.path.dirname(parent)
    return problem


def loadable_problem(root: str, folder: str) -> str | None:
    """Why the server may not load the folder `folder` under the sync root `root` (both real paths), or `None`:
    every folder below `root` down to `folder` must be this user's and writable by no one else, and `folder` itself
    0700 (`private_problem`), so that no other user wrote, or could change, what it holds."""
    relative = os.path.relpath(folder, root)
    path = root
    for part in [] if relative == "." else relative.split(os.sep)[:-1]:  # the folders in between
        path = os.path.join(path, part)
        info = os.lstat(path)
        if info.st_uid != os.geteuid():
            return f"{path} belongs to uid {info.st_uid}, not to the server's user (uid {os.geteuid()})"
        if info.st_mode & 0o022:
            return f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: other users can write to it"
    return private_problem(folder)


def key_file(port: int, directory: str | None = None) -> str:
    """Where `or1-trl serve` keeps the key it made for a server on this machine listening on `port`:
    `<user_dir>/vllm-server-<port>.key` (not created here)."""
    return os.path.join(directory or user_dir(create=False), f"vllm-server-{int(port)}.key")


def read_key(path: str) -> str | None:
    """The key in `path`, if it is a regular file of this user's with no permission for others (0600), in a folder
    only this user can change (`private_problem`), holding one printable line; else `None`."""
    if private_problem(os.path.dirname(path)):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            return None
        key = f.read(256).decode("ascii", errors="replace").strip()
    return key if key and key.isprintable() and " " not in key else None


def write_key(path: str, key: str) -> None:
    """Write `key` to `path`, mode 0600, replacing what is there in one step (a new file renamed over it: a link
    there is replaced, never written through). Its folder must be private (`private_problem`), else
    `PermissionError`."""
    problem = private_problem(os.path.dirname(path))
    if problem:
        raise PermissionError(problem)
    partial = f"{path}.{os.getpid()}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.replace(partial, path)
