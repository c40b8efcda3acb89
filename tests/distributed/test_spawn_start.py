"""A script that calls launch_local at module level (no main guard): every rank dies while starting, and the
launcher says so and names the fix instead of blaming the out-of-memory killer."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_missing_main_guard_is_named_with_its_fix(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent("""\
        import pipetrain

        def work(spec):
            print("rank", spec.rank, "ran")

        pipetrain.launch_local(work, 2)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "ran" not in done.stdout
    assert "died while starting, before running work()" in done.stderr, done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert "out of memory" not in done.stderr
