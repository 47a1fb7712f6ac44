"""Building the app (what `serve run` and Serve's build task do before any replica starts) imports no
torch: a built default checkpoint is found without the model builder, and device=auto asks torch only
where a GPU driver is present. Importing torch took 3 of the 5 seconds of the build task at start."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import sys, serve_app
serve_app.build_app({})  # model: the default checkpoint, already built; device: auto
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_building_the_app_for_the_default_model_imports_no_torch(model_dirs, tmp_path):
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "llama-small-seed0").symlink_to(model_dirs["llama"])  # as if built before
    env = {**os.environ, "KVSERVE_CACHE_DIR": str(cache), "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    import serve_app

    # device=auto asks torch where a GPU driver is present (the CI machines have none)
    gpu_driver = any(os.path.exists(p) for p in serve_app.GPU_DRIVER_PATHS)
    assert done.stdout.strip().splitlines()[-1] == ("['torch']" if gpu_driver else "[]")
