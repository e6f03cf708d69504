"""Errors raised by the LingBot-VA example.

They derive from :class:`resumekit.errors.ResumekitError` (so they carry their data as
attributes and pickle across rank processes) and from the built-in a caller would catch.
"""

from __future__ import annotations

from resumekit.errors import ResumekitError

__all__ = ["BatchError", "ConfigError", "EpisodeDirectoryError", "EpisodeFileError"]


class ConfigError(ResumekitError, ValueError):
    """A config value is invalid or a config name is unknown (``field`` or ``name``)."""


class EpisodeDirectoryError(ResumekitError, FileNotFoundError):
    """An episode directory is missing or holds no episode files (``path``)."""


class EpisodeFileError(ResumekitError, ValueError):
    """An episode file cannot be read or has a missing/ill-shaped key (``path``, ``key``)."""


class BatchError(ResumekitError, ValueError):
    """A batch lacks a key or a tensor has the wrong shape (``key``, ``shape``)."""
