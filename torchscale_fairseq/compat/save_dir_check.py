"""Upstream bug (fairseq 0.12.2, fairseq-fixed 0.12.3.1): the save-dir check uses one fixed file name.

``fairseq_cli/train.py`` (rank 0, also under ``--no-save``, whose save dir defaults to
``checkpoints`` in the working directory) checks that ``--save-dir`` is writable by creating
and then removing ``<save_dir>/dummy``. Two runs starting in one directory remove each other's
file (the second stops with ``FileNotFoundError: .../dummy``), and a user's own file named
``dummy`` there is deleted. We check with an anonymous temporary file instead; a save dir that
cannot be created or written stops with one line naming it.
"""

from __future__ import annotations

import os
import tempfile

from fairseq import checkpoint_utils

from torchscale_fairseq.errors import TsConfigError


def verify_checkpoint_directory(save_dir: str) -> None:
    """Create ``save_dir`` if needed and check that a file can be written there."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=save_dir):
            pass
    except OSError as e:
        raise TsConfigError(
            f"cannot write to --save-dir {save_dir}: {e.strerror or e}; point --save-dir at a writable directory"
        ) from e


def patch_save_dir_check() -> None:
    checkpoint_utils.verify_checkpoint_directory = verify_checkpoint_directory
