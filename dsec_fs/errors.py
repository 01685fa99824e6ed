"""The errors dsecfs raises, one class per kind of failure.

Callers decide what to do by class, not by message:

- ``CorruptError``: bytes we read are wrong (a flipped bit, a truncated object, a hash mismatch).
  Retrying the same source will not help. ``FormatError`` is the on-disk-structure flavour, naming the
  structure and byte offset; ``IntegrityError`` is a content hash that does not match.
- ``UnsupportedError``: well-formed input that uses something we do not implement (an unknown feature
  bit, an xattr prefix EROFS cannot store).
- ``UnavailableError``: the store (or a local resource) cannot answer now. ``transient`` says whether a
  retry may succeed (a 503, a timeout) or not (a missing bucket, access denied).
- ``NotFoundError``: a named thing (object, ref, layer) does not exist.
- ``InputError``: the user's input to a build is unusable (unreadable file, name too long, file changed
  while read). Names the path.
- ``ConflictError``: a name is taken (a sandbox id, a ref that must not be overwritten).

Every error carries ``where``: a short, human-readable location such as ``meta.erofs: inode nid 40 at
offset 1280`` or ``chunk 3f2a...`` so that the message alone tells an operator where to look. The CLI maps
each class to its own exit code (``exit_code``), so scripts can tell them apart too.
"""

from __future__ import annotations


class DsecError(Exception):
    """Base of every error dsecfs raises on purpose."""

    exit_code = 1
    kind = "error"

    def __init__(self, message: str, *, where: str | None = None):
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class CorruptError(DsecError):
    """Data read back is not what was written."""

    exit_code = 3
    kind = "corrupt"


class FormatError(CorruptError):
    """An on-disk structure fails validation; names the structure and its byte offset."""

    def __init__(self, structure: str, offset: int | None, message: str, *, source: str | None = None):
        self.structure = structure
        self.offset = offset
        where = structure if offset is None else f"{structure} at offset {offset}"
        super().__init__(message, where=f"{source}: {where}" if source else where)


class IntegrityError(CorruptError):
    """A content hash does not match the name it was stored under."""


class UnsupportedError(DsecError):
    """Valid input that uses a feature dsecfs does not implement."""

    exit_code = 4
    kind = "unsupported"


class UnavailableError(DsecError):
    """A store or resource cannot answer; ``transient`` says whether retrying may help."""

    exit_code = 5
    kind = "unavailable"

    def __init__(self, message: str, *, where: str | None = None, transient: bool = True):
        self.transient = transient
        super().__init__(message, where=where)


class NotFoundError(DsecError):
    """A named object, ref or layer does not exist."""

    exit_code = 6
    kind = "not-found"


class InputError(DsecError):
    """The input to a build or a command is unusable; ``where`` names the path or member."""

    exit_code = 2
    kind = "input"


class ConflictError(DsecError):
    """A name that must be unique is already taken."""

    exit_code = 7
    kind = "conflict"
