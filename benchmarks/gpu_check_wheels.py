"""The wheels that benchmarks/gpu_check.py carries to the GPU machine, fetched here.

The GPU machine reaches no package registry. Its python3 (3.12, in the device tool's image)
has torch, Triton, pytest, pytest-timeout, pytest-xdist, psutil, nvidia-ml-py, scikit-learn,
numpy, pandas and the small libraries they need (the device tool's KINDS.md lists them), but
not Dask, IPython, Jupyter or bokeh. WHEELS is what the controller and notebook 04 need beyond
that image: the closure of monarch-nb's requirements, ipykernel, ipywidgets, jupyter_bokeh,
nbclient and nbformat, less what the image has. Each is fetched at the version this
environment has, so that the GPU machine runs what the suite here tests: about 28 MB, inside
the 64 MiB that a run's working tree and carried folders may take together.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

WHEELS = (
    # Dask
    "dask",
    "distributed",
    "locket",
    "partd",
    "tblib",
    "tornado",
    "zict",
    # IPython
    "asttokens",
    "executing",
    "ipython",
    "ipython-pygments-lexers",
    "jedi",
    "matplotlib-inline",
    "parso",
    "pexpect",
    "prompt-toolkit",
    "ptyprocess",
    "pure-eval",
    "stack-data",
    "traitlets",
    "wcwidth",
    # a Jupyter kernel, and nbclient to run notebooks on it
    "comm",
    "debugpy",
    "fastjsonschema",
    "ipykernel",
    "jsonschema",
    "jsonschema-specifications",
    "jupyter-client",
    "jupyter-core",
    "nbclient",
    "nbformat",
    "nest-asyncio2",
    "platformdirs",
    "pyzmq",
    "referencing",
    "rpds-py",
    # widgets and figures: the live panel, %monarch plot
    "bokeh",
    "ipywidgets",
    "jupyter-bokeh",
    "jupyterlab-widgets",
    "widgetsnbextension",
    "xyzservices",
)
# The GPU machine's Python and platform (the device tool's README says how to fetch for it).
PIP_TARGET = ["--python-version", "3.12", "--implementation", "cp"] + [
    arg
    for tag in (
        "manylinux_2_28_x86_64",
        "manylinux_2_27_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "manylinux1_x86_64",
    )
    for arg in ("--platform", tag)
]


def wanted() -> dict[str, str]:
    """name -> the version installed here; a name not installed here is an error."""
    missing, versions = [], {}
    for name in WHEELS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        raise SystemExit(
            f"not installed here: {', '.join(missing)}; run this with the project's environment "
            "(make setup installs it, then .venv/bin/python)"
        )
    return versions


def download(folder: Path) -> int:
    """Fetch WHEELS into ``folder`` for the GPU machine, and drop any other wheel there (two
    versions of one package stop the whole install)."""
    from packaging.utils import canonicalize_name, parse_wheel_filename

    versions = wanted()
    folder.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={version}" for name, version in versions.items()]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    proc = subprocess.run([*cmd, *PIP_TARGET, "-d", str(folder), *pins])
    if proc.returncode != 0:
        return proc.returncode
    keep = {(canonicalize_name(n), v) for n, v in versions.items()}
    for wheel in folder.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if (name, str(version)) not in keep:
            wheel.unlink()
    wheels = sorted(folder.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB, in {folder}: carry it to the GPU")
    return 0 if len(wheels) == len(WHEELS) else 1
