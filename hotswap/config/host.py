"""What the config reads of the host it runs on."""

from __future__ import annotations

import os


def available_memory_bytes() -> int:
    """The host's available memory (MemAvailable), or total physical memory where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
