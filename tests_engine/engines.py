"""A vLLM engine the tests drive: ``engine_process.py`` in a child process, and its records.

Each engine is a process tree of its own (the frontend, which is ``engine_process.py``, the
engine core and the workers), started in a new session so that a test that fails can end
exactly that tree.  Its logs go to a file; an engine that fails shows their end.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import probe

HERE = Path(__file__).resolve().parent

START_DEADLINE_S = 900
"""Only stops a hung start: several engineers' jobs share this machine's two cores."""
COMMAND_DEADLINE_S = 600
EXIT_DEADLINE_S = 300

Prompt = dict[str, Any]


class EngineError(RuntimeError):
    """The engine failed, hung or answered an error; the message ends with its logs."""


class Engine:
    """One vLLM engine (``LLM(**llm)``) with mmcache's plugin on (``MMCACHE_VLLM=1``) or off.

    Its processes write what caches they built into ``records`` (see ``probe.py``).  Leaving
    its ``with`` block kills whatever is left of its process tree (nothing, after
    :meth:`exit`).
    """

    def __init__(
        self, directory: Path, llm: dict[str, Any], *, mmcache: bool, probe_path: Path
    ) -> None:
        self.records_dir = directory / "records"
        self.records_dir.mkdir()
        self.log_path = directory / "engine.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MMCACHE_VLLM")}
        env.update(
            PYTHONPATH=os.pathsep.join([str(HERE), str(probe_path)]),
            VLLM_CPU_KVCACHE_SPACE="1",
            # No pinning of each worker's threads to cores of its own: two workers share
            # this machine's cores (and other jobs' processes use them too).
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_CACHE_ROOT=str(directory / "vllm-cache"),
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
            HF_HOME=str(directory / "hf-home"),
        )
        env[probe.PROBE_DIR_ENV] = str(self.records_dir)
        if mmcache:
            env["MMCACHE_VLLM"] = "1"
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(HERE / "engine_process.py"), json.dumps({"llm": llm})],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
                start_new_session=True,
            )
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_replies, daemon=True).start()
        try:
            self._reply(START_DEADLINE_S)
        except EngineError:
            self.kill()
            raise

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()

    def _read_replies(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._replies.put(line)
        self._replies.put(None)

    def _fail(self, what: str) -> EngineError:
        tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-80:])
        return EngineError(f"{what}\n--- the end of {self.log_path} ---\n{tail}")

    def _reply(self, deadline_s: float) -> dict[str, Any]:
        try:
            line = self._replies.get(timeout=deadline_s)
        except queue.Empty:
            raise self._fail(f"no answer from the engine in {deadline_s} s") from None
        if line is None:
            raise self._fail("the engine closed its output (it exited)")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise self._fail(f"the engine answered an error:\n{reply['error']}")
        return reply

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()
        return self._reply(COMMAND_DEADLINE_S)

    def generate(
        self, prompts: list[Prompt], max_tokens: int
    ) -> tuple[list[list[int]], list[str | None]]:
        """Greedy token ids of ``prompts``, all in one ``LLM.generate`` call, and each one's
        finish reason (``"error"``, with no tokens, for a request vLLM failed)."""
        reply = self.ask("generate", prompts=prompts, max_tokens=max_tokens)
        return reply["token_ids"], reply["finish_reasons"]

    def records(self) -> list[dict[str, Any]]:
        return probe.read_records(self.records_dir)

    def exit(self) -> int:
        """Ask the engine to exit; its exit status (the tree is killed if it hangs)."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        deadline = time.monotonic() + EXIT_DEADLINE_S
        while not self._exited() and time.monotonic() < deadline:
            time.sleep(0.1)
        exited = self._exited()
        self.kill()
        if not exited:
            raise self._fail("the engine did not exit")
        return self.process.returncode

    def _exited(self) -> bool:
        """Whether the frontend exited, leaving it unreaped (so its pid, which names the
        process group, cannot be reused)."""
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PID, self.process.pid, flags) is not None

    def kill(self) -> None:
        """SIGKILL what is left of the engine's process tree (its process group), then reap
        the frontend.  Once reaped, its pid could name another group: nothing is killed."""
        if self.process.returncode is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
