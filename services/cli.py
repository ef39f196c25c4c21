"""`flexlb` command line."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexlb", description="FlexLB control plane for LLM inference clusters")
    sub = parser.add_subparsers(dest="command", required=True)
    schema = sub.add_parser("schema", help="print the JSON Schema of every bus message")
    schema.add_argument("--out", help="write to this file instead of stdout")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "schema":
        import json

        from schemas.messages import json_schema

        text = json.dumps(json_schema(), indent=2)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text + "\n")
        else:
            print(text)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
