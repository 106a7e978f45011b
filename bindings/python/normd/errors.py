"""NormdError: every failure the library or the daemon reports."""

from . import _lib


class NormdError(RuntimeError):
    """A call to libnormclient or a job failed.

    Attributes:
        status: the status name from the shared table, e.g. ``"INVALID_ARGUMENT"``,
            ``"NOT_FOUND"``, ``"UNSUPPORTED"``, ``"TIMEOUT"``, or
            ``"DISCONNECTED"`` (enqueue mode: the daemon died or dropped the
            connection; streams waiting on it were released).
        code: the library's negative status code (``NC_E*``).
        message: the daemon's one-line explanation (from the job's reply), or
            the library's (``nc_last_error()``).

    In the enqueue mode (``Client.enqueue``) an error may belong to an
    earlier job: the daemon's later refusals come back from a later
    ``enqueue()``, ``check()`` or ``stream_wait()``, as CUDA's asynchronous
    errors do, and the message names the request.

    It derives from RuntimeError, which is what PyTorch code usually catches.
    """

    def __init__(self, code, message):
        self.code = int(code)
        self.status = status_name(self.code)
        self.message = message or status_text(self.code)
        super().__init__("%s: %s" % (self.status, self.message))


def status_name(code):
    """The table name of a status code ("OK", "INVALID_ARGUMENT", ..., "UNKNOWN")."""
    return _lib.text(_lib.load().nc_status_name(int(code)))


def status_text(code):
    """The library's short description of a status ("invalid argument", ...)."""
    return _lib.text(_lib.load().nc_strerror(int(code)))


def check(rc, message=None):
    """Raises NormdError for a negative return code; returns rc otherwise.

    The message defaults to nc_last_error(), which must be read on the
    thread that made the failed call (ctypes calls stay on the calling
    thread, so calling this right after the call is enough).
    """
    if rc < 0:
        if message is None:
            message = _lib.text(_lib.load().nc_last_error())
        raise NormdError(rc, message)
    return rc
