from __future__ import annotations

import openai
import pytest

from folio import LLM
from tests.api.server_runner import MODEL, running_server


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf):
    return LLM(smollm2_gguf, kv_cache_memory="256MiB")


@pytest.fixture(scope="session")
def served(smollm2_llm):
    """One server for the API tests that need no special options."""
    with running_server(smollm2_llm, MODEL) as (url, server):
        yield url, server
    pool = smollm2_llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks  # nothing left holding KV


@pytest.fixture(scope="session")
def base_url(served):
    return served[0]


@pytest.fixture(scope="session")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
