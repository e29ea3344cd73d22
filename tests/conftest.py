import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny_models.py

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SSD_SKIP_REAL_MODEL") == "1":
        skip = pytest.mark.skip(reason="SSD_SKIP_REAL_MODEL=1")
        for item in items:
            if "real_model" in item.keywords:
                item.add_marker(skip)
