"""Upstream bug (fairseq 0.12.2, fairseq-fixed 0.12.3.1): checkpoint copies are not atomic.

fairseq saves the first checkpoint of a round atomically (``.tmp`` + rename) but then
*copies* it onto ``checkpoint_last.pt`` / ``checkpoint_best.pt`` in place with
``PathManager.copy``, so a kill during the copy corrupts them. We make the copy atomic
too (copy to ``.tmp``, then ``os.replace``). A failed copy (disk full, read-only
directory) removes its ``.tmp`` and stops with one line naming the file and the fix;
the previous checkpoints stay. (The first write's errors are handled by the trainer.)
"""

from __future__ import annotations

import os
import shutil

from fairseq.file_io import PathManager

from torchscale_fairseq.errors import TsConfigError

_stock_copy = PathManager.copy


def _local(path: str) -> bool:
    return "://" not in str(path)


def atomic_copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
    if not _local(dst_path):
        return _stock_copy(src_path, dst_path, overwrite)
    tmp = f"{dst_path}.tmp"
    try:
        shutil.copyfile(src_path, tmp)
        os.replace(tmp, dst_path)
    except OSError as e:
        remove_if_present(tmp)
        raise checkpoint_write_error(dst_path, e) from e
    return True


def remove_if_present(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def checkpoint_write_error(path: str, e: OSError) -> TsConfigError:
    return TsConfigError(
        f"cannot write checkpoint {path}: {e.strerror or e}; free space or point --save-dir at a writable "
        "directory (the previous checkpoints are unchanged)"
    )


def patch_checkpoint_writes() -> None:
    PathManager.copy = staticmethod(atomic_copy)
