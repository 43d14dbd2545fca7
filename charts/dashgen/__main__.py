"""Write (or, with ``--check``, compare) the generated dashboards. Usage, from charts/::

    python -m dashgen [--out slipstream/dashboards] [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dashgen import instance, pools, slo_overview

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "slipstream" / "dashboards"


def render_all() -> dict[str, str]:
    """File name -> JSON text, for every dashboard."""
    rendered = {}
    for module in (slo_overview, instance, pools):
        board = module.build()
        rendered[f"{board['uid']}.json"] = json.dumps(board, indent=2, sort_keys=True) + "\n"
    return rendered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashgen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="dashboards folder")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the checked-in files differ from what would be written")
    args = parser.parse_args(argv)
    rendered = render_all()
    if args.check:
        stale = sorted(name for name, text in rendered.items()
                       if not (args.out / name).is_file() or (args.out / name).read_text() != text)
        extra = sorted(p.name for p in args.out.glob("*.json") if p.name not in rendered)
        for name in stale + extra:
            print(f"dashboard out of date: {args.out / name}", file=sys.stderr)
        if stale or extra:
            print("regenerate with: make dashboards", file=sys.stderr)
        return 1 if stale or extra else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in rendered.items():
        (args.out / name).write_text(text)
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
