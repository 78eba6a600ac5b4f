"""Whether a batch queue can ever run the jobs a ``%monarch scale`` asks for: dask-jobqueue's
SLURMCluster asks Slurm for one job per ``processes`` ranks, and ranks run until the cluster
goes down, so jobs past what the partition holds at once pend for ever (``scale 64`` on a
partition of 2 CPUs used to wait out ``--wait``, 600 s, then name the pending jobs). Refused
before any job is submitted, in one line: what the jobs need against what ``scontrol show
partition`` says the partition has. Other queues, or a Slurm that does not answer, are not
checked here (their jobs' states are named when ``--wait`` runs out)."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

SCONTROL_TIMEOUT = 10.0  # seconds; a Slurm that does not answer is not waited for longer
MiB = 2**20


def check(cluster: Any, n: int) -> None:
    """Refuse (ValueError, one line) ``n`` ranks where ``cluster`` is a SLURMCluster whose
    partition cannot run the jobs for them at once, by its CPUs or its memory."""
    if not any(c.__name__ == "SLURMCluster" for c in type(cluster).__mro__):
        return
    job = _job(cluster)
    partition = _partition(job["partition"])
    if partition is None:
        return
    per_job = max(int(getattr(cluster._dummy_job, "worker_processes", 1) or 1), 1)
    jobs = -(-n // per_job)
    fits = [(partition["cpus"] // job["cpus"], f"{job['cpus']} CPU{_s(job['cpus'])}")]
    if job["memory"] and partition["memory"]:
        fits.append((partition["memory"] // job["memory"], f"{_mib(job['memory'])}"))
    most = min(jobs_fit for jobs_fit, _ in fits)
    if jobs <= most:
        return
    each = " and ".join(what for _, what in fits)
    has = f"{partition['cpus']} CPUs" + (
        f" and {_mib(partition['memory'])}" if len(fits) > 1 else ""
    )
    name = partition["name"]
    raise ValueError(
        f"scale {n} is more than Slurm partition {name} can run at once: {jobs} jobs of "
        f"{each} each, and it has {has} in all (scontrol show partition {name}); their jobs "
        f"would wait for ever; scale to {most * per_job} at most, or use a larger partition"
    )


def _job(cluster: Any) -> dict[str, Any]:
    """The partition (None: the default one), CPUs and memory (bytes) of one of the
    cluster's jobs, from its ``#SBATCH`` header."""
    header = getattr(cluster, "job_header", "") or ""
    lines = [line[len("#SBATCH") :] for line in header.splitlines() if line.startswith("#SBATCH")]
    options = " ".join(lines)
    partition = _option(options, "-p", "--partition")
    tasks = int(_option(options, "-n", "--ntasks") or 1)
    cpus = int(_option(options, "-c", "--cpus-per-task") or 1)
    memory = _bytes(_option(options, None, "--mem") or "")
    return {"partition": partition, "cpus": tasks * cpus, "memory": memory}


def _option(options: str, short: str | None, long: str) -> str | None:
    names = [re.escape(long) + "[= ]"] + ([re.escape(short) + " ?"] if short else [])
    found = re.search(rf"(?:^|\s)(?:{'|'.join(names)})(\S+)", options)
    return found.group(1) if found else None


def _partition(name: str | None) -> dict[str, Any] | None:
    """``scontrol show partition``'s name, CPUs and memory (bytes) of ``name`` (None: the
    default partition), or None where Slurm does not say."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    argv = [scontrol, "show", "partition", "--oneliner", *([name] if name else [])]
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if name is None and fields.get("Default") != "YES":
            continue
        try:
            cpus = int(fields["TotalCPUs"])
        except (KeyError, ValueError):
            return None
        tres = dict(t.split("=", 1) for t in fields.get("TRES", "").split(",") if "=" in t)
        memory = _bytes(tres.get("mem", ""))
        return {"name": fields.get("PartitionName"), "cpus": cpus, "memory": memory}
    return None


def _bytes(text: str) -> int | None:
    """Slurm's memory sizes (``954M``, ``24105M``, ``2G``; megabytes without a unit)."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)B?", text.strip().upper())
    if not found:
        return None
    scale = {"K": 2**10, "M": MiB, "": MiB, "G": 2**30, "T": 2**40}[found.group(2)]
    return int(float(found.group(1)) * scale)


def _mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / MiB:.0f} MiB"


def _s(n: int) -> str:
    return "" if n == 1 else "s"
