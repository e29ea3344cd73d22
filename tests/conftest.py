import ctypes
import gc
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny_models.py

from tiny_models import GREEDY, PROMPTS, random_model  # noqa: E402

from ssd import LLM  # noqa: E402

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
# Engines here measure their start-up latencies afresh (tests of the stored ones set their own directory).
os.environ["SSD_AUTOCONFIG_CACHE"] = "off"


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SSD_SKIP_REAL_MODEL") == "1":
        skip = pytest.mark.skip(reason="SSD_SKIP_REAL_MODEL=1")
        for item in items:
            if "real_model" in item.keywords:
                item.add_marker(skip)


# A tiny target/draft pair and its AR outputs, shared by the SD and SSD engine tests
# (a test module may define its own `models`, which then takes precedence).
@pytest.fixture(scope="module")
def models():
    target = random_model(vocab=40, layers=2, seed=3, scale=2.0)
    draft = random_model(vocab=40, layers=1, seed=4, scale=2.0)
    return target, draft


@pytest.fixture(scope="module")
def ar_outputs(models):
    with LLM(target=models[0], mode="ar", dtype="float32", max_batch=4, max_len=128) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(autouse=True)
def _give_back_real_models_memory(request):
    """After a test that loads the real models (GBs each): collect them and hand glibc's freed pages back to the
    system, so the suite's peak memory is one such test's, not the sum of their fragments (CI's 24 GB)."""
    yield
    if request.node.get_closest_marker("real_model") is not None:
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:  # not glibc
            pass
