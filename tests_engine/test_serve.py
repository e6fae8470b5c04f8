"""mmcache's plugin under vLLM's API server (``vllm serve``): images as data URLs in OpenAI
chat requests.

The API server is the frontend here (its own renderer, media decoding and chat template);
its tokens must be those ``vllm.LLM`` without a cache gives for the same prompt text and
pixels (the tiny LLaVA's chat template renders the prompt ``LLM`` is given).  With
``--api-server-count 2``, two API servers share one ring: what one put is a hit of the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engines import START_DEADLINE_S, Connection, Server, cli_args
from workloads import (
    MAX_TOKENS,
    MODELS,
    A,
    B,
    check_every_process_built,
    image_data_url,
    mode_args,
)

import mmcache


@dataclasses.dataclass
class Served:
    tokens: list[list[int]]
    """Image A, image A again (a hit), image B."""
    records: list[dict[str, Any]]
    frontend_pid: int
    ring_name: str
    ring: dict[str, Any]
    exit_status: int


@pytest.fixture(scope="module")
def served(
    start_server: Callable[..., Server],
    model_dir: Callable[[str], Path],
    expected_tokens: Callable[[str], list[list[list[int]]]],
) -> Served:
    expected_tokens("llava")  # its engine runs first: one engine at a time
    model = MODELS["llava"]
    args = cli_args({**model.llm, **mode_args(model, "shm")})
    with start_server(str(model_dir("llava")), args, mmcache=True) as server:
        tokens = [
            server.chat(
                [
                    {"type": "image_url", "image_url": {"url": image_data_url(image)}},
                    {"type": "text", "text": "w17 w23"},
                ],
                MAX_TOKENS,
            )
            for image in (A, A, B)
        ]
        records = server.records()
        (ring_name,) = [r["ring"] for r in records if r["role"] == "frontend"]
        ring = mmcache.inspect(ring_name)
        exit_status = server.stop()
    return Served(tokens, records, server.process.pid, ring_name, ring, exit_status)


def test_served_tokens_are_those_of_vllm_without_a_cache(
    served: Served, expected_tokens: Callable[[str], list[list[list[int]]]]
) -> None:
    """The first round's first two prompts are image A's and image B's."""
    first_round = expected_tokens("llava")[0]
    assert served.tokens == [first_round[0], first_round[0], first_round[1]]


def test_every_process_built_mmcaches_cache(served: Served) -> None:
    check_every_process_built(served.records, "shm", 1, [served.frontend_pid])


def test_the_ring(served: Served) -> None:
    """Image A's second request was a hit; the worker read every handle it was given."""
    ring = served.ring
    assert ring["puts"] > 0 and ring["hits"] > 0
    workers = [r["pid"] for r in served.records if r["role"] == "worker"]
    assert [reader["pid"] for reader in ring["readers"]] == workers
    assert [reader["outstanding"] for reader in ring["readers"]] == [0]


def test_a_stopped_server_leaves_nothing(served: Served) -> None:
    """Ctrl-C: the server exits 0 and its ring is gone."""
    assert served.exit_status == 0
    assert not (Path("/dev/shm") / served.ring_name).exists()


# -- several API servers, one ring ----------------------------------------------------------

API_SERVERS = 2
MAX_CONNECTIONS = 8
"""Connections opened (and kept open) until one reaches the second API server: vLLM's API
servers accept a new connection in the one with the fewest open, so the second nearly always
does."""


@dataclasses.dataclass
class Request:
    image: str
    pid: int
    """The API server that answered it."""
    hit: bool
    """Whether its item was a hit of that server's cache."""
    tokens: list[int]


@dataclasses.dataclass
class ServedByTwo:
    requests: list[Request]
    """Image A on the first API server, then A on the second, B on the second, B on the
    first (and A on each connection that reached the first server again)."""
    records: list[dict[str, Any]]
    launcher_pid: int
    ring_name: str
    ring: dict[str, Any]
    exit_status: int


def content(image: list[int]) -> list[dict[str, Any]]:
    return [
        {"type": "image_url", "image_url": {"url": image_data_url(image)}},
        {"type": "text", "text": "w17 w23"},
    ]


def wait_until_every_api_server_is_up(server: Server) -> None:
    """vLLM clears each API server's cache once it is up, the ring with it: what another
    server put before that would be gone."""
    deadline = time.monotonic() + START_DEADLINE_S
    while not (
        len(stats := server.frontend_stats()) == API_SERVERS
        and all(s["clears"] >= 1 for s in stats.values())
    ):
        if server.exited() or time.monotonic() > deadline:
            raise server.fail(f"not every API server came up: {stats}")
        time.sleep(1)


def send(server: Server, connection: Connection, name: str, image: list[int]) -> Request:
    """One chat request with ``image`` on ``connection``; which server answered it, and
    whether that server's cache had the image."""
    before = server.frontend_stats()
    tokens = connection.chat(content(image), MAX_TOKENS)
    after = server.frontend_stats()
    (pid,) = [pid for pid in after if after[pid]["total"] != before[pid]["total"]]
    assert after[pid]["total"] == before[pid]["total"] + 1
    return Request(name, pid, after[pid]["hits"] > before[pid]["hits"], tokens)


@pytest.fixture(scope="module")
def served_by_two(
    start_server: Callable[..., Server],
    model_dir: Callable[[str], Path],
    expected_tokens: Callable[[str], list[list[list[int]]]],
) -> ServedByTwo:
    expected_tokens("llava")  # its engine runs first: one engine at a time
    model = MODELS["llava"]
    args = cli_args({**model.llm, **mode_args(model, "shm"), "api_server_count": API_SERVERS})
    with start_server(str(model_dir("llava")), args, mmcache=True) as server:
        wait_until_every_api_server_is_up(server)
        with contextlib.ExitStack() as connections:
            first = connections.enter_context(server.connect())
            requests = [send(server, first, "A", A)]
            for _ in range(MAX_CONNECTIONS):
                second = connections.enter_context(server.connect())
                requests.append(send(server, second, "A", A))
                if requests[-1].pid != requests[0].pid:
                    break
            else:
                raise AssertionError(f"{MAX_CONNECTIONS} connections reached one API server")
            requests += [send(server, second, "B", B), send(server, first, "B", B)]
        records = server.records()
        (ring_name,) = {r["ring"] for r in records if r["role"] == "frontend"}
        ring = mmcache.inspect(ring_name)
        exit_status = server.stop()
    return ServedByTwo(requests, records, server.process.pid, ring_name, ring, exit_status)


def test_two_api_servers_give_the_tokens_of_vllm_without_a_cache(
    served_by_two: ServedByTwo, expected_tokens: Callable[[str], list[list[list[int]]]]
) -> None:
    first_round = expected_tokens("llava")[0]
    expected = {"A": first_round[0], "B": first_round[1]}
    assert [r.tokens for r in served_by_two.requests] == [
        expected[r.image] for r in served_by_two.requests
    ]


def test_each_api_server_hits_what_the_other_put(served_by_two: ServedByTwo) -> None:
    """Image A, put by the first server, is a hit of the second, which never processed it;
    image B, put by the second, is a hit of the first."""
    requests = served_by_two.requests
    first, second = requests[0].pid, requests[-3].pid
    assert first != second
    assert [(r.image, r.pid, r.hit) for r in requests[:1] + requests[-3:]] == [
        ("A", first, False),
        ("A", second, True),
        ("B", second, False),
        ("B", first, True),
    ]


def test_every_api_server_built_mmcaches_cache_on_one_ring(served_by_two: ServedByTwo) -> None:
    """Both API servers (not the launcher) built mmcache's sender cache; they, and the
    launcher, are the ring's writers; the worker is its reader."""
    records, ring = served_by_two.records, served_by_two.ring
    api_servers = sorted({r.pid for r in served_by_two.requests})
    check_every_process_built(records, "shm", 1, api_servers)
    assert ring["max_writers"] == API_SERVERS + 1
    writers = sorted(w["pid"] for w in ring["writers"] if w["alive"])
    assert writers == sorted([served_by_two.launcher_pid, *api_servers])
    workers = [r["pid"] for r in records if r["role"] == "worker"]
    assert [reader["pid"] for reader in ring["readers"]] == workers
    assert [reader["outstanding"] for reader in ring["readers"]] == [0]


RING_GONE_DEADLINE_S = 30.0  # a ring still there after this was left for good


def test_two_stopped_api_servers_leave_nothing(served_by_two: ServedByTwo) -> None:
    """Ctrl-C: the launcher exits 0, and the ring is gone with the last writer (an API
    server may finish its close a moment after the launcher exited: the last writer to
    leave unlinks the ring, whichever it is)."""
    assert served_by_two.exit_status == 0
    ring = Path("/dev/shm") / served_by_two.ring_name
    deadline = time.monotonic() + RING_GONE_DEADLINE_S
    while ring.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = None
    with contextlib.suppress(Exception):  # gone meanwhile, or not a ring any more
        left = mmcache.inspect(served_by_two.ring_name)
    assert not ring.exists(), f"the ring was left: {left}"
