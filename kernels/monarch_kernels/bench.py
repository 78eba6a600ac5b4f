# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""Benchmark: dense nn.Linear, the two-bmm pipeline, torch.compile of it, and the fused op.

    python -m monarch_kernels.bench              # GPU when there is one, else a small CPU set
    python -m monarch_kernels.bench --cases 4096:64:16384 --dtypes bfloat16 --json bench.json

Every case is square (in = out = n) with ``blocks`` blocks per factor, ``p = q = r = s = n /
blocks``. For each method the table gives milliseconds, effective GB/s (the Monarch product's
minimal traffic divided by the time) and ``%bound``: the Monarch product's lower-bound time
divided by the measured time. The bound is the larger of the memory floor (minimal traffic at
the bandwidth of a device-to-device copy) and the matrix-unit ceiling (its FLOPs at the rate of
a large dense matmul); the ``bound`` column says which, and the rate measured. Both probes run
interleaved with the methods, in the same rounds, and every time is the fastest of its rounds,
so that load from other processes on a shared machine distorts all of them alike.
Forward+backward moves x, y, dy, dx (and x again): 5 activations; 3x the FLOPs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from .ops import monarch_matmul

PATH_ENV_VAR = "MONARCH_KERNELS_PATH"  # read by triton_launch; importing it would need Triton

GPU_CASES = [(4096, 64, 16384), (4096, 4, 16384), (1024, 32, 16384), (8192, 64, 8192)]
CPU_CASES = [(4096, 64, 1024), (1024, 4, 1024)]


def bmm_pipeline(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Today's public implementation: two bmm calls with permutation copies between them."""
    k, _q, p = w1.shape
    l, s, r = w2.shape
    batch = x.shape[:-1]
    b = x.numel() // x.shape[-1]
    out1 = torch.bmm(x.reshape(b, k, p).transpose(0, 1), w1.transpose(-1, -2))  # (k, B, q)
    out1 = out1.transpose(0, 1).reshape(b, r, l).transpose(-1, -2).contiguous().transpose(0, 1)
    out2 = torch.bmm(out1, w2.transpose(-1, -2))  # (l, B, s)
    return out2.permute(1, 2, 0).reshape(*batch, s * l)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    fns: dict[str, Callable[[], object]], device: torch.device, min_time: float, calls: int = 1
) -> dict[str, float]:
    """Fastest milliseconds per call of each function, calling them in turn for rounds until
    each has had about ``min_time`` seconds.

    Interleaved rounds and the minimum, not the median: on a shared machine other processes
    only ever add time, and they should not favour whichever method ran in a quiet moment.
    A round makes ``calls`` calls back to back between two synchronisations: with 1, the time
    is a call's latency, host-side launch work included; with more, the host queues the next
    call while the device runs this one, as in a training loop, and the time approaches the
    device's.
    """
    best = dict.fromkeys(fns, float("inf"))
    spent = 0.0
    rounds = 0
    while rounds < 5 or (spent < min_time * len(fns) and rounds < 200):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            elapsed = time.perf_counter() - start
            spent += elapsed
            best[name] = min(best[name], elapsed / calls)
        rounds += 1
    return {name: 1e3 * t for name, t in best.items()}


def _probes(device: torch.device, dtype: torch.dtype) -> tuple[dict, dict]:
    """The memory floor's and the matrix-unit ceiling's probes: calls and their work.

    A device-to-device copy (bytes read + written) and a large dense matmul (FLOPs). They run
    interleaved with the methods, so that all of them see the same machine.
    """
    gpu = device.type == "cuda"
    src = torch.empty((1 << 28) if gpu else (1 << 26), device=device).uniform_()
    dst = torch.empty_like(src)
    m = 8192 if gpu else 2048
    a = torch.randn(m, m, device=device, dtype=dtype)
    b = torch.randn(m, m, device=device, dtype=dtype)
    calls = {("probe", "copy"): lambda: dst.copy_(src), ("probe", "matmul"): lambda: a @ b}
    work = {("probe", "copy"): 2 * src.numel() * src.element_size(), ("probe", "matmul"): 2 * m**3}
    return calls, work


FORCED_PATHS = ("three_kernel", "blas")  # triton_launch.PATHS (importing it needs Triton)


def _methods(n: int, blocks: int, device, dtype, use_compile: bool, paths=FORCED_PATHS):
    bs = n // blocks
    w1 = torch.randn(blocks, bs, bs, device=device, dtype=dtype) / bs**0.5
    w2 = torch.randn(blocks, bs, bs, device=device, dtype=dtype) / bs**0.5
    dense = nn.Linear(n, n, bias=False, device=device, dtype=dtype)
    params = {"dense": [dense.weight], "bmm": [w1, w2], "compiled": [w1, w2], "fused": [w1, w2]}
    fns = {
        "dense nn.Linear": ("dense", dense),
        "bmm pipeline": ("bmm", lambda x: bmm_pipeline(x, w1, w2)),
        "fused op": ("fused", lambda x: monarch_matmul(x, w1, w2)),
    }
    if use_compile:
        compiled = torch.compile(bmm_pipeline, fullgraph=True, dynamic=False)
        fns["compile(bmm)"] = ("compiled", lambda x: compiled(x, w1, w2))
    fns = {name: (group, fn, contextlib.nullcontext) for name, (group, fn) in fns.items()}
    if device.type == "cuda":
        # each of the op's paths forced (forward and backward), to see what the op chose from
        for path in paths:
            fns[f"op, {path} path"] = (
                "fused",
                lambda x: monarch_matmul(x, w1, w2),
                lambda path=path: _forced_path(path),
            )
    return fns, params


@contextlib.contextmanager
def _forced_path(path: str):
    old = os.environ.get(PATH_ENV_VAR)
    os.environ[PATH_ENV_VAR] = path
    try:
        yield
    finally:
        if old is None:
            del os.environ[PATH_ENV_VAR]
        else:
            os.environ[PATH_ENV_VAR] = old


def run_case(
    n,
    blocks,
    batch,
    dtype,
    device,
    use_compile,
    min_time,
    calls=1,
    paths=FORCED_PATHS,
    errors: dict[str, str] | None = None,
):
    """Rows of the table for one (n, blocks, batch, dtype); a method that failed has "-" in
    its cells, and its error's first line in ``errors`` (keyed "n:blocks:batch dtype method")."""
    elt = torch.empty((), dtype=dtype).element_size()
    flops = 2 * batch * 2 * n * (n // blocks)  # two stages of block-diagonal products
    weights = 2 * n * (n // blocks) * elt
    traffic = {"fwd": 2 * batch * n * elt + weights, "f+b": 5 * batch * n * elt + 3 * weights}
    flop = {"fwd": flops, "f+b": 3 * flops}
    x = torch.randn(batch, n, device=device, dtype=dtype)
    dy = torch.randn(batch, n, device=device, dtype=dtype)
    fns, params = _methods(n, blocks, device, dtype, use_compile, paths)
    fns_by_key = {}
    failed = {}  # name -> the error's first line: a row that says so, not a lost table
    for name, (group, fn, ctx) in fns.items():
        ps = params[group]

        def fwd(fn=fn, ctx=ctx):
            with torch.no_grad(), ctx():
                return fn(x)

        def fwd_bwd(fn=fn, ps=ps, ctx=ctx):
            xg = x.detach().requires_grad_()
            for p in ps:
                p.grad = None
            with ctx():
                fn(xg).backward(dy)

        for p in ps:
            p.requires_grad_(True)
        try:
            fwd()  # warm-up: allocation, autotuning, compilation
            fwd_bwd()
        except Exception as err:  # any failure becomes its row; the other methods still run
            failed[name] = _first_line(err)
            continue
        fns_by_key[(name, "fwd")] = fwd
        fns_by_key[(name, "f+b")] = fwd_bwd
    names = list(fns)
    if device.type == "cuda" and "fused op" not in failed:
        # the op with the host's launch work taken away, as CUDA graphs (torch.compile's
        # mode="reduce-overhead", or a graphed training step) take it away
        name = "fused op, CUDA graph"
        names.insert(names.index("fused op") + 1, name)
        try:
            for key in ("fwd", "f+b"):
                fns_by_key[(name, key)] = _graphed(fns_by_key[("fused op", key)])
        except Exception as err:  # any failure becomes its row
            failed[name] = _first_line(err)
    probes, work = _probes(device, dtype)
    for fn in probes.values():
        fn()
    ms = time_interleaved({**probes, **fns_by_key}, device, min_time, calls)
    bw = work["probe", "copy"] / (ms["probe", "copy"] * 1e-3)
    rate = work["probe", "matmul"] / (ms["probe", "matmul"] * 1e-3)
    bound_s = {key: max(traffic[key] / bw, flop[key] / rate) for key in ("fwd", "f+b")}
    if traffic["fwd"] / bw >= flops / rate:
        kind = f"memory {bw / 1e9:.0f} GB/s"
    else:
        kind = f"matmul {rate / 1e12:.2f} TF/s"
    rows = []
    for name in names:
        if name in failed:
            rows.append([f"{n}", f"{blocks}", f"{batch}", str(dtype)[6:], kind, name] + ["-"] * 8)
            print(f"{name} ({n}:{blocks}:{batch} {str(dtype)[6:]}) failed: {failed[name]}")
            if errors is not None:
                errors[f"{n}:{blocks}:{batch} {str(dtype)[6:]} {name}"] = failed[name]
            continue
        rows.append(
            [f"{n}", f"{blocks}", f"{batch}", str(dtype).replace("torch.", ""), kind, name]
            + [
                v
                for key in ("fwd", "f+b")
                for v in (
                    f"{ms[name, key]:.3f}",
                    f"{traffic[key] / (ms[name, key] * 1e-3) / 1e9:.1f}",
                    f"{100 * bound_s[key] / (ms[name, key] * 1e-3):.1f}",
                    f"{ms['dense nn.Linear', key] / ms[name, key]:.2f}x",
                )
            ]
        )
    return rows


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once as a CUDA graph (after warm-up on a side stream); returns its
    replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


HEADER = ["n", "blocks", "batch", "dtype", "bound", "method"] + [
    f"{key} {col}" for key in ("fwd", "f+b") for col in ("ms", "GB/s", "%bound", "vs dense")
]


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(HEADER, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join([line, sep, *body])


def records(rows: list[list[str]], errors: dict[str, str]) -> list[dict]:
    """The table's rows as dicts keyed by HEADER, numbers as numbers ("3.34x" -> 3.34; a failed
    method's cells None, with its ``error``)."""
    out = []
    for row in rows:
        rec: dict = {}
        for key, cell in zip(HEADER, row, strict=True):
            if key in ("n", "blocks", "batch"):
                rec[key] = int(cell)
            elif key in ("dtype", "bound", "method"):
                rec[key] = cell
            else:
                rec[key] = None if cell == "-" else float(cell.rstrip("x"))
        error = errors.get(f"{row[0]}:{row[1]}:{row[2]} {row[3]} {row[5]}")
        if error is not None:
            rec["error"] = error
        out.append(rec)
    return out


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", help="comma-separated n:blocks:batch (default: per device)")
    parser.add_argument("--dtypes", help="comma-separated, e.g. bfloat16,float16")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile(bmm)")
    parser.add_argument("--min-time", type=float, default=None, help="seconds per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--calls",
        type=int,
        default=None,
        help="calls back to back per timed round: 1 times each call's latency (launch work "
        "included), more lets the host run ahead as in training (default 10 on a GPU, 1 on CPU)",
    )
    parser.add_argument(
        "--paths",
        default=",".join(FORCED_PATHS),
        help="comma-separated paths of the op to force, a row each (GPU; empty for none)",
    )
    parser.add_argument(
        "--json",
        metavar="FILE",
        help="also write the rows, the device and the paths chosen (rewritten after each case)",
    )
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(paths) - set(FORCED_PATHS))
    if unknown:
        parser.error(f"--paths: unknown {', '.join(unknown)}; choose from {FORCED_PATHS}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    cases = (
        [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
        if args.cases
        else (GPU_CASES if gpu else CPU_CASES)
    )
    dtypes = [
        getattr(torch, d)
        for d in (args.dtypes or ("bfloat16,float16" if gpu else "float32")).split(",")
    ]
    min_time = args.min_time if args.min_time is not None else (0.2 if gpu else 0.5)
    calls = args.calls if args.calls is not None else (10 if gpu else 1)
    if calls < 1:
        parser.error("--calls must be at least 1")
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if gpu else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; torch {torch.__version__}")
    print(
        "bound: the memory floor (copy bandwidth) or matmul ceiling measured with each case; "
        f"%bound = bound time / time; {calls} call(s) back to back per timed round"
    )
    report = {"device": name, "torch": torch.__version__, "triton": _triton_version()}
    report |= {"calls": calls, "min_time": min_time, "complete": False}
    rows: list[list[str]] = []
    errors: dict[str, str] = {}
    for dtype in dtypes:
        for n, blocks, batch in cases:
            rows += run_case(
                n,
                blocks,
                batch,
                dtype,
                device,
                not args.no_compile,
                min_time,
                calls,
                paths,
                errors,
            )
            if args.json:  # after every case: a run stopped part-way keeps what it measured
                _write_json(args.json, report | {"rows": records(rows, errors)})
    print()
    print(format_table(rows))
    chosen: list[str] = []
    if gpu:
        from .triton_launch import chosen_paths

        chosen = sorted(
            f"{key[0]}, batch <= {key[1]}, "
            f"{' '.join('x'.join(map(str, t[0])) for t in key[2:-2] if t is not None)}, "
            f"{str(key[-2])[6:]}: {path}"
            for key, path in chosen_paths().items()
        )
        print("\nfused op, the paths it chose:\n  " + "\n  ".join(chosen or ["none"]))
    if args.json:
        report |= {"complete": True, "rows": records(rows, errors), "chosen_paths": chosen}
        _write_json(args.json, report)


def _write_json(path: str, report: dict) -> None:
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
