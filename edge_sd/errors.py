"""A small exception hierarchy; the CLI turns each into one line on stderr and an exit code."""

from __future__ import annotations


class EdgeSDError(Exception):
    """Base of every error edge-sd raises on purpose (bad input, bad artifacts)."""

    exit_code = 1


class UsageError(EdgeSDError):
    """The caller asked for something that cannot work (bad option, empty prompt...). field: the
    setting at fault, where one is (the command line names its option instead)."""

    exit_code = 2

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class ArtifactError(EdgeSDError):
    """An artifact folder is missing, incomplete, corrupted or of an unknown version."""

    exit_code = 3


class ExportError(EdgeSDError):
    """Loading, exporting or validating a model failed."""

    exit_code = 4


class ProviderError(EdgeSDError):
    """An execution provider was asked for that this machine cannot give."""

    exit_code = 5


class ContextLimitError(EdgeSDError):
    """A sequence would grow past an engine's maximum context."""

    exit_code = 6
