"""The public-API fuzz test (tests/test_fuzz.py) with many more cases: each random case either
raises a clear ValueError before compiling or decodes right (lengths, vocabulary, greedy equal to
autoregressive decoding). Prints hypothesis's statistics; exits non-zero on the first case that
breaks the rule (hypothesis then shows it, shrunk).

    .venv/bin/python experiments/fuzz_api.py [--examples 1000]
"""

import argparse
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=1000)
    args = ap.parse_args()
    env = dict(os.environ, FUZZ_EXAMPLES=str(args.examples))
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(ROOT / "tests" / "test_fuzz.py"), "--hypothesis-show-statistics"],
                           env=env, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
