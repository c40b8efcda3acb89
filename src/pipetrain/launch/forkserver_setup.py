"""The fork server's own set-up, run by importing this module last among the server's preloads (launch/forkserver.py):
nothing else imports it, and importing it anywhere else would be a mistake.

- `gc.freeze()`: the objects of the server's imports move to the collector's permanent generation, so a rank's
  collections never walk them (each walk would write to, and so copy, every page a rank shares with the server).
- The server ends at once at exit (`os._exit` as its first exit handler): its interpreter's teardown, with torch
  loaded, takes about a second, during which it holds the launcher's standard output and error open (a caller
  reading them to the end, as a test does, would wait for it). Forked ranks end by `os._exit` and never run it.
"""

from __future__ import annotations

import atexit
import gc
import os

gc.freeze()
atexit.register(os._exit, 0)
