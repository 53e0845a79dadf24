"""``python -m tests.mutations``: run the negative controls' mutants and print a table.

Exit status 0 when every mutant run was killed; 1 when any survived, went stale or could
not be judged (a test failing unmutated, nothing run, a timeout); 2 for bad options.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

from tests.mutations.runner import KILLED, MutantResult, Runner, describe_tests, stale_reason
from tests.mutations.table import KINDS, MUTANTS, Mutant

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.mutations",
        description="Break, in a temporary copy of the tree, the code each claimed negative control guards, "
        "and check that the tests named for it fail. The working tree is never modified.",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="list the mutants and whether each one's original text still occurs exactly once "
        "(exit 1 if any is stale); run nothing",
    )
    parser.add_argument("--only", default="", metavar="NAME[,NAME]", help="run only these mutants")
    parser.add_argument(
        "--kind",
        default=",".join(KINDS),
        metavar="KIND[,KIND]",
        help=f"run only mutants of these kinds ({', '.join(KINDS)}; default: all; e2e ones start "
        "servers and take minutes each)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds per pytest run (default by kind: unit 600, kernel 900, e2e 2400)",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip running each mutant's tests on the unmutated copy first (a kill then proves less)",
    )
    parser.add_argument("--keep", action="store_true", help="keep each mutant's copy and print where")
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter that runs the tests (default: this one, i.e. the project's venv)",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")
    return parser.parse_args(argv)


def usage_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def select(args: argparse.Namespace) -> list[Mutant]:
    kinds = {k.strip() for k in args.kind.split(",") if k.strip()}
    unknown_kinds = kinds - set(KINDS)
    if unknown_kinds:
        usage_error(f"unknown kind(s) {', '.join(sorted(unknown_kinds))}; known: {', '.join(KINDS)}")
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    known = {m.name for m in MUTANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        usage_error(f"unknown mutant(s) {', '.join(unknown)}; see --list")
    return [m for m in MUTANTS if m.kind in kinds and (not names or m.name in names)]


def list_mutants(mutants: Sequence[Mutant]) -> int:
    stale = 0
    for m in mutants:
        reason = stale_reason(m, REPO)
        stale += reason is not None
        print(f"{m.name:<48} {m.kind:<6} {'STALE: ' + reason if reason else 'ok'}")
        print(f"    {m.file}: {m.breaks}")
        print(f"    tests: {describe_tests(m)}")
        print(f"    claim: {m.claim}")
    print(f"{len(mutants)} mutants, {stale} stale")
    return 1 if stale else 0


def print_table(results: Sequence[MutantResult]) -> None:
    width = max([len(r.name) for r in results] + [6])
    print(f"{'mutant':<{width}}  {'kind':<6}  {'result':<15}  {'seconds':>7}  tests")
    for r in results:
        print(f"{r.name:<{width}}  {r.kind:<6}  {r.status:<15}  {r.seconds:7.1f}  {r.tests}")
    for r in results:
        if r.detail:
            first, *rest = r.detail.strip().splitlines()
            print(f"\n{r.name}: {first}")
            if r.status != KILLED:
                for line in rest:
                    print(f"    {line}")
    killed = sum(r.status == KILLED for r in results)
    print(
        f"\n{killed} of {len(results)} killed"
        + (
            ""
            if killed == len(results)
            else f"; not killed: {', '.join(r.name + ' (' + r.status + ')' for r in results if r.status != KILLED)}"
        )
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    mutants = select(args)
    if args.list:
        return list_mutants(mutants)
    if not mutants:
        print("no mutant selected", file=sys.stderr)
        return 2
    runner = Runner(REPO, args.python, baseline=not args.no_baseline, timeout_s=args.timeout, keep_copies=args.keep)
    results = []
    for mutant in mutants:
        print(f"[{len(results) + 1}/{len(mutants)}] {mutant.name} ({mutant.kind}) ...", flush=True)
        result = runner.run(mutant)
        print(f"    {result.status} in {result.seconds:.1f} s", flush=True)
        results.append(result)
    print()
    print_table(results)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
