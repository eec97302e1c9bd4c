"""The one error type of the input side."""

from maxtrain.errors import UserError


class DataError(UserError, ValueError):
    """Bad input data or data settings. The message names the file (and line or record where known)
    and the fix. A ValueError, so `python -m maxtrain.train` prints it as `maxtrain: error: ...`."""
