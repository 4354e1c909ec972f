"""Files a profile is saved to and loaded from: their kind by suffix, bounded reads of
regular files only, and writes that leave no half file."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

SPECIAL_FILES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(path: str | os.PathLike) -> str:
    """'speedscope', 'speedscope.gz', 'pprof', 'pyspy' (our lossless file) or 'html', from the file name."""
    name = os.fspath(path).lower()
    if name.endswith(".pb.gz"):
        return "pprof"
    if name.endswith(".pyspy.gz"):
        return "pyspy"
    if name.endswith(".json.gz"):
        return "speedscope.gz"
    if name.endswith(".json"):
        return "speedscope"
    if name.endswith(".html"):
        return "html"
    raise ValueError(
        f"path must end in .json or .json.gz (speedscope, e.g. out.speedscope.json.gz), "
        f".pb.gz (pprof), .pyspy.gz (dask-pyspy's own file, loads back losslessly) or .html (report), "
        f"got {os.fspath(path)!r}"
    )


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of `path` if it is a regular file (after symlinks) of at most `limit`
    bytes: a device such as /dev/zero would never end, and a FIFO would block."""
    # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            what = next((what for test, what in SPECIAL_FILES if test(st.st_mode)), "a special file")
            raise ValueError(f"not a regular file but {what}")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1) if st.st_size <= limit else b""
    finally:
        os.close(fd)
    if max(st.st_size, len(data)) > limit:
        raise ValueError(
            f"{max(st.st_size, len(data))} bytes, more than config pyspy.max-result ({limit >> 20} MiB) allows"
        )
    return data


def check_writable(path: str | os.PathLike) -> Path:
    """Fail before any work is done if `path` cannot be written."""
    file_kind(path)
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise OSError(f"cannot write {str(path)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise OSError(f"cannot write {str(path)!r}: permission denied")
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same directory, so a failure leaves no half file.

    An error names `path`, not the temporary file the user never asked for.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        raise OSError(e.errno, f"cannot write {str(path)!r}: {e.strerror}") from None
