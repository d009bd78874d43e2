"""What the preflight reports: each problem (where, what was found, the fix), and what passed."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Problem", "PreflightError", "PreflightReport", "Checks"]


@dataclass(frozen=True)
class Problem:
    """One thing that keeps the experiment from running: where, what was found, the fix."""

    where: str
    found: str
    fix: str

    def __str__(self) -> str:
        return f"{self.where}: {self.found}" + (f". Fix: {self.fix}" if self.fix else "")


class PreflightError(ValueError):
    """The experiment cannot run as configured; ``problems`` lists every problem found."""

    def __init__(self, problems: list[Problem], seconds: float | None = None):
        self.problems = list(problems)
        self.seconds = seconds
        lines = [f"  {i}. {p}" for i, p in enumerate(self.problems, 1)]
        took = f" (the checks took {seconds:.1f} s)" if seconds is not None else ""
        super().__init__(
            f"preflight found {len(self.problems)} problem(s); nothing was started{took}:\n"
            + "\n".join(lines)
        )


@dataclass
class PreflightReport:
    """What passed (one line per check), notes that are not errors, and the seconds it took."""

    passed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Checks:
    """Collects problems, passed checks and notes while the checks run."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.report = PreflightReport()

    def problem(self, where: str, found: str, fix: str) -> None:
        self.problems.append(Problem(where, found, fix))

    def ok(self, line: str) -> None:
        self.report.passed.append(line)
