"""Which shared memory a process sees, so that a worker knows whether the API can map its
capture files (arena.py) or must be sent the rows themselves.

Two processes share tapc's shared-memory folder when they run on one kernel (its boot id) and
the folder is one filesystem object there (device and inode: two containers with /dev/shm of
their own differ, two that bind the host's do not). The API puts its identity in the engine's
config (config.py `api_shm`); each worker compares its own, wherever vLLM's executor placed it (on
Ray, rank 0 need not be on the API's node).
"""
from __future__ import annotations

import os

from tapc import settings

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def shm_identity(directory: str | None = None) -> str | None:
    """"boot id:device:inode" of the shared-memory folder (`TAPC_SHM_DIR`, else /dev/shm), or
    None where it cannot be read (no such folder, or a kernel without a boot id)."""
    try:
        with open(BOOT_ID) as f:
            boot = f.read().strip()
        st = os.stat(directory or settings.TAPC_SHM_DIR)
    except OSError:
        return None
    return f"{boot}:{st.st_dev}:{st.st_ino}"
