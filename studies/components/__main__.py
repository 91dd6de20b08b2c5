"""python -m studies.components: the component study (see studies/components/__init__.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from errors import ExitCode, MissingError, ProjectError

from . import REPO
from .report import read_results, write_report
from .study import DEFAULT_STEPS, run_study


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies.components",
                                 description="The component study: what each part of the NVFP4 "
                                             "recipe fixes, measured on the demo model's tensors.")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="BF16 training steps")
    ap.add_argument("--batches", type=int, default=6,
                    help="captured steps (batches) per capture point (3 points)")
    ap.add_argument("--model-batches", type=int, default=6,
                    help="of those, how many also get the variant and layer-scan passes")
    ap.add_argument("--sr-steps", type=int, default=8, help="optimizer steps per SR run (0: skip)")
    ap.add_argument("--sr-seeds", type=int, default=8, help="SR seeds in the optimizer-step runs")
    ap.add_argument("--seed", type=int, default=1234, help="the BF16 run's trainer.seed")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="docs/components")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild README.md and the plots from <out>/results.json")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    os.chdir(REPO)
    out = Path(args.out)
    try:
        if args.report_only:
            if not (out / "results.json").is_file():
                raise MissingError(f"--out {out}: no results.json to rebuild the report from")
            results = read_results(out)
        else:
            results = run_study(args)
    except ProjectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    write_report(results, out)
    print(f"report: {out}/README.md, rht.png, sr.png, weight2d.png, layers.png, formats.png, "
          f"results.json")
    return ExitCode.OK


if __name__ == "__main__":
    from compat import quiet_cpu_fallback_warnings

    quiet_cpu_fallback_warnings()
    sys.exit(main())
