"""Errors Strata raises on bad input. Each message is one line naming the thing and the reason."""


class StrataError(Exception):
    """Base class: the CLI prints the message alone on stderr and exits 2."""


class InvalidArgument(StrataError, ValueError):
    """An argument or option has a value Strata cannot use."""


class FormatError(StrataError):
    """A model file is malformed: bad magic, truncated, inconsistent metadata."""


class UnsupportedError(StrataError):
    """Well-formed input that Strata does not support (architecture, quant type)."""


class PackError(StrataError):
    """A pack directory is missing a file, fails its checksum, or is of another format version."""


class DeviceError(StrataError):
    """A CUDA driver call failed, or no usable GPU was found."""
