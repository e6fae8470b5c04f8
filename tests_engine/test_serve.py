"""mmcache's plugin under vLLM's API server (``vllm serve``): images as data URLs in OpenAI
chat requests.

The API server is the frontend here (its own renderer, media decoding and chat template);
its tokens must be those ``vllm.LLM`` without a cache gives for the same prompt text and
pixels (the tiny LLaVA's chat template renders the prompt ``LLM`` is given).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engines import Server
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


def cli_args(llm: dict[str, Any]) -> list[str]:
    """``vllm serve``'s flags for ``LLM`` arguments."""
    args = []
    for key, value in llm.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        else:
            args += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return args


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
    check_every_process_built(served.records, "shm", 1, served.frontend_pid)


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
