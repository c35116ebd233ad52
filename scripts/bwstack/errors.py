"""Errors a person can act on. The CLI prints `str(error)` on one line and exits with `exit_code`."""

from __future__ import annotations


class BwstackError(Exception):
    """An operation failed; the message says what and what to do."""

    exit_code = 1


class UsageError(BwstackError):
    """Bad input from the user: a malformed lock, an unknown profile, a bad flag value."""

    exit_code = 2


class LockError(UsageError):
    """stack.lock.yaml is malformed or inconsistent; names the key and profile."""

    def __init__(self, path: str, where: str, message: str) -> None:
        self.path = path
        self.where = where
        super().__init__(f"{path}: {where}: {message}" if where else f"{path}: {message}")


class ArchiveRefusedError(UsageError):
    """An archive to restore is malformed or hostile (a member outside the generation, a device file, a damaged
    stream, not the bytes its .sha256 names): bad input, refused before anything is written."""


class HashMismatchError(BwstackError):
    """A wheel (downloaded or in a wheelhouse) is not the one the lock names: bad input, as a hostile archive is,
    so exit 2; nothing of it was kept. (A damaged copy in the store's own cache is removed and fetched again.)"""

    exit_code = 2


class BusyError(BwstackError):
    """Another bwstack run holds the store's lock."""

    exit_code = 3


class PreflightError(BwstackError):
    """The node is not fit for the requested change; nothing was touched."""

    exit_code = 4


class IntegrityError(BwstackError):
    """A generation's files no longer match its manifest."""

    exit_code = 5
