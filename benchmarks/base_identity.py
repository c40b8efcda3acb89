"""What the LoRA base identity costs: the whole-file digest (pipetrain.lora.identity, WHOLE) against the older
first-and-last-MiB digest (EDGES) and a plain sha256 of every byte, on the prepared SmolLM2-135M folder (or the
folder given), each timed twice side by side (the second reading from the page cache).

    python benchmarks/base_identity.py [FOLDER]
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

from pipetrain.lora.identity import EDGES, WHOLE, folder_identity
from pipetrain.workloads.hf.smollm2 import default_folder


def _sha256(folder: Path) -> None:
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            hashlib.file_digest(f, "sha256")


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else default_folder()
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    print(f"{folder}: {size / 1e6:.0f} MB of weights")
    timings = {}
    for _ in range(2):
        for name, run in ((WHOLE, lambda: folder_identity(folder, WHOLE)),
                          (EDGES, lambda: folder_identity(folder, EDGES)), ("sha256 of every byte", lambda: _sha256(folder))):
            start = time.perf_counter()
            run()
            timings[name] = time.perf_counter() - start
    for name, seconds in timings.items():
        print(f"{name:>22}: {seconds:.3f} s ({size / seconds / 1e9:.2f} GB/s), {seconds / timings[WHOLE]:.2f} x {WHOLE}")


if __name__ == "__main__":
    main()
