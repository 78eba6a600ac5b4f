"""The parallelism lessons' bookkeeping in the kernel (notebooks 07 and 08): each strategy's losses
against one process's, the bytes its busiest rank sent, the memory a rank held, its timeline."""

from __future__ import annotations

from monarch_nb.errors import current


class Runs:
    """What each strategy's run left on the ranks, pulled into the kernel by ``compare``."""

    def __init__(self, reference: list[float]):
        self.reference = reference
        self.losses: dict[str, list[float]] = {}
        self.sent: dict[str, float] = {}
        self.memory: dict[str, dict[str, int]] = {}
        self.profiles: dict = {}

    def compare(
        self,
        name: str,
        against: list[float] | None = None,
        memory: str | None = None,
        keep: bool = True,
    ) -> float:
        """Pull the ranks' ``losses`` (``transformer.train``'s, with ``.sent``) and print how far
        they are from the one-process run (ranks without any, such as a pipeline's first stages,
        are skipped); keep them (unless not ``keep``), the most bytes a rank sent a step, and
        ``memory`` (the name of a ``parallel_costs.memory`` dict on the ranks: the largest of
        each); return the largest difference."""
        ctl = current()
        against = self.reference if against is None else against
        pulled = ctl.pull("losses").values()
        runs = [losses for losses in pulled if losses]
        worst = max(abs(a - b) for losses in runs for a, b in zip(losses, against, strict=True))
        print(
            f"{name}: final loss {runs[-1][-1]:.4f}, largest difference from one process "
            f"{worst:.1e}"
        )
        if not keep:
            return worst
        self.losses[name] = list(runs[-1])
        self.sent[name] = max(losses.sent for losses in pulled)
        if memory:
            held = list(ctl.pull(memory).values())
            self.memory[name] = {k: max(h[k] for h in held) for k in held[0]}
        return worst

    def keep_profile(self, name: str):
        """The last profiled cell's timeline and numbers (``%%monarch --profile``), as
        ``name``'s; returns its rows (one a rank: step_ms, compute_ms, comm_ms, idle_ms,
        overlap)."""
        self.profiles[name] = current().last_profile
        return self.profiles[name].analysis.numbers.rows

    def table(self):
        """Print each profiled strategy's step and its shares: the mean over the ranks."""
        print(f"{'strategy':>11}  {'step ms':>7}  compute  communication  idle  overlap")
        for name, profile in self.profiles.items():
            rows = profile.analysis.numbers.rows
            step = sum(r["step_ms"] for r in rows) / len(rows)
            share = {
                k: sum(r[k] for r in rows) / len(rows) / step
                for k in ("compute_ms", "comm_ms", "idle_ms")
            }
            overlap = sum(r["overlap"] for r in rows) / len(rows)
            print(
                f"{name:>11}  {step:7.1f}  {share['compute_ms']:7.0%}  "
                f"{share['comm_ms']:13.0%}  {share['idle_ms']:4.0%}  {overlap:7.0%}"
            )


def kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"
