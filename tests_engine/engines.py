"""vLLM engines the tests drive, each a process tree of its own, and what they record.

* :class:`Engine`: ``engine_process.py`` (``vllm.LLM`` as the frontend, commands on stdin).
* :class:`Server`: vLLM's OpenAI-compatible API server (``vllm serve``) as the frontend.

Either starts the frontend in a new session, which the engine core and the workers it starts
join, so that a test can end exactly that tree.  Logs go to a file; an engine that fails
shows their end.  Every process records the caches it built (``probe.py``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import probe

HERE = Path(__file__).resolve().parent

START_DEADLINE_S = 1800
"""Only stops a hung start: several engineers' jobs share this machine's two cores."""
COMMAND_DEADLINE_S = 600
EXIT_DEADLINE_S = 300

Prompt = dict[str, Any]


class EngineError(RuntimeError):
    """The engine failed, hung or answered an error; the message ends with its logs."""


class ProcessTree:
    """A vLLM frontend started as ``argv`` with mmcache's plugin on (``MMCACHE_VLLM=1``) or
    off, in ``directory``.  Leaving its ``with`` block kills what is left of the tree."""

    def __init__(
        self,
        directory: Path,
        argv: list[str],
        *,
        mmcache: bool,
        probe_path: Path,
        stdin: int | None = None,
        stdout: int | IO[Any] | None = None,
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
            # A connection a test keeps open stays with its API server between requests.
            VLLM_HTTP_TIMEOUT_KEEP_ALIVE=str(COMMAND_DEADLINE_S),
            HF_HUB_OFFLINE="1",
            HF_HOME=str(directory / "hf-home"),
        )
        env[probe.PROBE_DIR_ENV] = str(self.records_dir)
        if mmcache:
            env["MMCACHE_VLLM"] = "1"
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                argv,
                stdin=stdin,
                stdout=log if stdout is None else stdout,
                stderr=log,
                env=env,
                text=True,
                start_new_session=True,
            )

    def __enter__(self) -> ProcessTree:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()

    def fail(self, what: str) -> EngineError:
        tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-80:])
        return EngineError(f"{what}\n--- the end of {self.log_path} ---\n{tail}")

    def records(self) -> list[dict[str, Any]]:
        return probe.read_records(self.records_dir)

    def exited(self) -> bool:
        """Whether the frontend exited, leaving it unreaped (so its pid, which names the
        process group, cannot be reused)."""
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PID, self.process.pid, flags) is not None

    def wait_exit(self) -> int:
        """The frontend's exit status once it exits (the tree is killed if it hangs)."""
        deadline = time.monotonic() + EXIT_DEADLINE_S
        while not self.exited() and time.monotonic() < deadline:
            time.sleep(0.1)
        exited = self.exited()
        self.kill()
        if not exited:
            raise self.fail("the engine did not exit")
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL what is left of the process tree (its process group), then reap the
        frontend.  Once reaped, its pid could name another group: nothing is killed."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        if self.process.stdin is not None:
            # What it flushes, nobody reads any more.
            with contextlib.suppress(BrokenPipeError):
                self.process.stdin.close()


class Engine(ProcessTree):
    """One ``vllm.LLM(**llm)`` run by ``engine_process.py``."""

    def __init__(
        self, directory: Path, llm: dict[str, Any], *, mmcache: bool, probe_path: Path
    ) -> None:
        argv = [sys.executable, str(HERE / "engine_process.py"), json.dumps({"llm": llm})]
        super().__init__(
            directory,
            argv,
            mmcache=mmcache,
            probe_path=probe_path,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
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

    def _read_replies(self) -> None:
        assert self.process.stdout is not None
        with self.process.stdout:  # closed at its end: the whole tree is gone
            for line in self.process.stdout:
                self._replies.put(line)
        self._replies.put(None)

    def _reply(self, deadline_s: float) -> dict[str, Any]:
        try:
            line = self._replies.get(timeout=deadline_s)
        except queue.Empty:
            raise self.fail(f"no answer from the engine in {deadline_s} s") from None
        if line is None:
            raise self.fail("the engine closed its output (it exited)")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise self.fail(f"the engine answered an error:\n{reply['error']}")
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

    def exit(self) -> int:
        """Ask the engine to exit; its exit status (the tree is killed if it hangs)."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        return self.wait_exit()


def cli_args(llm: dict[str, Any]) -> list[str]:
    """``vllm serve``'s flags for ``LLM`` arguments (a flag ``False`` is left at its
    default, off)."""
    args = []
    for key, value in llm.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False:
            args += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server(ProcessTree):
    """vLLM's OpenAI-compatible API server for ``model`` with ``args`` (``vllm serve``'s
    flags) on a free loopback port, ready to answer.

    It runs as ``python serve_cli.py serve``: vLLM's own ``vllm`` command, which vllm-cpu
    0.32.0's cannot run as it is (``serve_cli.py`` says why).  With ``--api-server-count N``
    among ``args`` it is ready when one of them is.
    """

    def __init__(
        self, directory: Path, model: str, args: list[str], *, mmcache: bool, probe_path: Path
    ) -> None:
        self.model = model
        self.port = _free_port()
        argv = [sys.executable, str(HERE / "serve_cli.py"), "serve", model]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        super().__init__(directory, argv, mmcache=mmcache, probe_path=probe_path)
        deadline = time.monotonic() + START_DEADLINE_S
        while not self._healthy():
            if self.exited() or time.monotonic() > deadline:
                self.kill()
                raise self.fail("the server did not start")
            time.sleep(1)

    def __enter__(self) -> Server:
        return self

    def _healthy(self) -> bool:
        try:
            with self.connect(timeout=5) as connection:
                return connection.get("/health") == 200
        except (ConnectionError, TimeoutError, http.client.HTTPException):
            return False

    def connect(self, *, timeout: float = COMMAND_DEADLINE_S) -> Connection:
        """A connection of its own (HTTP/1.1 keep-alive: one API server answers all its
        requests); use it in a ``with`` block."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        return Connection(self, connection)

    def chat(self, content: list[dict[str, Any]], max_tokens: int) -> list[int]:
        """The greedy token ids of one user message of ``content`` parts (OpenAI's), on a
        connection of its own."""
        with self.connect() as connection:
            return connection.chat(content, max_tokens)

    def frontend_stats(self) -> dict[int, dict[str, int]]:
        """Each API server's cache statistics, by pid (``probe.read_stats``)."""
        return probe.read_stats(self.records_dir)

    def stop(self) -> int:
        """Ctrl-C (SIGINT) to the server; its exit status (the tree is killed if it hangs)."""
        self.process.send_signal(signal.SIGINT)
        return self.wait_exit()


class Connection:
    """One HTTP connection to a :class:`Server`, kept open between requests."""

    def __init__(self, server: Server, connection: http.client.HTTPConnection) -> None:
        self._server = server
        self._connection = connection

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._connection.close()

    def get(self, path: str) -> int:
        """The status of ``GET path``."""
        self._connection.request("GET", path)
        with self._connection.getresponse() as response:
            response.read()
            return response.status

    def chat(self, content: list[dict[str, Any]], max_tokens: int) -> list[int]:
        """The greedy token ids of one user message of ``content`` parts (OpenAI's)."""
        body = {
            "model": self._server.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        self._connection.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with self._connection.getresponse() as response:
            payload = response.read()
            if response.status != 200:
                raise self._server.fail(f"the server answered {response.status}: {payload!r}")
        token_ids: list[int] = json.loads(payload)["choices"][0]["token_ids"]
        return token_ids
