"""python -m benchmarks NAME [--out DIR] [--quick] [options]: see benchmarks/README.md."""

from __future__ import annotations

import argparse
import importlib
import sys

from benchmarks.registry import BENCHMARKS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="gla_inductor's benchmarks and tools. `python -m benchmarks NAME --help` lists a "
                    "benchmark's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(f"  {name:13s} {e.summary}" for name, e in BENCHMARKS.items()))
    p.add_argument("name", choices=list(BENCHMARKS), metavar="NAME", help="one of: " + ", ".join(BENCHMARKS))
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        parser().parse_args(argv[:1] or ["--help"])  # prints help, or the choices with an error
        return 0
    name, entry = argv[0], BENCHMARKS[argv[0]]
    module = importlib.import_module(entry.module)
    sub = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("--out", metavar="DIR", help="write STEM.json and STEM.md (and STEM.png) into DIR")
    sub.add_argument("--name", dest="stem", metavar="STEM",
                     help="file name stem of the results (default: DEVICE-DATE-NAME)")
    sub.add_argument("--quick", action="store_true", help="a smoke run: small shapes, few repetitions")
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    result = module.run(args)
    if result is None:
        return 0
    if args.out:
        for path in result.write(args.out, args.stem):
            print(f"wrote {path}", file=sys.stderr)
    print(result.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
