"""loadtest/batch_padding.py: the batcher's padding at a steady queue depth (what the H200's HTTP run was padded)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_more_waiting_items_leave_less_padding_in_full_batches():
    out = subprocess.run([sys.executable, "loadtest/batch_padding.py", "--queued", "48", "512", "--batch-size", "16",
                          "--batches", "40"], cwd=REPO, check=True, capture_output=True, text=True, timeout=120)
    few, many = (json.loads(line) for line in out.stdout.splitlines())
    assert (few["queued"], many["queued"]) == (48, 512) and few["batches"] == many["batches"] == 40
    assert 0 < many["mean_padding"] < few["mean_padding"] < 1
    assert 15 <= many["mean_rows"] <= 16 and few["mean_rows"] <= 16
