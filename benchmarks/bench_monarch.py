"""Monarch kernels benchmark: dense, the bmm pipeline, torch.compile of it, the fused op.

    python benchmarks/bench_monarch.py [--cases 4096:64:16384] [--dtypes bfloat16]

The table and the methodology live in ``monarch_kernels.bench``; this script only runs it.
"""

from monarch_kernels.bench import main

if __name__ == "__main__":
    main()
