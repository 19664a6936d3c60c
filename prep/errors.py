"""The one exception type for mistakes a user can fix, and the errors of the machine that become one."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager


class XprepError(Exception):
    """A user-fixable problem: the CLI prints the message as one line and exits with status 2.

    Messages name the file (and line or record), what is wrong, and what to do about it.
    """

    exit_code = 2  # the CLI's exit status (a subclass may name another: xprep.train.trainer.TooManyBadSteps)


# What the machine, not the program, refuses: a full disk or quota, a permission, a read-only filesystem.
MACHINE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS})


def machine_error(e: OSError, path: str | None = None, option: str | None = None, nbytes: int | None = None,
                  action: str | None = "writing") -> XprepError | None:
    """The one-line error for ``e`` when the machine caused it (``MACHINE_ERRNOS``), else None: any other OSError
    is a bug or an unexpected failure, and keeps its traceback.

    ``path`` is what was being written (``e.filename``, where the system named one, is used first); ``option`` the
    command's option that chose where (``-o``, ``--html``, ``--output``), named in the fix; ``nbytes`` what was
    being written when the disk filled, where known; ``action`` what was being done (None: not known, the file is
    just named). The one place these messages are worded: ``xprep``'s commands (``cli._user_errors``), their worker
    processes and the trainer use it.
    """
    if not isinstance(e, OSError) or e.errno not in MACHINE_ERRNOS:
        return None
    file = e.filename or path
    where = "" if not file else f" {action} {file}" if action else f": {file}"
    elsewhere = f"choose another {option}" if option else "write elsewhere"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
        size = f": {nbytes:,} bytes were being written" if nbytes else ""
        return XprepError(f"{what}{where}{size}; free space on that filesystem or {elsewhere}")
    if e.errno == errno.EROFS:
        return XprepError(f"read-only filesystem{where}; {elsewhere} on a writable one")
    return XprepError(f"permission denied{where}; check its permissions (and its directory's) or {elsewhere}")


def machine_cause(error: BaseException) -> OSError | None:
    """The OSError of the machine (``MACHINE_ERRNOS``) behind ``error``, else None: ``error`` itself, what caused
    it or was being handled when it came (``__cause__``, ``__context__``), or one of the failures an exception
    gathers from several ranks or workers (``failures``: {rank: exception or (exception, traceback)}, as
    torch.distributed.checkpoint's CheckpointException)."""
    seen: set[int] = set()
    todo: list[object] = [error]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in MACHINE_ERRNOS:
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        for failure in failures.values() if isinstance(failures, dict) else ():
            todo.append(failure[0] if isinstance(failure, tuple) and failure else failure)
    return None


@contextmanager
def machine_errors(path: str | None = None, option: str | None = None, nbytes: int | None = None,
                   action: str = "writing") -> Iterator[None]:
    """Within: an OSError of the machine (``machine_error``) becomes its one-line XprepError; any other passes."""
    try:
        yield
    except OSError as e:
        mapped = machine_error(e, path, option, nbytes, action)
        if mapped is None:
            raise
        raise mapped from None
