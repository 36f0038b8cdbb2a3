"""Embeddings of a split model equal the single process's: the final hidden states are whole on a
tensor-parallel rank (after the last all-reduce), on the last pipeline stage (its result goes back to
rank 0), and gathered from the ranks that computed each row under context parallelism; mean pooling's
running sum spans chunked-prefill steps on whichever rank pools."""

from __future__ import annotations

import numpy as np
import pytest

from folio import LLM

TOLERANCE = 1e-5
PROMPTS = [[(5 * j) % 300 + 1 for j in range(41)], [4, 4, 8, 15, 16, 23, 42], [250]]


@pytest.fixture(scope="module")
def reference(tiny_folders) -> dict[str, list[list[float]]]:
    llm = LLM(tiny_folders["llama"], num_kv_blocks=64, max_num_batched_tokens=8)
    return {method: [o.embedding for o in llm.embed(PROMPTS, pooling=method, use_tqdm=False)]
            for method in ("last", "mean")}  # fmt: skip


@pytest.mark.parametrize(
    "split",
    [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"context_parallel_size": 2}],
    ids=["tp2", "pp2", "cp2"],
)
def test_split_embeddings_match_one_process(tiny_folders, reference, split):
    llm = LLM(tiny_folders["llama"], num_kv_blocks=64, max_num_batched_tokens=8, **split)
    try:
        for method, expected in reference.items():
            got = [o.embedding for o in llm.embed(PROMPTS, pooling=method, use_tqdm=False)]
            for a, b in zip(got, expected, strict=True):
                np.testing.assert_allclose(np.array(a), np.array(b), atol=TOLERANCE, rtol=0)
    finally:
        llm.close()
