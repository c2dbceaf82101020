"""GPU tests: everything here needs CUDA and is skipped without it (CI has no GPU; scripts/gpu_check.sh runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session")
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
