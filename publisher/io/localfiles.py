"""Reading local folders we do not own (a base folder given as MODEL_ID, the download cache) without being led
outside them.

Rules (docs/reliability.md, "Hostile input"):

- A link to a regular file is followed only when its target stays inside the folder (or, for a
  huggingface_hub cache snapshot, inside that repo's ``blobs`` folder, where the cache keeps the bytes, or the
  cache-wide shared blob store that Xet downloads link those blobs to); its content is then read as if the file
  were there. A link that leaves, dangles or loops is refused, by name.
- A linked folder is refused wherever it points (it would make files appear twice, or pull in a tree).
- Special files (FIFOs, sockets, devices) are refused by name and never opened: a FIFO opened for reading would
  block forever. Every open is ``O_NONBLOCK | O_NOFOLLOW`` on the resolved path and checked with ``fstat``, so a
  file swapped for a FIFO or a link after the listing is refused too.
- Copies never create links: the output gets a plain file with the target's bytes.

``named_folder`` tells a mistyped folder from a Hub repo id where a command takes either (MODEL_ID, TARGET).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO

from publisher.errors import InputError, UsageError

SKIPPED_DIRS = (".git", ".cache")  # never part of a model: git's store, huggingface_hub's local-dir metadata
_SHOWN = 3  # names quoted in one error line


SHARED_BLOBS_MARKER = ".huggingface-shared-blobs"  # huggingface_hub marks its shared blob store with this file


def allowed_roots(folder: Path) -> tuple[Path, ...]:
    """Where links under ``folder`` may point: the folder itself and, for a huggingface_hub cache snapshot
    (``<cache>/models--org--name/snapshots/<sha>``), the repo's ``blobs`` folder and the cache's shared blob store
    (``<cache>/blobs``, where a Xet download's bytes live; huggingface_hub marks it with a file of its own)."""
    root = Path(os.path.realpath(folder))
    roots = [root]
    blobs = root.parent.parent / "blobs"
    if root.parent.name == "snapshots" and blobs.is_dir():
        roots.append(Path(os.path.realpath(blobs)))
        shared = shared_blob_store(root.parent.parent.parent)
        if shared is not None:
            roots.append(shared)
    return tuple(roots)


def shared_blob_store(cache: Path) -> Path | None:
    """The Hugging Face cache's shared blob store (``<cache>/blobs``, resolved), when huggingface_hub marked it as one."""
    shared = cache / "blobs"
    return Path(os.path.realpath(shared)) if (shared / SHARED_BLOBS_MARKER).is_file() else None


def in_shared_blob_store(path: Path, cache: Path) -> bool:
    """Whether ``path`` resolves into the cache's shared blob store (a Xet download's bytes, which other repos share)."""
    store = shared_blob_store(cache)
    return store is not None and _inside(os.path.realpath(path), (store,))


def _inside(path: str, roots: tuple[Path, ...]) -> bool:
    return any(os.path.commonpath([path, str(r)]) == str(r) for r in roots)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def list_folder(folder: Path) -> dict[str, int]:
    """Every regular file under ``folder`` (relative POSIX path -> size), by the rules above; raises
    ``InputError`` naming the offending entries."""
    root = Path(os.path.realpath(folder))
    roots = allowed_roots(root)
    sizes: dict[str, int] = {}
    leaving: list[str] = []
    special: list[str] = []
    stack = [root]
    while stack:
        current = stack.pop()
        with os.scandir(current) as entries:
            for entry in entries:
                if entry.name in SKIPPED_DIRS:
                    continue
                rel = Path(entry.path).relative_to(root).as_posix()
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    target = os.path.realpath(entry.path)
                    try:
                        tst = os.stat(target)
                    except OSError:
                        leaving.append(f"{rel} -> {os.readlink(entry.path)} (dangling or looping)")
                        continue
                    if not _inside(target, roots):
                        leaving.append(f"{rel} -> {os.readlink(entry.path)}")
                    elif stat.S_ISDIR(tst.st_mode):
                        special.append(f"{rel} (a linked folder)")
                    elif not stat.S_ISREG(tst.st_mode):
                        special.append(f"{rel} (links to {_kind(tst.st_mode)})")
                    else:
                        sizes[rel] = tst.st_size
                elif stat.S_ISDIR(st.st_mode):
                    stack.append(Path(entry.path))
                elif stat.S_ISREG(st.st_mode):
                    sizes[rel] = st.st_size
                else:
                    special.append(f"{rel} ({_kind(st.st_mode)})")
    if leaving:
        raise InputError(f"the base folder {folder} has links that leave it or lead nowhere: {_names(leaving)}; nothing outside the "
                         "base folder is read: copy those files in instead of linking them", kind="link")
    if special:
        raise InputError(f"the base folder {folder} has entries that are not regular files: {_names(special)}; "
                         "remove them (FIFOs, sockets, devices and linked folders are never read)", kind="special")
    return dict(sorted(sizes.items()))


def _names(items: list[str]) -> str:
    items = sorted(items)
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def open_regular(path: Path, roots: tuple[Path, ...] | None = None) -> BinaryIO:
    """Open a regular file for reading, unbuffered, never blocking on a FIFO and never opening a device;
    ``roots``: where the resolved path must lie (None: anywhere, e.g. our own output folder)."""
    real = os.path.realpath(path)
    if roots is not None and not _inside(real, roots):
        raise InputError(f"{path} links to {real}, outside {roots[0]}; nothing outside the folder is read", kind="link")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        raise InputError(f"{path} does not exist (or is a dangling link)", kind="missing") from None
    if not stat.S_ISREG(mode):
        raise InputError(f"{path} is {_kind(mode)}, not a regular file; it is never read", kind="special")
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the stat above
        os.close(fd)
        raise InputError(f"{path} is not a regular file; it is never read", kind="special")
    f = os.fdopen(fd, "rb", buffering=0)
    f.name = str(path)  # error messages name the path, not the descriptor
    return f


def read_bytes(path: Path, roots: tuple[Path, ...] | None = None, limit: int | None = None) -> bytes:
    """A regular file's bytes; with ``limit``, at most ``limit + 1`` bytes are read (the caller checks)."""
    with open_regular(path, roots) as f:
        return f.read() if limit is None else f.read(limit + 1)


def copy_regular(src: Path, dst: Path, roots: tuple[Path, ...] | None = None) -> None:
    """Copy a regular file's bytes to a new plain file ``dst`` (never a link, never through one)."""
    with open_regular(src, roots) as fin:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)


def plain_name(name: str) -> bool:
    """A single, ordinary path segment (a component folder name): no separator, not ".", "..", empty or hidden."""
    return bool(name) and "/" not in name and "\\" not in name and "\0" not in name and not name.startswith(".")


_SEPARATORS = tuple(dict.fromkeys(("/", os.sep, os.altsep or "/")))
_PATH_STARTS = ("~", *(f"{dots}{sep}" for dots in ("", ".", "..") for sep in _SEPARATORS))


def looks_like_path(name: str) -> bool:
    """``name`` is written as a path, not a repo id: it starts with ./ ../ / or ~, ends with a separator, or has a
    separator after a first part that exists here (``out/model`` beside a folder ``out``)."""
    if name.startswith(_PATH_STARTS) or name.endswith(_SEPARATORS):
        return True
    first = next((name.split(sep, 1)[0] for sep in _SEPARATORS if sep in name), None)
    return first is not None and Path(first).expanduser().exists()


def named_folder(name: str, what: str) -> None:
    """``UsageError`` when ``name`` (``what``: MODEL_ID, TARGET) is a file, or written as a path to a folder that does
    not exist: a mistyped folder would otherwise be read as a repo id and fail as one."""
    path = Path(name).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise UsageError(f"{what} {name} is a file, not a folder; give the folder that holds the model (or a Hub repo "
                         "id, NAMESPACE/NAME)")
    if looks_like_path(name):
        close = _close_folder(path, name)
        raise UsageError(f"no such folder: {name}{f' (did you mean {close}?)' if close else ''}; give an existing "
                         f"folder as {what}, or a Hub repo id (NAMESPACE/NAME)")


def _close_folder(path: Path, name: str) -> str | None:
    """The folder beside ``path`` whose name is closest to its own, written as the user wrote ``name``."""
    import difflib
    from itertools import islice

    try:
        folders = [p.name for p in islice(path.parent.iterdir(), 10_000) if p.is_dir()]
    except OSError:  # the parent is missing or unreadable: nothing to suggest
        return None
    close = difflib.get_close_matches(path.name, folders, n=1)
    if not close:
        return None
    given = name.rstrip("".join(_SEPARATORS))
    return given[: len(given) - len(path.name)] + close[0]
