"""Store micro-benchmarks (put, get copy / zero-copy, lookup; 4 KiB..16 MiB; 1-4 reader
processes), each also as a multiple of a numpy memcpy measured in the same run.

The same code backs ``mmcache bench``; this script exists so ``benches/`` runs on its own:

    python benches/bench_store.py [--quick] [--json PATH]
"""

import sys

from mmcache.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
