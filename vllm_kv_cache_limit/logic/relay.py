"""The cap error relay: an engine-core or worker process leaves its cap error
for the first process, which raises it instead of vLLM's generic
"Engine core initialization failed". The file lies in a folder private to
the first process and is opened ``O_EXCL | O_NOFOLLOW``.

Pure: no vLLM import.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import stat
import tempfile
from typing import NoReturn

from vllm_kv_cache_limit.logic import envs
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError


def raise_cap_error(message: str, error: type[KVCacheMaxMemoryError] = KVCacheMaxMemoryError) -> NoReturn:
    """Raise a cap error (``error``, a :class:`KVCacheMaxMemoryError`); from
    an engine-core or worker process, also hand the message to the first
    process (see ``patch``)."""
    relay_cap_error(message)
    raise error(message)


def relay_cap_error(message: str) -> bool:
    """Leave ``message`` for the first process, once: the first error written
    wins. The file lies in the first process's private folder and is created
    ``O_EXCL | O_NOFOLLOW``, so nothing planted there can redirect it.
    Whether the first process will find a cap error there (this one or an
    earlier one): False without a relay, or where it cannot be written."""
    path = os.environ.get(envs.ERROR_FILE)
    if not path:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:  # an earlier error, or something planted (a link is not read)
        try:
            found = os.lstat(path)
        except OSError:
            return False
        return stat.S_ISREG(found.st_mode) and found.st_size > 0
    except OSError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as relay:
        relay.write(message)
    return True


_relay_dir: str | None = None


def arm_error_relay() -> None:
    """Name the relay file for the processes this engine starts: in a folder
    private to this process (``mkdtemp``, mode 0700), removed at exit."""
    global _relay_dir
    if _relay_dir is None or not os.path.isdir(_relay_dir):
        _relay_dir = tempfile.mkdtemp(prefix="vllm-kv-cache-limit-")
        atexit.register(shutil.rmtree, _relay_dir, True)
    path = os.path.join(_relay_dir, "cap-error")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.environ[envs.ERROR_FILE] = path


def take_relayed_error() -> str | None:
    """Read and remove the cap error left by a child process, if any."""
    path = os.environ.get(envs.ERROR_FILE)
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, encoding="utf-8") as relay:
        message = relay.read()
    with contextlib.suppress(OSError):
        os.unlink(path)
    return message or None
