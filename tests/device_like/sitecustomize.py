"""Make this Python look like the GPU machine's (no Ray, no pydantic) for `gpu.sh --dry-run`'s test.

Put this folder first on PYTHONPATH: Python imports `sitecustomize` at start-up. Every top-level
name in RAYTRAIN_DDP_HIDE (comma-separated) is then looked up only outside this interpreter's own
site-packages, so a package installed there is missing, and one installed elsewhere on the path
(where `gpu.sh` puts the carried wheels: `pip install --target`) is found. Test-only.
"""

import importlib.machinery
import os
import site
import sys

_HIDDEN = {n.strip() for n in os.environ.get("RAYTRAIN_DDP_HIDE", "").split(",") if n.strip()}
_SITE = {os.path.realpath(p) for p in site.getsitepackages() + [site.getusersitepackages()]}


class _HideFromSite:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if "." in name or name not in _HIDDEN:
            return None
        elsewhere = [p for p in sys.path if os.path.realpath(p or ".") not in _SITE]
        spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden: as on the GPU machine)", name=name)
        return spec


if _HIDDEN:
    sys.meta_path.insert(0, _HideFromSite())
