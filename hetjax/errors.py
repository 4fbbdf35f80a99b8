"""Every error hetjax raises on purpose, in one hierarchy.

A command's exit status follows the branch: a `ConfigError` is the user's input
(exit 2, before anything is compiled or allocated); any other `HetjaxError` is a
run that failed for a named reason (exit 1). Anything else is a bug in hetjax.
"""

from __future__ import annotations


class HetjaxError(Exception):
    """A failure hetjax explains: the message names the cause and the fix."""


# -- the user's input (exit 2) ----------------------------------------------------------


class ConfigError(HetjaxError, ValueError):
    """A user mistake in the config or the command line: names the field and the fix."""


class DataError(ConfigError):
    """The configured data cannot be read or does not fit the job (path, format, size)."""


class DoesNotFit(ConfigError):
    """The model, optimizer and activations need more memory than the devices have."""


class UnknownPlatform(ConfigError):
    """A platform profile hetjax does not have (config.compile.platform)."""


class ArtifactMismatch(ConfigError):
    """An exported program was made for another platform, mesh or config."""


class MissingExtra(ConfigError, ImportError):
    """An optional dependency is not installed: names the extra that installs it."""


class ConvertError(HetjaxError, ValueError):
    """A Hugging Face model or checkpoint that cannot be converted (names the tensor)."""


# -- a run that failed (exit 1) -----------------------------------------------------------


class CheckpointError(HetjaxError, RuntimeError):
    """A checkpoint cannot be saved or restored."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint's bytes do not match the checksum saved with it."""


class TrainingDiverged(HetjaxError, RuntimeError):
    """The loss stopped being finite."""


class BackendStarted(HetjaxError, RuntimeError):
    """jax's backend started before the platform profile could set its flags."""


class JobError(HetjaxError, RuntimeError):
    """A job over islands failed while running: an island, a link or a transfer."""


class IslandStartError(JobError):
    """An island's processes could not form their jax.distributed world."""


class IslandLost(JobError):
    """A peer island stopped answering or exited."""


class IslandsDiverged(JobError):
    """Islands that must hold identical parameters do not."""


class TransferError(JobError):
    """A cross-mesh transfer failed (the message names the tag, the peer and the cause)."""


class TransferTimeout(TransferError, TimeoutError):
    """A peer did not send, answer or accept within LinkConfig.timeout_s."""


class PeerLost(TransferTimeout):
    """The peer closed the connection in the middle of a transfer (it died)."""
